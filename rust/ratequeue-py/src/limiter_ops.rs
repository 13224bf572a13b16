//! Limiter's construction, reservation and the decisions its methods share (the
//! Python methods themselves are in `limiter.rs`).

use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyInt, PyString, PyTuple};
use ratequeue_core::limiter::MAX_RATES;
use ratequeue_core::{Deny, Limiter, Rate, Reserved};

use crate::args::{opt_text, seconds_ns};
use crate::blocking::{try_or_unblocked, unblocked};
use crate::clock::any_clock;
use crate::errors::{to_py, type_err};
use crate::limiter::{Costs, LimiterPy};
use crate::rate::RatePy;
use crate::reservation::{ReservationHeld, ReservationPy};
use crate::waiting::{new_gate, Gate, GatePy, PermitPy};

impl LimiterPy {
    /// True when someone waits in this limiter's queue (nobody overtakes them).
    pub fn has_waiters(&self) -> bool {
        self.gate.queue.waiting() != 0
    }

    /// Nanoseconds until `costs` (per unit) would be granted behind everyone queued now
    /// (GIL released while the queue is read); None when nobody waits.
    pub fn backlog_delay_ns(&self, py: Python<'_>, costs: &[u64]) -> Option<u64> {
        if self.gate.queue.waiting() == 0 {
            return None;
        }
        let q = self.gate.queue.clone();
        py.detach(move || q.predict_delay(costs)).ok().flatten().map(|(_, d)| d)
    }

    /// `acquire(**costs, priority=priority, timeout=timeout)` when it is granted at once
    /// (nobody queued; the rates admit `costs` now), else None and nothing changed: the
    /// call must queue, or `acquire` raises (a cost or argument it refuses), and its own
    /// call then does. The LLM transport's native prepare asks it first: the common call
    /// is granted without a crossing of its own. Never waits with the GIL held (a take
    /// undone for a joiner asks the queue's lock detached, as `acquire` does).
    pub(crate) fn grant_now(
        &self,
        py: Python<'_>,
        costs: &Bound<'_, PyDict>,
        priority: &Bound<'_, PyAny>,
        timeout: &Bound<'_, PyAny>,
    ) -> Option<PermitPy> {
        let c = self.costs_named(None, costs.iter()).ok()?;
        self.grant_costs_now(py, &c[..self.core.units().len()], priority, timeout)
    }

    /// [`Self::grant_now`] of costs already per unit, in this limiter's order (the
    /// transport's reader computes them so: no names matched).
    pub(crate) fn grant_costs_now(
        &self,
        py: Python<'_>,
        c: &[u64],
        priority: &Bound<'_, PyAny>,
        timeout: &Bound<'_, PyAny>,
    ) -> Option<PermitPy> {
        let class = self.gate.class(Some(priority).filter(|p| !p.is_none())).ok()?;
        self.gate.timeout(Some(timeout).filter(|t| !t.is_none())).ok()?;
        self.gate.permit_now(py, c, class).ok().flatten()
    }

    /// The core limiter (for policies).
    pub fn core(&self) -> &Arc<Limiter> {
        &self.core
    }

    /// Its queue (policies wake it when they give capacity back).
    pub fn gate(&self) -> &Arc<Gate> {
        &self.gate
    }

    /// Changes rate `i`, then lets the queue re-read its schedule (waiters may be due
    /// earlier or later now).
    pub(crate) fn set_rate_now(&self, py: Python<'_>, i: usize, rate: Rate) -> PyResult<()> {
        let (core, q) = (&self.core, &self.gate.queue);
        py.detach(|| {
            core.set_rate(i, rate)?;
            q.poll_now();
            Ok(())
        })
        .map_err(|e| to_py(py, e))
    }

    pub(crate) fn costs(&self, n: Option<&Bound<'_, PyAny>>, kw: Option<&Bound<'_, PyDict>>) -> PyResult<Costs> {
        let mut out = [0u64; MAX_RATES];
        crate::keywords::unit_costs(self.core.units(), &self.defaults, n, kw, &mut out)?;
        Ok(out)
    }

    /// The costs of a call whose keywords come as (name, value) pairs (the fast entry's
    /// `kwnames`): as [`Self::costs`] reads them.
    pub(crate) fn costs_named<'py>(
        &self,
        n: Option<&Bound<'py, PyAny>>,
        named: impl IntoIterator<Item = (Bound<'py, PyAny>, Bound<'py, PyAny>)>,
    ) -> PyResult<Costs> {
        let mut out = [0u64; MAX_RATES];
        crate::keywords::unit_costs_named(self.core.units(), &self.unit_names, &self.defaults, n, named, &mut out)?;
        Ok(out)
    }

    /// try_acquire's decision on `c` (costs per unit), counted: false while anyone
    /// waits (nobody overtakes a waiter).
    #[inline]
    pub(crate) fn decide_now(&self, c: &[u64]) -> Result<bool, Deny> {
        let queue = &self.gate.queue;
        if queue.waiting() != 0 {
            queue.note_try(false);
            return Ok(false);
        }
        let core = &self.core;
        // Re-checked after the take: a waiter joining meanwhile undoes it (see joined),
        // refused with Wait(0), and is owed a wake-up (it may be scheduled behind it).
        let decided = try_or_unblocked(
            || core.try_acquire_idle_nowait(c, || queue.joined()),
            || core.try_acquire_idle(c, || queue.joined()),
        );
        if decided.is_ok() {
            queue.note_try(true);
            return Ok(true);
        }
        self.refused_now(decided)
    }

    /// The end of [`Self::decide_now`] for a decision that did not admit (out of line).
    #[inline(never)]
    fn refused_now(&self, decided: Result<(), Deny>) -> Result<bool, Deny> {
        let queue = &self.gate.queue;
        if decided == Err(Deny::Wait(0)) {
            unblocked(|| queue.rewake_after_undo());
        }
        match decided {
            Ok(()) => queue.note_try(true),
            Err(Deny::Wait(_)) => queue.note_try(false),
            Err(_) => {}
        }
        decided.map(|()| true)
    }

    /// `try_acquire()` with no argument on one unit, at its default cost `c`
    /// ([`LimiterPy::default_one`]): [`Self::decide_now`] with the answer in one register,
    /// True or False; None (nothing consumed, nothing counted) for what only the general
    /// path answers: a cost above the burst (its error), or the multi-rate lock busy.
    #[inline(always)]
    pub(crate) fn decide_default(&self, c: u64) -> Option<bool> {
        let queue = &self.gate.queue;
        if queue.waiting() != 0 {
            queue.note_try(false);
            return Some(false);
        }
        match self.core.try_acquire_idle_nowait(&[c], || queue.joined()) {
            Some(Ok(())) => {
                queue.note_try(true);
                Some(true)
            }
            Some(refused) => self.refused_default(refused),
            None => None,
        }
    }

    /// The end of [`Self::decide_default`] for a decision that did not admit (out of
    /// line): as [`Self::decide_now`] ends it; None for an error to raise.
    #[inline(never)]
    fn refused_default(&self, decided: Result<(), Deny>) -> Option<bool> {
        match self.refused_now(decided) {
            Ok(ok) => Some(ok),
            Err(Deny::Wait(_)) => Some(false),
            Err(_) => None,
        }
    }

    /// With one unit, the cost of a call without keywords whose only argument is absent
    /// or a plain int below 2**64 - 1; else None (the one validation path decides,
    /// including the saturating 2**64 - 1).
    #[inline]
    pub(crate) fn one_cost(&self, n: Option<&Bound<'_, PyAny>>) -> Option<u64> {
        match n {
            _ if self.core.units().len() != 1 => None,
            None => self.defaults[0],
            Some(n) if n.is_exact_instance_of::<PyInt>() => n.extract::<u64>().ok().filter(|v| *v != u64::MAX),
            _ => None,
        }
    }

    /// try_acquire's answer to a decision.
    #[inline]
    pub(crate) fn answer(&self, py: Python<'_>, decided: Result<bool, Deny>) -> PyResult<bool> {
        match decided {
            Ok(true) => Ok(true),
            Ok(false) | Err(Deny::Wait(_)) => Ok(false),
            Err(d) => Err(self.deny(py, d)),
        }
    }

    #[inline]
    pub(crate) fn deny(&self, py: Python<'_>, d: Deny) -> PyErr {
        to_py(py, self.core.error_for(d, "not admitted"))
    }

    /// `Limiter(*rates, ...)`: the core limiter, registered for fork, and its queue.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn build(
        py: Python<'_>,
        rates: &Bound<'_, PyTuple>,
        clock: Option<&Bound<'_, PyAny>>,
        max_wait: Option<&Bound<'_, PyAny>>,
        max_queue: Option<&Bound<'_, PyAny>>,
        classes: Option<&Bound<'_, PyAny>>,
        name: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<LimiterPy> {
        let name = opt_text("name", name)?;
        let mut list = Vec::with_capacity(rates.len());
        for r in rates.iter() {
            let r = r.cast::<RatePy>().map_err(|_| type_err("rates", "Rate objects", &r))?;
            list.push((r.get().unit.clone(), r.get().rate));
        }
        let any = any_clock(clock)?;
        let core = Arc::new(Limiter::new(list, any.clone()).map_err(|e| to_py(py, e))?);
        unblocked(|| ratequeue_core::fork::register_arc(&core));
        let max_wait_ns = max_wait.map(|m| seconds_ns("max_wait", m)).transpose()?;
        let gate = new_gate(
            py,
            core.clone(),
            core.units().len(),
            any,
            classes,
            max_queue,
            max_wait_ns,
            core.units().to_vec(),
        )?;
        let mut defaults = [None; MAX_RATES];
        let single = core.units().len() == 1;
        for (i, u) in core.units().iter().enumerate() {
            if single || u == "requests" {
                defaults[i] = Some(1);
            }
        }
        let clock_obj = match clock {
            Some(c) => c.clone().unbind(),
            None => Bound::new(py, crate::clock::MonotonicClockPy)?.into_any().unbind(),
        };
        Ok(LimiterPy {
            unit_names: core.units().iter().map(|u| PyString::intern(py, u).unbind()).collect(),
            default_one: if single { defaults[0] } else { None },
            core,
            gate,
            defaults,
            max_wait_ns,
            clock: clock_obj,
            name,
        })
    }

    /// `reserve`: debited at once when nobody waits, else queued behind the waiters.
    pub(crate) fn reserve_in_order(
        slf: &Bound<'_, Self>,
        n: Option<&Bound<'_, PyAny>>,
        max_wait: Option<&Bound<'_, PyAny>>,
        costs: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<ReservationPy> {
        let py = slf.py();
        let me = slf.get();
        let c = me.costs(n, costs)?;
        let mw = match max_wait {
            Some(m) => Some(seconds_ns("max_wait", m)?),
            None => me.max_wait_ns,
        };
        let core = me.core.clone();
        let now_path = move |_| core.reserve(&c, mw);
        // A multi-rate reservation takes the limiter's lock: without the GIL.
        // A reservation that raced a waiter joining is cancelled, then queued behind it.
        let undo = |r: ratequeue_core::Reservation| {
            me.core.cancel(&r);
        };
        let idle = if me.core.rate_count() == 1 {
            me.gate.queue.reserve_if_idle(now_path.clone(), undo)
        } else {
            let (q, now_path) = (&me.gate.queue, now_path.clone());
            py.detach(|| q.reserve_if_idle(now_path, undo))
        };
        let inner = match idle {
            Some(r) => ReservationHeld::Now(r.map_err(|e| to_py(py, e))?),
            None => {
                let (q, units) = (me.gate.queue.clone(), me.core.units().len());
                match py.detach(move || q.reserve(&c[..units], 0, mw, now_path)) {
                    Ok(Reserved::Now(r)) => ReservationHeld::Now(r),
                    Ok(Reserved::Queued(r)) => ReservationHeld::Queued(r, c[..units].to_vec()),
                    Err(e) => return Err(to_py(py, e)),
                }
            }
        };
        Ok(ReservationPy::new(slf.clone().unbind(), inner))
    }
}
