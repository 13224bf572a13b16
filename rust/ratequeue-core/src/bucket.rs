//! The GCRA bucket: the theoretical arrival time (TAT) in one atomic word, updated by
//! compare-and-swap. No lock on any decision; a mutex only serialises rate changes.
//!
//! Time inside a bucket is counted in *ticks*: 2^m ticks make exactly one emission
//! interval T, with m chosen so a tick lasts between 0.5 and 1 ns. Debits are whole
//! multiples of 2^m ticks, so the long-run rate carries no rounding drift at all; only
//! reading the clock is quantised, to under a nanosecond, and that error never adds up.
//! The word holds a 4-bit generation (which parameter slot is current) and a 60-bit TAT
//! counted from the slot's *epoch*, a multiple of 2^52 ns at or before the bucket's
//! first use, so any clock reading works, however far from the clock's origin. 2^60
//! ticks last at least 18 years; a decision that finds its time 2^57 ns (4.5 years) past
//! the epoch *rebases*: it writes the next slot with a later epoch and moves the word to
//! it with the TAT shifted by exactly the ticks between the two epochs (whole multiples
//! of 2^52 ns are a whole number of ticks, so nothing is rounded), in one CAS. A rate
//! change works the same way, with the bucket's content converted to the new rate.
//!
//! Capacity comes back by one undo rule ([`Bucket::give_back`]), shared by every level:
//! exact (a CAS back from the word a debit left) while the debit is the latest change;
//! otherwise a refund, only while no grant is scheduled in the future (TAT ≤ now + tau)
//! and only of what the debit can still hold, never past full; otherwise nothing
//! (lowering the TAT under a scheduled grant would let a newcomer share its slot).

use crate::rate::Rate;
use crate::sync::{AtomicU64, Mutex, Ordering};

const GEN_SHIFT: u32 = 60;
const TAT_MASK: u64 = (1 << GEN_SHIFT) - 1;
/// The largest TAT a bucket can hold, in ticks.
pub(crate) const TAT_LIMIT: u64 = TAT_MASK;
const GENS: usize = 16;
const Q_BITS: u32 = 52;
const Q_ONE: f64 = (1u64 << Q_BITS) as f64;
/// Epochs are multiples of 2^52 ns: moving one shifts ticks by exactly `q_ticks` per unit.
const EPOCH_BITS: u32 = Q_BITS;
/// A decision this far past its epoch rebases when the change lock is free.
const REBASE_NS: u64 = 1 << 57;
/// A decision this far past its epoch always rebases first (ticks stay below 2^59).
const MUST_REBASE_NS: u64 = 1 << 58;
/// A new epoch lies this far before the reading that set it (earlier arrivals stay exact).
const EPOCH_MARGIN_NS: u64 = 1 << 55;

/// The epoch for a bucket read at `ns`: at most 2^55 + 2^52 ns before it.
#[inline]
pub(crate) fn epoch_for(ns: u64) -> u64 {
    ns.saturating_sub(EPOCH_MARGIN_NS) & !((1u64 << EPOCH_BITS) - 1)
}

/// True when a decision at `ns` should move an epoch `epoch` forward first.
#[inline]
pub(crate) fn needs_rebase(epoch: u64, ns: u64) -> bool {
    ns.saturating_sub(epoch) >= REBASE_NS
}

/// After a lost compare-and-swap: pause 1, 2, 4 … up to 64 spins (the winner keeps the
/// line for its next decision meanwhile), so contention does not become a retry storm.
#[inline]
fn backoff(spins: &mut u32) {
    *spins = (*spins * 2).clamp(1, 64);
    for _ in 0..*spins {
        std::hint::spin_loop();
    }
}

/// Why a bucket did not admit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Deny {
    /// It would admit after this many nanoseconds (beyond what the caller allowed).
    Wait(u64),
    /// The cost exceeds the burst: it can never conform. `unit` is set by the limiter.
    TooLarge { cost: u64, burst: u64, unit: usize },
}

/// `before` of a debit known only by the word it left (a queue's grant token).
const UNKNOWN: u64 = u64::MAX;

/// A debit on a bucket, held so that it can be given back by the one undo rule
/// ([`Bucket::give_back`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Taken {
    /// Nanoseconds from the arrival given to `take` until the grant.
    pub delay_ns: u64,
    before: u64,
    after: u64,
    cost: u64,
    latest: bool,
    /// The bucket's refund count when taken, plus this debit's own refunds.
    refunded: u64,
    /// For a grant scheduled ahead, the TAT it left (0 otherwise): until the grant's
    /// time a partial give-back keeps the TAT there, so that "TAT > now + tau" still
    /// says a grant is scheduled ahead.
    slot: u64,
}

impl Taken {
    /// The bucket's word right after this debit (a token of "nothing came after").
    pub fn after_word(&self) -> u64 {
        self.after
    }

    /// The cost this debit stands for now (after any settle).
    pub fn cost(&self) -> u64 {
        self.cost
    }

    /// True while it can still be undone exactly (nothing seen after it).
    pub fn is_latest(&self) -> bool {
        self.latest
    }

    /// A debit of `cost` known only by the word `after` it left (a grant's token).
    pub fn from_token(after: u64, cost: u64) -> Taken {
        Taken {
            delay_ns: 0,
            before: UNKNOWN,
            after,
            cost,
            latest: true,
            refunded: UNKNOWN,
            slot: 0,
        }
    }
}

/// What giving capacity back did (the one undo rule; see [`Bucket::give_back`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Undo {
    /// Nothing came after the debit: the bucket is as if it had been taken smaller (or
    /// not at all).
    Exact,
    /// Refunded: no grant is scheduled in the future on the bucket.
    Refunded,
    /// Nothing to give: the bucket is full, or time already restored what was taken.
    Nothing,
    /// Kept: a later grant is scheduled in the future on the bucket, and giving back
    /// under it would let a newcomer share its slot.
    Dropped,
}

impl Undo {
    /// True when capacity came back.
    pub fn gave(self) -> bool {
        matches!(self, Undo::Exact | Undo::Refunded)
    }
}

#[derive(Debug, Default)]
#[repr(align(64))]
struct Slot {
    m: AtomicU64,
    tau: AtomicU64,
    burst: AtomicU64,
    q_ticks: AtomicU64,
    epoch: AtomicU64,
    amount: AtomicU64,
    period: AtomicU64,
    /// When this generation became current (ns).
    since: AtomicU64,
}

/// The fixed-point GCRA arithmetic of one rate (shared by the atomic bucket and the
/// keyed map, whose TATs live in a table).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Params {
    pub(crate) m: u64,
    pub(crate) tau: u64,
    pub(crate) burst: u64,
    q_ticks: u64,
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
        let delay_ns = self.ns_until(at_ns, new.saturating_sub(self.tau));
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
        if target <= self.ticks(at_ns) {
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

/// A lock-free GCRA token bucket.
#[derive(Debug)]
#[repr(align(64))]
pub struct Bucket {
    word: AtomicU64,
    /// Ticks given back by refunds so far (monotonic; written under `change`).
    refunded: AtomicU64,
    slots: [Slot; GENS],
    change: Mutex<()>,
    /// The latest clock time of a debit scheduled after the call that made it by
    /// something other than this bucket's own schedule (see [`Bucket::note_ahead`]).
    ahead: AtomicU64,
    /// The latest clock time at which an undo or refund gave capacity back.
    given: AtomicU64,
}

impl Bucket {
    /// A full bucket at `rate` counting from clock time 0 (it rebases on first use
    /// far from 0; [`Bucket::new_at`] avoids that).
    pub fn new(rate: Rate) -> Bucket {
        Bucket::new_at(rate, 0)
    }

    /// A full bucket at `rate` whose epoch suits a clock now showing `now_ns`.
    pub fn new_at(rate: Rate, now_ns: u64) -> Bucket {
        let b = Bucket {
            word: AtomicU64::new(0),
            refunded: AtomicU64::new(0),
            slots: Default::default(),
            change: Mutex::new(()),
            ahead: AtomicU64::new(0),
            given: AtomicU64::new(0),
        };
        b.write_slot(0, &rate, epoch_for(now_ns), 0);
        b
    }

    fn write_slot(&self, gen: usize, rate: &Rate, epoch: u64, since_ns: u64) {
        let p = Params::of(rate);
        let s = &self.slots[gen];
        s.since.store(since_ns, Ordering::Relaxed);
        s.m.store(p.m, Ordering::Relaxed);
        s.tau.store(p.tau, Ordering::Relaxed);
        s.burst.store(p.burst, Ordering::Relaxed);
        s.q_ticks.store(p.q_ticks, Ordering::Relaxed);
        s.epoch.store(epoch, Ordering::Relaxed);
        s.amount.store(rate.amount.to_bits(), Ordering::Relaxed);
        s.period.store(rate.period_ns.to_bits(), Ordering::Relaxed);
    }

    #[inline]
    fn params(&self, word: u64) -> Params {
        self.slot_params((word >> GEN_SHIFT) as usize)
    }

    #[inline]
    fn slot_params(&self, gen: usize) -> Params {
        let s = &self.slots[gen];
        Params {
            m: s.m.load(Ordering::Relaxed),
            tau: s.tau.load(Ordering::Relaxed),
            burst: s.burst.load(Ordering::Relaxed),
            q_ticks: s.q_ticks.load(Ordering::Relaxed),
            epoch: s.epoch.load(Ordering::Relaxed),
        }
    }

    /// The word and its parameters for a decision at `at_ns`, rebased first if `at_ns`
    /// lies far past the epoch.
    #[inline]
    fn load_at(&self, at_ns: u64) -> (u64, Params) {
        let w = self.word.load(Ordering::Acquire);
        let p = self.params(w);
        if needs_rebase(p.epoch, at_ns) {
            return self.rebase(at_ns);
        }
        (w, p)
    }

    /// Moves the epoch forward for a decision at `at_ns`, keeping the bucket's content
    /// exactly (a TAT before the new epoch becomes 0: full either way). Skipped while a
    /// rate change or another rebase holds the change lock, unless `at_ns` is so far
    /// ahead that the ticks would leave their range.
    #[cold]
    #[inline(never)]
    fn rebase(&self, at_ns: u64) -> (u64, Params) {
        loop {
            let w = self.word.load(Ordering::Acquire);
            let p = self.params(w);
            if !needs_rebase(p.epoch, at_ns) {
                return (w, p);
            }
            let _guard = match self.change.try_lock() {
                Ok(g) => g,
                Err(std::sync::TryLockError::Poisoned(e)) => e.into_inner(),
                Err(std::sync::TryLockError::WouldBlock) if at_ns - p.epoch < MUST_REBASE_NS => return (w, p),
                Err(std::sync::TryLockError::WouldBlock) => self.change.lock().unwrap_or_else(|e| e.into_inner()),
            };
            let w = self.word.load(Ordering::Acquire);
            let p = self.params(w);
            if !needs_rebase(p.epoch, at_ns) {
                return (w, p);
            }
            let epoch = epoch_for(at_ns);
            let gen = (((w >> GEN_SHIFT) as usize) + 1) % GENS;
            self.write_slot(gen, &self.rate_of(w), epoch, at_ns);
            let shift = p.shift_to(epoch);
            let mut w = w;
            loop {
                let next = ((gen as u64) << GEN_SHIFT) | (w & TAT_MASK).saturating_sub(shift);
                match self
                    .word
                    .compare_exchange_weak(w, next, Ordering::AcqRel, Ordering::Acquire)
                {
                    Ok(_) => break,
                    Err(seen) => w = seen,
                }
            }
        }
    }

    fn rate_of(&self, word: u64) -> Rate {
        let s = &self.slots[(word >> GEN_SHIFT) as usize];
        Rate {
            amount: f64::from_bits(s.amount.load(Ordering::Relaxed)),
            period_ns: f64::from_bits(s.period.load(Ordering::Relaxed)),
            burst: s.burst.load(Ordering::Relaxed),
        }
    }

    /// The raw state word (generation and TAT): equal values mean no change between.
    pub fn word(&self) -> u64 {
        self.word.load(Ordering::Acquire)
    }

    /// The current rate.
    pub fn rate(&self) -> Rate {
        self.rate_of(self.word.load(Ordering::Acquire))
    }

    /// Debits `cost` for an arrival at `at_ns` if it is granted within `max_delay_ns`;
    /// the grant time is max(at, TAT + (cost − burst)·T) (the Lindley recursion), and
    /// TAT becomes max(TAT, at) + cost·T. A refusal changes nothing.
    #[inline]
    pub fn take(&self, at_ns: u64, cost: u64, max_delay_ns: u64) -> Result<Taken, Deny> {
        self.take_with(at_ns, cost, max_delay_ns, false)
    }

    /// Admits `cost` at `at_ns` now or refuses, changing nothing on a refusal: the
    /// decision of [`Bucket::take`] with no delay allowed, keeping no record for an undo.
    /// One clock conversion per decision; a lost CAS retries from the word it returned
    /// after a pause, so two threads on one bucket do not keep taking the line from each
    /// other.
    #[inline]
    pub fn try_take(&self, at_ns: u64, cost: u64) -> Result<(), Deny> {
        let (mut w, mut p) = self.load_at(at_ns);
        let mut spins = 0u32;
        'params: loop {
            if cost > p.burst {
                return Err(Deny::TooLarge {
                    cost,
                    burst: p.burst,
                    unit: 0,
                });
            }
            // Both below 2^60 (cost <= burst, and tau = burst << m < 2^57).
            let (now, add) = (p.ticks(at_ns), cost << p.m);
            loop {
                let new = (w & TAT_MASK).max(now) + add;
                if new > now + p.tau || new > TAT_MASK {
                    return Err(self.refusal(&p, at_ns, new));
                }
                let next = (w & !TAT_MASK) | new;
                if next == w {
                    return Ok(());
                }
                match self
                    .word
                    .compare_exchange_weak(w, next, Ordering::AcqRel, Ordering::Acquire)
                {
                    Ok(_) => return Ok(()),
                    Err(seen) if seen >> GEN_SHIFT == w >> GEN_SHIFT => {
                        w = seen;
                        backoff(&mut spins);
                    }
                    Err(_) => {
                        (w, p) = self.load_at(at_ns);
                        continue 'params;
                    }
                }
            }
        }
    }

    /// The refusal of a decision at `at_ns` that would leave the TAT at `new`.
    #[cold]
    #[inline(never)]
    fn refusal(&self, p: &Params, at_ns: u64, new: u64) -> Deny {
        Deny::Wait(p.ns_until(at_ns, new.saturating_sub(p.tau)))
    }

    /// [`Bucket::take`], for a grant time the queue scheduled (`scheduled`) or an arrival.
    #[inline(always)]
    pub fn take_with(&self, at_ns: u64, cost: u64, max_delay_ns: u64, scheduled: bool) -> Result<Taken, Deny> {
        let (mut w, mut p) = self.load_at(at_ns);
        loop {
            let (new, delay_ns) = p.step(w & TAT_MASK, at_ns, cost, max_delay_ns, scheduled)?;
            // Read before the debit: a refund it counts was applied before it.
            let refunded = self.refunded.load(Ordering::Acquire);
            let next = (w & !TAT_MASK) | new;
            if next == w {
                return Ok(Taken {
                    delay_ns,
                    before: w,
                    after: w,
                    cost,
                    latest: true,
                    refunded,
                    slot: 0,
                });
            }
            match self
                .word
                .compare_exchange_weak(w, next, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => {
                    return Ok(Taken {
                        delay_ns,
                        before: w,
                        after: next,
                        cost,
                        latest: true,
                        refunded,
                        slot: if delay_ns > 0 { new } else { 0 },
                    })
                }
                Err(seen) if seen >> GEN_SHIFT == w >> GEN_SHIFT => w = seen,
                Err(_) => (w, p) = self.load_at(at_ns),
            }
        }
    }

    /// Records that a debit was scheduled at `at_ns`, later than the clock when it was
    /// made, by a time this bucket's own TAT does not show (another rate or level set
    /// it): until then, refunds leave everything before it in place.
    pub fn note_ahead(&self, at_ns: u64) {
        self.ahead.fetch_max(at_ns, Ordering::AcqRel);
    }

    /// The latest clock time at which an undo or refund gave capacity back: a grant
    /// scheduled in the past (a late wake-up) is never dated before it, or it would use
    /// capacity that was not free yet at its time.
    pub fn given_at(&self) -> u64 {
        self.given.load(Ordering::Acquire)
    }

    /// Nanoseconds from `at_ns` until `cost` would conform (0 = now); changes nothing.
    #[inline]
    pub fn delay_for(&self, at_ns: u64, cost: u64) -> Result<u64, Deny> {
        let (w, p) = self.load_at(at_ns);
        if cost > p.burst {
            return Err(Deny::TooLarge {
                cost,
                burst: p.burst,
                unit: 0,
            });
        }
        let now = p.ticks(at_ns);
        let new = (w & TAT_MASK).max(now) + (cost << p.m);
        Ok(p.ns_until(at_ns, new.saturating_sub(p.tau)))
    }

    /// The earliest time ≥ `at_ns` at which `ahead` and then `cost` would all have
    /// conformed if served back to back (the FIFO schedule of a backlog).
    pub fn predict(&self, at_ns: u64, ahead: u64, cost: u64) -> u64 {
        let (w, p) = self.load_at(at_ns);
        p.predict(w & TAT_MASK, at_ns, ahead.saturating_add(cost))
    }

    /// A copy of the schedule as it stands at `at_ns`, for [`SimBucket`] simulations.
    pub(crate) fn sim_at(&self, at_ns: u64) -> SimBucket {
        let (w, p) = self.load_at(at_ns);
        SimBucket {
            tat: (w & TAT_MASK) as u128,
            p,
        }
    }

    /// Undoes `t` if no other debit came after it; true when undone.
    pub fn untake(&self, t: &Taken) -> bool {
        t.before == t.after
            || self
                .word
                .compare_exchange(t.after, t.before, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
    }

    /// The one undo rule: gives back `ret` (at most what `t` still stands for) at
    /// `at_ns`. Exact while `t` is still the bucket's latest change: a CAS from the word
    /// it left back to the word before it (or to `ret` less). Otherwise a refund, only
    /// while no grant is scheduled in the future (TAT ≤ now + tau), capped by what `t`
    /// can still hold and never past full; else nothing ([`Undo::Dropped`]). What `t`
    /// holds ends at the TAT it left, less every refund since it was taken (each moved
    /// it down); nothing after a rate change, or for a debit known only by its token.
    /// `t` is updated, so a later give-back starts from here.
    pub fn give_back(&self, t: &mut Taken, ret: u64, at_ns: u64) -> Undo {
        let ret = ret.min(t.cost);
        if ret == 0 {
            return Undo::Nothing;
        }
        if t.latest && (t.refunded == UNKNOWN || t.refunded == self.refunded.load(Ordering::Acquire)) {
            let (w, _) = self.load_at(at_ns);
            if w == t.after {
                let p = self.params(w);
                let full = ret == t.cost && t.before != UNKNOWN;
                // Until its grant's time, the TAT keeps marking a grant scheduled ahead
                // (see `slot`).
                let lowered = (w & TAT_MASK).saturating_sub(p.cost_ticks(ret));
                let kept = !full && t.slot > p.ticks(at_ns).saturating_add(p.tau) && lowered < t.slot;
                let next = if full {
                    t.before
                } else {
                    (w & !TAT_MASK) | if kept { t.slot } else { lowered }
                };
                if next == w
                    || self
                        .word
                        .compare_exchange(w, next, Ordering::AcqRel, Ordering::Acquire)
                        .is_ok()
                {
                    t.cost -= ret;
                    t.after = next;
                    if next != w {
                        self.given.fetch_max(at_ns, Ordering::AcqRel);
                    }
                    if kept {
                        // The word no longer spans the whole debit that is left.
                        t.before = UNKNOWN;
                        return Undo::Dropped;
                    }
                    return if next == w { Undo::Nothing } else { Undo::Exact };
                }
            }
        }
        t.latest = false;
        self.load_at(at_ns);
        let _guard = self.change_lock();
        let since = match t.refunded {
            UNKNOWN => None,
            r => Some(self.refunded.load(Ordering::Acquire).wrapping_sub(r)),
        };
        let mut w = self.word.load(Ordering::Acquire);
        loop {
            let p = self.params(w);
            let held = match (since, self.held_in(t.after, w, &p)) {
                (Some(since), Some(h)) => h.saturating_sub(since),
                _ => 0,
            };
            let ahead = self.ahead.load(Ordering::Acquire);
            let Some(tat) = p.refund_tat(w & TAT_MASK, at_ns, p.cost_ticks(ret), Some(held), ahead) else {
                t.cost -= ret;
                return Undo::Dropped;
            };
            let next = (w & !TAT_MASK) | tat;
            if next == w {
                t.cost -= ret;
                return Undo::Nothing;
            }
            match self
                .word
                .compare_exchange_weak(w, next, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => {
                    let given = w - next;
                    self.refunded.fetch_add(given, Ordering::Release);
                    self.given.fetch_max(at_ns, Ordering::AcqRel);
                    t.refunded = t.refunded.wrapping_add(given);
                    t.after -= given.min(t.after & TAT_MASK);
                    t.cost -= ret;
                    return Undo::Refunded;
                }
                Err(seen) => w = seen,
            }
        }
    }

    /// The TAT the debit that left word `after` holds, in the ticks of word `w` (params
    /// `p`): exact across rebases (same rate, a later epoch); None after a rate change.
    fn held_in(&self, after: u64, w: u64, p: &Params) -> Option<u64> {
        if (w ^ after) >> GEN_SHIFT == 0 {
            return Some(after & TAT_MASK);
        }
        let old = self.params(after);
        (old.q_ticks == p.q_ticks && old.m == p.m && old.epoch < p.epoch)
            .then(|| (after & TAT_MASK).saturating_sub(old.shift_to(p.epoch)))
    }

    /// Refunds `cost` at `at_ns` by the refund rule of [`Bucket::give_back`], uncapped
    /// (for a debit that is not held, e.g. a permit settled without its grant's token).
    pub fn refund(&self, at_ns: u64, cost: u64) -> Undo {
        self.load_at(at_ns);
        let _guard = self.change_lock();
        self.refund_locked(at_ns, cost, |_| None)
    }

    /// Refunds `ret` at `at_ns` of a debit of `cost` taken at `taken_at_ns` that is not
    /// held as a record: the refund rule, capped by what such a debit can still hold (its
    /// TAT was at least the tick of `taken_at_ns` plus its cost; across rate changes, what
    /// was left of it at each change, converted as the change converted the content).
    pub fn refund_since(&self, at_ns: u64, ret: u64, taken_at_ns: u64, cost: u64) -> Undo {
        self.load_at(at_ns);
        let _guard = self.change_lock();
        self.refund_locked(at_ns, ret, |w| Some(self.held_since(w, taken_at_ns, cost)))
    }

    /// What a debit of `cost` taken at `taken_at_ns` can still hold, as a TAT in the
    /// ticks of the word `w`'s generation (0: nothing known). Called under `change`.
    fn held_since(&self, w: u64, taken_at_ns: u64, cost: u64) -> u64 {
        let cur = (w >> GEN_SHIFT) as usize;
        // The generation current at `taken_at_ns`: walk back while it started later.
        let mut back = 0;
        let mut since = self.slots[cur].since.load(Ordering::Relaxed);
        while since > taken_at_ns {
            back += 1;
            let prev = self.slots[(cur + GENS - back) % GENS].since.load(Ordering::Relaxed);
            if back == GENS || prev > since {
                return 0; // older than every kept generation
            }
            since = prev;
        }
        let mut g = (cur + GENS - back) % GENS;
        let mut p = self.slot_params(g);
        // Less a nanosecond: a scheduled grant may be debited from just before it.
        let mut held = p
            .ticks(taken_at_ns.saturating_sub(1))
            .saturating_add(p.cost_ticks(cost));
        while g != cur {
            g = (g + 1) % GENS;
            let at = self.slots[g].since.load(Ordering::Relaxed);
            let q = self.slot_params(g);
            let left = held.saturating_sub(p.ticks(at)) as u128;
            // Converted as `set_rate` converts the content (rounded up).
            let left = ((left << q.m) + (1u128 << p.m) - 1) >> p.m;
            held = (q.ticks(at) as u128 + left).min(TAT_MASK as u128) as u64;
            p = q;
        }
        held
    }

    /// The refund rule with the cap `held` gives for the word (see [`Params::refund_tat`]);
    /// counts what it gave. Called under `change`.
    fn refund_locked(&self, at_ns: u64, cost: u64, held: impl Fn(u64) -> Option<u64>) -> Undo {
        let mut w = self.word.load(Ordering::Acquire);
        loop {
            let p = self.params(w);
            let ahead = self.ahead.load(Ordering::Acquire);
            let Some(tat) = p.refund_tat(w & TAT_MASK, at_ns, p.cost_ticks(cost), held(w), ahead) else {
                return Undo::Dropped;
            };
            let next = (w & !TAT_MASK) | tat;
            if next == w {
                return Undo::Nothing;
            }
            match self
                .word
                .compare_exchange_weak(w, next, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => {
                    self.refunded.fetch_add(w - next, Ordering::Release);
                    self.given.fetch_max(at_ns, Ordering::AcqRel);
                    return Undo::Refunded;
                }
                Err(seen) => w = seen,
            }
        }
    }

    /// Debits `cost` at `at_ns` unconditionally; the bucket may go into debt, which
    /// delays later admissions until time repays it.
    pub fn charge(&self, at_ns: u64, cost: u64) {
        self.charge_word(at_ns, cost);
    }

    /// Charges `extra` more on the debit `t` (an under-estimate; may go into debt); `t`
    /// stays exactly undoable while it is still the latest change.
    pub fn charge_more(&self, t: &mut Taken, extra: u64, at_ns: u64) {
        let (w, next) = self.charge_word(at_ns, extra);
        if t.latest && w == t.after {
            t.after = next;
        } else {
            t.latest = false;
        }
        t.cost = t.cost.saturating_add(extra);
    }

    /// Admits nothing before `until_ns`, then one unit there: the TAT moves up to
    /// `until + tau - T` (a debt the clock repays by then) and never back, so repeated
    /// holds to the same time do not add up. True when the TAT moved.
    pub fn hold_until(&self, at_ns: u64, until_ns: u64) -> bool {
        let (mut w, _) = self.load_at(at_ns);
        loop {
            let p = self.params(w);
            let target = p.ticks(until_ns).saturating_add(p.tau - (1u64 << p.m)).min(TAT_MASK);
            if w & TAT_MASK >= target {
                return false;
            }
            let next = (w & !TAT_MASK) | target;
            match self
                .word
                .compare_exchange_weak(w, next, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => return true,
                Err(seen) => w = seen,
            }
        }
    }

    fn charge_word(&self, at_ns: u64, cost: u64) -> (u64, u64) {
        let (mut w, _) = self.load_at(at_ns);
        loop {
            let p = self.params(w);
            let add = p.cost_ticks(cost);
            let tat = ((w & TAT_MASK).max(p.ticks(at_ns)) + add).min(TAT_MASK);
            let next = (w & !TAT_MASK) | tat;
            match self
                .word
                .compare_exchange_weak(w, next, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => return (w, next),
                Err(seen) => w = seen,
            }
        }
    }

    /// Units that could be admitted at `at_ns` (negative while in debt).
    pub fn available(&self, at_ns: u64) -> f64 {
        let (w, p) = self.load_at(at_ns);
        let used = (w & TAT_MASK).saturating_sub(p.ticks(at_ns));
        (p.tau as f64 - used as f64) / (1u64 << p.m) as f64
    }

    /// Holds the rate-change lock (for a fork).
    pub(crate) fn change_lock(&self) -> crate::sync::MutexGuard<'_, ()> {
        self.change.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Changes the rate and burst at `at_ns`, keeping the content used so far (in units):
    /// from the change on, admissions obey the new rate and burst.
    pub fn set_rate(&self, at_ns: u64, rate: Rate) {
        let _guard = self.change_lock();
        let w = self.word.load(Ordering::Acquire);
        let gen = (((w >> GEN_SHIFT) as usize) + 1) % GENS;
        let old_epoch = self.params(w).epoch;
        let epoch = if needs_rebase(old_epoch, at_ns) {
            epoch_for(at_ns)
        } else {
            old_epoch
        };
        self.write_slot(gen, &rate, epoch, at_ns);
        let new_p = Params::of(&rate).at_epoch(epoch);
        let mut w = w;
        loop {
            let p = self.params(w);
            let used = (w & TAT_MASK).saturating_sub(p.ticks(at_ns)) as u128;
            // Content in units = used / 2^m; in new ticks, rounded up (never gain).
            let used_new = ((used << new_p.m) + (1u128 << p.m) - 1) >> p.m;
            let tat = (new_p.ticks(at_ns) as u128 + used_new).min(TAT_MASK as u128) as u64;
            let next = ((gen as u64) << GEN_SHIFT) | tat;
            match self
                .word
                .compare_exchange_weak(w, next, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => return,
                Err(seen) => w = seen,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rate(per_sec: f64, burst: u64) -> Rate {
        Rate::new(per_sec, 1e9, burst).unwrap()
    }

    #[test]
    fn admits_burst_then_refuses() {
        let b = Bucket::new(rate(10.0, 3));
        for _ in 0..3 {
            assert!(b.take(0, 1, 0).is_ok());
        }
        assert_eq!(b.take(0, 1, 0), Err(Deny::Wait(100_000_000)));
        assert!(b.take(100_000_000, 1, 0).is_ok());
    }

    #[test]
    fn cost_above_burst_is_too_large() {
        let b = Bucket::new(rate(10.0, 3));
        assert!(matches!(
            b.take(0, 4, u64::MAX),
            Err(Deny::TooLarge { cost: 4, burst: 3, .. })
        ));
        assert_eq!(b.available(0), 3.0);
    }

    #[test]
    fn reserve_follows_lindley() {
        let b = Bucket::new(rate(100.0, 5));
        let mut delays = vec![];
        for _ in 0..10 {
            delays.push(b.take(0, 1, u64::MAX).unwrap().delay_ns);
        }
        assert_eq!(&delays[..5], &[0; 5]);
        for (k, d) in delays[5..].iter().enumerate() {
            let want = 10_000_000 * (k as u64 + 1);
            assert!(d.abs_diff(want) <= 1, "{d} vs {want}");
        }
    }

    #[test]
    fn untake_only_when_latest() {
        let b = Bucket::new(rate(1.0, 2));
        let t1 = b.take(0, 1, 0).unwrap();
        let t2 = b.take(0, 1, 0).unwrap();
        assert!(!b.untake(&t1));
        assert!(b.untake(&t2));
        assert_eq!(b.available(0), 1.0);
    }

    const S: u64 = 1_000_000_000;

    #[test]
    fn give_back_is_exact_while_latest() {
        let b = Bucket::new(rate(1.0, 1));
        b.take(0, 1, u64::MAX).unwrap();
        let before = b.word();
        let mut t = b.take(0, 1, u64::MAX).unwrap();
        assert_eq!(t.delay_ns, S);
        assert_eq!(b.give_back(&mut t, 1, 0), Undo::Exact);
        assert_eq!(b.word(), before);
        assert_eq!(b.give_back(&mut t, 1, 0), Undo::Nothing); // nothing left to give
        assert_eq!(b.take(0, 1, u64::MAX).unwrap().delay_ns, S);
    }

    #[test]
    fn give_back_under_a_scheduled_grant_is_dropped() {
        let b = Bucket::new(rate(1.0, 1));
        let mut t1 = b.take(0, 1, u64::MAX).unwrap();
        b.take(0, 1, u64::MAX).unwrap(); // scheduled at 1 s
        let w = b.word();
        assert_eq!(b.give_back(&mut t1, 1, 0), Undo::Dropped);
        assert_eq!(b.word(), w);
        assert_eq!(b.take(0, 1, u64::MAX).unwrap().delay_ns, 2 * S);
    }

    #[test]
    fn give_back_refunds_when_nothing_is_scheduled_ahead_never_past_full() {
        let b = Bucket::new(rate(1.0, 4));
        let mut t1 = b.take(0, 2, 0).unwrap();
        b.take(0, 1, 0).unwrap();
        assert_eq!(b.give_back(&mut t1, 2, 0), Undo::Refunded);
        assert_eq!(b.available(0), 3.0);
        assert_eq!(b.give_back(&mut t1, 2, 0), Undo::Nothing); // given once
        assert_eq!(b.refund(0, 100), Undo::Refunded);
        assert_eq!(b.available(0), 4.0);
        assert_eq!(b.refund(0, 1), Undo::Nothing);
        assert_eq!(b.available(0), 4.0);
    }

    #[test]
    fn refund_is_capped_by_what_the_debit_still_holds() {
        // A grant of 1 at 0 on a bucket of burst 2 holds nothing after 1 s: refunding it
        // at 3 s, after another grant, would allow 3 grants at one instant.
        let b = Bucket::new(rate(1.0, 2));
        let mut t1 = b.take(0, 1, 0).unwrap();
        b.take(3 * S, 1, 0).unwrap();
        assert_eq!(b.give_back(&mut t1, 1, 3 * S), Undo::Nothing);
        assert_eq!(b.available(3 * S), 1.0);
        // Half of it is still held at 0.5 s: as if it had never been taken.
        let b = Bucket::new(rate(1.0, 4));
        let mut t1 = b.take(0, 1, 0).unwrap();
        b.take(S / 2, 1, 0).unwrap();
        assert_eq!(b.available(S / 2), 2.5);
        assert_eq!(b.give_back(&mut t1, 1, S / 2), Undo::Refunded);
        assert_eq!(b.available(S / 2), 3.0);
    }

    #[test]
    fn settle_then_cancel_is_exact_while_latest() {
        let b = Bucket::new(rate(10.0, 10));
        let mut t = b.take(0, 5, 0).unwrap();
        assert_eq!(b.give_back(&mut t, 3, 0), Undo::Exact);
        assert_eq!((b.available(0), t.cost()), (8.0, 2));
        b.charge_more(&mut t, 4, 0);
        assert_eq!((b.available(0), t.cost()), (4.0, 6));
        let c = t.cost();
        assert_eq!(b.give_back(&mut t, c, 0), Undo::Exact);
        assert_eq!(b.available(0), 10.0);
    }

    #[test]
    fn long_run_rate_is_exact() {
        for per_sec in [1.0 / 86_400.0, 0.37, 3.0, 999.0, 123_457.0, 33_333_333.0, 1e8] {
            let b = Bucket::new(rate(per_sec, 1));
            let mut t = 0u64;
            let n = (1e16 * per_sec / 1e9).clamp(100.0, 100_000.0) as u64;
            for _ in 0..n {
                let d = b.take(t, 1, u64::MAX).unwrap().delay_ns;
                t += d;
            }
            let want = (n - 1) as f64 * 1e9 / per_sec;
            let err = (t as f64 - want).abs() / want;
            assert!(err < 1e-6, "rate {per_sec}: err {err}");
        }
    }

    #[test]
    fn set_rate_keeps_content() {
        let b = Bucket::new(rate(10.0, 10));
        for _ in 0..4 {
            b.take(0, 1, 0).unwrap();
        }
        b.set_rate(0, rate(1000.0, 20));
        assert!((b.available(0) - 16.0).abs() < 1e-9);
        assert_eq!(b.rate().burst, 20);
        for _ in 0..40 {
            b.set_rate(0, rate(1000.0, 20));
        }
        assert!((b.available(0) - 16.0).abs() < 1e-9);
    }

    #[test]
    fn hold_until_admits_one_unit_at_the_time_and_never_adds_up() {
        let b = Bucket::new(rate(10.0, 5));
        assert!(b.hold_until(0, 2_000_000_000));
        assert!(!b.hold_until(0, 2_000_000_000)); // the same hold again changes nothing
        assert!(!b.hold_until(0, 1_000_000_000)); // an earlier one neither
        assert!((b.available(0) + 19.0).abs() < 1e-9);
        assert!(matches!(b.take(1_999_999_999, 1, 0), Err(Deny::Wait(1))));
        assert!(b.take(2_000_000_000, 1, 0).is_ok());
        assert!(b.take(2_000_000_000, 1, 0).is_err());
        let full = Bucket::new(rate(10.0, 5));
        assert!(full.hold_until(0, 0)); // until now: all but one unit used
        assert!((full.available(0) - 1.0).abs() < 1e-9);
    }

    #[test]
    fn charge_goes_into_debt_and_refund_caps_at_full() {
        let b = Bucket::new(rate(1.0, 2));
        b.charge(0, 5);
        assert_eq!(b.available(0), -3.0);
        assert_eq!(b.take(0, 1, 0), Err(Deny::Wait(4_000_000_000)));
        assert_eq!(b.refund(0, 100), Undo::Dropped); // the debt is a grant scheduled ahead
        assert_eq!(b.available(0), -3.0);
        assert_eq!(b.refund(3_000_000_000, 100), Undo::Refunded);
        assert_eq!(b.available(3_000_000_000), 2.0);
    }
}

#[cfg(test)]
mod epoch_tests {
    use super::*;

    const DAY_NS: u64 = 86_400_000_000_000;
    const YEAR_NS: u64 = 365 * DAY_NS + DAY_NS / 4;

    fn rate(per_sec: f64, burst: u64) -> Rate {
        Rate::new(per_sec, 1e9, burst).unwrap()
    }

    /// A random schedule of every operation on two buckets whose clocks differ by
    /// `offset_b - offset_a`; every answer must be identical.
    fn differential(a: &Bucket, offset_a: u64, b: &Bucket, offset_b: u64, seed: u64, steps: usize, max_step_ns: u64) {
        let mut x = seed;
        let mut t = 0u64;
        let mut next = || {
            x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let z = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            let z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        };
        let room = u64::MAX - (1 << 61) - offset_a.max(offset_b);
        for step in 0..steps {
            let r = next();
            let (ta, tb) = (offset_a + t, offset_b + t);
            let cost = 1 + next() % 3;
            match r % 16 {
                0..=4 => assert_eq!(
                    a.take(ta, cost, 0).map(|t| t.delay_ns),
                    b.take(tb, cost, 0).map(|t| t.delay_ns),
                    "take, step {step}"
                ),
                5..=7 => {
                    let max = next() % (10 * max_step_ns);
                    let (ra, rb) = (a.take(ta, cost, max), b.take(tb, cost, max));
                    assert_eq!(ra.map(|t| t.delay_ns), rb.map(|t| t.delay_ns), "reserve, step {step}");
                }
                8 => {
                    a.charge(ta, cost * 7);
                    b.charge(tb, cost * 7);
                }
                9 => assert_eq!(a.refund(ta, cost), b.refund(tb, cost), "refund, step {step}"),
                10 => {
                    let r = rate(0.001 + (next() % 10_000) as f64 / 100.0, 1 + next() % 9);
                    a.set_rate(ta, r);
                    b.set_rate(tb, r);
                }
                11 => assert_eq!(a.delay_for(ta, cost), b.delay_for(tb, cost), "delay_for, step {step}"),
                12 => assert_eq!(
                    a.predict(ta, cost * 5, cost) - offset_a,
                    b.predict(tb, cost * 5, cost) - offset_b,
                    "predict, step {step}"
                ),
                _ => t += (next() % max_step_ns).min(room - t),
            }
            assert_eq!(
                a.available(ta).to_bits(),
                b.available(tb).to_bits(),
                "available, step {step}"
            );
        }
    }

    #[test]
    fn a_bucket_at_2_pow_62_behaves_exactly_like_one_at_0() {
        for (seed, per_sec) in [(1u64, 10.0), (2, 0.37), (3, 1.0 / 86_400.0), (4, 123_457.0)] {
            let r = rate(per_sec, 5);
            let (a, b) = (Bucket::new(r), Bucket::new(r));
            differential(&a, 0, &b, 1 << 62, seed, 20_000, 2_000_000_000);
            let (a, b) = (Bucket::new(r), Bucket::new_at(r, 1 << 62));
            differential(&a, 0, &b, 1 << 62, seed, 20_000, 2_000_000_000);
        }
    }

    #[test]
    fn rebases_keep_content_exactly() {
        // Steps of up to 2 years: both buckets rebase many times, at different moments
        // (their epochs differ), mid-debt and between rate changes.
        for seed in 1..=8u64 {
            let r = rate(1.0 / 3600.0, 3);
            let (a, b) = (Bucket::new(r), Bucket::new_at(r, 3 * YEAR_NS));
            differential(&a, 0, &b, 1 << 62, seed, 2_000, 2 * YEAR_NS);
            let (a, b) = (Bucket::new(r), Bucket::new(r));
            differential(&a, 0, &b, 5 << 52, seed, 500, 11 * YEAR_NS);
        }
    }

    #[test]
    fn rebase_mid_debt_keeps_the_debt() {
        let b = Bucket::new(rate(1.0, 2));
        let t0 = REBASE_NS - 3_000_000_000;
        b.charge(t0, 10);
        let before = b.available(t0);
        assert!((before + 8.0).abs() < 1e-6, "{before}");
        let gen = b.word() >> GEN_SHIFT;
        let (wait, tat) = (b.delay_for(t0, 1).unwrap(), b.word() & TAT_MASK);
        // 4 s later, past the rebase point: the TAT moved by exactly the epoch's shift.
        let t1 = t0 + 4_000_000_000;
        let after = b.available(t1);
        assert_ne!(b.word() >> GEN_SHIFT, gen, "rebased");
        let p = b.params(b.word());
        assert_eq!(b.word() & TAT_MASK, tat - Params::of(&rate(1.0, 2)).shift_to(p.epoch));
        assert!((after + 4.0).abs() < 1e-6, "{after}");
        assert_eq!(b.delay_for(t1, 1), Ok(wait - 4_000_000_000));
        assert_eq!(b.take(t1, 1, 0), Err(Deny::Wait(wait - 4_000_000_000)));
        assert_eq!(b.take(t1, 1, u64::MAX).map(|t| t.delay_ns), Ok(wait - 4_000_000_000));
        assert_eq!(b.available(t1 + 8_000_000_000), 2.0);
    }

    #[test]
    fn a_give_back_across_a_rebase_stays_capped_by_what_the_debit_holds() {
        let b = Bucket::new(rate(1.0, 10));
        let t0 = REBASE_NS - 500_000_000;
        let mut a = b.take(t0, 1, 0).unwrap();
        b.take(t0, 5, 0).unwrap();
        let t1 = t0 + 750_000_000;
        assert!((b.available(t1) - 4.75).abs() < 1e-6);
        assert_eq!(b.params(b.word()).epoch, epoch_for(t1), "rebased");
        // Not the latest: refunded only the 0.25 s the first debit still holds.
        assert_eq!(b.give_back(&mut a, 1, t1), Undo::Refunded);
        assert!((b.available(t1) - 5.0).abs() < 1e-6, "{}", b.available(t1));
    }

    #[test]
    fn one_a_day_for_120_years_admits_one_a_day() {
        let days = 120 * YEAR_NS / DAY_NS;
        for start in [0, 1_764_000_000_123_456_789, 1 << 62] {
            for b in [
                Bucket::new(rate(1.0 / 86_400.0, 1)),
                Bucket::new_at(rate(1.0 / 86_400.0, 1), start),
            ] {
                let mut admitted = 0;
                for d in 0..days {
                    let t = start + d * DAY_NS;
                    admitted += b.take(t, 1, 0).is_ok() as u64;
                    assert_eq!(b.take(t, 1, 0), Err(Deny::Wait(DAY_NS)), "day {d}");
                }
                assert_eq!(admitted, days, "start {start}");
            }
        }
    }

    #[test]
    fn any_time_in_u64_is_decided() {
        let b = Bucket::new(rate(10.0, 2));
        for t in [0, 1 << 59, 1 << 62, 1 << 63, u64::MAX - (1 << 40)] {
            assert!(b.take(t, 2, 0).is_ok(), "{t}");
            assert_eq!(b.delay_for(t, 1), Ok(100_000_000));
            assert_eq!(b.predict(t, 1, 1), t + 200_000_000);
        }
    }

    #[test]
    fn a_time_before_the_epoch_counts_as_the_epoch() {
        let start = 1u64 << 62;
        let b = Bucket::new_at(rate(1.0, 1), start);
        let epoch = b.params(b.word()).epoch;
        assert!(epoch <= start && start - epoch <= EPOCH_MARGIN_NS + (1 << EPOCH_BITS));
        assert!(b.take(epoch - 5, 1, 0).is_ok());
        // Counted as taken at the epoch: conforms again 1 s after the epoch.
        assert_eq!(b.delay_for(epoch - 5, 1), Ok(1_000_000_005));
        assert_eq!(b.delay_for(epoch + 1_000_000_000, 1), Ok(0));
    }

    #[test]
    fn beyond_the_word_the_wait_is_the_true_one() {
        let b = Bucket::new(rate(1.0 / 86_400.0, 1));
        let mut n = 0u64;
        let err = loop {
            match b.take(0, 1, u64::MAX) {
                Ok(t) => assert!(t.delay_ns.abs_diff(n * DAY_NS) <= 1 + n * DAY_NS / 1_000_000_000_000),
                Err(e) => break e,
            }
            n += 1;
        };
        // Years of reservations fill the word; the refusal tells the real wait.
        assert!(n * DAY_NS > 8 * YEAR_NS, "{n}");
        assert!(
            matches!(err, Deny::Wait(w) if w.abs_diff(n * DAY_NS) <= n * DAY_NS / 1_000_000_000_000),
            "{err:?}"
        );
    }
}
