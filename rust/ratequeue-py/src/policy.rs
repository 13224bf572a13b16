//! Python Policy: several limits passed at once (user quota → tenant concurrency →
//! cluster bucket), all or nothing; its levels are in policy_level.rs, its permit and
//! awaitable in policy_permit.rs.

use std::sync::Arc;
use std::time::Duration;

use pyo3::prelude::*;
use pyo3::types::PyDict;
use ratequeue_core::policy::{Held, PolicyAcquire, Refusal, Step};
use ratequeue_core::wait::Slot;
use ratequeue_core::{AnyClock, Deny, Error, Level, LevelArgs, LevelKind, Policy, Wake};

use crate::args::seconds_ns;
use crate::blocking::unblocked;
use crate::convert::key_named;
use crate::errors::{setup_err, to_py, type_err};
use crate::policy_level::{level_of, LevelPy};
use crate::policy_permit::{PolicyAcquiringPy, PolicyPermitPy};
use crate::waiting::is_main_thread;

/// Interval at which a main-thread wait looks for signals (Ctrl-C).
const SIGNAL_SLICE: Duration = Duration::from_millis(50);

/// Several limits decided together: all or nothing, waiting for the latest.
#[pyclass(frozen, subclass, name = "Policy", module = "ratequeue")]
pub struct PolicyPy {
    core: Arc<Policy>,
    levels: Vec<LevelPy>,
    /// The units of each level (shared by its permits).
    units: Arc<[Vec<String>]>,
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
        self.args_named(kw.into_iter().flat_map(|d| d.iter()))
    }

    /// [`Self::args`] of keywords as (name, value) pairs.
    pub(crate) fn args_named<'py>(
        &self,
        named: impl IntoIterator<Item = (Bound<'py, PyAny>, Bound<'py, PyAny>)>,
    ) -> PyResult<Vec<LevelArgs>> {
        let levels: Vec<_> = self.levels.iter().map(LevelPy::keywords).collect();
        let calls = crate::keywords::policy_keywords_named(&levels, named)?;
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

    /// The permit of `held` for `args`, after `delay_ns`.
    pub(crate) fn permit(&self, args: Vec<LevelArgs>, held: Vec<Held>, start_ns: u64, delay_ns: u64) -> PolicyPermitPy {
        PolicyPermitPy::new(
            self.core.clone(),
            self.units.clone(),
            (args, held),
            (start_ns, delay_ns),
            self.clock.clone(),
        )
    }

    /// The clock of the policy's levels.
    pub(crate) fn clock(&self) -> &AnyClock {
        &self.clock
    }

    /// Every level now, when nobody waits on any and each admits (an acquire's fast
    /// path: the queues would grant it at once too); None otherwise.
    fn try_now(&self, py: Python<'_>, args: &[LevelArgs], now: u64) -> Option<Vec<Held>> {
        if self.waiters_ahead(py, args).is_some() {
            return None;
        }
        let core = &self.core;
        unblocked(|| core.try_now(args, now))
    }

    /// The first enforced level where someone already waits (a policy does not
    /// overtake the waiters of its levels, as their own try_acquire does not).
    fn waiters_ahead(&self, py: Python<'_>, args: &[LevelArgs]) -> Option<usize> {
        self.levels.iter().enumerate().find_map(|(i, l)| {
            if self.core.levels()[i].shadow {
                return None;
            }
            l.has_waiters(py, args[i].key).then_some(i)
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
            wait = wait.max(l.backlog_delay_ns(py, &args[i]).unwrap_or(0));
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
            let (kind, shape, c, wake, queues) = level_of(&name, &v)?;
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
            py_levels.push(LevelPy::new(name, shape, v.unbind()));
        }
        for s in &shadow_names {
            if !py_levels.iter().any(|l| &l.name == s) {
                return Err(setup_err(format!("shadow names {s:?}, which is not a level")));
            }
        }
        check_levels(&py_levels)?;
        let core = Policy::new(core_levels).map_err(|e| to_py(py, e))?;
        Ok(PolicyPy {
            core: Arc::new(core),
            units: py_levels.iter().map(LevelPy::units).collect(),
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
            Ok(held) => Ok(Some(self.permit(args, held, now, 0))),
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
            Ok((delay, held)) => Ok(self.permit(args, held, now, delay)),
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
        self.acquire_args(py, args, timeout)
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
        let start = me.clock.now_ns();
        let permit = match me.try_now(py, &args, start) {
            Some(held) => Some(Py::new(py, me.permit(args.clone(), held, start, 0))?),
            None => None,
        };
        let (policy, clock) = (me.core.clone(), me.clock.clone());
        let core = Arc::new(unblocked(move || {
            PolicyAcquire::started_at(policy, args, clock, t, start)
        }));
        Ok(PolicyAcquiringPy::new(slf.clone().unbind(), core, permit))
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

impl PolicyPy {
    /// `acquire` of parsed keywords: `args` per level, `timeout` as given.
    pub(crate) fn acquire_args(
        &self,
        py: Python<'_>,
        args: Vec<LevelArgs>,
        timeout: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PolicyPermitPy> {
        let t = timeout.map(|t| seconds_ns("timeout", t)).transpose()?;
        // The call's time: the fast path decides at it, and the delay counts from it.
        let start = self.clock.now_ns();
        if let Some(held) = self.try_now(py, &args, start) {
            return Ok(self.permit(args, held, start, 0));
        }
        let pa = PolicyAcquire::started_at(self.core.clone(), args, self.clock.clone(), t, start);
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
                    let permit = self.permit(pa.args().to_vec(), held, start, waited_ns.saturating_add(delay_ns));
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
            let slice = match slice {
                Some(s) => s,
                None => match is_main_thread(py) {
                    Ok(main) => *slice.insert(main.then_some(SIGNAL_SLICE)),
                    Err(e) => {
                        // A signal handler raised inside that check (Ctrl-C): stop here.
                        py.detach(|| pa.abandon_slot(&slot));
                        return Err(e);
                    }
                },
            };
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
}

/// Refuses set-ups that can never work: a level named like a call keyword or like a
/// unit of any level (its keyword would be ambiguous).
fn check_levels(levels: &[LevelPy]) -> PyResult<()> {
    crate::keywords::check_policy_levels(&levels.iter().map(LevelPy::keywords).collect::<Vec<_>>())
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
