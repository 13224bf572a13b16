//! Python KeyedConcurrency: at most `limit` holders per key, waiting per key (see
//! keyed.rs); keys holding nothing cost nothing.

use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::types::PyDict;
use ratequeue_core::keyed::KeyPermits;
use ratequeue_core::{KeyQueues, KeyedSemaphore};

use crate::args::{opt_text, size, Permits};
use crate::blocking::unblocked;
use crate::clock::any_clock;
use crate::convert::key_of;
use crate::errors::to_py;
use crate::keyed::{Keyed, DEFAULT_MAX_KEYS};
use crate::waiting::PermitPy;

/// At most `limit` holders per key (e.g. per tenant); keys holding nothing cost nothing.
#[pyclass(frozen, name = "KeyedConcurrency", module = "ratequeue")]
pub struct KeyedConcurrencyPy {
    core: Arc<KeyedSemaphore>,
    keyed: Keyed,
    #[pyo3(get)]
    name: Option<String>,
}

impl KeyedConcurrencyPy {
    /// True when `key` has waiters (a policy must not overtake them either).
    pub fn has_waiters(&self, key: u64) -> bool {
        self.keyed.has_waiters(key)
    }

    /// The core map (for policies).
    pub fn core(&self) -> &Arc<KeyedSemaphore> {
        &self.core
    }

    /// The per-key queues (policies wake a key's queue when they release permits).
    pub fn key_queues(&self) -> &Arc<KeyQueues> {
        &self.keyed.queues
    }

    /// The per-key queues (policies wait in them).
    pub fn acquire_key(&self, py: Python<'_>, key: u64, n: u64, timeout_ns: Option<u64>) -> PyResult<PermitPy> {
        self.keyed.acquire(py, key, n, timeout_ns)
    }
}

#[pymethods]
impl KeyedConcurrencyPy {
    #[new]
    #[pyo3(signature = (limit, *, clock = None, max_wait = None, max_queue = None, name = None))]
    fn new(
        py: Python<'_>,
        limit: &Bound<'_, PyAny>,
        clock: Option<&Bound<'_, PyAny>>,
        max_wait: Option<&Bound<'_, PyAny>>,
        max_queue: Option<&Bound<'_, PyAny>>,
        name: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let name = opt_text("name", name)?;
        let core = Arc::new(KeyedSemaphore::new(size("limit", limit, u64::MAX)?).map_err(|e| to_py(py, e))?);
        let keyed = Keyed::over(
            py,
            &core,
            any_clock(clock)?,
            max_wait,
            max_queue,
            DEFAULT_MAX_KEYS,
            Vec::new(),
            |sem, key| Arc::new(KeyPermits { sem, key }),
        )?;
        Ok(KeyedConcurrencyPy { core, keyed, name })
    }

    /// Takes `n` permits on `key` now, or returns None; never waits.
    #[pyo3(signature = (key, n = Permits(1)), text_signature = "($self, key, n=1)")]
    fn try_acquire(&self, py: Python<'_>, key: &Bound<'_, PyAny>, n: Permits) -> PyResult<Option<PermitPy>> {
        let k = key_of(self.core.hasher(), key)?;
        let p = self.keyed.try_now(py, k, n.0)?;
        self.keyed.queues.note_try(p.is_some());
        Ok(p)
    }

    /// Waits for `n` permits on `key` (GIL released); returned on exit.
    #[pyo3(signature = (key, n = Permits(1), *, timeout = None), text_signature = "($self, key, n=1, *, timeout=None)")]
    fn acquire(
        &self,
        py: Python<'_>,
        key: &Bound<'_, PyAny>,
        n: Permits,
        timeout: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PermitPy> {
        self.keyed.acquire_py(py, self.core.hasher(), key, n.0, timeout)
    }

    /// Awaitable and async context manager; the permits return on exit.
    #[pyo3(signature = (key, n = Permits(1), *, timeout = None), text_signature = "($self, key, n=1, *, timeout=None)")]
    fn acquire_async(
        &self,
        py: Python<'_>,
        key: &Bound<'_, PyAny>,
        n: Permits,
        timeout: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Py<PyAny>> {
        self.keyed.acquire_async_py(py, self.core.hasher(), key, n.0, timeout)
    }

    /// On a ManualClock: advances the clock through every due time (deadlines) of the
    /// keys' queues up to `until`.
    fn run_until(&self, py: Python<'_>, until: &Bound<'_, PyAny>) -> PyResult<usize> {
        self.keyed.run_until(py, until)
    }

    /// Grants and expires whatever is due now on every key; the next due time or None.
    fn poll(&self) -> Option<f64> {
        self.keyed.poll()
    }

    /// Permits held on `key` now.
    fn in_use(&self, key: &Bound<'_, PyAny>) -> PyResult<u64> {
        let k = key_of(self.core.hasher(), key)?;
        Ok(unblocked(|| self.core.in_use(k)))
    }

    /// The per-key limit.
    #[getter]
    fn limit(&self) -> u64 {
        self.core.limit()
    }

    fn __len__(&self) -> usize {
        unblocked(|| self.core.len())
    }

    /// Keys holding permits, tries, waiting keys and the queue-wait histogram.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = self.keyed.stats(py)?;
        d.set_item("keys", py.detach(|| self.core.len()))?;
        d.set_item("limit", self.core.limit())?;
        d.set_item("name", self.name.clone())?;
        Ok(d)
    }

    fn __repr__(&self) -> String {
        format!(
            "KeyedConcurrency(limit={}, keys={})",
            self.core.limit(),
            unblocked(|| self.core.len())
        )
    }
}
