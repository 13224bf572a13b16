//! Python KeyedLimiter and KeyedConcurrency: a limit per key (user, API key, tenant),
//! batch decisions over numpy arrays, and waiting per key with the queue discipline of
//! Limiter (a queue exists only for a key that has waiters).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use numpy::{PyArray1, PyReadonlyArray1};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBytes, PyDict, PyString};
use ratequeue_core::keyed::{KeyBucket, KeyPermits};
use ratequeue_core::queue::Stalled;
use ratequeue_core::{
    AnyClock, Deny, Error, GrantRef, Histogram, KeyHasher, KeyedLimiter, KeyedSemaphore, QueueConfig, Resource,
    WaitQueue,
};

use crate::args::{cost, opt_text, seconds_ns, size, Cost, Permits};
use crate::blocking::{try_or_unblocked, unblocked};
use crate::clock::any_clock;
use crate::errors::{to_py, type_err};
use crate::histogram::HistogramPy;
use crate::limiter::{RatePy, DEFAULT_MAX_QUEUE};
use crate::waiting::{AcquiringPy, Gate, PermitOwner, PermitPy, Ready};

/// Default bound on the number of keys held.
pub const DEFAULT_MAX_KEYS: usize = 1 << 20;

/// What a key may be, in a TypeError.
const KEY_KINDS: &str = "a str, bytes or int";

static INDEX: PyOnceLock<Py<PyAny>> = PyOnceLock::new();

/// The map key of a Python key: a str by its text, bytes by its bytes, an integer (int of
/// any size, bool, numpy integer: whatever `operator.index` accepts) by its exact value.
pub fn key_of(h: &KeyHasher, key: &Bound<'_, PyAny>) -> PyResult<u64> {
    key_named(h, key, "key")
}

/// As [`key_of`], naming the argument `name` in the TypeError for anything else.
pub fn key_named(h: &KeyHasher, key: &Bound<'_, PyAny>, name: &str) -> PyResult<u64> {
    if let Ok(s) = key.cast::<PyString>() {
        return Ok(h.str(s.to_str()?));
    }
    if let Ok(b) = key.cast::<PyBytes>() {
        return Ok(h.bytes(b.as_bytes()));
    }
    if let Ok(v) = key.extract::<i64>() {
        return Ok(h.signed(v));
    }
    if let Ok(v) = key.extract::<u64>() {
        return Ok(h.int(v));
    }
    // An integer outside [-2^63, 2^64), by its decimal digits; or not an integer.
    let index = INDEX.import(key.py(), "operator", "index")?;
    let v = index.call1((key,)).map_err(|e| {
        if e.is_instance_of::<PyTypeError>(key.py()) {
            type_err(name, KEY_KINDS, key)
        } else {
            e
        }
    })?;
    Ok(h.big_int(v.str()?.to_str()?))
}

/// The queues of the keys that have waiters, created on demand and dropped when idle.
pub struct KeyGates {
    map: Mutex<HashMap<u64, Arc<Gate>>>,
    live: AtomicUsize,
    clock: AnyClock,
    config: QueueConfig,
    waits: Vec<Arc<Histogram>>,
    units: Vec<String>,
    returns_on_exit: bool,
    make: Box<dyn Fn(u64) -> Arc<dyn Resource> + Send + Sync>,
}

impl KeyGates {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Arc<Gate>>> {
        self.map.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The queue of `key` if it has one (never waits for the map's lock with the GIL).
    pub fn existing(&self, key: u64) -> Option<Arc<Gate>> {
        if self.live.load(Ordering::Acquire) == 0 {
            return None;
        }
        let now = match self.map.try_lock() {
            Ok(m) => Some(m),
            Err(std::sync::TryLockError::Poisoned(e)) => Some(e.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => None,
        };
        match now {
            Some(m) => m.get(&key).cloned(),
            None => unblocked(|| self.lock().get(&key).cloned()),
        }
    }

    /// True when someone waits on `key` (nobody overtakes them).
    pub fn has_waiters(&self, key: u64) -> bool {
        self.existing(key).is_some_and(|g| g.queue.waiting() > 0)
    }

    /// Drops every queue that nobody waits in and nobody holds (a queue whose last user
    /// left while another thread briefly held it too).
    fn sweep_idle(m: &mut HashMap<u64, Arc<Gate>>) {
        m.retain(|_, g| Arc::strong_count(g) > 1 || g.queue.waiting() > 0);
    }

    /// The queue of `key`, created if needed (outside the map's lock: a new queue
    /// registers for fork safety, and the registry comes first in the lock order).
    pub fn get(&self, key: u64) -> Arc<Gate> {
        if let Some(g) = self.lock().get(&key) {
            return g.clone();
        }
        let fresh = Arc::new(Gate {
            queue: WaitQueue::with_histograms(
                (self.make)(key),
                1,
                self.clock.clone(),
                self.config.clone(),
                self.waits.clone(),
            ),
            units: self.units.clone(),
            returns_on_exit: self.returns_on_exit,
        });
        let mut m = self.lock();
        if m.len() >= 64 && m.len().is_power_of_two() {
            // Amortised: the map stays within about twice the keys that have waiters.
            Self::sweep_idle(&mut m);
        }
        let g = m.entry(key).or_insert(fresh).clone();
        self.live.store(m.len(), Ordering::Release);
        g
    }

    /// Drops `key`'s queue if nobody waits in it and nobody else holds it (`held`:
    /// references the caller still holds).
    pub fn done(&self, key: u64, held: usize) {
        let mut m = self.lock();
        if let Some(g) = m.get(&key) {
            if Arc::strong_count(g) <= 1 + held && g.queue.waiting() == 0 {
                m.remove(&key);
            }
        }
        self.live.store(m.len(), Ordering::Release);
    }

    /// Grants whatever can now be granted on `key`.
    pub fn poll(&self, key: u64) {
        if let Some(g) = self.existing(key) {
            g.queue.poll_now();
        }
    }

    /// The queues of every key that has one, now.
    fn all(&self) -> Vec<Arc<Gate>> {
        self.lock().values().cloned().collect()
    }

    /// Grants and expires what is due now on every key; the next due time, if any.
    pub fn poll_all(&self) -> Option<u64> {
        let next = self.all().iter().filter_map(|g| g.queue.poll_now()).min();
        let mut m = self.lock();
        Self::sweep_idle(&mut m);
        self.live.store(m.len(), Ordering::Release);
        next
    }

    /// On a ManualClock: moves the clock through every due time of every key's queue up
    /// to `until_ns`, polling there (the virtual-time driver of a keyed limit). Never
    /// spins (see [`ratequeue_core::WaitQueue::run_until`]).
    pub fn run_until(&self, clock: &ratequeue_core::ManualClock, until_ns: u64) -> Result<usize, Error> {
        ratequeue_core::clock::check_time("until", until_ns)?;
        let mut n = 0;
        let mut stalled = Stalled::default();
        loop {
            let gates = self.all();
            let next = gates.iter().filter_map(|g| g.queue.next_wake()).min();
            match next {
                Some(t) if t <= until_ns => {
                    let progress = || gates.iter().fold(0u64, |a, g| a.wrapping_add(g.queue.progress()));
                    let before = (clock.now_ns(), progress());
                    let now = clock.set(t.max(before.0))?;
                    for g in &gates {
                        g.queue.poll(now);
                    }
                    n += 1;
                    stalled.check(before != (now, progress()), until_ns, now)?;
                }
                _ => break,
            }
        }
        clock.set(until_ns.max(clock.now_ns()))?;
        self.poll_all();
        Ok(n)
    }

    /// Keys with a queue now.
    pub fn len(&self) -> usize {
        self.live.load(Ordering::Acquire)
    }
}

impl ratequeue_core::fork::ForkLocks for KeyGates {
    fn rank(&self) -> ratequeue_core::fork::Rank {
        ratequeue_core::fork::Rank::KeyMap
    }

    fn lock_for_fork<'a>(&'a self, held: &mut Vec<Box<dyn ratequeue_core::fork::Held + 'a>>) {
        held.push(Box::new(self.lock()));
    }
}

/// A permit of one key: returns and settles on the key, then lets its waiters through.
struct KeyOwner {
    gates: Arc<KeyGates>,
    key: u64,
    resource: Arc<dyn Resource>,
}

impl PermitOwner for KeyOwner {
    fn units(&self) -> &[String] {
        &self.gates.units
    }

    fn returns_on_exit(&self) -> bool {
        self.gates.returns_on_exit
    }

    fn give_back(&self, costs: &[u64]) {
        unblocked(|| {
            self.resource.give_back(costs, None);
            self.gates.poll(self.key);
        });
    }

    fn settle(&self, estimated: &[u64], actual: &[u64], grant: GrantRef) -> GrantRef {
        // Through the key's queue when it has one, as a Limiter permit settles: an
        // overage then waits behind the reservations promised a time on the key.
        unblocked(|| match self.gates.existing(self.key) {
            Some(g) => g.queue.settle(estimated, actual, grant),
            None => {
                let grant = self.resource.settle(estimated, actual, grant);
                self.gates.poll(self.key);
                grant
            }
        })
    }
}

/// Shared per-key waiting for both keyed types.
struct Keyed {
    gates: Arc<KeyGates>,
    tried_admitted: AtomicU64,
    tried_refused: AtomicU64,
}

impl Keyed {
    fn run_until(&self, py: Python<'_>, until: &Bound<'_, PyAny>) -> PyResult<usize> {
        let AnyClock::Manual(m) = &self.gates.clock else {
            return Err(PyValueError::new_err("run_until needs a limiter on a ManualClock"));
        };
        let t = seconds_ns("until", until)?;
        let (gates, m) = (self.gates.clone(), m.clone());
        py.detach(move || gates.run_until(&m, t)).map_err(|e| to_py(py, e))
    }

    fn owner(&self, key: u64) -> Arc<dyn PermitOwner> {
        Arc::new(KeyOwner {
            gates: self.gates.clone(),
            key,
            resource: (self.gates.make)(key),
        })
    }

    fn note(&self, admitted: bool) {
        let c = if admitted {
            &self.tried_admitted
        } else {
            &self.tried_refused
        };
        c.fetch_add(1, Ordering::Relaxed);
    }

    /// Now, or None when it must queue; errors when it never can.
    fn try_now(&self, py: Python<'_>, key: u64, c: u64) -> PyResult<Option<PermitPy>> {
        if self.gates.has_waiters(key) {
            return Ok(None);
        }
        let r = (self.gates.make)(key);
        let at_ns = self.gates.clock.now_ns();
        let taken = try_or_unblocked(
            || r.try_take_token_nowait(at_ns, &[c]),
            || r.try_take_token(at_ns, &[c]),
        );
        match taken {
            Ok(token) => {
                // Every grant of an acquire records its wait, an immediate one 0 (as
                // Limiter and Concurrency do).
                self.gates.waits[0].record(0);
                Ok(Some(
                    PermitPy::new(self.owner(key), &[c], 0).with_grant(GrantRef { at_ns, token }),
                ))
            }
            Err(Deny::Wait(_)) => Ok(None),
            Err(d) => Err(to_py(py, r.error_for(d))),
        }
    }

    /// acquire from Python arguments.
    fn acquire_py(
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
    fn acquire_async_py(
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

    fn acquire(&self, py: Python<'_>, key: u64, c: u64, timeout_ns: Option<u64>) -> PyResult<PermitPy> {
        if let Some(p) = self.try_now(py, key, c)? {
            return Ok(p);
        }
        let gate = py.detach(|| self.gates.get(key));
        let r = gate.acquire_blocking(py, &[c], 0, timeout_ns);
        let owner = self.owner(key);
        let out = r.map(|p| p.rehome(owner));
        drop(gate);
        py.detach(|| self.gates.done(key, 0));
        out
    }

    fn acquire_async(&self, py: Python<'_>, key: u64, c: u64, timeout_ns: Option<u64>) -> PyResult<Py<PyAny>> {
        if let Some(p) = self.try_now(py, key, c)? {
            return Ok(Py::new(py, Ready::new(Py::new(py, p)?.into_any()))?.into_any());
        }
        let gate = py.detach(|| self.gates.get(key));
        let gates = self.gates.clone();
        let a = AcquiringPy::queued(
            &gate,
            &[c],
            timeout_ns,
            self.owner(key),
            Box::new(move || unblocked(|| gates.done(key, 1))),
        );
        Ok(Py::new(py, a)?.into_any())
    }
}

fn costs_array(py: Python<'_>, costs: Option<&Bound<'_, PyAny>>, n: usize) -> PyResult<Option<Vec<u64>>> {
    let Some(c) = costs else { return Ok(None) };
    let v: Vec<u64> = if let Ok(a) = c.extract::<PyReadonlyArray1<'_, u64>>() {
        a.as_slice()
            .map(|s| s.to_vec())
            .unwrap_or_else(|_| a.as_array().iter().copied().collect())
    } else {
        crate::args::numbers("costs", c, cost)?
    };
    if v.len() != n {
        return Err(PyValueError::new_err(format!(
            "costs has {} entries for {n} keys",
            v.len()
        )));
    }
    let _ = py;
    Ok(Some(v))
}

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
        self.keyed.gates.has_waiters(key)
    }

    /// Nanoseconds until `cost` on `key` would be granted behind the key's waiters
    /// (GIL released while the queue is read); None when nobody waits on it.
    pub fn backlog_delay_ns(&self, py: Python<'_>, key: u64, cost: u64) -> Option<u64> {
        let g = self.keyed.gates.existing(key).filter(|g| g.queue.waiting() != 0)?;
        py.detach(move || g.queue.predict_delay(&[cost]))
            .ok()
            .flatten()
            .map(|(_, d)| d)
    }

    /// The core map (for policies).
    pub fn core(&self) -> &Arc<KeyedLimiter> {
        &self.core
    }

    /// The per-key queues (policies wake a key's queue when they give capacity back).
    pub fn key_gates(&self) -> &Arc<KeyGates> {
        &self.keyed.gates
    }

    /// The unit this limiter counts.
    pub fn unit(&self) -> &str {
        &self.unit
    }
}

fn gates(
    py: Python<'_>,
    clock: AnyClock,
    max_wait: Option<&Bound<'_, PyAny>>,
    max_queue: Option<&Bound<'_, PyAny>>,
    units: Vec<String>,
    make: Box<dyn Fn(u64) -> Arc<dyn Resource> + Send + Sync>,
) -> PyResult<Arc<KeyGates>> {
    let max_wait_ns = max_wait.map(|m| seconds_ns("max_wait", m)).transpose()?;
    let max_queue = match max_queue {
        None => DEFAULT_MAX_QUEUE,
        Some(m) => usize::try_from(size("max_queue", m, u64::MAX)?).unwrap_or(usize::MAX),
    };
    let config = QueueConfig::new(Vec::new(), max_queue, max_wait_ns).map_err(|e| to_py(py, e))?;
    let g = Arc::new(KeyGates {
        map: Mutex::new(HashMap::new()),
        live: AtomicUsize::new(0),
        clock,
        config,
        waits: vec![Arc::new(Histogram::new())],
        returns_on_exit: units.is_empty(),
        units,
        make,
    });
    unblocked(|| ratequeue_core::fork::register_arc(&g));
    Ok(g)
}

fn keyed_stats<'py>(py: Python<'py>, k: &Keyed) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("tried_admitted", k.tried_admitted.load(Ordering::Relaxed))?;
    d.set_item("tried_refused", k.tried_refused.load(Ordering::Relaxed))?;
    d.set_item("waiting_keys", k.gates.len())?;
    let copy = Histogram::new();
    copy.add_snapshot(&k.gates.waits[0].snapshot());
    d.set_item("wait", HistogramPy { inner: Arc::new(copy) })?;
    Ok(d)
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
        unblocked(|| ratequeue_core::fork::register_arc(&core));
        let c2 = core.clone();
        let make: Box<dyn Fn(u64) -> Arc<dyn Resource> + Send + Sync> =
            Box::new(move |key| Arc::new(KeyBucket { keyed: c2.clone(), key }));
        let gates = gates(py, any, max_wait, max_queue, vec![r.unit.clone()], make)?;
        Ok(KeyedLimiterPy {
            core,
            keyed: Keyed {
                gates,
                tried_admitted: AtomicU64::new(0),
                tried_refused: AtomicU64::new(0),
            },
            unit: r.unit.clone(),
            name,
        })
    }

    /// Admits `cost` on `key` now or returns False; never waits (False while the key has
    /// waiters: nobody overtakes them).
    #[pyo3(signature = (key, cost = Cost(1)), text_signature = "($self, key, cost=1)")]
    fn try_acquire(&self, py: Python<'_>, key: &Bound<'_, PyAny>, cost: Cost) -> PyResult<bool> {
        let k = key_of(self.core.hasher(), key)?;
        if self.keyed.gates.has_waiters(k) {
            self.keyed.note(false);
            return Ok(false);
        }
        let core = &self.core;
        match try_or_unblocked(|| core.try_acquire_nowait(k, cost.0), || core.try_acquire(k, cost.0)) {
            Ok(()) => {
                self.keyed.note(true);
                Ok(true)
            }
            Err(Deny::Wait(_)) => {
                self.keyed.note(false);
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
        let costs = costs_array(py, costs, hashed.len())?;
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
        let gates = &self.keyed.gates;
        let core = self.core.clone();
        let r = if gates.len() == 0 {
            py.detach(|| core.try_acquire_many(&hashed, costs.as_deref(), &mut out))
        } else {
            // Some keys have waiters: those are refused (no barging), one by one.
            py.detach(|| {
                for (i, k) in hashed.iter().enumerate() {
                    if gates.has_waiters(*k) {
                        continue;
                    }
                    match core.try_acquire(*k, costs.as_ref().map_or(1, |c| c[i])) {
                        Ok(()) => out[i] = true,
                        Err(Deny::Wait(_)) => {}
                        Err(d) => return Err(d),
                    }
                }
                Ok(())
            })
        };
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
        self.keyed.tried_admitted.fetch_add(admitted, Ordering::Relaxed);
        self.keyed
            .tried_refused
            .fetch_add(out.len() as u64 - admitted, Ordering::Relaxed);
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
        let queued = self.keyed.gates.existing(k).filter(|g| g.queue.waiting() != 0);
        let delay = match queued {
            Some(g) => py
                .detach(move || g.queue.predict_delay(&[cost]))
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
        unblocked(|| self.keyed.gates.poll_all()).map(crate::clock::due_seconds)
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
        let d = keyed_stats(py, &self.keyed)?;
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
        HistogramPy {
            inner: self.keyed.gates.waits[0].clone(),
        }
    }

    fn __repr__(&self) -> String {
        let keys = unblocked(|| self.core.len());
        format!("KeyedLimiter({}, keys={})", self.rate().__repr__(), keys)
    }
}

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
        self.keyed.gates.has_waiters(key)
    }

    /// The core map (for policies).
    pub fn core(&self) -> &Arc<KeyedSemaphore> {
        &self.core
    }

    /// The per-key queues (policies wake a key's queue when they release permits).
    pub fn key_gates(&self) -> &Arc<KeyGates> {
        &self.keyed.gates
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
        unblocked(|| ratequeue_core::fork::register_arc(&core));
        let c2 = core.clone();
        let make: Box<dyn Fn(u64) -> Arc<dyn Resource> + Send + Sync> =
            Box::new(move |key| Arc::new(KeyPermits { sem: c2.clone(), key }));
        let gates = gates(py, any_clock(clock)?, max_wait, max_queue, Vec::new(), make)?;
        Ok(KeyedConcurrencyPy {
            core,
            keyed: Keyed {
                gates,
                tried_admitted: AtomicU64::new(0),
                tried_refused: AtomicU64::new(0),
            },
            name,
        })
    }

    /// Takes `n` permits on `key` now, or returns None; never waits.
    #[pyo3(signature = (key, n = Permits(1)), text_signature = "($self, key, n=1)")]
    fn try_acquire(&self, py: Python<'_>, key: &Bound<'_, PyAny>, n: Permits) -> PyResult<Option<PermitPy>> {
        let k = key_of(self.core.hasher(), key)?;
        let p = self.keyed.try_now(py, k, n.0)?;
        self.keyed.note(p.is_some());
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
        unblocked(|| self.keyed.gates.poll_all()).map(crate::clock::due_seconds)
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
        let d = keyed_stats(py, &self.keyed)?;
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
