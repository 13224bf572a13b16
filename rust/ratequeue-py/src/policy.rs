//! Python Policy: several limits passed at once (user quota → tenant concurrency →
//! cluster bucket), all or nothing; one permit releases what must be released.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};
use ratequeue_core::policy::{Held, LevelQueues, PolicyAcquire, QueueRef, Refusal, Step, Waker};
use ratequeue_core::queue::Slot;
use ratequeue_core::{AnyClock, Deny, Error, Level, LevelArgs, LevelKind, Outcome, Policy, Wake};

use crate::args::{cost, seconds_ns};
use crate::blocking::unblocked;
use crate::concurrency::ConcurrencyPy;
use crate::errors::{to_py, type_err};
use crate::keyed::{key_named, KeyGates, KeyedConcurrencyPy, KeyedLimiterPy};
use crate::limiter::LimiterPy;
use crate::waiting::{is_main_thread, ChannelPy, Gate, Ready};

/// Interval at which a main-thread wait looks for signals (Ctrl-C).
const SIGNAL_SLICE: Duration = Duration::from_millis(50);

/// A Limiter's one queue, for a policy to join.
struct OneQueue(Arc<Gate>);

impl LevelQueues for OneQueue {
    fn existing(&self, _key: u64) -> Option<QueueRef> {
        Some(QueueRef::new(self.0.queue.clone()))
    }
}

/// A keyed level's queue of a key, kept in its map while the policy holds it.
struct KeyQueues(Arc<KeyGates>);

impl LevelQueues for KeyQueues {
    fn existing(&self, key: u64) -> Option<QueueRef> {
        self.0.existing(key).map(|g| QueueRef {
            queue: g.queue.clone(),
            keep: Some(g),
        })
    }

    fn queue(&self, key: u64) -> Option<QueueRef> {
        let g = self.0.get(key);
        Some(QueueRef {
            queue: g.queue.clone(),
            keep: Some(g),
        })
    }

    fn done(&self, key: u64) {
        self.0.done(key, 0);
    }
}

/// How a level reads its arguments from a call.
enum Shape {
    /// Costs per unit, in the limiter's unit order.
    Units(Vec<String>),
    /// A key (the level's name) and a cost in one unit.
    KeyedUnit(String),
    /// Permits (1 per call); `keyed`: a key is needed.
    Permits { keyed: bool },
}

struct LevelPy {
    name: String,
    shape: Shape,
    obj: Py<PyAny>,
}

/// Several limits decided together: all or nothing, waiting for the latest.
#[pyclass(frozen, name = "Policy", module = "ratequeue")]
pub struct PolicyPy {
    core: Arc<Policy>,
    levels: Vec<LevelPy>,
    clock: AnyClock,
}

/// The error for a refusal; `max_wait_ns`: the bound a reservation was refused
/// against (retry_after is then the excess, as for Limiter.reserve).
fn refusal_error(py: Python<'_>, p: &PolicyPy, r: Refusal, max_wait_ns: u64) -> PyErr {
    let name = &p.levels[r.level].name;
    let e = match r.deny {
        Deny::TooLarge { cost, burst, .. } => Error::CostTooLarge {
            unit: format!("(level {name:?})"),
            cost,
            burst,
        },
        Deny::Wait(ns) => Error::Overloaded {
            reason: format!("refused by level {name:?}"),
            retry_after_ns: if ns == u64::MAX {
                0
            } else {
                ns.saturating_sub(max_wait_ns)
            },
        },
    };
    to_py(py, e)
}

impl PolicyPy {
    fn args(&self, kw: Option<&Bound<'_, PyDict>>) -> PyResult<Vec<LevelArgs>> {
        let mut used = std::collections::HashSet::new();
        let get = |name: &str| -> Option<Bound<'_, PyAny>> { kw.and_then(|d| d.get_item(name).ok().flatten()) };
        let mut out = Vec::with_capacity(self.levels.len());
        for (i, l) in self.levels.iter().enumerate() {
            let unit_cost = |u: &str, used: &mut std::collections::HashSet<String>| -> PyResult<u64> {
                match get(u) {
                    Some(v) => {
                        used.insert(u.to_owned());
                        cost(u, &v)
                    }
                    None if u == "requests" => Ok(1),
                    None => Err(PyTypeError::new_err(format!(
                        "missing cost for unit {u:?} (level {:?}): pass {u}=...",
                        l.name
                    ))),
                }
            };
            let key_for = |used: &mut std::collections::HashSet<String>| -> PyResult<Bound<'_, PyAny>> {
                used.insert(l.name.clone());
                get(&l.name).ok_or_else(|| {
                    PyTypeError::new_err(format!("missing key for level {:?}: pass {}=...", l.name, l.name))
                })
            };
            let a = match &l.shape {
                Shape::Units(units) => LevelArgs {
                    key: 0,
                    costs: units.iter().map(|u| unit_cost(u, &mut used)).collect::<PyResult<_>>()?,
                },
                Shape::KeyedUnit(u) => {
                    let k = key_for(&mut used)?;
                    let key = match &self.core.levels()[i].kind {
                        LevelKind::KeyedRate(m) => key_named(m.hasher(), &k, &l.name)?,
                        _ => 0,
                    };
                    LevelArgs {
                        key,
                        costs: vec![unit_cost(u, &mut used)?],
                    }
                }
                Shape::Permits { keyed } => {
                    let key = if *keyed {
                        let k = key_for(&mut used)?;
                        match &self.core.levels()[i].kind {
                            LevelKind::KeyedConcurrency(m) => key_named(m.hasher(), &k, &l.name)?,
                            _ => 0,
                        }
                    } else {
                        0
                    };
                    LevelArgs { key, costs: vec![1] }
                }
            };
            out.push(a);
        }
        if let Some(d) = kw {
            for k in d.keys() {
                let k: String = k.extract()?;
                if !used.contains(&k) {
                    return Err(PyTypeError::new_err(format!(
                        "unexpected keyword {k:?}: not a keyed level's name nor a unit of any level"
                    )));
                }
            }
        }
        Ok(out)
    }

    fn permit(&self, args: Vec<LevelArgs>, held: Vec<Held>, delay_ns: u64) -> PolicyPermitPy {
        PolicyPermitPy {
            policy: self.core.clone(),
            units: self
                .levels
                .iter()
                .map(|l| match &l.shape {
                    Shape::Units(u) => u.clone(),
                    Shape::KeyedUnit(u) => vec![u.clone()],
                    Shape::Permits { .. } => Vec::new(),
                })
                .collect(),
            state: Mutex::new((args, held)),
            delay_ns,
            released: AtomicBool::new(false),
            clock: self.clock.clone(),
            fork_gen: ratequeue_core::fork::generation(),
        }
    }

    /// Every level now, when nobody waits on any and each admits (an acquire's fast
    /// path: the queues would grant it at once too); None otherwise.
    fn try_now(&self, py: Python<'_>, args: &[LevelArgs]) -> Option<Vec<Held>> {
        if self.waiters_ahead(py, args).is_some() {
            return None;
        }
        let (core, now) = (&self.core, self.clock.now_ns());
        unblocked(|| core.try_now(args, now))
    }

    /// The first enforced level where someone already waits (a policy does not
    /// overtake the waiters of its levels, as their own try_acquire does not).
    fn waiters_ahead(&self, py: Python<'_>, args: &[LevelArgs]) -> Option<usize> {
        self.levels.iter().enumerate().find_map(|(i, l)| {
            if self.core.levels()[i].shadow {
                return None;
            }
            let o = l.obj.bind(py);
            let waits = if let Ok(x) = o.cast::<LimiterPy>() {
                x.get().has_waiters()
            } else if let Ok(x) = o.cast::<KeyedLimiterPy>() {
                x.get().has_waiters(args[i].key)
            } else if let Ok(x) = o.cast::<ConcurrencyPy>() {
                x.get().gate().queue.waiting() != 0
            } else if let Ok(x) = o.cast::<KeyedConcurrencyPy>() {
                x.get().has_waiters(args[i].key)
            } else {
                false
            };
            waits.then_some(i)
        })
    }

    /// The latest time, from now, at which the enforced rate levels that have waiters
    /// would grant these costs behind them (0 when none can say).
    fn backlog_delay_ns(&self, py: Python<'_>, args: &[LevelArgs]) -> u64 {
        let mut wait = 0;
        for (i, l) in self.levels.iter().enumerate() {
            if self.core.levels()[i].shadow {
                continue;
            }
            let o = l.obj.bind(py);
            let d = if let Ok(x) = o.cast::<LimiterPy>() {
                x.get().backlog_delay_ns(py, &args[i].costs)
            } else if let Ok(x) = o.cast::<KeyedLimiterPy>() {
                x.get().backlog_delay_ns(py, args[i].key, args[i].costs[0])
            } else {
                None
            };
            wait = wait.max(d.unwrap_or(0));
        }
        wait
    }
}

#[pymethods]
impl PolicyPy {
    /// `levels`: an ordered dict of name → Limiter | KeyedLimiter | Concurrency |
    /// KeyedConcurrency. Keyed levels take their key from the keyword of their name;
    /// costs are keywords per unit. `shadow`: names of levels evaluated and counted
    /// but never enforced.
    #[new]
    #[pyo3(signature = (levels, *, shadow = None))]
    fn new(py: Python<'_>, levels: &Bound<'_, PyAny>, shadow: Option<&Bound<'_, PyAny>>) -> PyResult<Self> {
        let levels = levels
            .cast::<PyDict>()
            .map_err(|_| type_err("levels", "a dict of level name to limit", levels))?;
        let shadow_names = match shadow {
            Some(s) if !s.is_none() => crate::args::texts("shadow", s)?,
            _ => Vec::new(),
        };
        let mut core_levels = Vec::new();
        let mut py_levels = Vec::new();
        let mut clock = None;
        for (k, v) in levels.iter() {
            let name = crate::args::text("levels", &k).map_err(|_| type_err("levels", "str names", &k))?;
            // Each level's queue is woken whenever the policy gives capacity back to it.
            let queues: Option<Arc<dyn LevelQueues>>;
            let (kind, shape, c, wake): (_, _, _, Waker) = if let Ok(l) = v.cast::<LimiterPy>() {
                let core = l.get().core().clone();
                let units = core.units().to_vec();
                let c = core.clock().clone();
                let gate = l.get().gate().clone();
                queues = Some(Arc::new(OneQueue(gate.clone())));
                let wake = Arc::new(move |_| {
                    let gate = gate.clone();
                    unblocked(move || {
                        gate.queue.poll_now();
                    })
                });
                (LevelKind::Rate(core), Shape::Units(units), Some(c), wake)
            } else if let Ok(l) = v.cast::<KeyedLimiterPy>() {
                let core = l.get().core().clone();
                let c = core.clock().clone();
                let gates = l.get().key_gates().clone();
                queues = Some(Arc::new(KeyQueues(gates.clone())));
                (
                    LevelKind::KeyedRate(core),
                    Shape::KeyedUnit(l.get().unit().to_owned()),
                    Some(c),
                    Arc::new(move |key| {
                        let gates = gates.clone();
                        unblocked(move || gates.poll(key))
                    }),
                )
            } else if let Ok(l) = v.cast::<ConcurrencyPy>() {
                let gate = l.get().gate().clone();
                queues = Some(Arc::new(OneQueue(gate.clone())));
                (
                    LevelKind::Concurrency(l.get().semaphore().clone()),
                    Shape::Permits { keyed: false },
                    None,
                    Arc::new(move |_| {
                        let gate = gate.clone();
                        unblocked(move || {
                            gate.queue.poll_now();
                        })
                    }),
                )
            } else if let Ok(l) = v.cast::<KeyedConcurrencyPy>() {
                let gates = l.get().key_gates().clone();
                queues = Some(Arc::new(KeyQueues(gates.clone())));
                (
                    LevelKind::KeyedConcurrency(l.get().core().clone()),
                    Shape::Permits { keyed: true },
                    None,
                    Arc::new(move |key| {
                        let gates = gates.clone();
                        unblocked(move || gates.poll(key))
                    }),
                )
            } else {
                return Err(type_err(
                    &format!("levels[{name:?}]"),
                    "a Limiter, KeyedLimiter, Concurrency or KeyedConcurrency",
                    &v,
                ));
            };
            if let (Some(c), None) = (&c, &clock) {
                clock = Some(c.clone());
            }
            let is_shadow = shadow_names.contains(&name);
            core_levels.push(Level {
                name: name.clone(),
                kind,
                shadow: is_shadow,
                wake: Some(wake),
                queues,
            });
            py_levels.push(LevelPy {
                name,
                shape,
                obj: v.unbind(),
            });
        }
        for s in &shadow_names {
            if !py_levels.iter().any(|l| &l.name == s) {
                return Err(PyValueError::new_err(format!(
                    "shadow names {s:?}, which is not a level"
                )));
            }
        }
        check_levels(&py_levels)?;
        let core = Policy::new(core_levels).map_err(|e| to_py(py, e))?;
        Ok(PolicyPy {
            core: Arc::new(core),
            levels: py_levels,
            clock: clock.unwrap_or_default(),
        })
    }

    /// Admits on every level now, or on none: a PolicyPermit, or None when refused.
    #[pyo3(signature = (**kw))]
    fn try_acquire(&self, py: Python<'_>, kw: Option<&Bound<'_, PyDict>>) -> PyResult<Option<PolicyPermitPy>> {
        let args = self.args(kw)?;
        if let Some(i) = self.waiters_ahead(py, &args) {
            self.core.note_refused(i);
            return Ok(None);
        }
        let (core, now) = (&self.core, self.clock.now_ns());
        match unblocked(|| core.try_acquire(&args, now)) {
            Ok(held) => Ok(Some(self.permit(args, held, 0))),
            Err(Refusal {
                deny: Deny::Wait(_), ..
            }) => Ok(None),
            Err(r) => Err(refusal_error(py, self, r, 0)),
        }
    }

    /// Reserves every rate level for one grant at the latest time any of them needs
    /// (concurrency levels must be free now): a PolicyPermit whose `delay` says how long
    /// to wait. Raises Overloaded at once, holding nothing, beyond `max_wait`, and while
    /// any enforced level has requests waiting (a reservation never overtakes them nor
    /// moves them later); `retry_after` is then when those rate levels' queues will have
    /// served their backlog and this request (0.0 when only a concurrency level waits).
    #[pyo3(signature = (*, max_wait = None, **kw))]
    fn reserve(
        &self,
        py: Python<'_>,
        max_wait: Option<&Bound<'_, PyAny>>,
        kw: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<PolicyPermitPy> {
        let args = self.args(kw)?;
        if let Some(i) = self.waiters_ahead(py, &args) {
            self.core.note_refused(i);
            return Err(to_py(
                py,
                Error::Overloaded {
                    reason: format!(
                        "level {:?} has requests waiting: a reservation does not overtake them",
                        self.levels[i].name
                    ),
                    retry_after_ns: self.backlog_delay_ns(py, &args),
                },
            ));
        }
        let mw = max_wait
            .map(|m| seconds_ns("max_wait", m))
            .transpose()?
            .unwrap_or(u64::MAX);
        let (core, now) = (&self.core, self.clock.now_ns());
        match py.detach(|| core.reserve(&args, now, mw, false)) {
            Ok((delay, held)) => Ok(self.permit(args, held, delay)),
            Err(r) => Err(refusal_error(py, self, r, mw)),
        }
    }

    /// Waits for every level (GIL released): in the queue of each concurrency level in
    /// order, then every rate level held for one common time behind its queue, all
    /// within `timeout` (the core's one policy lifecycle, `PolicyAcquire`). Returns a
    /// PolicyPermit (a context manager releasing the concurrency permits on exit);
    /// Ctrl-C or an error gives back everything taken.
    #[pyo3(signature = (*, timeout = None, **kw))]
    fn acquire(
        &self,
        py: Python<'_>,
        timeout: Option<&Bound<'_, PyAny>>,
        kw: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<PolicyPermitPy> {
        let args = self.args(kw)?;
        let t = timeout.map(|t| seconds_ns("timeout", t)).transpose()?;
        if let Some(held) = self.try_now(py, &args) {
            return Ok(self.permit(args, held, 0));
        }
        let pa = PolicyAcquire::new(self.core.clone(), args, self.clock.clone(), t);
        let mut slice = None;
        loop {
            let slot = Slot::new();
            match py.detach(|| pa.advance(&|| Wake::Thread(slot.clone()))) {
                Ok(Step::Queued(_)) => {}
                Ok(Step::Done {
                    delay_ns,
                    waited_ns,
                    held,
                }) => {
                    let permit = self.permit(pa.args().to_vec(), held, waited_ns.saturating_add(delay_ns));
                    if delay_ns > 0 && !self.clock.is_manual() {
                        if let Err(e) = sleep_interruptibly(py, Duration::from_nanos(delay_ns)) {
                            permit.cancel(py);
                            return Err(e);
                        }
                    }
                    return Ok(permit);
                }
                Err(e) => return Err(to_py(py, e)),
            }
            let slice = *slice.get_or_insert_with(|| is_main_thread(py).then_some(SIGNAL_SLICE));
            loop {
                let s = slot.clone();
                if let Some(o) = py.detach(move || s.wait(slice)) {
                    py.detach(|| pa.outcome(o)).map_err(|e| to_py(py, e))?;
                    break;
                }
                if let Err(e) = py.check_signals() {
                    py.detach(|| pa.abandon_slot(&slot));
                    return Err(e);
                }
            }
        }
    }

    /// Awaitable (and async context manager) version of acquire: the same lifecycle,
    /// its waits bridged to the running event loop by ratequeue.aio.
    #[pyo3(signature = (*, timeout = None, **kw))]
    fn acquire_async(
        slf: &Bound<'_, Self>,
        timeout: Option<&Bound<'_, PyAny>>,
        kw: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<PolicyAcquiringPy> {
        let py = slf.py();
        let me = slf.get();
        let args = me.args(kw)?;
        let t = timeout.map(|t| seconds_ns("timeout", t)).transpose()?;
        let permit = OnceLock::new();
        if let Some(held) = me.try_now(py, &args) {
            let _ = permit.set(Py::new(py, me.permit(args.clone(), held, 0))?);
        }
        Ok(PolicyAcquiringPy {
            policy: slf.clone().unbind(),
            core: Arc::new(PolicyAcquire::new(me.core.clone(), args, me.clock.clone(), t)),
            permit,
            awaited: AtomicBool::new(false),
            left_ns: AtomicU64::new(0),
        })
    }

    /// Level names, in order.
    #[getter]
    fn levels(&self) -> Vec<String> {
        self.levels.iter().map(|l| l.name.clone()).collect()
    }

    /// Admitted requests and, per level, refusals and shadow refusals.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        d.set_item("admitted", self.core.admitted())?;
        let levels = PyDict::new(py);
        for (i, l) in self.levels.iter().enumerate() {
            let c = self.core.counts(i);
            let e = PyDict::new(py);
            e.set_item("refused", c.refused)?;
            e.set_item("shadow_refused", c.shadow_refused)?;
            e.set_item("shadow", self.core.levels()[i].shadow)?;
            levels.set_item(&l.name, e)?;
        }
        d.set_item("levels", levels)?;
        Ok(d)
    }
}

/// Keywords of Policy calls: never a level's name.
const KEYWORDS: [&str; 2] = ["timeout", "max_wait"];

/// Refuses set-ups that can never work: a level named like a call keyword or like a
/// unit of any level (its keyword would be ambiguous).
fn check_levels(levels: &[LevelPy]) -> PyResult<()> {
    let units: Vec<&str> = levels
        .iter()
        .flat_map(|l| match &l.shape {
            Shape::Units(u) => u.iter().map(String::as_str).collect(),
            Shape::KeyedUnit(u) => vec![u.as_str()],
            Shape::Permits { .. } => Vec::new(),
        })
        .collect();
    for l in levels {
        if KEYWORDS.contains(&l.name.as_str()) {
            return Err(PyValueError::new_err(format!(
                "level {:?} is named like a keyword of Policy calls {KEYWORDS:?}: rename the level",
                l.name
            )));
        }
        if units.contains(&l.name.as_str()) {
            return Err(PyValueError::new_err(format!(
                "level {:?} is named like a unit a level counts: its keyword would be both a key \
                 and a cost; rename the level",
                l.name
            )));
        }
    }
    Ok(())
}

fn sleep_interruptibly(py: Python<'_>, d: Duration) -> PyResult<()> {
    let end = std::time::Instant::now() + d;
    loop {
        let left = end.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return Ok(());
        }
        let step = left.min(Duration::from_millis(50));
        py.detach(move || std::thread::sleep(step));
        py.check_signals()?;
    }
}

/// What a policy granted: a context manager that returns concurrency permits on exit;
/// `settle` corrects estimated costs on every rate level.
#[pyclass(frozen, name = "PolicyPermit", module = "ratequeue")]
pub struct PolicyPermitPy {
    policy: Arc<Policy>,
    units: Vec<Vec<String>>,
    state: Mutex<(Vec<LevelArgs>, Vec<Held>)>,
    delay_ns: u64,
    released: AtomicBool,
    clock: AnyClock,
    /// The fork generation it was granted in: in a forked child every permit starts
    /// free, so one from before the fork gives nothing back there.
    fork_gen: u64,
}

impl PolicyPermitPy {
    /// Gives back everything by each level's one undo rule (see `Policy::undo`), once,
    /// waking the levels' queues; the GIL is released meanwhile (the permit's lock and
    /// the queues' are taken without it).
    pub fn cancel(&self, py: Python<'_>) {
        if self.released.swap(true, Ordering::AcqRel) || self.fork_gen != ratequeue_core::fork::generation() {
            return;
        }
        py.detach(|| {
            let now = self.clock.now_ns();
            let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
            let (args, held) = &mut *st;
            self.policy.undo_all(held, args, now);
        });
    }
}

#[pymethods]
impl PolicyPermitPy {
    /// Seconds the caller waits (or waited) for the latest level.
    #[getter]
    fn delay(&self) -> f64 {
        self.delay_ns as f64 / 1e9
    }

    /// True once released or cancelled.
    #[getter]
    fn released(&self) -> bool {
        self.released.load(Ordering::Acquire)
    }

    /// Returns the concurrency permits (rate capacity stays used); only the first call
    /// has an effect. Returns True if this call released.
    fn release(&self, py: Python<'_>) -> bool {
        if self.released.swap(true, Ordering::AcqRel) {
            return false;
        }
        if self.fork_gen != ratequeue_core::fork::generation() {
            return true;
        }
        py.detach(|| {
            let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
            for (i, h) in st.1.iter_mut().enumerate() {
                self.policy.release(i, h);
            }
        });
        true
    }

    /// Gives back everything taken, once: each rate exactly where nothing came after
    /// it, else refunded while no grant is scheduled ahead, else kept; permits returned.
    #[pyo3(name = "cancel")]
    fn cancel_py(&self, py: Python<'_>) {
        self.cancel(py);
    }

    /// Corrects estimated costs (keywords per unit) on every rate level that counts
    /// them: refunds (never past the burst) or charges the overage (possibly debt).
    #[pyo3(signature = (**kw))]
    fn settle(&self, py: Python<'_>, kw: Option<&Bound<'_, PyDict>>) -> PyResult<()> {
        let mut given: Vec<(usize, usize, u64)> = Vec::new();
        if let Some(d) = kw {
            for (k, v) in d.iter() {
                let name: String = k.extract()?;
                let c = cost(&name, &v)?;
                let mut found = false;
                for (i, units) in self.units.iter().enumerate() {
                    if let Some(j) = units.iter().position(|u| *u == name) {
                        given.push((i, j, c));
                        found = true;
                    }
                }
                if !found {
                    return Err(PyTypeError::new_err(format!(
                        "unexpected keyword {name:?}: no level counts it"
                    )));
                }
            }
        }
        py.detach(|| {
            let now = self.clock.now_ns();
            let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
            let (args, held) = &mut *st;
            let mut actual = args.clone();
            for (i, j, c) in given {
                actual[i].costs[j] = c;
            }
            self.policy.settle(held, args, &actual, now);
            *args = actual;
        });
        Ok(())
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_exc))]
    fn __exit__(&self, py: Python<'_>, _exc: &Bound<'_, PyTuple>) -> bool {
        self.release(py);
        false
    }

    fn __repr__(&self) -> String {
        format!("PolicyPermit(delay={}, released={})", self.delay(), self.released())
    }
}

/// What `Policy.acquire_async` returns: await it for a PolicyPermit, or use `async
/// with`. The core decides every step (`PolicyAcquire`); ratequeue.aio only bridges its
/// waits to the running event loop.
#[pyclass(frozen, name = "PolicyAcquiring", module = "ratequeue")]
pub struct PolicyAcquiringPy {
    policy: Py<PolicyPy>,
    core: Arc<PolicyAcquire>,
    permit: OnceLock<Py<PolicyPermitPy>>,
    /// True once awaited: the permit is the caller's from then on.
    awaited: AtomicBool,
    /// Nanoseconds from the final step to the rate levels' common time.
    left_ns: AtomicU64,
}

impl Drop for PolicyAcquiringPy {
    /// Never awaited, a permit taken at once (every level free) goes back.
    fn drop(&mut self) {
        if !*self.awaited.get_mut() {
            if let Some(p) = self.permit.take() {
                Python::attach(|py| p.get().cancel(py));
            }
        }
    }
}

static POLICY_WAIT: pyo3::sync::PyOnceLock<Py<PyAny>> = pyo3::sync::PyOnceLock::new();

#[pymethods]
impl PolicyAcquiringPy {
    fn __await__(slf: &Bound<'_, Self>) -> PyResult<Py<PyAny>> {
        let py = slf.py();
        slf.get().awaited.store(true, Ordering::Release);
        if let Some(p) = slf.get().permit.get() {
            // Granted at once (every level free, nobody waiting), or awaited again.
            return Ok(Py::new(py, Ready::new(p.clone_ref(py).into_any()))?.into_any());
        }
        let wait = POLICY_WAIT.import(py, "ratequeue.aio", "_policy_wait")?;
        Ok(wait.call1((slf,))?.call_method0("__await__")?.unbind())
    }

    fn __aenter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_exc))]
    fn __aexit__(&self, py: Python<'_>, _exc: &Bound<'_, PyTuple>) -> PyResult<Py<Ready>> {
        if let Some(p) = self.permit.get() {
            p.get().release(py);
        }
        Py::new(py, Ready::new(false.into_pyobject(py)?.to_owned().into_any().unbind()))
    }

    /// Goes on as far as it can on `channel`: the PolicyPermit when every level is
    /// held, else the ticket whose outcome arrives in the channel. Raises the refusal
    /// (everything given back). RuntimeError on a closed channel.
    fn _submit(&self, py: Python<'_>, channel: &Bound<'_, ChannelPy>) -> PyResult<Py<PyAny>> {
        let chan = channel.get().inner.clone();
        if chan.is_closed() {
            return Err(pyo3::exceptions::PyRuntimeError::new_err("the channel is closed"));
        }
        let core = &self.core;
        match py.detach(|| core.advance(&|| Wake::Channel(chan.clone()))) {
            Ok(Step::Queued(t)) => Ok(t.into_pyobject(py)?.into_any().unbind()),
            Ok(Step::Done {
                delay_ns,
                waited_ns,
                held,
            }) => {
                let policy = self.policy.get();
                let permit = policy.permit(core.args().to_vec(), held, waited_ns.saturating_add(delay_ns));
                if !policy.clock.is_manual() {
                    self.left_ns.store(delay_ns, Ordering::Release);
                }
                let p = Py::new(py, permit)?;
                let _ = self.permit.set(p.clone_ref(py));
                Ok(p.into_any())
            }
            Err(e) => Err(to_py(py, e)),
        }
    }

    /// The wait under way was granted (`token`: its grant): None, the next step is
    /// `_submit` again.
    #[pyo3(signature = (waited_ns, token = None))]
    fn _granted(&self, py: Python<'_>, waited_ns: u64, token: Option<u64>) -> PyResult<Option<Py<PyAny>>> {
        let o = Outcome::Granted {
            at_ns: 0,
            waited_ns,
            token: token.unwrap_or(0),
        };
        let core = &self.core;
        py.detach(|| core.outcome(o)).map_err(|e| to_py(py, e))?;
        Ok(None)
    }

    /// The WaitTimeout for the wait under way, which expired (everything given back).
    fn _timeout_error(&self, py: Python<'_>, waited_ns: u64) -> PyErr {
        let core = &self.core;
        match py.detach(|| core.outcome(Outcome::TimedOut { waited_ns })) {
            Err(e) => to_py(py, e),
            Ok(()) => to_py(
                py,
                Error::WaitTimeout {
                    waited_ns,
                    retry_after_ns: 0,
                },
            ),
        }
    }

    /// Gives back everything held; True if the wait under way left its queue, False if
    /// its queue decided already (its grant then comes to `_give_back`).
    fn _cancel(&self, py: Python<'_>, ticket: u64) -> bool {
        let _ = ticket; // one wait at a time: the core knows which
        py.detach(|| self.core.abandon())
    }

    /// Gives back everything held and the grant (`token`) of the wait under way, which
    /// arrived after its waiter left.
    #[pyo3(signature = (token = None))]
    fn _give_back(&self, py: Python<'_>, token: Option<u64>) {
        let core = &self.core;
        py.detach(|| match token {
            Some(t) => core.give_back_late(t),
            None => {
                core.abandon();
            }
        });
    }

    /// The task left after a step was granted but before it resumed: everything held
    /// is given back, once.
    fn _abandon(&self, py: Python<'_>, result: &Bound<'_, PyAny>) {
        let _ = result; // None: the grant is already in the core's state
        py.detach(|| self.core.abandon());
    }

    /// Seconds to sleep after the final step until the common time (0 on a ManualClock).
    fn _left(&self) -> f64 {
        self.left_ns.load(Ordering::Acquire) as f64 / 1e9
    }
}
