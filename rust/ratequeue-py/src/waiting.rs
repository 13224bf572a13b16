//! Waiting from Python: the core's blocking acquire and permits driven with the GIL
//! released (signal checks on the main thread), and the shared queue statistics.
//! Shared by Limiter and Concurrency.

use std::sync::Arc;
use std::time::Duration;

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyString, PyTuple};
use ratequeue_core::wait::{Detach, Host, Permit, Stopped};
use ratequeue_core::{AnyClock, Error, GrantRef, QueueConfig, WaitQueue};

use crate::args::{seconds_ns, size};
use crate::blocking::unblocked;
use crate::errors::{to_py, type_err};
use crate::histogram::HistogramPy;

pub use crate::aio::{acquire_async, submit, AcquiringPy, ChannelPy, Ready};
pub use ratequeue_core::wait::{Gate, PermitOwner};

/// Interval at which a main-thread wait looks for signals (Ctrl-C); other threads
/// sleep until their wake-up.
const SIGNAL_SLICE: Duration = Duration::from_millis(50);

/// Waits of the core run detached from Python when this thread is attached.
#[derive(Clone, Copy)]
pub struct Unblocked;

impl Detach for Unblocked {
    #[inline]
    fn detached<T: Send, F: FnOnce() -> T + Send>(&self, f: F) -> T {
        unblocked(f)
    }
}

/// A blocked acquire on a Python thread: detached while it waits; on the main thread,
/// woken every [`SIGNAL_SLICE`] to run signal handlers (Ctrl-C stops the wait).
struct PyHost<'py> {
    py: Python<'py>,
}

impl Detach for PyHost<'_> {
    #[inline]
    fn detached<T: Send, F: FnOnce() -> T + Send>(&self, f: F) -> T {
        self.py.detach(f)
    }
}

impl Host for PyHost<'_> {
    type Interrupt = PyErr;

    fn slice(&mut self) -> PyResult<Option<Duration>> {
        // Asked only once queued: the path admitted at once never looks. An exception
        // raised inside (a signal handler: Ctrl-C) stops the wait, a grant given back.
        Ok(is_main_thread(self.py)?.then_some(SIGNAL_SLICE))
    }

    fn check(&mut self) -> PyResult<()> {
        self.py.check_signals()
    }
}

/// A gate driven from Python: arguments converted, waits detached.
pub trait GatePy {
    /// The class index for `priority` (None: the first class).
    fn class(&self, priority: Option<&Bound<'_, PyAny>>) -> PyResult<usize>;
    /// The class names, in order.
    fn class_names(&self) -> Vec<String>;
    /// A timeout in seconds as nanoseconds (None: the queue's max_wait).
    fn timeout(&self, timeout: Option<&Bound<'_, PyAny>>) -> PyResult<Option<u64>>;
    /// A permit of this gate holding `costs` (its grant set by `with_grant`).
    fn permit(&self, costs: &[u64], waited_ns: u64) -> PermitPy;
    /// `costs` in `class` granted at once, without waiting: Ok(None) when the call must
    /// queue, Err when it can never be admitted. The queue's lock (after a take undone for
    /// a joiner) is waited for with the GIL released.
    fn permit_now(&self, py: Python<'_>, costs: &[u64], class: usize) -> Result<Option<PermitPy>, Error>;
    /// Blocks until granted (GIL released), raising Overloaded, WaitTimeout, or
    /// KeyboardInterrupt (leaving the queue clean).
    fn acquire(&self, py: Python<'_>, costs: &[u64], class: usize, timeout_ns: Option<u64>) -> PyResult<PermitPy>;
}

impl GatePy for Arc<Gate> {
    fn class(&self, priority: Option<&Bound<'_, PyAny>>) -> PyResult<usize> {
        match crate::args::opt_text("priority", priority)?.as_deref() {
            None => Ok(0),
            Some(p) => self.queue.class_index(p).ok_or_else(|| {
                let names: Vec<&str> = self.queue.config().classes.iter().map(|(n, _)| n.as_str()).collect();
                crate::errors::not_a_class(p, &names)
            }),
        }
    }

    fn class_names(&self) -> Vec<String> {
        self.queue.config().classes.iter().map(|(n, _)| n.clone()).collect()
    }

    fn timeout(&self, timeout: Option<&Bound<'_, PyAny>>) -> PyResult<Option<u64>> {
        timeout.map(|t| seconds_ns("timeout", t)).transpose()
    }

    fn permit(&self, costs: &[u64], waited_ns: u64) -> PermitPy {
        PermitPy::new(self.clone(), costs, waited_ns)
    }

    fn permit_now(&self, py: Python<'_>, costs: &[u64], class: usize) -> Result<Option<PermitPy>, Error> {
        Ok(self.try_now_in(&PyHost { py }, costs, class)?.map(PermitPy::from))
    }

    fn acquire(&self, py: Python<'_>, costs: &[u64], class: usize, timeout_ns: Option<u64>) -> PyResult<PermitPy> {
        let mut host = PyHost { py };
        match self.acquire_blocking(&mut host, costs, class, timeout_ns) {
            Ok(p) => Ok(PermitPy { inner: p }),
            Err(Stopped::Failed(e)) => Err(to_py(py, e)),
            Err(Stopped::Interrupted(e)) => Err(e),
        }
    }
}

thread_local! {
    /// The fork generation in which this thread was found not to be the interpreter's
    /// main thread (`u64::MAX`: not known).
    static NOT_MAIN: std::cell::Cell<u64> = const { std::cell::Cell::new(u64::MAX) };
}

/// True on the interpreter's main thread. A thread found not to be it is remembered until
/// the next fork (a child forked from it has it as its main thread, and its signal
/// handlers run there), so a blocked acquire off the main thread runs no Python code for
/// it (~5,000 instructions with the GIL held); the main thread asks Python each time.
/// The calls run Python code, where a pending signal's handler may run and raise
/// (Ctrl-C): that error is returned, for the caller to stop its wait with, never dropped.
pub(crate) fn is_main_thread(py: Python<'_>) -> PyResult<bool> {
    let generation = ratequeue_core::fork::generation();
    if NOT_MAIN.with(|g| g.get()) == generation {
        return Ok(false);
    }
    let threading = py.import("threading")?;
    let main = threading.call_method0("main_thread")?;
    let current = threading.call_method0("current_thread")?;
    let is_main = current.is(&main);
    if !is_main {
        // The fork handlers count the generations (installed with the first queue).
        ratequeue_core::fork::install();
        NOT_MAIN.with(|g| g.set(generation));
    }
    Ok(is_main)
}

/// What a grant gave: context manager; a Concurrency permit is returned on exit, or when
/// dropped unreleased.
#[pyclass(frozen, name = "Permit", module = "ratequeue")]
pub struct PermitPy {
    inner: Permit,
}

impl From<Permit> for PermitPy {
    fn from(inner: Permit) -> PermitPy {
        PermitPy { inner }
    }
}

impl PermitPy {
    /// A permit of `owner` holding `costs`, granted after `waited_ns` in the queue.
    pub fn new(owner: Arc<dyn PermitOwner>, costs: &[u64], waited_ns: u64) -> PermitPy {
        PermitPy {
            inner: Permit::new(owner, costs, waited_ns, GrantRef::default()),
        }
    }

    /// The core permit.
    pub(crate) fn permit(&self) -> &Permit {
        &self.inner
    }

    /// True when granted in this process (not inherited across a fork).
    pub fn granted_here(&self) -> bool {
        self.inner.granted_here()
    }

    /// The same permit, knowing its grant (when it was taken, and its token).
    pub fn with_grant(mut self, grant: GrantRef) -> PermitPy {
        self.inner.set_grant(grant);
        self
    }

    /// `settle(**costs)` with the keywords as (name, value) pairs (a dict's items, or
    /// the fast entry's `kwnames` beside its values).
    pub(crate) fn settle_named<'py>(
        &self,
        named: impl IntoIterator<Item = (Bound<'py, PyAny>, Bound<'py, PyAny>)>,
    ) -> PyResult<()> {
        let units = self.inner.owner().units();
        if units.is_empty() {
            return Err(crate::errors::wrong_type("a Concurrency permit has no costs to settle"));
        }
        // (unit index, cost) per keyword: a few inline, more on the heap.
        let (mut inline, mut n, mut more) = ([(0usize, 0u64); 4], 0, Vec::new());
        for (k, v) in named {
            let k = k.cast_into::<PyString>()?;
            let name = k.to_str()?;
            let i = units.iter().position(|u| u == name).ok_or_else(|| {
                crate::errors::unexpected_keyword(name, &format!("this limiter counts units {units:?}"))
            })?;
            let c = (i, crate::keywords::plain_cost(name, &v)?);
            if n < inline.len() {
                inline[n] = c;
                n += 1;
            } else {
                more.push(c);
            }
        }
        let costs = if more.is_empty() {
            &inline[..n]
        } else {
            more.splice(0..0, inline);
            &more[..]
        };
        // Locks are tried first; only a busy one is waited for, detached from Python.
        self.inner.settle(costs, &Unblocked);
        Ok(())
    }

    /// The same grant, owned by `owner` instead (e.g. a key rather than its queue); this
    /// one is marked released, so that dropping it gives nothing back.
    pub fn rehome(&self, owner: Arc<dyn PermitOwner>) -> PermitPy {
        let moved = PermitPy {
            inner: self.inner.rehome(owner, &Unblocked),
        };
        self.inner.mark_released();
        moved
    }
}

impl Drop for PermitPy {
    /// Dropped unreleased (never released, or lost to an interrupt as `acquire` returned
    /// it), a Concurrency permit's slots go back, a busy lock waited for detached from
    /// Python: a slot is never lost for good. A rate grant has nothing to return.
    fn drop(&mut self) {
        if self.inner.owner().returns_on_exit() && !self.inner.released() {
            self.inner.release(&Unblocked);
        }
    }
}

#[pymethods]
impl PermitPy {
    /// Seconds spent in the queue (arrival to grant, in schedule time).
    #[getter]
    fn waited(&self) -> f64 {
        self.inner.waited_ns() as f64 / 1e9
    }

    /// The grant's schedule time, in nanoseconds of the limiter's clock (its
    /// `now_ns()`): when the capacity was taken, whenever the holder woke up.
    #[getter]
    fn granted_at_ns(&self) -> u64 {
        self.inner.held(&Unblocked).1.at_ns
    }

    /// True once released.
    #[getter]
    fn released(&self) -> bool {
        self.inner.released()
    }

    /// Returns a Concurrency permit now (a rate grant has nothing to return); only the
    /// first call has an effect. Returns True if this call released it.
    pub(crate) fn release(&self) -> bool {
        self.inner.release(&Unblocked)
    }

    /// Corrects the costs this grant was admitted with (an estimate, e.g. prompt +
    /// max_tokens) to the actual ones: the difference is refunded (never past the
    /// burst) or the overage charged (the bucket may go into debt and delay later
    /// requests until time repays it). Units not named keep their estimate. May be
    /// called again; each call settles against the previous one.
    #[pyo3(signature = (**costs))]
    fn settle(&self, costs: Option<&Bound<'_, PyDict>>) -> PyResult<()> {
        self.settle_named(costs.into_iter().flat_map(|d| d.iter()))
    }

    /// The costs this permit holds, by unit.
    #[getter]
    fn costs(&self) -> std::collections::HashMap<String, u64> {
        let (c, _) = self.inner.held(&Unblocked);
        self.inner.owner().units().iter().cloned().zip(c).collect()
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

/// Default bound on queue depth: waiting never grows memory without limit.
pub const DEFAULT_MAX_QUEUE: usize = 100_000;

/// A queue over `resource` from the Python arguments shared by Limiter and Concurrency.
#[allow(clippy::too_many_arguments)]
pub fn new_gate(
    py: Python<'_>,
    resource: Arc<dyn ratequeue_core::Resource>,
    units: usize,
    clock: AnyClock,
    classes: Option<&Bound<'_, PyAny>>,
    max_queue: Option<&Bound<'_, PyAny>>,
    max_wait_ns: Option<u64>,
    unit_names: Vec<String>,
) -> PyResult<Arc<Gate>> {
    let returns_on_exit = unit_names.is_empty();
    let mut list = Vec::new();
    if let Some(c) = classes {
        let d = c
            .cast::<PyDict>()
            .map_err(|_| type_err("classes", "a dict of class name to weight", c))?;
        for (k, v) in d.iter() {
            let name = crate::args::text("classes", &k).map_err(|_| type_err("classes", "str names", &k))?;
            let w = crate::args::positive(&format!("classes[{name:?}]"), &v)?;
            list.push((name, w));
        }
    }
    let max_queue = match max_queue {
        None => DEFAULT_MAX_QUEUE,
        Some(m) => usize::try_from(size("max_queue", m, u64::MAX)?).unwrap_or(usize::MAX),
    };
    let config = QueueConfig::new(list, max_queue, max_wait_ns).map_err(|e| to_py(py, e))?;
    // A new queue registers for fork safety: without the GIL.
    let queue = py.detach(|| WaitQueue::new(resource, units, clock, config));
    Ok(Gate::new(queue, unit_names, returns_on_exit))
}

/// The live queue-wait histogram of a class (None: the first class).
pub fn wait_histogram(gate: &Arc<Gate>, priority: Option<&Bound<'_, PyAny>>) -> PyResult<HistogramPy> {
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
