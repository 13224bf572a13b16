//! A limiter over one or more rates in named units (e.g. requests and tokens): every
//! decision is all-or-nothing across its buckets, lock-free on the fast path.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::MutexGuard;

use crate::bucket::{Bucket, Deny, Taken, Undo};
use crate::clock::{self, AnyClock};
use crate::error::Error;
use crate::rate::Rate;

mod resource;
#[cfg(test)]
mod tests;

/// The most rates one limiter may hold.
pub const MAX_RATES: usize = 16;
/// How many multi-rate grants a limiter remembers for a late give-back.
pub const RECENT: usize = 256;

/// The debits of the latest tokened multi-rate grants, by token (oldest first).
type Recent = VecDeque<(u64, Vec<Taken>)>;

/// Several GCRA buckets, each counting one unit, decided together.
#[derive(Debug)]
pub struct Limiter {
    clock: AnyClock,
    /// One rate on the monotonic clock reading the TSC: decisions read the counter and
    /// the bucket converts it in one multiply ([`Bucket::try_take_words_counter`]).
    /// Invariant (set in [`Limiter::new`], never changed): true only when `buckets` holds
    /// exactly one bucket ([`Limiter::counter_bucket`] relies on it).
    on_counter: bool,
    buckets: Box<[Bucket]>,
    bucket_unit: Box<[usize]>,
    units: Box<[String]>,
    /// Serialises every change of a multi-rate limiter (decisions, undos, refunds,
    /// charges, rate changes) so that one change's check, debits and (on a refusal) undo
    /// are never interleaved with another's; single-rate decisions stay lock-free. It
    /// guards the debits of the latest tokened grants (at most [`RECENT`]), so that a
    /// grant given back after other changes still follows the one undo rule on each rate
    /// (a grant no longer listed gives nothing back): one lock, which the fork handler
    /// takes, and which a caller holding the GIL only tries.
    multi: std::sync::Mutex<Recent>,
    /// Multi-rate: counts changes (under `multi`); a grant's token is its value right
    /// after the grant, so "unchanged" means no change on any bucket since.
    seq: AtomicU64,
    /// Give-backs kept because a later grant stood on them (per bucket).
    refunds_dropped: AtomicU64,
}

impl crate::fork::ForkLocks for Limiter {
    fn rank(&self) -> crate::fork::Rank {
        crate::fork::Rank::Resource
    }

    fn lock_for_fork<'a>(&'a self, held: &mut Vec<Box<dyn crate::fork::Held + 'a>>) {
        held.push(Box::new(self.lock_multi()));
        for b in self.buckets.iter() {
            held.push(Box::new(b.change_lock()));
        }
    }
}

/// Capacity held for a caller from `at_ns` on, with every bucket's debit; given back by
/// the one undo rule ([`Limiter::undo_reservation`]).
#[derive(Clone, Debug)]
pub struct Reservation {
    /// When the caller may proceed (clock nanoseconds).
    pub at_ns: u64,
    /// How long from the reservation until then.
    pub delay_ns: u64,
    taken: Vec<Taken>,
    /// Several rates: the change count right after this debit (see `Limiter::seq`).
    seq: u64,
    /// The ticket of an overage settled on it still owed in a queue (see
    /// [`crate::WaitQueue::settle_by`]): a policy's, not debited yet.
    pub(crate) owed: Option<u64>,
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
        // The counter is read only for one rate: several are decided under a lock, at
        // one time in nanoseconds for all.
        let counter = match clock {
            AnyClock::Monotonic if rates.len() == 1 => clock::tsc_scale(),
            _ => None,
        };
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
            buckets.push(Bucket::new_on(rate, clock.now_ns(), counter));
        }
        Ok(Limiter {
            clock,
            on_counter: counter.is_some(),
            buckets: buckets.into(),
            bucket_unit: bucket_unit.into(),
            units: units.into(),
            multi: std::sync::Mutex::new(VecDeque::new()),
            seq: AtomicU64::new(0),
            refunds_dropped: AtomicU64::new(0),
        })
    }

    /// The distinct unit names, in order of first appearance.
    #[inline]
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
        match &*self.buckets {
            // One rate counts the one unit (index 0), which a denial already names.
            [b] => b.try_take(now, costs[0]),
            _ => self.try_acquire_all(now, costs),
        }
    }

    /// [`Limiter::try_acquire_at`] on several rates (out of line: the one-rate decision
    /// stays small enough to inline).
    #[inline(never)]
    fn try_acquire_all(&self, now: u64, costs: &[u64]) -> Result<(), Deny> {
        self.take_all(now, costs, 0, false).map(|_| ())
    }

    /// The one bucket of a limiter that reads the counter (None otherwise), with no
    /// bounds check on the decision's path.
    #[inline(always)]
    fn counter_bucket(&self) -> Option<&Bucket> {
        if !self.on_counter {
            return None;
        }
        debug_assert_eq!(self.buckets.len(), 1);
        // SAFETY: `on_counter` is true only for a limiter made with exactly one rate (see
        // `Limiter::new`), and `buckets` is never changed after it: index 0 exists.
        Some(unsafe { self.buckets.get_unchecked(0) })
    }

    /// Admits `costs` (one per unit, indexed as [`Limiter::units`]) now or not at all.
    /// `Err(Deny::Wait(ns))`: refused, would conform in `ns`; nothing was consumed.
    #[inline]
    pub fn try_acquire(&self, costs: &[u64]) -> Result<(), Deny> {
        if let Some(b) = self.counter_bucket() {
            // One rate counts the one unit (index 0), which a denial already names.
            return b.try_take_words_counter(clock::read_counter(), costs[0]).map(|_| ());
        }
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
        let _serial = self.lock_multi();
        self.take_all_serial(now, costs, max_delay_ns, scheduled)
    }

    /// [`Limiter::try_acquire`] without waiting for the multi-rate lock: None (nothing
    /// changed) when another decision holds it.
    #[inline]
    pub fn try_acquire_nowait(&self, costs: &[u64]) -> Option<Result<(), Deny>> {
        self.try_acquire_at_nowait(self.clock.now_ns(), costs)
    }

    #[inline]
    fn try_acquire_at_nowait(&self, now: u64, costs: &[u64]) -> Option<Result<(), Deny>> {
        if self.buckets.len() == 1 {
            return Some(self.try_acquire_at(now, costs));
        }
        let _serial = self.try_lock_multi()?;
        Some(self.take_all_serial(now, costs, 0, false).map(|_| ()))
    }

    /// [`Limiter::try_acquire_nowait`] for a caller that must not overtake a queue: after
    /// the take, `joined()` (the queue's [`crate::WaitQueue::joined`]) is asked once more
    /// and, when someone joined since the caller's own check, the take is undone (exactly
    /// while it is the latest change, else by the refund rule) and refused with
    /// `Deny::Wait(0)`, so no time promised to a joiner moves.
    #[inline]
    pub fn try_acquire_idle_nowait(&self, costs: &[u64], joined: impl Fn() -> bool) -> Option<Result<(), Deny>> {
        if let Some(b) = self.counter_bucket() {
            return Some(self.try_take_one_idle_counter(b, costs, joined).map(|_| ()));
        }
        let now = self.clock.now_ns();
        if self.buckets.len() == 1 {
            return Some(self.try_take_one_idle(now, costs, joined).map(|_| ()));
        }
        self.try_all_idle_nowait(now, costs, &joined)
    }

    /// [`Limiter::try_acquire_idle_nowait`] on several rates (out of line).
    #[inline(never)]
    fn try_all_idle_nowait(&self, now: u64, costs: &[u64], joined: &dyn Fn() -> bool) -> Option<Result<(), Deny>> {
        let _serial = self.try_lock_multi()?;
        Some(self.take_all_idle(now, costs, joined).map(|_| ()))
    }

    /// [`Limiter::try_acquire_idle_nowait`], waiting for the multi-rate lock if busy.
    pub fn try_acquire_idle(&self, costs: &[u64], joined: impl Fn() -> bool) -> Result<(), Deny> {
        if let Some(b) = self.counter_bucket() {
            return self.try_take_one_idle_counter(b, costs, joined).map(|_| ());
        }
        let now = self.clock.now_ns();
        if self.buckets.len() == 1 {
            return self.try_take_one_idle(now, costs, joined).map(|_| ());
        }
        let _serial = self.lock_multi();
        self.take_all_idle(now, costs, &joined).map(|_| ())
    }

    /// One rate: the fast take, undone when `joined()` after it; Ok(the word it left).
    #[inline]
    fn try_take_one_idle(&self, now: u64, costs: &[u64], joined: impl Fn() -> bool) -> Result<u64, Deny> {
        // One rate counts the one unit (index 0), which a denial already names.
        let (b, c) = (&self.buckets[0], costs[0]);
        let (before, after) = b.try_take_words(now, c)?;
        if joined() {
            self.untake_raced(b, before, after, now, c);
            return Err(Deny::Wait(0));
        }
        Ok(after)
    }

    /// [`Limiter::try_take_one_idle`] at a reading of the clock's counter (see
    /// [`Limiter::try_acquire`]).
    #[inline]
    fn try_take_one_idle_counter(&self, b: &Bucket, costs: &[u64], joined: impl Fn() -> bool) -> Result<u64, Deny> {
        let c = costs[0];
        let raw = clock::read_counter();
        let (before, after) = b.try_take_words_counter(raw, c)?;
        if joined() {
            self.untake_raced(b, before, after, b.counter_ns(raw), c);
            return Err(Deny::Wait(0));
        }
        Ok(after)
    }

    /// Gives back a fast take that raced a joiner: exactly while it is the latest change,
    /// else what such a debit can still hold, by the refund rule.
    #[cold]
    #[inline(never)]
    fn untake_raced(&self, b: &Bucket, before: u64, after: u64, now: u64, cost: u64) {
        if !b.untake_words(before, after) {
            self.note(b.refund_since(now, cost, now, cost));
        }
    }

    /// Several rates, the multi-rate lock held: [`Limiter::take_all_serial`] with no
    /// delay, undone (exactly: every change is serialised) when `joined()` after it.
    fn take_all_idle(&self, now: u64, costs: &[u64], joined: &dyn Fn() -> bool) -> Result<Reservation, Deny> {
        let r = self.take_all_serial(now, costs, 0, false)?;
        if joined() {
            self.undo(&r.taken);
            self.seq.fetch_add(1, Ordering::AcqRel);
            return Err(Deny::Wait(0));
        }
        Ok(r)
    }

    /// The body of [`Limiter::take_all`], with the multi-rate lock held.
    fn take_all_serial(
        &self,
        now: u64,
        costs: &[u64],
        max_delay_ns: u64,
        scheduled: bool,
    ) -> Result<Reservation, Deny> {
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
                    seq: self.seq.fetch_add(1, Ordering::AcqRel) + 1,
                    owed: None,
                });
            }
            // Every change is serialised, so this is not expected: give back what this
            // attempt debited (exactly: nothing came after it) and decide again.
            self.undo(&taken);
        }
    }

    /// Debits `costs` for a grant at `at_ns` within `max_delay_ns`, all or nothing,
    /// returning a handle that [`Limiter::undo_reservation`] can take back.
    pub fn take_at(&self, at_ns: u64, costs: &[u64], max_delay_ns: u64) -> Result<Reservation, Deny> {
        let r = self.take_at_with(at_ns, costs, max_delay_ns, false)?;
        self.note_ahead(r.at_ns, self.clock.now_ns());
        Ok(r)
    }

    /// A grant scheduled at `at_ns`, after `now`, by a time a rate's own TAT may not show
    /// (the slowest rate's, or another level's): each rate keeps it from refunds.
    fn note_ahead(&self, at_ns: u64, now: u64) {
        if at_ns > now {
            for b in &self.buckets {
                b.note_ahead(at_ns);
            }
        }
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
                    seq: 0,
                    owed: None,
                })
                .map_err(|d| self.with_unit(0, d));
        }
        self.take_all(at_ns, costs, max_delay_ns, scheduled)
    }

    fn lock_multi(&self) -> MutexGuard<'_, Recent> {
        self.multi.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// [`Limiter::lock_multi`] if it is free now.
    fn try_lock_multi(&self) -> Option<MutexGuard<'_, Recent>> {
        match self.multi.try_lock() {
            Ok(g) => Some(g),
            Err(std::sync::TryLockError::Poisoned(e)) => Some(e.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => None,
        }
    }

    /// The lock every change of a multi-rate limiter holds (None for a single rate).
    fn serial(&self) -> Option<MutexGuard<'_, Recent>> {
        (self.buckets.len() > 1).then(|| self.lock_multi())
    }

    /// Holds the list of recent multi-rate grants as a thread filing a grant does.
    #[cfg(test)]
    pub(crate) fn hold_grant_list(&self) -> impl Drop + '_ {
        self.lock_multi()
    }

    /// A grant's token: one rate, the word it left; several, the change count right
    /// after it, covering every rate, its debits filed in `recent` (moved, not copied)
    /// for a late give-back. `recent` is the multi-rate lock's list: the lock held from
    /// the grant to its filing, so no change comes between and no fork sees it filed half.
    fn token_of(&self, r: Reservation, recent: Option<&mut Recent>) -> u64 {
        match recent {
            Some(list) if self.buckets.len() > 1 => {
                if list.len() == RECENT {
                    list.pop_front();
                }
                list.push_back((r.seq, r.taken));
                r.seq
            }
            _ => r.taken[0].after_word(),
        }
    }

    /// A grant at `at_ns` with no delay and its token, the multi-rate lock held through
    /// both (`scheduled`: a grant the queue scheduled, see [`Bucket::take_with`]).
    fn take_token_at(&self, at_ns: u64, costs: &[u64], scheduled: bool) -> Result<u64, Deny> {
        if self.buckets.len() == 1 {
            return self
                .take_at_with(at_ns, costs, 0, scheduled)
                .map(|r| self.token_of(r, None));
        }
        let mut recent = self.lock_multi();
        self.take_all_serial(at_ns, costs, 0, scheduled)
            .map(|r| self.token_of(r, Some(&mut recent)))
    }

    fn note(&self, u: Undo) -> Undo {
        if u == Undo::Dropped {
            self.refunds_dropped.fetch_add(1, Ordering::Relaxed);
        }
        u
    }

    /// Give-backs kept so far because a later grant stood on them (counted per rate).
    pub fn refunds_dropped(&self) -> u64 {
        self.refunds_dropped.load(Ordering::Relaxed)
    }

    /// Gives back everything `r` still holds at `now_ns`, per rate by the one undo rule
    /// ([`Bucket::give_back`]: exact while latest, else refunded while no grant is
    /// scheduled ahead, else kept and counted). Returns how many rates gave capacity back.
    pub fn undo_reservation(&self, r: &mut Reservation, now_ns: u64) -> usize {
        let _serial = self.serial();
        let mut gave = 0;
        for (i, t) in r.taken.iter_mut().enumerate() {
            let ret = t.cost();
            gave += usize::from(self.note(self.buckets[i].give_back(t, ret, now_ns)).gave());
        }
        self.seq.fetch_add(1, Ordering::AcqRel);
        gave
    }

    /// Settles what `r` holds from `estimated` to `actual` costs (per unit) at `now_ns`:
    /// refunds by the one undo rule, overage charged (possibly into debt). True when
    /// capacity came back.
    pub fn settle_reservation(&self, r: &mut Reservation, estimated: &[u64], actual: &[u64], now_ns: u64) -> bool {
        let _serial = self.serial();
        let mut gave = false;
        for (i, t) in r.taken.iter_mut().enumerate() {
            let u = self.bucket_unit[i];
            let (e, a) = (estimated[u], actual[u]);
            if a < e {
                gave |= self.note(self.buckets[i].give_back(t, e - a, now_ns)).gave();
            } else if a > e {
                self.buckets[i].charge_more(t, a - e, now_ns);
            }
        }
        self.seq.fetch_add(1, Ordering::AcqRel);
        gave
    }

    fn undo(&self, taken: &[Taken]) {
        for (i, t) in taken.iter().enumerate() {
            self.buckets[i].untake(t);
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
                    seq: 0,
                    owed: None,
                })
                .map_err(|d| self.with_unit(0, d))
        } else {
            self.take_all(now, costs, max, false)
        };
        if let Ok(r) = &r {
            self.note_ahead(r.at_ns, now);
        }
        r.map_err(|d| match d {
            // Within max_wait, yet refused: the reservations already queued reach beyond
            // what a bucket can hold (over 9 years ahead).
            Deny::Wait(ns) if ns <= max => Error::Overloaded {
                reason: format!(
                    "the wait of {:.6} s reaches beyond the bucket's range of reservations ahead",
                    ns as f64 / 1e9
                ),
                retry_after_ns: ns,
            },
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

    /// Cancels a reservation by the one undo rule (see [`Limiter::undo_reservation`]);
    /// returns how many rates gave capacity back. Call it once per reservation.
    pub fn cancel(&self, r: &Reservation) -> usize {
        self.undo_reservation(&mut r.clone(), self.clock.now_ns())
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
        let _serial = self.serial();
        b.set_rate(self.clock.now_ns(), rate);
        self.seq.fetch_add(1, Ordering::AcqRel);
        Ok(())
    }

    /// Gives back `costs` of a grant not held as a record (e.g. an over-estimate) by
    /// the refund rule of [`Bucket::give_back`]; true when capacity came back.
    pub fn refund(&self, costs: &[u64]) -> bool {
        let now = self.clock.now_ns();
        let _serial = self.serial();
        let mut gave = false;
        for (i, b) in self.buckets.iter().enumerate() {
            let c = costs[self.bucket_unit[i]];
            if c > 0 {
                gave |= self.note(b.refund(now, c)).gave();
            }
        }
        self.seq.fetch_add(1, Ordering::AcqRel);
        gave
    }

    /// Admits nothing in `unit` (every unit when None) before `until_ns` (see
    /// [`Bucket::hold_until`]); never shortens a longer debt. True when a bucket moved.
    pub fn hold_until(&self, until_ns: u64, unit: Option<usize>) -> bool {
        let now = self.clock.now_ns();
        let _serial = self.serial();
        let mut moved = false;
        for (i, b) in self.buckets.iter().enumerate() {
            if unit.is_none_or(|u| u == self.bucket_unit[i]) {
                moved |= b.hold_until(now, until_ns);
            }
        }
        self.seq.fetch_add(1, Ordering::AcqRel);
        moved
    }

    /// Charges `costs` now regardless of conformance (an under-estimate): may go into debt.
    pub fn charge(&self, costs: &[u64]) {
        self.charge_at(self.clock.now_ns(), costs);
    }

    /// Charges `costs` at `now` (a schedule time) regardless of conformance: may go into
    /// debt.
    pub fn charge_at(&self, now: u64, costs: &[u64]) {
        let _serial = self.serial();
        for (i, b) in self.buckets.iter().enumerate() {
            let c = costs[self.bucket_unit[i]];
            if c > 0 {
                b.charge(now, c);
            }
        }
        self.seq.fetch_add(1, Ordering::AcqRel);
    }
}
