//! Waiting from Python: blocking acquire with the GIL released, the awaitable of
//! acquire_async (fast path in Rust, queued path in ratequeue.aio), permits, and the
//! event-loop channel. Shared by Limiter and Concurrency.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};
use ratequeue_core::queue::{Cancelled, Slot};
use ratequeue_core::{Error, GrantRef, Outcome, Submitted, WaitQueue, Wake};

use crate::args::seconds_ns;
use crate::blocking::{copy_unblocked, try_or_unblocked, unblocked};
use crate::errors::to_py;
use crate::histogram::HistogramPy;

pub use crate::aio::{acquire_async, submit, AcquiringPy, ChannelPy, Ready};

/// Interval at which a main-thread wait looks for signals (Ctrl-C); other threads
/// sleep until their wake-up.
const SIGNAL_SLICE: Duration = Duration::from_millis(50);

/// What a permit returns to when released or settled.
pub trait PermitOwner: Send + Sync {
    /// Unit names, indexed as the costs (empty: nothing to settle).
    fn units(&self) -> &[String];
    /// True when the permit is returned on exit (concurrency).
    fn returns_on_exit(&self) -> bool;
    /// Returns the permits of a grant.
    fn give_back(&self, costs: &[u64]);
    /// Settles estimated costs to actual ones by the one undo rule; returns the grant
    /// as it now stands, for the next settle.
    fn settle(&self, estimated: &[u64], actual: &[u64], grant: GrantRef) -> GrantRef;
}

impl PermitOwner for Gate {
    fn units(&self) -> &[String] {
        &self.units
    }

    fn returns_on_exit(&self) -> bool {
        self.returns_on_exit
    }

    fn give_back(&self, costs: &[u64]) {
        let q = &self.queue;
        try_or_unblocked(
            || q.try_give_back(costs, None).then_some(()),
            || q.give_back(costs, None),
        );
    }

    fn settle(&self, estimated: &[u64], actual: &[u64], grant: GrantRef) -> GrantRef {
        unblocked(|| self.queue.settle(estimated, actual, grant))
    }
}

/// A queue plus how its permits behave on exit.
pub struct Gate {
    pub queue: Arc<WaitQueue>,
    /// Unit names, indexed as the costs (empty for a semaphore: nothing to settle).
    pub units: Vec<String>,
    /// True for a semaphore: the permit is returned when the holder is done.
    pub returns_on_exit: bool,
}

impl Gate {
    /// The class index for `priority` (None: the first class).
    pub fn class(&self, priority: Option<&Bound<'_, PyAny>>) -> PyResult<usize> {
        match crate::args::opt_text("priority", priority)?.as_deref() {
            None => Ok(0),
            Some(p) => self.queue.class_index(p).ok_or_else(|| {
                let names: Vec<&str> = self.queue.config().classes.iter().map(|(n, _)| n.as_str()).collect();
                crate::errors::not_a_class(p, &names)
            }),
        }
    }

    /// The class names, in order.
    pub fn class_names(&self) -> Vec<String> {
        self.queue.config().classes.iter().map(|(n, _)| n.clone()).collect()
    }

    pub fn timeout(&self, timeout: Option<&Bound<'_, PyAny>>) -> PyResult<Option<u64>> {
        timeout.map(|t| seconds_ns("timeout", t)).transpose()
    }

    pub(crate) fn permit(self: &Arc<Self>, costs: &[u64], waited_ns: u64) -> PermitPy {
        PermitPy::new(self.clone(), costs, waited_ns)
    }

    /// Blocks until granted (GIL released), raising Overloaded, WaitTimeout, or
    /// KeyboardInterrupt (leaving the queue clean).
    pub fn acquire_blocking(
        self: &Arc<Self>,
        py: Python<'_>,
        costs: &[u64],
        class: usize,
        timeout_ns: Option<u64>,
    ) -> PyResult<PermitPy> {
        match self.queue.try_now_token(costs, class) {
            Ok((at_ns, token)) => return Ok(self.permit(costs, 0).with_grant(GrantRef::new(at_ns, token))),
            Err(Some(d)) => return Err(to_py(py, self.queue_error(d))),
            Err(None) => {}
        }
        let slot = Slot::new();
        let submitted = py.detach(|| {
            self.queue
                .submit(costs, class, timeout_ns, || Wake::Thread(slot.clone()))
        });
        let ticket = match submitted {
            Ok(Submitted::Granted { at_ns }) => {
                return Ok(self.permit(costs, 0).with_grant(GrantRef::new(at_ns, None)))
            }
            Ok(Submitted::Queued(t)) => t,
            Err(e) => return Err(to_py(py, e)),
        };
        let slice = is_main_thread(py).then_some(SIGNAL_SLICE);
        loop {
            let s = slot.clone();
            if let Some(o) = py.detach(move || s.wait(slice)) {
                return self.outcome(py, costs, o);
            }
            if let Err(e) = py.check_signals() {
                py.detach(|| self.abandon(ticket, &slot, costs));
                return Err(e);
            }
        }
    }

    fn queue_error(&self, d: ratequeue_core::Deny) -> Error {
        self.queue.error_for(d)
    }

    fn outcome(self: &Arc<Self>, py: Python<'_>, costs: &[u64], o: Outcome) -> PyResult<PermitPy> {
        match o {
            Outcome::Granted {
                at_ns,
                waited_ns,
                token,
            } => Ok(self.permit(costs, waited_ns).with_grant(GrantRef {
                at_ns,
                token: Some(token),
                owed: None,
            })),
            Outcome::TimedOut { waited_ns } => Err(to_py(
                py,
                Error::WaitTimeout {
                    waited_ns,
                    retry_after_ns: py.detach(|| self.queue.retry_after_ns(costs)),
                },
            )),
        }
    }

    /// Leaves the queue after an interruption: removed, or the grant that won the race
    /// is given back. Exactly once either way.
    fn abandon(&self, ticket: u64, slot: &Slot, costs: &[u64]) {
        if self.queue.cancel(ticket) == Cancelled::NotQueued {
            if let Some(Outcome::Granted { token, .. }) = slot.take() {
                self.queue.give_back(costs, Some(token));
            }
        }
    }
}

/// True on the interpreter's main thread, asked each time: a child forked from another
/// thread has that thread as its main thread (and its signal handlers run there).
pub(crate) fn is_main_thread(py: Python<'_>) -> bool {
    let Ok(threading) = py.import("threading") else {
        return true;
    };
    match (
        threading.call_method0("main_thread"),
        threading.call_method0("current_thread"),
    ) {
        (Ok(main), Ok(current)) => current.is(&main),
        _ => true,
    }
}

/// What a grant gave: context manager; a Concurrency permit is returned on exit.
#[pyclass(frozen, name = "Permit", module = "ratequeue")]
pub struct PermitPy {
    owner: Arc<dyn PermitOwner>,
    costs: Mutex<Vec<u64>>,
    waited_ns: u64,
    released: AtomicBool,
    /// The grant, for settling by the one undo rule (locked after `costs`).
    grant: Mutex<GrantRef>,
    /// The fork generation it was granted in: in a forked child every permit starts
    /// free, so one from before the fork gives nothing back there.
    fork_gen: u64,
}

impl PermitPy {
    /// A permit of `owner` holding `costs`, granted after `waited_ns` in the queue.
    pub fn new(owner: Arc<dyn PermitOwner>, costs: &[u64], waited_ns: u64) -> PermitPy {
        PermitPy {
            owner,
            costs: Mutex::new(costs.to_vec()),
            waited_ns,
            released: AtomicBool::new(false),
            grant: Mutex::new(GrantRef::default()),
            fork_gen: ratequeue_core::fork::generation(),
        }
    }

    /// True when granted in this process (not inherited across a fork).
    pub fn granted_here(&self) -> bool {
        self.fork_gen == ratequeue_core::fork::generation()
    }

    /// The same permit, knowing its grant (when it was taken, and its token).
    pub fn with_grant(self, grant: GrantRef) -> PermitPy {
        *self.grant.lock().unwrap_or_else(|e| e.into_inner()) = grant;
        self
    }

    /// Marks the permit released; true if this call did (the first one).
    pub(crate) fn mark_released(&self) -> bool {
        !self.released.swap(true, Ordering::AcqRel)
    }

    /// The same grant, owned by `owner` instead (e.g. a key rather than its queue).
    pub fn rehome(&self, owner: Arc<dyn PermitOwner>) -> PermitPy {
        let costs = copy_unblocked(&self.costs);
        let grant = copy_unblocked(&self.grant);
        PermitPy::new(owner, &costs, self.waited_ns).with_grant(grant)
    }
}

#[pymethods]
impl PermitPy {
    /// Seconds spent in the queue (arrival to grant, in schedule time).
    #[getter]
    fn waited(&self) -> f64 {
        self.waited_ns as f64 / 1e9
    }

    /// The grant's schedule time, in nanoseconds of the limiter's clock (its
    /// `now_ns()`): when the capacity was taken, whenever the holder woke up.
    #[getter]
    fn granted_at_ns(&self) -> u64 {
        copy_unblocked(&self.grant).at_ns
    }

    /// True once released.
    #[getter]
    fn released(&self) -> bool {
        self.released.load(Ordering::Acquire)
    }

    /// Returns a Concurrency permit now (a rate grant has nothing to return); only the
    /// first call has an effect. Returns True if this call released it.
    pub(crate) fn release(&self) -> bool {
        if self.released.swap(true, Ordering::AcqRel) {
            return false;
        }
        if self.owner.returns_on_exit() && self.granted_here() {
            let costs = copy_unblocked(&self.costs);
            self.owner.give_back(&costs);
        }
        true
    }

    /// Corrects the costs this grant was admitted with (an estimate, e.g. prompt +
    /// max_tokens) to the actual ones: the difference is refunded (never past the
    /// burst) or the overage charged (the bucket may go into debt and delay later
    /// requests until time repays it). Units not named keep their estimate. May be
    /// called again; each call settles against the previous one.
    #[pyo3(signature = (**costs))]
    fn settle(&self, costs: Option<&Bound<'_, PyDict>>) -> PyResult<()> {
        let units = self.owner.units();
        if units.is_empty() {
            return Err(crate::errors::wrong_type("a Concurrency permit has no costs to settle"));
        }
        let mut named = Vec::new();
        if let Some(kw) = costs {
            for (k, v) in kw.iter() {
                let name: String = k.extract()?;
                let i = units.iter().position(|u| *u == name).ok_or_else(|| {
                    crate::errors::unexpected_keyword(&name, &format!("this limiter counts units {units:?}"))
                })?;
                named.push((i, crate::args::cost(&name, &v)?));
            }
        }
        // This permit's locks are held across the core call: taken without the GIL.
        unblocked(|| {
            let mut cur = self.costs.lock().unwrap_or_else(|e| e.into_inner());
            let mut actual = cur.clone();
            for &(i, c) in &named {
                actual[i] = c;
            }
            let mut grant = self.grant.lock().unwrap_or_else(|e| e.into_inner());
            *grant = self.owner.settle(&cur, &actual, *grant);
            *cur = actual;
        });
        Ok(())
    }

    /// The costs this permit holds, by unit.
    #[getter]
    fn costs(&self) -> std::collections::HashMap<String, u64> {
        let c = copy_unblocked(&self.costs);
        self.owner.units().iter().cloned().zip(c).collect()
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_exc))]
    fn __exit__(&self, _exc: &Bound<'_, PyTuple>) -> bool {
        self.release();
        false
    }

    fn __repr__(&self) -> String {
        format!("Permit(waited={}, released={})", self.waited(), self.released())
    }
}

/// The live queue-wait histogram of a class (None: the first class).
pub fn wait_histogram(gate: &Gate, priority: Option<&Bound<'_, PyAny>>) -> PyResult<HistogramPy> {
    let class = gate.class(priority)?;
    let h = gate.queue.wait_histogram(class).expect("class index checked");
    Ok(HistogramPy { inner: h.clone() })
}

/// Shared stats of queue owners (Limiter, Concurrency): counters, depths and a copy of
/// each class's wait histogram, in one snapshot.
pub fn queue_stats<'py>(py: Python<'py>, q: &WaitQueue) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    let c = q.counts();
    let depths_now = py.detach(|| q.depths());
    d.set_item("waiting", q.waiting())?;
    d.set_item("tried_admitted", c.tried_admitted)?;
    d.set_item("tried_refused", c.tried_refused)?;
    d.set_item("immediate", c.immediate)?;
    d.set_item("queued_grants", c.queued_grants)?;
    d.set_item("refused_full", c.refused_full)?;
    d.set_item("refused_deadline", c.refused_deadline)?;
    d.set_item("timed_out", c.timed_out)?;
    d.set_item("cancelled", c.cancelled)?;
    let depths = PyDict::new(py);
    for ((name, _), n) in q.config().classes.iter().zip(depths_now) {
        depths.set_item(name, n)?;
    }
    d.set_item("depths", depths)?;
    let waits = PyDict::new(py);
    for (i, (name, _)) in q.config().classes.iter().enumerate() {
        if let Some(h) = q.wait_histogram(i) {
            let copy = ratequeue_core::Histogram::new();
            copy.add_snapshot(&h.snapshot());
            waits.set_item(name, HistogramPy { inner: Arc::new(copy) })?;
        }
    }
    d.set_item("wait", waits)?;
    Ok(d)
}
