//! Python Policy: several limits passed at once (user quota → tenant concurrency →
//! cluster bucket), all or nothing; one permit releases what must be released.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};
use ratequeue_core::policy::{Held, Refusal, Waker};
use ratequeue_core::{AnyClock, Deny, Error, Level, LevelArgs, LevelKind, Policy};

use crate::args::{cost, seconds_ns};
use crate::blocking::unblocked;
use crate::concurrency::ConcurrencyPy;
use crate::errors::{to_py, type_err};
use crate::keyed::{key_named, KeyedConcurrencyPy, KeyedLimiterPy};
use crate::limiter::LimiterPy;
use crate::waiting::PermitPy;

/// A concurrency level to wait on, and the key to wait on (None: unkeyed).
type Step = (Py<PyAny>, Option<Py<PyAny>>);

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

impl LevelPy {
    /// How a call's keywords address this level.
    fn keywords(&self) -> crate::args::LevelKeywords<'_> {
        let (keyed, units) = match &self.shape {
            Shape::Units(u) => (false, u.as_slice()),
            Shape::KeyedUnit(u) => (true, std::slice::from_ref(u)),
            Shape::Permits { keyed } => (*keyed, &[][..]),
        };
        crate::args::LevelKeywords {
            name: &self.name,
            keyed,
            units,
        }
    }
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
        let levels: Vec<_> = self.levels.iter().map(LevelPy::keywords).collect();
        let calls = crate::args::policy_keywords(&levels, kw)?;
        calls
            .into_iter()
            .enumerate()
            .map(|(i, c)| {
                let key = match (&c.key, &self.core.levels()[i].kind) {
                    (Some(k), LevelKind::KeyedRate(m)) => key_named(m.hasher(), k, &self.levels[i].name)?,
                    (Some(k), LevelKind::KeyedConcurrency(m)) => key_named(m.hasher(), k, &self.levels[i].name)?,
                    _ => 0,
                };
                Ok(LevelArgs { key, costs: c.costs })
            })
            .collect()
    }

    fn permit(&self, args: Vec<LevelArgs>, held: Vec<Held>, delay_ns: u64, extra: Vec<Py<PermitPy>>) -> PolicyPermitPy {
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
            extra,
            delay_ns,
            released: AtomicBool::new(false),
            clock: self.clock.clone(),
            fork_gen: ratequeue_core::fork::generation(),
        }
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

    /// Waits (GIL released) in the queue of every enforced concurrency level, in order.
    fn wait_concurrency(
        &self,
        py: Python<'_>,
        args: &[LevelArgs],
        deadline: Option<u64>,
    ) -> PyResult<Vec<Py<PermitPy>>> {
        let mut got: Vec<Py<PermitPy>> = Vec::new();
        for (i, l) in self.levels.iter().enumerate() {
            if !matches!(l.shape, Shape::Permits { .. }) || self.core.levels()[i].shadow {
                continue;
            }
            let timeout = deadline.map(|d| d.saturating_sub(self.clock.now_ns()));
            let r = if let Ok(c) = l.obj.bind(py).cast::<ConcurrencyPy>() {
                c.get().gate().acquire_blocking(py, &[1], 0, timeout)
            } else if let Ok(k) = l.obj.bind(py).cast::<KeyedConcurrencyPy>() {
                k.get().acquire_key(py, args[i].key, 1, timeout)
            } else {
                continue;
            };
            match r.and_then(|p| Py::new(py, p)) {
                Ok(p) => got.push(p),
                Err(e) => {
                    for p in &got {
                        p.get().release();
                    }
                    return Err(e);
                }
            }
        }
        Ok(got)
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
            let (kind, shape, c, wake): (_, _, _, Waker) = if let Ok(l) = v.cast::<LimiterPy>() {
                let core = l.get().core().clone();
                let units = core.units().to_vec();
                let c = core.clock().clone();
                let gate = l.get().gate().clone();
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
            Ok(held) => Ok(Some(self.permit(args, held, 0, Vec::new()))),
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
            Ok((delay, held)) => Ok(self.permit(args, held, delay, Vec::new())),
            Err(r) => Err(refusal_error(py, self, r, mw)),
        }
    }

    /// Waits for every level (GIL released): first in the queue of each concurrency
    /// level, then for the latest rate level, all within `timeout`. Returns a
    /// PolicyPermit (a context manager releasing the concurrency permits on exit).
    /// Ctrl-C or an error gives back everything taken.
    #[pyo3(signature = (*, timeout = None, **kw))]
    fn acquire(
        &self,
        py: Python<'_>,
        timeout: Option<&Bound<'_, PyAny>>,
        kw: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<PolicyPermitPy> {
        let args = self.args(kw)?;
        let start = self.clock.now_ns();
        let deadline = timeout
            .map(|t| seconds_ns("timeout", t))
            .transpose()?
            .map(|t| start.saturating_add(t));
        let conc = self.wait_concurrency(py, &args, deadline)?;
        let now = self.clock.now_ns();
        let mw = deadline.map_or(u64::MAX, |d| d.saturating_sub(now));
        let core = &self.core;
        let (delay, held) = match py.detach(|| core.reserve(&args, now, mw, true)) {
            Ok(x) => x,
            Err(r) => {
                for p in &conc {
                    p.get().release();
                }
                return Err(refusal_error(py, self, r, mw));
            }
        };
        let permit = self.permit(args, held, delay + now.saturating_sub(start), conc);
        if delay > 0 && !self.clock.is_manual() {
            if let Err(e) = sleep_interruptibly(py, Duration::from_nanos(delay)) {
                permit.cancel(py);
                return Err(e);
            }
        }
        Ok(permit)
    }

    /// The second half of an asyncio acquire (ratequeue.aio does the waiting): reserve
    /// the rate levels within `max_wait` seconds, the concurrency `permits` being held.
    #[pyo3(signature = (permits, max_wait, **kw))]
    fn _reserve_rates(
        &self,
        py: Python<'_>,
        permits: Vec<Py<PermitPy>>,
        max_wait: Option<f64>,
        kw: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<PolicyPermitPy> {
        let args = self.args(kw)?;
        let mw = max_wait.map_or(u64::MAX, |s| (s.max(0.0) * 1e9) as u64);
        let (core, now) = (&self.core, self.clock.now_ns());
        match py.detach(|| core.reserve(&args, now, mw, true)) {
            Ok((delay, held)) => Ok(self.permit(args, held, delay, permits)),
            Err(r) => {
                for p in &permits {
                    p.get().release();
                }
                Err(refusal_error(py, self, r, mw))
            }
        }
    }

    /// The (name, level object, keyed) of each enforced concurrency level, in order,
    /// with the key to wait on (for ratequeue.aio).
    #[pyo3(signature = (**kw))]
    fn _concurrency_steps<'py>(&self, py: Python<'py>, kw: Option<&Bound<'py, PyDict>>) -> PyResult<Vec<Step>> {
        self.args(kw)?;
        let mut out = Vec::new();
        for (i, l) in self.levels.iter().enumerate() {
            if let Shape::Permits { keyed } = l.shape {
                if self.core.levels()[i].shadow {
                    continue;
                }
                let key = if keyed {
                    kw.and_then(|d| d.get_item(&l.name).ok().flatten()).map(|k| k.unbind())
                } else {
                    None
                };
                out.push((l.obj.clone_ref(py), key));
            }
        }
        Ok(out)
    }

    /// Awaitable (and async context manager) version of acquire: waits in each
    /// concurrency level's queue, then for the latest rate level, within `timeout`.
    #[pyo3(signature = (*, timeout = None, **kw))]
    fn acquire_async(
        slf: &Bound<'_, Self>,
        timeout: Option<&Bound<'_, PyAny>>,
        kw: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Py<PyAny>> {
        let py = slf.py();
        slf.get().args(kw)?;
        let t = timeout
            .map(|t| seconds_ns("timeout", t))
            .transpose()?
            .map(|ns| ns as f64 / 1e9);
        let make = POLICY_ACQUIRE.import(py, "ratequeue.aio", "PolicyAcquire")?;
        let kw = kw.map_or_else(|| PyDict::new(py), |d| d.clone());
        Ok(make.call1((slf, t, kw))?.unbind())
    }

    /// True on a ManualClock (nothing sleeps; `delay` tells the wait).
    #[getter]
    fn _manual(&self) -> bool {
        self.clock.is_manual()
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

/// Refuses set-ups that can never work: a level named like a call keyword or like a
/// unit of any level (its keyword would be ambiguous).
fn check_levels(levels: &[LevelPy]) -> PyResult<()> {
    crate::args::check_policy_levels(&levels.iter().map(LevelPy::keywords).collect::<Vec<_>>())
}

static POLICY_ACQUIRE: pyo3::sync::PyOnceLock<Py<pyo3::types::PyType>> = pyo3::sync::PyOnceLock::new();

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
    extra: Vec<Py<PermitPy>>,
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
            drop(st);
            for p in &self.extra {
                p.get().release();
            }
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
            drop(st);
            for p in &self.extra {
                p.get().release();
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
