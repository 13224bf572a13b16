//! The GCRA bucket: the theoretical arrival time (TAT) in one atomic word, updated by
//! compare-and-swap. No lock on any decision; a mutex only serialises rate changes.
//!
//! Time inside a bucket is counted in *ticks*: 2^m ticks make exactly one emission
//! interval T, with m chosen so a tick lasts between 0.5 and 1 ns. Debits are whole
//! multiples of 2^m ticks, so the long-run rate carries no rounding drift at all; only
//! reading the clock is quantised, to under a nanosecond, and that error never adds up.
//! A one-rate limiter on the monotonic clock hands its bucket the TSC reading itself,
//! converted to ticks in one multiply ([`Bucket::try_take_words_counter`]): never later
//! than the nanosecond reading's ticks and at most 4 ticks earlier, with every refusal
//! decided on the nanosecond reading: from any state it admits exactly what that reading
//! admits, and an admission on an idle bucket may leave the TAT up to 4 ticks (at most
//! 4 ns) earlier, as an arrival read that much earlier would.
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

#[cfg(test)]
mod counter_tests;
mod params;
#[cfg(test)]
mod tests;
mod undo;

pub(crate) use params::{Params, SimBucket};

use crate::clock::{self, CounterTicks};
use crate::rate::Rate;
use crate::sync::{AtomicU64, Mutex, Ordering};

const GEN_SHIFT: u32 = 60;
const TAT_MASK: u64 = (1 << GEN_SHIFT) - 1;
/// The largest TAT a bucket can hold, in ticks.
pub(crate) const TAT_LIMIT: u64 = TAT_MASK;
/// Parameter slots, one per generation. 15, not 16: the word's top generation value
/// (15) is never used, so a word plus any debit of at most 2^60 ticks stays below 2^64
/// and the fast paths compare and add whole words ([`Bucket::try_take_words_counter`]).
const GENS: usize = 15;
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
    /// The one-multiply conversion from the monotonic clock's counter to this slot's
    /// ticks ([`CounterTicks`]); a span of 0 when there is none (the epoch is not the
    /// clock's origin, or the bucket does not read the counter).
    counter_zero: AtomicU64,
    counter_k: AtomicU64,
    counter_span: AtomicU64,
    /// 2^m (the ticks of one unit), so that a cost (at most the burst) is one multiply.
    unit: AtomicU64,
    /// This slot's generation in the word's place (`gen << GEN_SHIFT`).
    gen_bits: AtomicU64,
    amount: AtomicU64,
    period: AtomicU64,
    /// When this generation became current (ns).
    since: AtomicU64,
}

/// A lock-free GCRA token bucket.
#[derive(Debug)]
#[repr(align(64))]
pub struct Bucket {
    word: AtomicU64,
    /// Ticks given back by refunds so far (monotonic; written under `change`).
    refunded: AtomicU64,
    /// One more slot than [`GENS`]: indexed by the word's top 4 bits with no bounds
    /// check; the last is never written or current.
    slots: [Slot; GENS + 1],
    change: Mutex<()>,
    /// The latest clock time of a debit scheduled after the call that made it by
    /// something other than this bucket's own schedule (see [`Bucket::note_ahead`]).
    ahead: AtomicU64,
    /// The latest clock time at which an undo or refund gave capacity back.
    given: AtomicU64,
    /// The monotonic clock's counter scale `(origin, mult)` when decisions may come as
    /// counter readings ([`Bucket::try_take_words_counter`]).
    counter: Option<(u64, u64)>,
}

impl Bucket {
    /// A full bucket at `rate` counting from clock time 0 (it rebases on first use
    /// far from 0; [`Bucket::new_at`] avoids that).
    pub fn new(rate: Rate) -> Bucket {
        Bucket::new_at(rate, 0)
    }

    /// A full bucket at `rate` whose epoch suits a clock now showing `now_ns`.
    pub fn new_at(rate: Rate, now_ns: u64) -> Bucket {
        Bucket::new_on(rate, now_ns, None)
    }

    /// [`Bucket::new_at`] on the monotonic clock, whose counter scale (see
    /// [`clock::tsc_scale`]) `counter` is: decisions may then come as counter readings.
    pub(crate) fn new_on(rate: Rate, now_ns: u64, counter: Option<(u64, u64)>) -> Bucket {
        let b = Bucket {
            word: AtomicU64::new(0),
            refunded: AtomicU64::new(0),
            slots: Default::default(),
            change: Mutex::new(()),
            ahead: AtomicU64::new(0),
            given: AtomicU64::new(0),
            counter,
        };
        b.write_slot(0, &rate, epoch_for(now_ns), 0);
        b
    }

    fn write_slot(&self, gen: usize, rate: &Rate, epoch: u64, since_ns: u64) {
        let p = Params::of(rate);
        let s = &self.slots[gen];
        // Counter readings count from the clock's origin: only a slot whose epoch is
        // that origin converts them in one multiply.
        let c = match self.counter {
            Some((origin, mult)) if epoch == 0 => clock::counter_ticks(origin, mult, p.q_ticks, REBASE_NS),
            _ => None,
        };
        let c = c.unwrap_or(CounterTicks { zero: 0, k: 0, span: 0 });
        s.counter_zero.store(c.zero, Ordering::Relaxed);
        s.counter_k.store(c.k, Ordering::Relaxed);
        s.counter_span.store(c.span, Ordering::Relaxed);
        s.unit.store(1 << p.m, Ordering::Relaxed);
        s.gen_bits.store((gen as u64) << GEN_SHIFT, Ordering::Relaxed);
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
        self.try_take_words(at_ns, cost).map(|_| ())
    }

    /// [`Bucket::try_take`], returning the words before and after the debit, so that
    /// [`Bucket::untake_words`] can undo it exactly while nothing came after it.
    #[inline]
    pub fn try_take_words(&self, at_ns: u64, cost: u64) -> Result<(u64, u64), Deny> {
        // Only scalars live across the loop (a `Params` kept there is copied through the
        // stack, and reading it back stalls on store forwarding). The slot's fields are
        // read one by one, each where it is first needed, and the time since the epoch
        // once: it decides the rebase and gives the ticks.
        let w = self.word.load(Ordering::Acquire);
        let s = &self.slots[(w >> GEN_SHIFT) as usize];
        let rel = at_ns.saturating_sub(s.epoch.load(Ordering::Relaxed));
        if rel >= REBASE_NS {
            return self.try_take_words_rebased(at_ns, cost);
        }
        // A cost above the burst: the general path says so (`Deny::TooLarge`).
        if cost > s.burst.load(Ordering::Relaxed) {
            return self.take_words(at_ns, cost);
        }
        // `Params::ticks` for rel < 2^57 (its clamp at 2^62 cannot bite): below 2^59, and
        // `now + tau` below 2^60 - 1 (tau = burst << m < 2^57), so no clamp at TAT_MASK.
        let now = ((rel as u128 * s.q_ticks.load(Ordering::Relaxed) as u128) >> Q_BITS) as u64;
        // Refused, or a generation moved under it: the general path (which says how long
        // until it conforms).
        self.debit(w, s, now, cost, || self.take_words(at_ns, cost))
    }

    /// [`Bucket::try_take_words`] for the monotonic clock's counter reading `raw` (see
    /// [`clock::read_counter`]) on a bucket made with its scale ([`Bucket::new_on`]):
    /// the same decision, with the ticks converted from the counter in one multiply
    /// ([`CounterTicks`]), never later than `try_take_words(monotonic ns of raw)` reads
    /// them. Outside the conversion's span (or on a bucket without it) and on a refusal,
    /// the nanosecond path decides.
    #[inline]
    pub(crate) fn try_take_words_counter(&self, raw: u64, cost: u64) -> Result<(u64, u64), Deny> {
        let w = self.word.load(Ordering::Acquire);
        let s = &self.slots[(w >> GEN_SHIFT) as usize];
        let c = CounterTicks {
            zero: s.counter_zero.load(Ordering::Relaxed),
            k: s.counter_k.load(Ordering::Relaxed),
            span: s.counter_span.load(Ordering::Relaxed),
        };
        let Some(now) = c.ticks(raw) else {
            return self.take_words_counter_far(raw, cost);
        };
        // A cost above the burst: the general path says so (`Deny::TooLarge`).
        if cost > s.burst.load(Ordering::Relaxed) {
            return self.take_words_counter(raw, cost);
        }
        // As in `try_take_words`: within the span the clock shows under 2^57 ns past the
        // epoch, so `now` is below 2^59 and `now + tau` below 2^60 - 1.
        self.debit(w, s, now, cost, || self.take_words_counter(raw, cost))
    }

    /// The debit of the fast paths, on the word `w` read with its slot `s`: the word (or
    /// a later one of the same generation) moves to max(TAT, now) + cost·2^m if that is
    /// at most now + tau; `general` decides otherwise (a refusal, or a generation moved
    /// under it). A lost CAS retries out of line ([`Bucket::debit_retry`]).
    ///
    /// Requires `cost <= burst` and `now + tau <= TAT_MASK`. The arithmetic is on whole
    /// words, the generation on top: `now` and the limit carry the slot's generation
    /// bits, so max(word, now) is max(TAT, now) under the same generation; an admitted
    /// word is at most that generation's bits + TAT_MASK, and no sum wraps: a word is
    /// below 15·2^60 (the top generation value is never used, see [`GENS`]) and the
    /// debit cost·2^m ≤ tau below 2^57.
    #[inline(always)]
    fn debit(
        &self,
        w: u64,
        s: &Slot,
        now: u64,
        cost: u64,
        general: impl Fn() -> Result<(u64, u64), Deny>,
    ) -> Result<(u64, u64), Deny> {
        debug_assert!(now + s.tau.load(Ordering::Relaxed) <= TAT_MASK);
        debug_assert!(cost <= s.burst.load(Ordering::Relaxed));
        debug_assert_eq!(w & !TAT_MASK, s.gen_bits.load(Ordering::Relaxed));
        debug_assert!(w >> GEN_SHIFT < GENS as u64);
        let add = cost * s.unit.load(Ordering::Relaxed);
        let now = now | s.gen_bits.load(Ordering::Relaxed);
        let limit = now + s.tau.load(Ordering::Relaxed);
        let next = w.max(now) + add;
        if next > limit {
            return general();
        }
        // A take that changes nothing (cost 0, the TAT ahead of now) writes the same
        // word: no test for it on the path of every other take.
        // SeqCst: a fast path reads the queue's waiting count after its take (see
        // `WaitQueue::try_now_token`); with the joiner's fence, one sees the other.
        match self
            .word
            .compare_exchange_weak(w, next, Ordering::SeqCst, Ordering::Acquire)
        {
            Ok(_) => Ok((w, next)),
            Err(seen) => match self.debit_retry(seen, now, add, limit) {
                Some(words) => Ok(words),
                None => general(),
            },
        }
    }

    /// [`Bucket::debit`] after a lost CAS (out of line: the first attempt's path stays
    /// straight): retries from the word `w` the CAS returned, after a pause, while the
    /// generation is unchanged. Some(the words before and after) when it debited; None
    /// when the general path must decide (a refusal, or another generation).
    #[cold]
    #[inline(never)]
    fn debit_retry(&self, mut w: u64, now: u64, add: u64, limit: u64) -> Option<(u64, u64)> {
        let mut spins = 0u32;
        loop {
            if (w ^ now) >> GEN_SHIFT != 0 {
                return None;
            }
            backoff(&mut spins);
            let next = w.max(now) + add;
            if next > limit {
                return None;
            }
            match self
                .word
                .compare_exchange_weak(w, next, Ordering::SeqCst, Ordering::Acquire)
            {
                Ok(_) => return Some((w, next)),
                Err(seen) => w = seen,
            }
        }
    }

    /// The general decision of [`Bucket::try_take_words`] (a refusal, or a generation
    /// moved under it), out of line so that the fast path stays small enough to inline.
    #[inline(never)]
    fn take_words(&self, at_ns: u64, cost: u64) -> Result<(u64, u64), Deny> {
        self.take(at_ns, cost, 0).map(|t| (t.before, t.after))
    }

    /// [`Bucket::take_words`] at the counter reading `raw`, in nanoseconds.
    #[inline(never)]
    fn take_words_counter(&self, raw: u64, cost: u64) -> Result<(u64, u64), Deny> {
        self.take(self.counter_ns(raw), cost, 0).map(|t| (t.before, t.after))
    }

    /// The monotonic clock's nanoseconds at the counter reading `raw` (as
    /// [`clock::counter_ns`], from the scale the bucket keeps).
    #[inline]
    pub(crate) fn counter_ns(&self, raw: u64) -> u64 {
        match self.counter {
            Some((origin, mult)) => clock::scale_to_ns(raw.saturating_sub(origin), mult),
            None => clock::counter_ns(raw),
        }
    }

    /// [`Bucket::try_take_words_counter`] outside the one-multiply span: the
    /// nanosecond path.
    #[cold]
    #[inline(never)]
    fn take_words_counter_far(&self, raw: u64, cost: u64) -> Result<(u64, u64), Deny> {
        self.try_take_words(self.counter_ns(raw), cost)
    }

    /// [`Bucket::try_take_words`] for a decision far past the epoch: rebased first (see
    /// [`Bucket::rebase`]), then the same rule with the clamps a time up to 2^58 ns past
    /// the epoch needs.
    #[cold]
    #[inline(never)]
    fn try_take_words_rebased(&self, at_ns: u64, cost: u64) -> Result<(u64, u64), Deny> {
        let (mut w, p) = self.load_at(at_ns);
        if cost > p.burst {
            return Err(Deny::TooLarge {
                cost,
                burst: p.burst,
                unit: 0,
            });
        }
        // Below 2^60 each (cost <= burst, and tau = burst << m < 2^57).
        let now = p.ticks(at_ns);
        let (add, limit) = (cost << p.m, (now + p.tau).min(TAT_MASK));
        let gen = w & !TAT_MASK;
        loop {
            let new = (w & TAT_MASK).max(now) + add;
            if new > limit {
                return self.take(at_ns, cost, 0).map(|t| (t.before, t.after));
            }
            let next = gen | new;
            if next == w {
                return Ok((w, w));
            }
            match self
                .word
                .compare_exchange_weak(w, next, Ordering::SeqCst, Ordering::Acquire)
            {
                Ok(_) => return Ok((w, next)),
                Err(seen) if seen & !TAT_MASK == gen => w = seen,
                Err(_) => return self.take(at_ns, cost, 0).map(|t| (t.before, t.after)),
            }
        }
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
                .compare_exchange_weak(w, next, Ordering::SeqCst, Ordering::Acquire)
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
        SimBucket::new(w & TAT_MASK, p)
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
