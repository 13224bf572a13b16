//! Python KeyedLimiter: one GCRA bucket per key (user, API key, tenant) in a bounded
//! map, batch decisions over numpy arrays, and waiting per key (see keyed.rs).

use std::sync::Arc;

use numpy::{PyArray1, PyReadonlyArray1};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyString};
use ratequeue_core::keyed::KeyBucket;
use ratequeue_core::{Deny, Error, KeyQueues, KeyedLimiter};

use crate::args::{opt_text, size, Cost};
use crate::blocking::{try_or_unblocked, unblocked};
use crate::clock::any_clock;
use crate::convert::{costs_array, key_of};
use crate::errors::{to_py, type_err};
use crate::histogram::HistogramPy;
use crate::keyed::{Keyed, DEFAULT_MAX_KEYS};
use crate::rate::RatePy;
use crate::waiting::PermitPy;

/// One GCRA bucket per key (user, API key, tenant), in a bounded map.
#[pyclass(frozen, name = "KeyedLimiter", module = "ratequeue")]
pub struct KeyedLimiterPy {
    core: Arc<KeyedLimiter>,
    keyed: Keyed,
    unit: String,
    #[pyo3(get)]
    name: Option<String>,
}

impl KeyedLimiterPy {
    /// True when `key` has waiters (a policy must not overtake them either).
    pub fn has_waiters(&self, key: u64) -> bool {
        self.keyed.has_waiters(key)
    }

    /// Nanoseconds until `cost` on `key` would be granted behind the key's waiters
    /// (GIL released while the queue is read); None when nobody waits on it.
    pub fn backlog_delay_ns(&self, py: Python<'_>, key: u64, cost: u64) -> Option<u64> {
        self.keyed.backlog_delay_ns(py, key, cost)
    }

    /// The core map (for policies).
    pub fn core(&self) -> &Arc<KeyedLimiter> {
        &self.core
    }

    /// The per-key queues (policies wake a key's queue when they give capacity back).
    pub fn key_queues(&self) -> &Arc<KeyQueues> {
        &self.keyed.queues
    }

    /// The unit this limiter counts.
    pub fn unit(&self) -> &str {
        &self.unit
    }
}

#[pymethods]
impl KeyedLimiterPy {
    #[new]
    #[pyo3(signature = (rate, *, max_keys = None, clock = None, max_wait = None, max_queue = None, name = None))]
    fn new(
        py: Python<'_>,
        rate: &Bound<'_, RatePy>,
        max_keys: Option<&Bound<'_, PyAny>>,
        clock: Option<&Bound<'_, PyAny>>,
        max_wait: Option<&Bound<'_, PyAny>>,
        max_queue: Option<&Bound<'_, PyAny>>,
        name: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let name = opt_text("name", name)?;
        let max_keys = match max_keys {
            None => DEFAULT_MAX_KEYS,
            Some(m) => usize::try_from(size("max_keys", m, u64::MAX)?).unwrap_or(usize::MAX),
        };
        let any = any_clock(clock)?;
        let r = rate.get();
        let core = Arc::new(KeyedLimiter::new(r.rate, max_keys, any.clone()).map_err(|e| to_py(py, e))?);
        let keyed = Keyed::over(
            py,
            &core,
            any,
            max_wait,
            max_queue,
            max_keys,
            vec![r.unit.clone()],
            |keyed, key| Arc::new(KeyBucket { keyed, key }),
        )?;
        Ok(KeyedLimiterPy {
            core,
            keyed,
            unit: r.unit.clone(),
            name,
        })
    }

    /// Admits `cost` on `key` now or returns False; never waits (False while the key has
    /// waiters: nobody overtakes them).
    #[pyo3(signature = (key, cost = Cost(1)), text_signature = "($self, key, cost=1)")]
    fn try_acquire(&self, py: Python<'_>, key: &Bound<'_, PyAny>, cost: Cost) -> PyResult<bool> {
        let k = key_of(self.core.hasher(), key)?;
        if self.keyed.has_waiters(k) {
            self.keyed.queues.note_try(false);
            return Ok(false);
        }
        let (core, queues) = (&self.core, &self.keyed.queues);
        // Re-checked after the take: a waiter joining the key meanwhile undoes it.
        let joined = || queues.joined(k);
        match try_or_unblocked(
            || core.try_acquire_idle_nowait(k, cost.0, joined),
            || core.try_acquire_idle(k, cost.0, joined),
        ) {
            Ok(()) => {
                self.keyed.queues.note_try(true);
                Ok(true)
            }
            Err(Deny::Wait(_)) => {
                self.keyed.queues.note_try(false);
                Ok(false)
            }
            Err(Deny::TooLarge { cost, burst, .. }) => Err(to_py(
                py,
                Error::CostTooLarge {
                    unit: self.unit.clone(),
                    cost,
                    burst,
                },
            )),
        }
    }

    /// Decides every key in order, as the loop of try_acquire calls would (reading the
    /// clock once): `keys` is a numpy uint64 or int64 array (GIL released; each value `v`
    /// is the key `int(v)`) or a sequence of keys; `costs` (optional) the same length.
    /// Returns a numpy bool array.
    #[pyo3(signature = (keys, costs = None))]
    fn try_acquire_many<'py>(
        &self,
        py: Python<'py>,
        keys: &Bound<'py, PyAny>,
        costs: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyArray1<bool>>> {
        let h = self.core.hasher().clone();
        let hashed: Vec<u64> = if let Ok(a) = keys.extract::<PyReadonlyArray1<'_, u64>>() {
            let view = a.as_array();
            match view.as_slice() {
                Some(s) => py.detach(|| s.iter().map(|k| h.int(*k)).collect()),
                None => view.iter().map(|k| h.int(*k)).collect(),
            }
        } else if let Ok(a) = keys.extract::<PyReadonlyArray1<'_, i64>>() {
            // int64 (numpy's default integer): the same keys as the ints themselves.
            let view = a.as_array();
            match view.as_slice() {
                Some(s) => py.detach(|| s.iter().map(|k| h.signed(*k)).collect()),
                None => view.iter().map(|k| h.signed(*k)).collect(),
            }
        } else {
            if keys.is_instance_of::<PyString>() || keys.is_instance_of::<PyBytes>() {
                return Err(type_err("keys", "a numpy uint64 array or a sequence of keys", keys));
            }
            let it = keys
                .try_iter()
                .map_err(|_| type_err("keys", "a numpy uint64 array or a sequence of keys", keys))?;
            let mut v = Vec::new();
            for k in it {
                v.push(key_of(self.core.hasher(), &k?)?);
            }
            v
        };
        let costs = costs_array(costs, hashed.len())?;
        // A cost above the burst can never be admitted: refuse the whole call before
        // deciding anything.
        let burst = self.core.rate().burst;
        if let Some(&c) = costs.as_ref().and_then(|c| c.iter().find(|c| **c > burst)) {
            return Err(to_py(
                py,
                Error::CostTooLarge {
                    unit: self.unit.clone(),
                    cost: c,
                    burst,
                },
            ));
        }
        let mut out = vec![false; hashed.len()];
        let queues = &self.keyed.queues;
        let core = self.core.clone();
        // A key with waiters is refused (no barging), one joining meanwhile too.
        let r = py.detach(|| core.try_acquire_many_idle(&hashed, costs.as_deref(), &mut out, &**queues));
        if let Err(Deny::TooLarge { cost, burst, .. }) = r {
            return Err(to_py(
                py,
                Error::CostTooLarge {
                    unit: self.unit.clone(),
                    cost,
                    burst,
                },
            ));
        }
        let admitted = out.iter().filter(|x| **x).count() as u64;
        queues.note_tries(admitted, out.len() as u64 - admitted);
        Ok(PyArray1::from_vec(py, out))
    }

    /// Waits on `key` (its own FIFO queue, GIL released); a context manager whose
    /// permit can `settle` the cost.
    #[pyo3(signature = (key, cost = Cost(1), *, timeout = None), text_signature = "($self, key, cost=1, *, timeout=None)")]
    fn acquire(
        &self,
        py: Python<'_>,
        key: &Bound<'_, PyAny>,
        cost: Cost,
        timeout: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PermitPy> {
        self.keyed.acquire_py(py, self.core.hasher(), key, cost.0, timeout)
    }

    /// Awaitable (and async context manager) version of acquire.
    #[pyo3(signature = (key, cost = Cost(1), *, timeout = None), text_signature = "($self, key, cost=1, *, timeout=None)")]
    fn acquire_async(
        &self,
        py: Python<'_>,
        key: &Bound<'_, PyAny>,
        cost: Cost,
        timeout: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Py<PyAny>> {
        self.keyed
            .acquire_async_py(py, self.core.hasher(), key, cost.0, timeout)
    }

    /// Units `key` could be admitted now (a key never seen has a full bucket).
    fn available(&self, key: &Bound<'_, PyAny>) -> PyResult<f64> {
        let k = key_of(self.core.hasher(), key)?;
        Ok(unblocked(|| self.core.available(k)))
    }

    /// Seconds after which try_acquire of `cost` on `key` is admitted, the key's queued
    /// requests served first (0.0 = now): exact with no new arrivals; changes nothing.
    #[pyo3(signature = (key, cost = Cost(1)), text_signature = "($self, key, cost=1)")]
    fn retry_after(&self, py: Python<'_>, key: &Bound<'_, PyAny>, cost: Cost) -> PyResult<f64> {
        let cost = cost.0;
        let k = key_of(self.core.hasher(), key)?;
        let delay = match self.keyed.waited_on(k) {
            Some(q) => py
                .detach(move || q.predict_delay(&[cost]))
                .map(|p| p.map_or(u64::MAX, |(_, d)| d)),
            None => unblocked(|| self.core.delay_for(k, self.core.clock().now_ns(), cost)),
        };
        match delay {
            Ok(ns) => Ok(ns as f64 / 1e9),
            Err(Deny::TooLarge { cost, burst, .. }) => Err(to_py(
                py,
                Error::CostTooLarge {
                    unit: self.unit.clone(),
                    cost,
                    burst,
                },
            )),
            Err(Deny::Wait(ns)) => Ok(ns as f64 / 1e9),
        }
    }

    /// On a ManualClock: advances the clock through every due time of the keys'
    /// queues up to `until` (clock seconds), granting and expiring as real time would.
    fn run_until(&self, py: Python<'_>, until: &Bound<'_, PyAny>) -> PyResult<usize> {
        self.keyed.run_until(py, until)
    }

    /// Grants and expires whatever is due now on every key; the next due time or None.
    fn poll(&self) -> Option<f64> {
        self.keyed.poll()
    }

    /// Drops every key whose bucket is full again (changes no decision); returns how
    /// many. Eviction does this by itself when the map is full.
    fn sweep(&self) -> usize {
        unblocked(|| self.core.sweep())
    }

    fn __len__(&self) -> usize {
        unblocked(|| self.core.len())
    }

    /// The rate of every key.
    #[getter]
    fn rate(&self) -> RatePy {
        RatePy {
            rate: self.core.rate(),
            unit: self.unit.clone(),
        }
    }

    /// The most keys held at once.
    #[getter]
    fn max_keys(&self) -> usize {
        self.core.max_keys()
    }

    /// Keys, evictions, tries, waiting keys and the queue-wait histogram.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = self.keyed.stats(py)?;
        let c = py.detach(|| self.core.counts());
        d.set_item("keys", c.keys)?;
        d.set_item("max_keys", self.core.max_keys())?;
        d.set_item("evicted_full", c.evicted_full)?;
        d.set_item("evicted_live", c.evicted_live)?;
        d.set_item("refunds_dropped", c.refunds_dropped)?;
        d.set_item("name", self.name.clone())?;
        Ok(d)
    }

    /// The live histogram of queue waits (seconds), all keys together.
    fn wait_histogram(&self) -> HistogramPy {
        self.keyed.wait_histogram()
    }

    fn __repr__(&self) -> String {
        let keys = unblocked(|| self.core.len());
        format!("KeyedLimiter({}, keys={})", self.rate().__repr__(), keys)
    }
}
