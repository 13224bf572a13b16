//! Python Concurrency: a semaphore with the same queue discipline as Limiter.

use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::types::PyDict;
use ratequeue_core::Semaphore;

use crate::args::{opt_text, permits, seconds_ns, size};
use crate::blocking::unblocked;
use crate::clock::any_clock;
use crate::errors::to_py;
use crate::histogram::HistogramPy;
use crate::waiting::{new_gate, queue_stats, submit, wait_histogram, ChannelPy, Gate, GatePy, PermitPy};

/// At most `limit` holders at once; waiters queue by class, FIFO, bounded.
#[pyclass(frozen, name = "Concurrency", module = "ratequeue")]
pub struct ConcurrencyPy {
    sem: Arc<Semaphore>,
    gate: Arc<Gate>,
    #[pyo3(get)]
    name: Option<String>,
}

impl ConcurrencyPy {
    /// The core semaphore (for policies).
    pub fn semaphore(&self) -> &Arc<Semaphore> {
        &self.sem
    }

    /// Its queue (policies wait in it).
    pub fn gate(&self) -> &Arc<Gate> {
        &self.gate
    }

    fn permits(n: Option<&Bound<'_, PyAny>>) -> PyResult<[u64; 1]> {
        Ok([n.map(|n| permits("n", n)).transpose()?.unwrap_or(1)])
    }
}

#[pymethods]
impl ConcurrencyPy {
    #[new]
    #[pyo3(signature = (limit, *, classes = None, max_wait = None, max_queue = None, clock = None, name = None))]
    fn new(
        py: Python<'_>,
        limit: &Bound<'_, PyAny>,
        classes: Option<&Bound<'_, PyAny>>,
        max_wait: Option<&Bound<'_, PyAny>>,
        max_queue: Option<&Bound<'_, PyAny>>,
        clock: Option<&Bound<'_, PyAny>>,
        name: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let name = opt_text("name", name)?;
        let sem = Arc::new(Semaphore::new(size("limit", limit, u64::MAX)?).map_err(|e| to_py(py, e))?);
        unblocked(|| ratequeue_core::fork::register_arc(&sem));
        let max_wait_ns = max_wait.map(|m| seconds_ns("max_wait", m)).transpose()?;
        let gate = new_gate(
            py,
            sem.clone(),
            1,
            any_clock(clock)?,
            classes,
            max_queue,
            max_wait_ns,
            Vec::new(),
        )?;
        Ok(ConcurrencyPy { sem, gate, name })
    }

    /// Takes `n` permits now or returns None; never waits, never passes a waiter queued
    /// before the call (one joining during it may be passed: the call came first).
    #[pyo3(signature = (n = None))]
    fn try_acquire(&self, py: Python<'_>, n: Option<&Bound<'_, PyAny>>) -> PyResult<Option<PermitPy>> {
        use ratequeue_core::Resource;
        let c = Self::permits(n)?;
        let q = &self.gate.queue;
        if q.waiting() != 0 {
            // Nobody overtakes a waiter.
            q.note_try(false);
            return Ok(None);
        }
        match self.sem.try_take(0, &c) {
            Ok(()) => {
                q.note_try(true);
                let at_ns = q.now_ns();
                Ok(Some(
                    self.gate
                        .permit(&c, 0)
                        .with_grant(ratequeue_core::GrantRef::new(at_ns, None)),
                ))
            }
            Err(ratequeue_core::Deny::Wait(_)) => {
                q.note_try(false);
                Ok(None)
            }
            Err(d) => Err(to_py(py, q.error_for(d))),
        }
    }

    /// Waits for `n` permits (GIL released); a context manager that returns them.
    #[pyo3(signature = (n = None, *, priority = None, timeout = None))]
    fn acquire(
        &self,
        py: Python<'_>,
        n: Option<&Bound<'_, PyAny>>,
        priority: Option<&Bound<'_, PyAny>>,
        timeout: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PermitPy> {
        let c = Self::permits(n)?;
        self.gate
            .acquire(py, &c, self.gate.class(priority)?, self.gate.timeout(timeout)?)
    }

    /// Awaitable and async context manager; the permits return on exit.
    #[pyo3(signature = (n = None, *, priority = None, timeout = None))]
    fn acquire_async(
        &self,
        py: Python<'_>,
        n: Option<&Bound<'_, PyAny>>,
        priority: Option<&Bound<'_, PyAny>>,
        timeout: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Py<PyAny>> {
        let c = Self::permits(n)?;
        crate::waiting::acquire_async(
            py,
            &self.gate,
            &c,
            self.gate.class(priority)?,
            self.gate.timeout(timeout)?,
        )
    }

    /// Submits without blocking: a Permit when granted at once, else a ticket whose
    /// outcome is drained from `channel` (see Limiter.submit).
    #[pyo3(signature = (channel, n = None, *, priority = None, timeout = None))]
    fn submit(
        &self,
        py: Python<'_>,
        channel: &Bound<'_, ChannelPy>,
        n: Option<&Bound<'_, PyAny>>,
        priority: Option<&Bound<'_, PyAny>>,
        timeout: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Py<PyAny>> {
        let c = Self::permits(n)?;
        submit(
            py,
            &self.gate,
            channel,
            &c,
            self.gate.class(priority)?,
            self.gate.timeout(timeout)?,
        )
    }

    /// Gives back permits of a grant whose holder is gone (a drained grant nobody
    /// will use), exactly like releasing its Permit.
    #[pyo3(signature = (n = None))]
    fn give_back(&self, n: Option<&Bound<'_, PyAny>>) -> PyResult<()> {
        let c = Self::permits(n)?;
        unblocked(|| self.gate.queue.give_back(&c, None));
        Ok(())
    }

    /// Permits held now.
    #[getter]
    fn in_use(&self) -> u64 {
        self.sem.in_use()
    }

    /// The limit.
    #[getter]
    fn limit(&self) -> u64 {
        self.sem.limit()
    }

    /// Changes the limit at run time (waiters are granted at once if it grew).
    fn set_limit(&self, py: Python<'_>, limit: &Bound<'_, PyAny>) -> PyResult<()> {
        self.sem
            .set_limit(size("limit", limit, u64::MAX)?)
            .map_err(|e| to_py(py, e))?;
        py.detach(|| self.gate.queue.poll_now());
        Ok(())
    }

    /// Waiters now queued.
    #[getter]
    fn waiting(&self) -> usize {
        self.gate.queue.waiting()
    }

    /// Grants and expires whatever is due now; returns the next due time or None.
    fn poll(&self) -> Option<f64> {
        unblocked(|| self.gate.queue.poll_now()).map(crate::clock::due_seconds)
    }

    /// Counters and queue depths in one snapshot.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = queue_stats(py, &self.gate.queue)?;
        d.set_item("in_use", self.sem.in_use())?;
        d.set_item("limit", self.sem.limit())?;
        d.set_item("name", self.name.clone())?;
        Ok(d)
    }

    /// The live histogram of queue waits (seconds) of a class.
    #[pyo3(signature = (priority = None))]
    fn wait_histogram(&self, priority: Option<&Bound<'_, PyAny>>) -> PyResult<HistogramPy> {
        wait_histogram(&self.gate, priority)
    }

    /// The class names, in order.
    #[getter]
    fn classes(&self) -> Vec<String> {
        self.gate.class_names()
    }

    fn __repr__(&self) -> String {
        format!("Concurrency(limit={}, in_use={})", self.sem.limit(), self.sem.in_use())
    }
}
