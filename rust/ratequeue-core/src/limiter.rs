//! A limiter over one or more rates in named units (e.g. requests and tokens): every
//! decision is all-or-nothing across its buckets, lock-free on the fast path.

use crate::bucket::{Bucket, Deny, Taken};
use crate::clock::AnyClock;
use crate::error::Error;
use crate::queue::Resource;
use crate::rate::Rate;

/// The most rates one limiter may hold.
pub const MAX_RATES: usize = 16;

/// Several GCRA buckets, each counting one unit, decided together.
#[derive(Debug)]
pub struct Limiter {
    clock: AnyClock,
    buckets: Box<[Bucket]>,
    bucket_unit: Box<[usize]>,
    units: Box<[String]>,
    /// Serialises multi-rate decisions so that one decision's check, debits and (on a
    /// refusal) undo are never interleaved with another's; single-rate decisions stay
    /// lock-free.
    multi: std::sync::Mutex<()>,
}

/// Capacity held for a caller from `at_ns` on; see [`Limiter::cancel`] for refunds.
#[derive(Clone, Debug)]
pub struct Reservation {
    /// When the caller may proceed (clock nanoseconds).
    pub at_ns: u64,
    /// How long from the reservation until then.
    pub delay_ns: u64,
    taken: Vec<Taken>,
}

impl Limiter {
    /// A limiter over `rates`, each paired with the name of its unit.
    pub fn new(rates: Vec<(String, Rate)>, clock: AnyClock) -> Result<Limiter, Error> {
        if rates.is_empty() {
            return Err(Error::invalid("rates", 0, "must hold at least one Rate"));
        }
        if rates.len() > MAX_RATES {
            return Err(Error::invalid("rates", rates.len(), "may hold at most 16 rates"));
        }
        let mut units: Vec<String> = Vec::new();
        let mut bucket_unit = Vec::with_capacity(rates.len());
        let mut buckets = Vec::with_capacity(rates.len());
        for (unit, rate) in rates {
            if unit.is_empty() {
                return Err(Error::invalid("unit", "''", "must be a non-empty name"));
            }
            let idx = units.iter().position(|u| *u == unit).unwrap_or_else(|| {
                units.push(unit.clone());
                units.len() - 1
            });
            bucket_unit.push(idx);
            buckets.push(Bucket::new(rate));
        }
        Ok(Limiter {
            clock,
            buckets: buckets.into(),
            bucket_unit: bucket_unit.into(),
            units: units.into(),
            multi: std::sync::Mutex::new(()),
        })
    }

    /// The distinct unit names, in order of first appearance.
    pub fn units(&self) -> &[String] {
        &self.units
    }

    /// The index of `unit` in [`Limiter::units`].
    pub fn unit_index(&self, unit: &str) -> Option<usize> {
        self.units.iter().position(|u| u == unit)
    }

    /// The clock this limiter reads.
    pub fn clock(&self) -> &AnyClock {
        &self.clock
    }

    /// The current time on this limiter's clock.
    #[inline]
    pub fn now_ns(&self) -> u64 {
        self.clock.now_ns()
    }

    /// Number of rates (buckets).
    pub fn rate_count(&self) -> usize {
        self.buckets.len()
    }

    /// The rate at `index` and its unit.
    pub fn rate(&self, index: usize) -> Option<(&str, Rate)> {
        let b = self.buckets.get(index)?;
        Some((&self.units[self.bucket_unit[index]], b.rate()))
    }

    fn with_unit(&self, i: usize, d: Deny) -> Deny {
        match d {
            Deny::TooLarge { cost, burst, .. } => Deny::TooLarge {
                cost,
                burst,
                unit: self.bucket_unit[i],
            },
            other => other,
        }
    }

    /// The error a denial stands for, with `retry_after` filled in.
    pub fn error_for(&self, d: Deny, reason: &str) -> Error {
        match d {
            Deny::TooLarge { cost, burst, unit } => Error::CostTooLarge {
                unit: self.units[unit].clone(),
                cost,
                burst,
            },
            Deny::Wait(ns) => Error::Overloaded {
                reason: reason.to_owned(),
                retry_after_ns: ns,
            },
        }
    }

    /// Admits `costs` at `now` (see [`Limiter::try_acquire`]).
    #[inline]
    pub fn try_acquire_at(&self, now: u64, costs: &[u64]) -> Result<(), Deny> {
        if self.buckets.len() == 1 {
            let c = costs[self.bucket_unit[0]];
            return self.buckets[0]
                .take(now, c, 0)
                .map(|_| ())
                .map_err(|d| self.with_unit(0, d));
        }
        self.take_all(now, costs, 0, false).map(|_| ())
    }

    /// Admits `costs` (one per unit, indexed as [`Limiter::units`]) now or not at all.
    /// `Err(Deny::Wait(ns))`: refused, would conform in `ns`; nothing was consumed.
    #[inline]
    pub fn try_acquire(&self, costs: &[u64]) -> Result<(), Deny> {
        self.try_acquire_at(self.clock.now_ns(), costs)
    }

    /// Nanoseconds until `costs` would conform (0 = now); changes nothing.
    pub fn delay_for(&self, costs: &[u64]) -> Result<u64, Deny> {
        self.delay_at(self.clock.now_ns(), costs)
    }

    /// Nanoseconds from `now` until `costs` would conform; changes nothing.
    pub fn delay_at(&self, now: u64, costs: &[u64]) -> Result<u64, Deny> {
        let mut wait = 0;
        for (i, b) in self.buckets.iter().enumerate() {
            let d = b
                .delay_for(now, costs[self.bucket_unit[i]])
                .map_err(|d| self.with_unit(i, d))?;
            wait = wait.max(d);
        }
        Ok(wait)
    }

    /// Debits every bucket for a grant at the common time `now + delay`, with the delay
    /// at most `max_delay_ns`; all or nothing.
    fn take_all(&self, now: u64, costs: &[u64], max_delay_ns: u64, scheduled: bool) -> Result<Reservation, Deny> {
        let _serial = self.multi.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            let delay = self.delay_at(now, costs)?;
            if delay > max_delay_ns {
                return Err(Deny::Wait(delay));
            }
            let at = now.saturating_add(delay);
            let mut taken = Vec::with_capacity(self.buckets.len());
            let mut raced = false;
            for (i, b) in self.buckets.iter().enumerate() {
                match b.take_with(at, costs[self.bucket_unit[i]], 0, scheduled) {
                    Ok(t) => taken.push(t),
                    Err(Deny::Wait(_)) => {
                        raced = true;
                        break;
                    }
                    Err(d) => {
                        self.undo(&taken);
                        return Err(self.with_unit(i, d));
                    }
                }
            }
            if !raced {
                return Ok(Reservation {
                    at_ns: at,
                    delay_ns: delay,
                    taken,
                });
            }
            // Only a concurrent refund, charge or rate change can get here (decisions are
            // serialised): give back what this attempt debited and decide again.
            self.undo_or_refund(&taken, costs);
        }
    }

    /// Debits `costs` for a grant at `at_ns` within `max_delay_ns`, all or nothing,
    /// returning a handle that [`Limiter::undo_reservation`] can take back.
    pub fn take_at(&self, at_ns: u64, costs: &[u64], max_delay_ns: u64) -> Result<Reservation, Deny> {
        self.take_at_with(at_ns, costs, max_delay_ns, false)
    }

    fn take_at_with(&self, at_ns: u64, costs: &[u64], max_delay_ns: u64, scheduled: bool) -> Result<Reservation, Deny> {
        if self.buckets.len() == 1 {
            let c = costs[self.bucket_unit[0]];
            return self.buckets[0]
                .take_with(at_ns, c, max_delay_ns, scheduled)
                .map(|t| Reservation {
                    at_ns: at_ns.saturating_add(t.delay_ns),
                    delay_ns: t.delay_ns,
                    taken: vec![t],
                })
                .map_err(|d| self.with_unit(0, d));
        }
        self.take_all(at_ns, costs, max_delay_ns, scheduled)
    }

    /// Takes back a debit made by `take_at` (exactly where it is still the latest on a
    /// bucket, by refunding `costs` where it is not).
    pub fn undo_reservation(&self, r: &Reservation, costs: &[u64]) {
        let _serial = (self.buckets.len() > 1).then(|| self.multi.lock().unwrap_or_else(|e| e.into_inner()));
        self.undo_or_refund(&r.taken, costs);
    }

    fn undo(&self, taken: &[Taken]) {
        for (i, t) in taken.iter().enumerate() {
            self.buckets[i].untake(t);
        }
    }

    fn undo_or_refund(&self, taken: &[Taken], costs: &[u64]) {
        for (i, t) in taken.iter().enumerate() {
            if !self.buckets[i].untake(t) {
                self.buckets[i].refund(costs[self.bucket_unit[i]]);
            }
        }
    }

    /// Reserves `costs`: grants at once or after a delay, in arrival order (GCRA's
    /// Lindley recursion). Refused at once, consuming nothing, if the delay would exceed
    /// `max_wait_ns`.
    pub fn reserve(&self, costs: &[u64], max_wait_ns: Option<u64>) -> Result<Reservation, Error> {
        let now = self.clock.now_ns();
        let max = max_wait_ns.unwrap_or(u64::MAX);
        let r = if self.buckets.len() == 1 {
            let c = costs[self.bucket_unit[0]];
            self.buckets[0]
                .take(now, c, max)
                .map(|t| Reservation {
                    at_ns: now.saturating_add(t.delay_ns),
                    delay_ns: t.delay_ns,
                    taken: vec![t],
                })
                .map_err(|d| self.with_unit(0, d))
        } else {
            self.take_all(now, costs, max, false)
        };
        r.map_err(|d| match d {
            Deny::Wait(ns) => Error::Overloaded {
                reason: format!(
                    "the wait of {:.6} s exceeds max_wait={:.6} s",
                    ns as f64 / 1e9,
                    max as f64 / 1e9
                ),
                retry_after_ns: ns.saturating_sub(max),
            },
            d => self.error_for(d, ""),
        })
    }

    /// Cancels a reservation. Before its grant time, each bucket gets its cost back when
    /// no later reservation has been made on it (returning it then would let a newcomer
    /// overtake that later one and break the rate bound); otherwise the slot stays used.
    /// At or after its grant time nothing is returned. Returns how many buckets were
    /// refunded; call it once per reservation.
    pub fn cancel(&self, r: &Reservation) -> usize {
        if self.clock.now_ns() >= r.at_ns {
            return 0;
        }
        r.taken
            .iter()
            .enumerate()
            .filter(|(i, t)| self.buckets[*i].untake(t))
            .count()
    }

    /// Units of `unit` that could be admitted now: the least over its rates.
    pub fn available(&self, unit: usize) -> f64 {
        let now = self.clock.now_ns();
        self.buckets
            .iter()
            .zip(self.bucket_unit.iter())
            .filter(|(_, u)| **u == unit)
            .map(|(b, _)| b.available(now))
            .fold(f64::INFINITY, f64::min)
    }

    /// Replaces the rate at `index` from now on, keeping the bucket's used content.
    pub fn set_rate(&self, index: usize, rate: Rate) -> Result<(), Error> {
        let b = self
            .buckets
            .get(index)
            .ok_or_else(|| Error::invalid("rate", index, "is not the index of one of this limiter's rates"))?;
        b.set_rate(self.clock.now_ns(), rate);
        Ok(())
    }

    /// Gives back `costs` taken by a past grant (e.g. an over-estimate), never beyond full.
    pub fn refund(&self, costs: &[u64]) {
        for (i, b) in self.buckets.iter().enumerate() {
            let c = costs[self.bucket_unit[i]];
            if c > 0 {
                b.refund(c);
            }
        }
    }

    /// Charges `costs` now regardless of conformance (an under-estimate): may go into debt.
    pub fn charge(&self, costs: &[u64]) {
        let now = self.clock.now_ns();
        for (i, b) in self.buckets.iter().enumerate() {
            let c = costs[self.bucket_unit[i]];
            if c > 0 {
                b.charge(now, c);
            }
        }
    }
}

impl Resource for Limiter {
    #[inline]
    fn try_take(&self, now_ns: u64, costs: &[u64]) -> Result<(), Deny> {
        self.try_acquire_at(now_ns, costs)
    }

    fn ready_at(&self, at_ns: u64, costs: &[u64]) -> Result<Option<u64>, Deny> {
        Ok(Some(at_ns.saturating_add(self.delay_at(at_ns, costs)?)))
    }

    fn take_at(&self, at_ns: u64, costs: &[u64]) -> Result<u64, Deny> {
        self.take_at_with(at_ns, costs, 0, true)
            .map(|r| r.taken[0].after_word())
    }

    fn give_back(&self, costs: &[u64], token: Option<u64>) {
        // Every decision moves bucket 0's word (or leaves it as it found it), so an
        // unchanged word means no grant came after this one.
        match token {
            Some(t) if self.buckets[0].word() != t => {}
            _ => self.refund(costs),
        }
    }

    fn settle(&self, estimated: &[u64], actual: &[u64]) {
        let now = self.clock.now_ns();
        for (i, b) in self.buckets.iter().enumerate() {
            let u = self.bucket_unit[i];
            let (e, a) = (estimated[u], actual[u]);
            if a < e {
                b.refund(e - a);
            } else if a > e {
                b.charge(now, a - e);
            }
        }
    }

    fn service_ns(&self, costs: &[u64]) -> f64 {
        self.buckets
            .iter()
            .enumerate()
            .map(|(i, b)| costs[self.bucket_unit[i]] as f64 * b.rate().interval_ns())
            .fold(0.0, f64::max)
    }

    fn error_for(&self, d: Deny) -> Error {
        self.error_for(d, "not admitted")
    }

    fn predict(&self, now_ns: u64, ahead: &[u64], costs: &[u64]) -> Option<u64> {
        let mut t = now_ns;
        for (i, b) in self.buckets.iter().enumerate() {
            let u = self.bucket_unit[i];
            t = t.max(b.predict(now_ns, ahead[u], costs[u]));
        }
        Some(t)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;
    use std::sync::Arc;

    fn limiter(rates: &[(&str, f64, u64)]) -> (Limiter, Arc<ManualClock>) {
        let clock = Arc::new(ManualClock::new(0).unwrap());
        let rates = rates
            .iter()
            .map(|(u, r, b)| (u.to_string(), Rate::new(*r, 1e9, *b).unwrap()))
            .collect();
        (Limiter::new(rates, AnyClock::Manual(clock.clone())).unwrap(), clock)
    }

    #[test]
    fn all_or_nothing_across_units() {
        let (l, _) = limiter(&[("requests", 10.0, 5), ("tokens", 100.0, 100)]);
        assert!(l.try_acquire(&[1, 90]).is_ok());
        assert!(matches!(l.try_acquire(&[1, 20]), Err(Deny::Wait(_))));
        assert_eq!(l.available(0), 4.0);
        assert_eq!(l.available(1), 10.0);
        assert!(matches!(l.try_acquire(&[1, 200]), Err(Deny::TooLarge { unit: 1, .. })));
        assert_eq!(l.available(0), 4.0);
    }

    #[test]
    fn reserve_waits_for_the_slowest_rate() {
        let (l, clock) = limiter(&[("requests", 10.0, 1), ("tokens", 100.0, 100)]);
        let r1 = l.reserve(&[1, 100], None).unwrap();
        assert_eq!(r1.delay_ns, 0);
        let r2 = l.reserve(&[1, 50], None).unwrap();
        assert!(r2.delay_ns.abs_diff(500_000_000) <= 1);
        assert!(l.reserve(&[1, 50], Some(100_000_000)).is_err());
        assert_eq!(l.cancel(&r2), 2);
        clock.advance(1_000_000_000).unwrap();
        assert_eq!(l.available(1), 100.0);
    }

    #[test]
    fn same_unit_twice_applies_both() {
        let (l, _) = limiter(&[("requests", 10.0, 2), ("requests", 1.0, 3)]);
        assert_eq!(l.units().len(), 1);
        assert!(l.try_acquire(&[2]).is_ok());
        assert!(l.try_acquire(&[1]).is_err());
    }
}
