//! The levels of a Python Policy: which limit each is (Limiter, KeyedLimiter,
//! Concurrency, KeyedConcurrency), how a call addresses it, and its queues.

use std::sync::Arc;

use pyo3::prelude::*;
use ratequeue_core::policy::{LevelQueues, QueueRef, Waker};
use ratequeue_core::{AnyClock, LevelArgs, LevelKind};

use crate::blocking::unblocked;
use crate::concurrency::ConcurrencyPy;
use crate::errors::type_err;
use crate::keyed_concurrency::KeyedConcurrencyPy;
use crate::keyed_limiter::KeyedLimiterPy;
use crate::limiter::LimiterPy;
use crate::waiting::Gate;

/// A Limiter's one queue, for a policy to join.
struct OneQueue(Arc<Gate>);

impl LevelQueues for OneQueue {
    fn existing(&self, _key: u64) -> Option<QueueRef> {
        Some(QueueRef::new(self.0.queue.clone()))
    }
}

/// How a level reads its arguments from a call.
pub enum Shape {
    /// Costs per unit, in the limiter's unit order.
    Units(Vec<String>),
    /// A key (the level's name) and a cost in one unit.
    KeyedUnit(String),
    /// Permits (1 per call); `keyed`: a key is needed.
    Permits { keyed: bool },
}

/// A level as the Python call sees it: its name, shape and limit object.
pub struct LevelPy {
    pub name: String,
    shape: Shape,
    obj: Py<PyAny>,
}

/// What a level is made of: the core kind, its shape, its clock (rates), the waker of
/// its queues and the queues a policy joins.
pub type LevelParts = (LevelKind, Shape, Option<AnyClock>, Waker, Option<Arc<dyn LevelQueues>>);

impl LevelPy {
    pub fn new(name: String, shape: Shape, obj: Py<PyAny>) -> LevelPy {
        LevelPy { name, shape, obj }
    }

    /// How a call's keywords address this level.
    pub fn keywords(&self) -> crate::keywords::LevelKeywords<'_> {
        let (keyed, units) = match &self.shape {
            Shape::Units(u) => (false, u.as_slice()),
            Shape::KeyedUnit(u) => (true, std::slice::from_ref(u)),
            Shape::Permits { keyed } => (*keyed, &[][..]),
        };
        crate::keywords::LevelKeywords {
            name: &self.name,
            keyed,
            units,
        }
    }

    /// The units a permit of this level settles (none for permits).
    pub fn units(&self) -> Vec<String> {
        match &self.shape {
            Shape::Units(u) => u.clone(),
            Shape::KeyedUnit(u) => vec![u.clone()],
            Shape::Permits { .. } => Vec::new(),
        }
    }

    /// True when someone waits on this level (on `key` for a keyed one).
    pub fn has_waiters(&self, py: Python<'_>, key: u64) -> bool {
        let o = self.obj.bind(py);
        if let Ok(x) = o.cast::<LimiterPy>() {
            x.get().has_waiters()
        } else if let Ok(x) = o.cast::<KeyedLimiterPy>() {
            x.get().has_waiters(key)
        } else if let Ok(x) = o.cast::<ConcurrencyPy>() {
            x.get().gate().queue.waiting() != 0
        } else if let Ok(x) = o.cast::<KeyedConcurrencyPy>() {
            x.get().has_waiters(key)
        } else {
            false
        }
    }

    /// Nanoseconds until a rate level would grant `args` behind its waiters; None for
    /// permits or when nobody waits.
    pub fn backlog_delay_ns(&self, py: Python<'_>, args: &LevelArgs) -> Option<u64> {
        let o = self.obj.bind(py);
        if let Ok(x) = o.cast::<LimiterPy>() {
            x.get().backlog_delay_ns(py, &args.costs)
        } else if let Ok(x) = o.cast::<KeyedLimiterPy>() {
            x.get().backlog_delay_ns(py, args.key, args.costs[0])
        } else {
            None
        }
    }
}

/// The parts of level `name` from its limit object `v`; a TypeError for anything else.
pub fn level_of(name: &str, v: &Bound<'_, PyAny>) -> PyResult<LevelParts> {
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
        let gates = l.get().key_queues().clone();
        queues = Some(gates.clone());
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
        let gates = l.get().key_queues().clone();
        queues = Some(gates.clone());
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
            v,
        ));
    };
    Ok((kind, shape, c, wake, queues))
}
