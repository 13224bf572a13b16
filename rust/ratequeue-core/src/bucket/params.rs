//! The fixed-point GCRA arithmetic of one rate ([`Params`]), shared by the atomic bucket
//! and the keyed map, and [`SimBucket`], a private copy of a schedule played forward.

use super::{Deny, EPOCH_BITS, Q_BITS, Q_ONE, TAT_MASK};
use crate::rate::Rate;

/// The fixed-point GCRA arithmetic of one rate (shared by the atomic bucket and the
/// keyed map, whose TATs live in a table).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Params {
    pub(crate) m: u64,
    pub(crate) tau: u64,
    pub(crate) burst: u64,
    pub(super) q_ticks: u64,
    /// Clock nanoseconds of tick 0 (a multiple of 2^52); earlier times count as it.
    pub(crate) epoch: u64,
}

impl Params {
    pub(crate) fn of(rate: &Rate) -> Params {
        let t = rate.interval_ns();
        // 2^m ticks per interval, a tick in [0.5, 1) ns (t >= 1 ns by Rate's validation).
        let m = (t.log2().floor() as u64 + 1).min(58);
        let ticks_per_ns = (1u64 << m) as f64 / t;
        Params {
            m,
            tau: rate.burst << m,
            burst: rate.burst,
            // Q52 fixed point, rounded up (plus one ulp for the rounding of T itself) so
            // the clock is never read late: a retry after `ns_until` always conforms.
            q_ticks: (ticks_per_ns * Q_ONE).ceil() as u64 + 1,
            epoch: 0,
        }
    }

    /// The same arithmetic counting from `epoch` (a multiple of 2^52 ns).
    #[inline]
    pub(crate) fn at_epoch(self, epoch: u64) -> Params {
        debug_assert_eq!(epoch & ((1 << EPOCH_BITS) - 1), 0);
        Params { epoch, ..self }
    }

    /// Ticks from the epoch `self` counts from to the later epoch `to` (exact).
    pub(crate) fn shift_to(&self, to: u64) -> u64 {
        let units = (to.saturating_sub(self.epoch) >> EPOCH_BITS) as u128;
        (units * self.q_ticks as u128).min(u64::MAX as u128) as u64
    }

    /// One GCRA decision: the TAT after admitting `cost` at `at_ns` and the delay until
    /// the grant, if it is at most `max_delay_ns`. `tat` is in ticks (0 = full bucket).
    /// `scheduled`: `at_ns` is a grant time the queue computed from this TAT (rounded up
    /// to a whole nanosecond), not an arrival.
    #[inline]
    pub(crate) fn step(
        &self,
        tat: u64,
        at_ns: u64,
        cost: u64,
        max_delay_ns: u64,
        scheduled: bool,
    ) -> Result<(u64, u64), Deny> {
        if cost > self.burst {
            return Err(Deny::TooLarge {
                cost,
                burst: self.burst,
                unit: 0,
            });
        }
        let now = self.ticks(at_ns);
        // A grant scheduled at the TAT is handed out at the next whole nanosecond:
        // counting that rounding as idle time would let the schedule drift by up to a
        // nanosecond per grant, so a scheduled grant within a nanosecond of the TAT
        // counts as taken at the TAT.
        let base = if scheduled && now > tat && self.within_one_ns(now - tat) {
            tat
        } else {
            tat.max(now)
        };
        let new = base + (cost << self.m);
        let delay_ns = self.ns_until_from(at_ns, now, new.saturating_sub(self.tau));
        if delay_ns > max_delay_ns || new > TAT_MASK {
            // Beyond the word (years of reservations ahead): refused, with the true wait.
            return Err(Deny::Wait(delay_ns));
        }
        Ok((new, delay_ns))
    }

    /// The refund rule on one TAT: gives back up to `ticks` at `at_ns`, capped by what a
    /// debit that left the TAT at `held_until` can still hold (`held_until − now`), never
    /// past full (the TAT never goes below now), and only while no grant is scheduled in
    /// the future (TAT ≤ now + tau). `None`: dropped (a later grant stands on it).
    ///
    /// `ahead_ns`: the latest time a debit was scheduled at, when another rate set it (a
    /// grant the TAT alone does not reveal). Past `at_ns`, it stands for `now` in the cap
    /// and the floor (a later grant stands on everything held before it), and a refund
    /// without a record of what it held gives nothing.
    pub(crate) fn refund_tat(
        &self,
        tat: u64,
        at_ns: u64,
        ticks: u64,
        held_until: Option<u64>,
        ahead_ns: u64,
    ) -> Option<u64> {
        let now = self.ticks(at_ns);
        if tat > now.saturating_add(self.tau) || (ahead_ns > at_ns && held_until.is_none()) {
            return None;
        }
        let floor = self.ticks(at_ns.max(ahead_ns));
        let ticks = held_until.map_or(ticks, |h| ticks.min(h.saturating_sub(floor)));
        Some(if tat <= floor {
            tat
        } else {
            tat.saturating_sub(ticks).max(floor)
        })
    }

    /// The time at which a backlog of `total` cost, served back to back from `at_ns`,
    /// would have its last grant (Lindley recursion of the whole backlog).
    /// `u64::MAX` when that lies beyond the range of a u64 of nanoseconds.
    pub(crate) fn predict(&self, tat: u64, at_ns: u64, total: u64) -> u64 {
        let now = self.ticks(at_ns);
        let end = ((total as u128) << self.m) + tat.max(now) as u128;
        let target = end.saturating_sub(self.tau as u128);
        if target <= now as u128 {
            return at_ns;
        }
        self.time_of(target)
            .map_or(u64::MAX, |t| t.max(at_ns as u128).min(u64::MAX as u128) as u64)
    }

    /// The first clock nanosecond at which `ticks` reaches `target` (exact, unbounded).
    #[inline]
    fn time_of(&self, target: u128) -> Option<u128> {
        if target >> (128 - Q_BITS) != 0 {
            return None;
        }
        Some(self.epoch as u128 + (target << Q_BITS).div_ceil(self.q_ticks as u128))
    }

    /// True when `d` ticks last less than one nanosecond.
    #[inline]
    fn within_one_ns(&self, d: u64) -> bool {
        ((d as u128) << Q_BITS) < self.q_ticks as u128
    }

    /// `cost` in ticks, saturating.
    #[inline]
    pub(crate) fn cost_ticks(&self, cost: u64) -> u64 {
        cost.saturating_mul(1 << self.m).min(TAT_MASK)
    }

    /// Units that could be admitted at `at_ns` with this TAT (negative while in debt).
    pub(crate) fn available(&self, tat: u64, at_ns: u64) -> f64 {
        let used = tat.saturating_sub(self.ticks(at_ns));
        (self.tau as f64 - used as f64) / (1u64 << self.m) as f64
    }

    /// Ticks from the epoch to `ns` (a time before the epoch counts as the epoch). Below
    /// 2^59 for any `ns` less than 2^58 ns past the epoch, which rebasing keeps so.
    #[inline]
    pub(crate) fn ticks(&self, ns: u64) -> u64 {
        // At most 2^62 ns (146 years, ticks < 2^63: long past any TAT) so the product
        // shifted back fits a u64.
        let rel = ns.saturating_sub(self.epoch).min(1 << 62) as u128;
        ((rel * self.q_ticks as u128) >> Q_BITS) as u64
    }

    /// Nanoseconds from `at_ns` until the clock reaches tick `target`: the least x with
    /// ticks(at + x) >= target, computed exactly so a retry after it always conforms.
    pub(crate) fn ns_until(&self, at_ns: u64, target: u64) -> u64 {
        self.ns_until_from(at_ns, self.ticks(at_ns), target)
    }

    /// [`Params::ns_until`] with `now` = `self.ticks(at_ns)` already known.
    #[inline]
    fn ns_until_from(&self, at_ns: u64, now: u64, target: u64) -> u64 {
        debug_assert_eq!(now, self.ticks(at_ns));
        if target <= now {
            return 0;
        }
        let t = self.time_of(target as u128).expect("a u64 tick times 2^52 fits a u128");
        (t - at_ns as u128).min(u64::MAX as u128) as u64
    }
}

/// A private copy of a bucket's schedule, to play a backlog forward without touching it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct SimBucket {
    /// Exact past a u64: a long backlog may end beyond the range of the bucket's word.
    tat: u128,
    p: Params,
}

impl SimBucket {
    /// A copy of a schedule whose TAT is `tat` under `p`.
    pub(crate) fn new(tat: u64, p: Params) -> SimBucket {
        SimBucket { tat: tat as u128, p }
    }

    /// The earliest time >= `at_ns` at which `cost` conforms (`u64::MAX` when beyond
    /// the range of a u64 of nanoseconds); None when it never can.
    pub(crate) fn ready(&self, at_ns: u64, cost: u64) -> Option<u64> {
        if cost > self.p.burst {
            return None;
        }
        let now = self.p.ticks(at_ns) as u128;
        let target = (self.tat.max(now) + ((cost as u128) << self.p.m)).saturating_sub(self.p.tau as u128);
        if target <= now {
            return Some(at_ns);
        }
        Some(
            self.p
                .time_of(target)
                .map_or(u64::MAX, |t| t.max(at_ns as u128).min(u64::MAX as u128) as u64),
        )
    }

    /// Debits `cost` at `at_ns`, as a grant at that time would.
    pub(crate) fn take(&mut self, at_ns: u64, cost: u64) {
        self.tat = self
            .tat
            .max(self.p.ticks(at_ns) as u128)
            .saturating_add((cost as u128) << self.p.m);
    }
}
