//! Per-key waiting shared by KeyedLimiter and KeyedConcurrency: the core's
//! [`KeyQueues`] (a queue per key that has waiters) driven from Python, each wait and
//! each lock with the GIL released.

use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::types::PyDict;
use ratequeue_core::keyed_queue::MakeResource;
use ratequeue_core::{AnyClock, GrantRef, Histogram, KeyHasher, KeyQueues, QueueConfig, Resource, WaitQueue};

use crate::args::{seconds_ns, size};
use crate::blocking::{try_or_unblocked, unblocked};
use crate::convert::key_of;
use crate::errors::{needs_manual_clock, to_py};
use crate::histogram::HistogramPy;
use crate::waiting::{AcquiringPy, Gate, GatePy, PermitOwner, PermitPy, Ready, DEFAULT_MAX_QUEUE};

/// Default bound on the number of keys held (buckets, and queues of waiting keys).
pub const DEFAULT_MAX_KEYS: usize = 1 << 20;

/// A permit of one key: returns and settles on the key, then lets its waiters through.
struct KeyOwner {
    queues: Arc<KeyQueues>,
    key: u64,
    resource: Arc<dyn Resource>,
    units: Arc<[String]>,
    returns_on_exit: bool,
}

impl PermitOwner for KeyOwner {
    fn units(&self) -> &[String] {
        &self.units
    }

    fn returns_on_exit(&self) -> bool {
        self.returns_on_exit
    }

    fn give_back(&self, costs: &[u64]) {
        unblocked(|| {
            self.resource.give_back(costs, None);
            self.queues.poll(self.key);
        });
    }

    fn settle(&self, estimated: &[u64], actual: &[u64], grant: GrantRef) -> GrantRef {
        unblocked(|| self.queues.settle(self.key, estimated, actual, grant))
    }
}

/// The per-key queues of a keyed type and how its permits behave.
pub struct Keyed {
    pub queues: Arc<KeyQueues>,
    /// Unit names, indexed as the costs (empty for permits: nothing to settle).
    units: Arc<[String]>,
    /// True for permits: returned when the holder is done.
    returns_on_exit: bool,
}

impl Keyed {
    /// Queues of `make(key)` with the Python bounds `max_wait` and `max_queue` (per key),
    /// at most `max_keys` keys waiting at once.
    pub fn new(
        py: Python<'_>,
        clock: AnyClock,
        max_wait: Option<&Bound<'_, PyAny>>,
        max_queue: Option<&Bound<'_, PyAny>>,
        max_keys: usize,
        units: Vec<String>,
        make: MakeResource,
    ) -> PyResult<Keyed> {
        let max_wait_ns = max_wait.map(|m| seconds_ns("max_wait", m)).transpose()?;
        let max_queue = match max_queue {
            None => DEFAULT_MAX_QUEUE,
            Some(m) => usize::try_from(size("max_queue", m, u64::MAX)?).unwrap_or(usize::MAX),
        };
        let config = QueueConfig::new(Vec::new(), max_queue, max_wait_ns).map_err(|e| to_py(py, e))?;
        // A new map registers for the fork handlers: without the GIL.
        let queues = unblocked(|| KeyQueues::new(clock, config, max_keys, make)).map_err(|e| to_py(py, e))?;
        Ok(Keyed {
            queues,
            returns_on_exit: units.is_empty(),
            units: units.into(),
        })
    }

    /// Queues over the keyed map `core` (registered here for the fork handlers), the
    /// resource of each key made by `resource(core, key)`.
    #[allow(clippy::too_many_arguments)]
    pub fn over<T: ratequeue_core::fork::ForkLocks + 'static>(
        py: Python<'_>,
        core: &Arc<T>,
        clock: AnyClock,
        max_wait: Option<&Bound<'_, PyAny>>,
        max_queue: Option<&Bound<'_, PyAny>>,
        max_keys: usize,
        units: Vec<String>,
        resource: fn(Arc<T>, u64) -> Arc<dyn Resource>,
    ) -> PyResult<Keyed> {
        unblocked(|| ratequeue_core::fork::register_arc(core));
        let core = core.clone();
        let make: MakeResource = Box::new(move |key| resource(core.clone(), key));
        Keyed::new(py, clock, max_wait, max_queue, max_keys, units, make)
    }

    /// True when someone waits on `key` (nobody overtakes them); never waits for the
    /// map's lock with the GIL.
    #[inline]
    pub fn has_waiters(&self, key: u64) -> bool {
        let q = &self.queues;
        // No key has a queue (one atomic load, inlined in every caller's fast path).
        !q.is_empty() && try_or_unblocked(|| q.try_has_waiters(key), || q.has_waiters(key))
    }

    /// `key`'s queue when someone waits in it.
    pub fn waited_on(&self, key: u64) -> Option<Arc<WaitQueue>> {
        let q = &self.queues;
        try_or_unblocked(|| q.try_existing(key), || q.existing(key))
            .filter(|q| q.queue().waiting() != 0)
            .map(|q| q.queue().clone())
    }

    /// Nanoseconds until `cost` on `key` would be granted behind the key's waiters
    /// (GIL released while the queue is read); None when nobody waits on it.
    pub fn backlog_delay_ns(&self, py: Python<'_>, key: u64, cost: u64) -> Option<u64> {
        let q = self.waited_on(key)?;
        py.detach(move || q.predict_delay(&[cost]))
            .ok()
            .flatten()
            .map(|(_, d)| d)
    }

    pub fn run_until(&self, py: Python<'_>, until: &Bound<'_, PyAny>) -> PyResult<usize> {
        let AnyClock::Manual(m) = self.queues.clock() else {
            return Err(needs_manual_clock("run_until"));
        };
        let t = seconds_ns("until", until)?;
        let (queues, m) = (self.queues.clone(), m.clone());
        py.detach(move || queues.run_until(&m, t)).map_err(|e| to_py(py, e))
    }

    /// Grants and expires whatever is due now on every key; the next due time or None.
    pub fn poll(&self) -> Option<f64> {
        unblocked(|| self.queues.poll_all()).map(crate::clock::due_seconds)
    }

    fn owner(&self, key: u64) -> Arc<dyn PermitOwner> {
        Arc::new(KeyOwner {
            queues: self.queues.clone(),
            key,
            resource: self.queues.resource(key),
            units: self.units.clone(),
            returns_on_exit: self.returns_on_exit,
        })
    }

    /// A gate over `key`'s queue, its permits behaving as this type's.
    fn gate(&self, queue: Arc<WaitQueue>) -> Arc<Gate> {
        Gate::new(queue, self.units.to_vec(), self.returns_on_exit)
    }

    /// Now, or None when it must queue; errors when it never can.
    pub fn try_now(&self, py: Python<'_>, key: u64, c: u64) -> PyResult<Option<PermitPy>> {
        let q = &self.queues;
        match try_or_unblocked(|| q.try_now_nowait(key, &[c]), || q.try_now(key, &[c])) {
            Ok((at_ns, token)) => Ok(Some(
                PermitPy::new(self.owner(key), &[c], 0).with_grant(GrantRef::new(at_ns, token)),
            )),
            Err(None) => Ok(None),
            Err(Some(d)) => Err(to_py(py, q.resource(key).error_for(d))),
        }
    }

    /// acquire from Python arguments.
    pub fn acquire_py(
        &self,
        py: Python<'_>,
        h: &KeyHasher,
        key: &Bound<'_, PyAny>,
        c: u64,
        timeout: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PermitPy> {
        let t = timeout.map(|t| seconds_ns("timeout", t)).transpose()?;
        self.acquire(py, key_of(h, key)?, c, t)
    }

    /// acquire_async from Python arguments.
    pub fn acquire_async_py(
        &self,
        py: Python<'_>,
        h: &KeyHasher,
        key: &Bound<'_, PyAny>,
        c: u64,
        timeout: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Py<PyAny>> {
        let t = timeout.map(|t| seconds_ns("timeout", t)).transpose()?;
        self.acquire_async(py, key_of(h, key)?, c, t)
    }

    /// Waits on `key`'s queue (GIL released), the queue dropped after if idle.
    pub fn acquire(&self, py: Python<'_>, key: u64, c: u64, timeout_ns: Option<u64>) -> PyResult<PermitPy> {
        if let Some(p) = self.try_now(py, key, c)? {
            return Ok(p);
        }
        let handle = py.detach(|| self.queues.get(key)).map_err(|e| to_py(py, e))?;
        let gate = self.gate(handle.queue().clone());
        let out = gate.acquire(py, &[c], 0, timeout_ns).map(|p| p.rehome(self.owner(key)));
        drop((gate, handle));
        py.detach(|| self.queues.done(key, 0));
        out
    }

    fn acquire_async(&self, py: Python<'_>, key: u64, c: u64, timeout_ns: Option<u64>) -> PyResult<Py<PyAny>> {
        if let Some(p) = self.try_now(py, key, c)? {
            return Ok(Py::new(py, Ready::new(Py::new(py, p)?.into_any()))?.into_any());
        }
        let handle = py.detach(|| self.queues.get(key)).map_err(|e| to_py(py, e))?;
        let gate = self.gate(handle.queue().clone());
        let queues = self.queues.clone();
        // The awaitable keeps the key's queue in the map (its handle) until it goes.
        let a = AcquiringPy::queued(
            &gate,
            &[c],
            timeout_ns,
            self.owner(key),
            Box::new(move || {
                let _kept = &handle;
                unblocked(|| queues.done(key, 1))
            }),
        );
        Ok(Py::new(py, a)?.into_any())
    }

    /// The live histogram of queue waits (seconds), all keys together.
    pub fn wait_histogram(&self) -> HistogramPy {
        HistogramPy {
            inner: self.queues.wait_histogram().clone(),
        }
    }

    /// Tries, waiting keys and a copy of the queue-wait histogram.
    pub fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        let (admitted, refused) = self.queues.tries();
        d.set_item("tried_admitted", admitted)?;
        d.set_item("tried_refused", refused)?;
        d.set_item("waiting_keys", self.queues.len())?;
        let copy = Histogram::new();
        copy.add_snapshot(&self.queues.wait_histogram().snapshot());
        d.set_item("wait", HistogramPy { inner: Arc::new(copy) })?;
        Ok(d)
    }
}
