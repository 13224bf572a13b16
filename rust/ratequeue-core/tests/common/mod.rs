//! Shared by the randomized undo checks and the fast-path race tests: a seeded
//! generator, the window bound, and the check of what joined a fast path's window.
#![allow(dead_code)]

use std::sync::Arc;

use ratequeue_core::wait::{Slot, Submitted, Wake};
use ratequeue_core::{ManualClock, Outcome, QueuedReservation, WaitQueue};

/// Nanoseconds in one second.
pub const S: u64 = 1_000_000_000;

/// A tiny seeded generator (reproducible per seed, no dependency).
pub struct Lcg(pub u64);

impl Lcg {
    pub fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 33
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// Asserts net admitted in [s, s + d] ≤ burst + rate·d over every window of the
/// grants `(schedule time ns, net cost)`.
pub fn check_windows(grants: impl IntoIterator<Item = (u64, f64)>, per_sec: f64, burst: u64) {
    let mut g: Vec<(u64, f64)> = grants.into_iter().collect();
    g.sort_by_key(|x| x.0);
    for i in 0..g.len() {
        let mut total = 0.0;
        for j in i..g.len() {
            total += g[j].1;
            let d = (g[j].0 - g[i].0) as f64 / S as f64;
            let bound = burst as f64 + per_sec * d + 1e-6;
            assert!(total <= bound, "window [{}, {}]: {total} > {bound}", g[i].0, g[j].0);
        }
    }
}

/// A thread's waiter of cost `c` queued on `q` (panics if it is granted at once).
pub fn waiter(q: &Arc<WaitQueue>, c: u64) -> Arc<Slot> {
    let s = Slot::new();
    let s2 = s.clone();
    assert!(matches!(
        q.submit(&[c], 0, None, || Wake::Thread(s2)).unwrap(),
        Submitted::Queued(_)
    ));
    s
}

/// The grant time of a granted outcome (panics on anything else).
pub fn granted_at(o: Option<Outcome>) -> u64 {
    match o {
        Some(Outcome::Granted { at_ns, .. }) => at_ns,
        other => panic!("not granted: {other:?}"),
    }
}

/// Serves `q` to 10 s and checks what joined a fast path's window (rate 1/s, burst 2,
/// one unit used at 0): a waiter of cost 2 and a reservation of cost 1 behind it. The
/// reservation is granted exactly at its promise, and no window admits more than the
/// rate, counting `extra` grants (time, cost) made by the racing caller.
pub fn check_joiners(
    q: &Arc<WaitQueue>,
    clock: &ManualClock,
    (waiter, reservation): (&Slot, &QueuedReservation),
    extra: &[(u64, f64)],
    who: &str,
) {
    q.run_until(clock, 10 * S).unwrap();
    let w_at = granted_at(waiter.take());
    let r_at = granted_at(reservation.outcome());
    assert_eq!(r_at, reservation.at_ns, "{who}'s take moved the reservation's promise");
    let mut grants = vec![(0, 1.0), (w_at, 2.0), (r_at, 1.0)];
    grants.extend_from_slice(extra);
    check_windows(grants, 1.0, 2);
}
