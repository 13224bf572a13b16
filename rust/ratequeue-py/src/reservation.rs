//! Python Reservation: capacity held ahead of time on a Limiter, cancelled by the one
//! undo rule.

use std::sync::atomic::{AtomicBool, Ordering};

use pyo3::prelude::*;
use ratequeue_core::{QueuedReservation, Reservation};

use crate::limiter::LimiterPy;

/// What a reservation holds: a debit made at once, or a place in the queue (with its costs).
pub(crate) enum ReservationHeld {
    Now(Reservation),
    Queued(QueuedReservation, Vec<u64>),
}

/// Capacity held from `at` on; proceed after `delay` seconds.
#[pyclass(frozen, name = "Reservation", module = "ratequeue")]
pub struct ReservationPy {
    limiter: Py<LimiterPy>,
    inner: ReservationHeld,
    done: AtomicBool,
}

impl ReservationPy {
    /// A reservation of `limiter` holding `inner`.
    pub(crate) fn new(limiter: Py<LimiterPy>, inner: ReservationHeld) -> ReservationPy {
        ReservationPy {
            limiter,
            inner,
            done: AtomicBool::new(false),
        }
    }

    fn at_delay_ns(&self) -> (u64, u64) {
        match &self.inner {
            ReservationHeld::Now(r) => (r.at_ns, r.delay_ns),
            ReservationHeld::Queued(r, _) => (r.at_ns, r.delay_ns),
        }
    }
}

#[pymethods]
impl ReservationPy {
    /// Seconds from the reservation until the caller may proceed.
    #[getter]
    fn delay(&self) -> f64 {
        self.at_delay_ns().1 as f64 / 1e9
    }

    /// The clock time (seconds) at which the caller may proceed.
    #[getter]
    fn at(&self) -> f64 {
        self.at_delay_ns().0 as f64 / 1e9
    }

    /// True once cancel() has been called.
    #[getter]
    fn cancelled(&self) -> bool {
        self.done.load(Ordering::Acquire)
    }

    /// Cancels by the one undo rule: a reservation still queued leaves the queue (the
    /// waiters behind it move up); a debited one is undone on each rate exactly where
    /// nothing came after it, else refunded while no grant is scheduled ahead (never
    /// past full), else kept (counted in stats()["refunds_dropped"]); capacity given
    /// back wakes the limiter's queue. Returns True if anything was given back; only
    /// the first call acts.
    fn cancel(&self, py: Python<'_>) -> bool {
        if self.done.swap(true, Ordering::AcqRel) {
            return false;
        }
        let lim = self.limiter.get();
        match &self.inner {
            ReservationHeld::Now(r) => py.detach(|| {
                let gave = lim.core().cancel(r) > 0;
                if gave {
                    lim.gate().queue.poll_now();
                }
                gave
            }),
            ReservationHeld::Queued(r, costs) => {
                let q = lim.gate().queue.clone();
                py.detach(|| q.cancel_reservation(r, costs))
            }
        }
    }

    fn __repr__(&self) -> String {
        format!("Reservation(delay={}, at={})", self.delay(), self.at())
    }
}
