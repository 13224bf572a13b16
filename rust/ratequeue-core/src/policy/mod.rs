//! Multi-level policies: one request passes several limits at once (user quota →
//! tenant concurrency → cluster bucket), all or nothing. Rate levels are debited at one
//! common grant time (the latest any of them needs); a *shadow* level is evaluated and
//! debited like the others but its refusals are only counted, never enforced.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::bucket::Deny;
use crate::concurrency::Semaphore;
use crate::error::Error;
use crate::keyed::{KeyTaken, KeyedLimiter, KeyedSemaphore};
use crate::limiter::{Limiter, Reservation};
use crate::wait::{Cancelled, GrantRef, Joined, Outcome, QueuedReservation, Reserved, Resource, WaitQueue};

mod acquire;
mod awaited;
#[cfg(test)]
mod tests;

pub use acquire::{PolicyAcquire, Step};
pub use awaited::Finished;

/// What one level limits.
#[derive(Clone)]
pub enum LevelKind {
    /// A shared limiter (costs per its units).
    Rate(Arc<Limiter>),
    /// One bucket per key.
    KeyedRate(Arc<KeyedLimiter>),
    /// A shared concurrency limit.
    Concurrency(Arc<Semaphore>),
    /// A concurrency limit per key.
    KeyedConcurrency(Arc<KeyedSemaphore>),
}

/// Wakes the queue of a level (the argument: the key, for keyed levels) after capacity
/// came back to it, so its waiters are granted now rather than at their deadline.
pub type Waker = Arc<dyn Fn(u64) + Send + Sync>;

/// A level's wait queue, kept alive (with whatever owns it) while held.
#[derive(Clone)]
pub struct QueueRef {
    /// The queue.
    pub queue: Arc<WaitQueue>,
    /// What must stay alive while the queue is used (e.g. a key's entry in a map).
    pub keep: Option<Arc<dyn std::any::Any + Send + Sync>>,
}

impl QueueRef {
    /// A queue that owns itself.
    pub fn new(queue: Arc<WaitQueue>) -> QueueRef {
        QueueRef { queue, keep: None }
    }
}

/// Where a level's waiters queue (the argument: the key, for keyed levels).
pub trait LevelQueues: Send + Sync {
    /// The queue waiters of `key` use now, if it has one (a keyed level makes a queue
    /// only for a key that has waiters; without one, nobody waits there).
    fn existing(&self, key: u64) -> Option<QueueRef>;
    /// The queue to wait in for `key`, made if needed (None: the level has none).
    fn queue(&self, key: u64) -> Option<QueueRef> {
        self.existing(key)
    }
    /// A wait in `key`'s queue ended and its [`QueueRef`] was dropped: the level may
    /// drop a queue nobody uses any more.
    fn done(&self, _key: u64) {}
    /// Settles a debit on `key` through its queue ([`WaitQueue::settle_by`]): an overage
    /// is decided under a lock that orders it with every wait joining that queue. By
    /// default through [`LevelQueues::queue`]; a level whose queues are made on demand
    /// decides it under its own lock when the key has none. Returns what `debit`
    /// returned and what the debit owes now.
    fn settle_by(
        &self,
        key: u64,
        estimated: &[u64],
        actual: &[u64],
        owed: Option<u64>,
        debit: &mut dyn FnMut(&[u64], &[u64]) -> bool,
    ) -> (bool, Option<u64>) {
        let Some(q) = self.queue(key) else {
            return (debit(estimated, actual), None);
        };
        let out = q.queue.settle_by(estimated, actual, owed, debit);
        drop(q);
        self.done(key);
        out
    }
}

/// A named level of a policy.
#[derive(Clone)]
pub struct Level {
    /// Its name (in errors and stats).
    pub name: String,
    /// What it limits.
    pub kind: LevelKind,
    /// Evaluate and count, but never refuse.
    pub shadow: bool,
    /// Called whenever this policy gives capacity back to the level.
    pub wake: Option<Waker>,
    /// The level's wait queues: a policy's wait joins them behind their waiters (None:
    /// nobody ever waits on this level but through the policy).
    pub queues: Option<Arc<dyn LevelQueues>>,
}

impl Level {
    /// True for a concurrency level (shared or keyed).
    pub fn is_concurrency(&self) -> bool {
        matches!(self.kind, LevelKind::Concurrency(_) | LevelKind::KeyedConcurrency(_))
    }
}

/// One request's view of a level: its key (keyed levels) and costs.
#[derive(Clone, Debug, Default)]
pub struct LevelArgs {
    /// The hashed key (ignored by unkeyed levels).
    pub key: u64,
    /// Costs: per unit for `Rate`, `[cost]` for `KeyedRate`, `[permits]` for concurrency.
    pub costs: Vec<u64>,
}

/// A debit on one level that can be taken back.
#[derive(Clone, Debug)]
pub enum Held {
    /// Rate capacity (refundable only by undo or settle).
    Rate(Reservation),
    /// A keyed bucket debit.
    KeyedRate(KeyTaken),
    /// Shared permits.
    Permits(u64),
    /// Permits on a key.
    KeyedPermits(u64, u64),
    /// A reservation queued behind the level's waiters, debited by its queue at the
    /// policy's grant time.
    Queued(Box<QueuedHold>),
    /// A shadow level that would have refused: nothing held.
    Nothing,
}

impl Held {
    /// The ticket of an overage this debit still owes in its level's queue.
    fn owed(&self) -> Option<u64> {
        match self {
            Held::Rate(r) => r.owed,
            Held::KeyedRate(t) => t.owed,
            _ => None,
        }
    }

    fn set_owed(&mut self, owed: Option<u64>) {
        match self {
            Held::Rate(r) => r.owed = owed,
            Held::KeyedRate(t) => t.owed = owed,
            _ => {}
        }
    }
}

/// A policy's reservation in one level's queue (see [`Policy::reserve_queued`]).
#[derive(Clone)]
pub struct QueuedHold {
    queue: QueueRef,
    r: QueuedReservation,
    /// The costs held: what the queue debits at the grant, plus what a settle before
    /// the grant charged more (a settle before the grant only charges more).
    costs: Vec<u64>,
    /// The grant once seen, as settles left it.
    grant: Option<GrantRef>,
    /// The ticket of an overage settled before the grant and still owed in the queue.
    owed: Option<u64>,
    /// True once a settle before the grant charged more: the grant's debit is then not
    /// all it holds, and its token no exact undo.
    over: bool,
}

impl std::fmt::Debug for QueuedHold {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QueuedHold")
            .field("r", &self.r)
            .field("costs", &self.costs)
            .field("grant", &self.grant)
            .field("owed", &self.owed)
            .field("over", &self.over)
            .finish()
    }
}

impl QueuedHold {
    /// The grant, once the queue made it.
    fn grant(&self) -> Option<GrantRef> {
        self.grant.or_else(|| match self.r.outcome() {
            Some(Outcome::Granted { at_ns, token, .. }) => Some(GrantRef {
                at_ns,
                token: (!self.over).then_some(token),
                owed: self.owed,
            }),
            _ => None,
        })
    }

    /// The one undo rule for a queued reservation: before its grant it leaves the queue
    /// (nothing was debited, the waiters behind move up); once granted — at its time,
    /// which the holder may have used — it is kept. True when it left the queue.
    fn undo(&self) -> bool {
        let left = self.queue.queue.cancel(self.r.ticket) == Cancelled::Removed;
        if let Some(t) = self.owed.filter(|_| left) {
            // Never granted: nothing of it was used, the overage settled before either.
            self.queue.queue.cancel_owed(t);
        }
        left
    }

    /// Settles to `actual`: once granted by the one undo rule on the grant; before, in
    /// the queue (what it owes cancelled first, then what its grant will debit lowered;
    /// an overage owed behind the waiters queued now).
    fn settle(&mut self, actual: &[u64]) {
        if self.grant().is_none() {
            let q = &self.queue.queue;
            if let Some(owed) = q.settle_queued(self.r.ticket, &self.costs, actual, self.owed) {
                // What it owes now belongs to the grant: a later settle cancels it first,
                // and settles from these costs (never charging the overage again).
                self.owed = owed;
                self.over |= actual.iter().zip(&self.costs).any(|(a, e)| a > e);
                self.costs = actual.to_vec();
                return;
            }
            // Granted meanwhile: its outcome is in its slot now.
        }
        if let Some(g) = self.grant() {
            self.grant = Some(self.queue.queue.settle(&self.costs, actual, g));
            self.costs = actual.to_vec();
        }
    }
}

/// Why [`Policy::reserve_queued`] refused (nothing held).
#[derive(Clone, Debug, PartialEq)]
pub enum Refused {
    /// A level refused (see [`Refusal`]).
    Level(Refusal),
    /// A level's queue refused (full, or a cost it can never grant).
    Queue {
        /// Index of the level.
        level: usize,
        /// The queue's error.
        error: Error,
    },
}

/// What every level offers a policy — a rate, one key of a keyed rate, a semaphore, one
/// key of a keyed semaphore — so that it composes them without knowing their kind.
pub trait Limit: Send + Sync {
    /// Takes `a` at `at_ns` (no delay), giving a held record; a refusal changes nothing.
    fn take(&self, a: &LevelArgs, at_ns: u64) -> Result<Held, Deny>;
    /// Gives back everything `held` holds at `now_ns` by the one undo rule (rates: exact
    /// while latest, else refunded while no grant is scheduled ahead, else kept; permits:
    /// released). True when capacity came back.
    fn undo(&self, held: &mut Held, now_ns: u64) -> bool;
    /// Settles `held` from `estimated` to `actual` costs by the same rule (overage
    /// charged, possibly into debt). True when capacity came back.
    fn settle(&self, _held: &mut Held, _estimated: &[u64], _actual: &[u64], _now_ns: u64) -> bool {
        false
    }
    /// Returns held permits (a rate keeps its capacity). True when any came back.
    fn release(&self, _held: &mut Held) -> bool {
        false
    }
}

impl Limit for Limiter {
    fn take(&self, a: &LevelArgs, at_ns: u64) -> Result<Held, Deny> {
        self.take_at(at_ns, &a.costs, 0).map(Held::Rate)
    }

    fn undo(&self, held: &mut Held, now_ns: u64) -> bool {
        let Held::Rate(r) = held else { return false };
        self.undo_reservation(r, now_ns) > 0
    }

    fn settle(&self, held: &mut Held, estimated: &[u64], actual: &[u64], now_ns: u64) -> bool {
        let Held::Rate(r) = held else { return false };
        self.settle_reservation(r, estimated, actual, now_ns)
    }
}

impl Limit for KeyedLimiter {
    fn take(&self, a: &LevelArgs, at_ns: u64) -> Result<Held, Deny> {
        self.take_at(a.key, at_ns, a.costs[0]).map(Held::KeyedRate)
    }

    fn undo(&self, held: &mut Held, now_ns: u64) -> bool {
        let Held::KeyedRate(t) = held else { return false };
        let ret = t.cost();
        self.give_back(t, ret, now_ns).gave()
    }

    fn settle(&self, held: &mut Held, estimated: &[u64], actual: &[u64], now_ns: u64) -> bool {
        let Held::KeyedRate(t) = held else { return false };
        let (e, a) = (estimated[0], actual[0]);
        if a > e {
            self.charge_more(t, a - e, now_ns);
        }
        a < e && self.give_back(t, e - a, now_ns).gave()
    }
}

impl Limit for Semaphore {
    fn take(&self, a: &LevelArgs, at_ns: u64) -> Result<Held, Deny> {
        self.try_take(at_ns, &a.costs).map(|_| Held::Permits(a.costs[0]))
    }

    fn undo(&self, held: &mut Held, _now_ns: u64) -> bool {
        Limit::release(self, held)
    }

    fn release(&self, held: &mut Held) -> bool {
        let Held::Permits(n) = *held else { return false };
        self.give_back(&[n], None);
        true
    }
}

impl Limit for KeyedSemaphore {
    fn take(&self, a: &LevelArgs, _at_ns: u64) -> Result<Held, Deny> {
        self.try_take(a.key, a.costs[0])
            .map(|_| Held::KeyedPermits(a.key, a.costs[0]))
    }

    fn undo(&self, held: &mut Held, _now_ns: u64) -> bool {
        Limit::release(self, held)
    }

    fn release(&self, held: &mut Held) -> bool {
        let Held::KeyedPermits(k, n) = *held else { return false };
        KeyedSemaphore::release(self, k, n);
        true
    }
}

impl LevelKind {
    /// The level behind its common interface.
    pub fn limit(&self) -> &dyn Limit {
        match self {
            LevelKind::Rate(l) => &**l,
            LevelKind::KeyedRate(k) => &**k,
            LevelKind::Concurrency(s) => &**s,
            LevelKind::KeyedConcurrency(s) => &**s,
        }
    }
}

/// Counters per level.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LevelCounts {
    /// Times this level refused a request (enforced).
    pub refused: u64,
    /// Times this shadow level would have refused.
    pub shadow_refused: u64,
}

/// Several levels decided together.
pub struct Policy {
    levels: Vec<Level>,
    refused: Vec<AtomicU64>,
    shadow_refused: Vec<AtomicU64>,
    admitted: AtomicU64,
}

/// Why a policy refused: the level and its denial.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    /// Index of the refusing level.
    pub level: usize,
    /// Its denial (Wait(u64::MAX): a concurrency level, until a release).
    pub deny: Deny,
}

impl Policy {
    /// A policy over `levels` (checked in this order).
    pub fn new(levels: Vec<Level>) -> Result<Policy, Error> {
        if levels.is_empty() {
            return Err(Error::invalid("levels", 0, "must hold at least one level"));
        }
        let n = levels.len();
        Ok(Policy {
            levels,
            refused: (0..n).map(|_| AtomicU64::new(0)).collect(),
            shadow_refused: (0..n).map(|_| AtomicU64::new(0)).collect(),
            admitted: AtomicU64::new(0),
        })
    }

    /// The levels.
    pub fn levels(&self) -> &[Level] {
        &self.levels
    }

    /// Requests admitted.
    pub fn admitted(&self) -> u64 {
        self.admitted.load(Ordering::Relaxed)
    }

    /// Counts a refusal by level `i` decided outside the core (e.g. waiters ahead).
    pub fn note_refused(&self, i: usize) {
        self.refused[i].fetch_add(1, Ordering::Relaxed);
    }

    /// Counters of level `i`.
    pub fn counts(&self, i: usize) -> LevelCounts {
        LevelCounts {
            refused: self.refused[i].load(Ordering::Relaxed),
            shadow_refused: self.shadow_refused[i].load(Ordering::Relaxed),
        }
    }

    fn take_level(&self, i: usize, a: &LevelArgs, at_ns: u64) -> Result<Held, Deny> {
        self.levels[i].kind.limit().take(a, at_ns)
    }

    fn wake(&self, i: usize, key: u64) {
        if let Some(w) = &self.levels[i].wake {
            w(key);
        }
    }

    /// Gives back everything `held` holds on level `i` at `now_ns` (a refused attempt, a
    /// cancellation) by the level's one undo rule ([`Limit::undo`]) and wakes the
    /// level's queue if capacity came back. `held` becomes `Nothing`, so a second undo,
    /// release or settle does nothing.
    pub fn undo(&self, i: usize, held: &mut Held, a: &LevelArgs, now_ns: u64) {
        if let Held::Queued(q) = held {
            // The queue grants whoever can go now itself.
            q.undo();
            *held = Held::Nothing;
            return;
        }
        if let Some(t) = held.owed() {
            if let Some(q) = self.queue_of(i, a.key) {
                q.queue.cancel_owed(t);
            }
        }
        let gave = self.levels[i].kind.limit().undo(held, now_ns);
        *held = Held::Nothing;
        if gave {
            self.wake(i, a.key);
        }
    }

    /// Returns the permits `held` on level `i` (concurrency levels; rates keep theirs)
    /// and wakes the level's queue; `held` becomes `Nothing` (released once).
    pub fn release(&self, i: usize, held: &mut Held) {
        let key = match held {
            Held::KeyedPermits(k, _) => *k,
            _ => 0,
        };
        if self.levels[i].kind.limit().release(held) {
            *held = Held::Nothing;
            self.wake(i, key);
        }
    }

    /// Settles `held` from the `args` costs to the `actual` ones at `now_ns` on every
    /// rate level by the one undo rule ([`Limit::settle`]), waking a level's queue when
    /// capacity came back. While requests wait on a level, an overage is charged through
    /// its queue ([`WaitQueue::settle`]) so that it never moves a waiter onto a
    /// reservation's promised time. Levels already given back (`Nothing`) are skipped.
    pub fn settle(&self, held: &mut [Held], args: &[LevelArgs], actual: &[LevelArgs], now_ns: u64) {
        for (i, h) in held.iter_mut().enumerate() {
            match h {
                Held::Queued(q) => {
                    q.settle(&actual[i].costs);
                    continue;
                }
                Held::Nothing => continue,
                _ => {}
            }
            let (est, act) = (&args[i].costs, &actual[i].costs);
            let key = args[i].key;
            let limit = self.levels[i].kind.limit();
            let over = act.iter().zip(est).any(|(a, e)| a > e);
            let owed = h.owed();
            // An overage is decided under a lock of the level's queues, as a permit's
            // (LevelQueues::settle_by): charged on the debit itself unless reservations
            // are promised a time, else owed in the queue behind them (so that it never
            // moves a waiter onto a promised time, even one joining meanwhile), and what
            // it owes is cancelled first by a later settle down.
            let woke = match self.levels[i].queues.as_ref().filter(|_| over || owed.is_some()) {
                None => limit.settle(h, est, act, now_ns),
                Some(qs) => {
                    let (woke, owes) = qs.settle_by(key, est, act, owed, &mut |held, keep| {
                        limit.settle(h, held, keep, now_ns)
                    });
                    h.set_owed(owes);
                    woke
                }
            };
            if woke {
                self.wake(i, key);
            }
        }
    }

    /// Undoes every level, the last taken first: each undo is then exact where levels
    /// share a limiter (the later debit sits on the earlier one).
    pub fn undo_all(&self, held: &mut [Held], args: &[LevelArgs], now_ns: u64) {
        for (i, h) in held.iter_mut().enumerate().rev() {
            self.undo(i, h, &args[i], now_ns);
        }
    }

    /// Takes every level at `at_ns` (no delay), all or nothing. Shadow levels that
    /// would refuse are counted and hold nothing. Enforced refusals are counted when
    /// `count` is set.
    /// `count`: count enforced refusals (a reservation's retries do not); shadow
    /// refusals are counted on every decision that is kept.
    fn take_all(
        &self,
        args: &[LevelArgs],
        now_ns: u64,
        at_ns: u64,
        count: bool,
        rates_only: bool,
    ) -> Result<Vec<Held>, Refusal> {
        let mut shadowed = Vec::new();
        let mut held = Vec::with_capacity(self.levels.len());
        for i in 0..self.levels.len() {
            if rates_only && self.levels[i].is_concurrency() {
                held.push(Held::Nothing);
                continue;
            }
            match self.take_level(i, &args[i], at_ns) {
                Ok(h) => held.push(h),
                Err(d) if self.levels[i].shadow && !matches!(d, Deny::TooLarge { .. }) => {
                    shadowed.push(i);
                    held.push(Held::Nothing);
                }
                Err(d) => {
                    self.undo_all(&mut held, args, now_ns);
                    if count {
                        self.refused[i].fetch_add(1, Ordering::Relaxed);
                    }
                    return Err(Refusal { level: i, deny: d });
                }
            }
        }
        for i in shadowed {
            self.shadow_refused[i].fetch_add(1, Ordering::Relaxed);
        }
        Ok(held)
    }

    /// Admits now on every level or on none.
    /// The caller checked first that nobody waits on any level: a waiter or reservation
    /// that joined a level's queue since (see [`crate::WaitQueue::joined`]) undoes the
    /// takes (the one undo rule) and refuses with `Deny::Wait(0)`, moving no promise.
    pub fn try_acquire(&self, args: &[LevelArgs], now_ns: u64) -> Result<Vec<Held>, Refusal> {
        self.check_costs(args, now_ns)?;
        let mut r = self.take_all(args, now_ns, now_ns, true, false);
        if let Ok(held) = &mut r {
            let joined =
                (0..self.levels.len()).find(|i| self.queue_of(*i, args[*i].key).is_some_and(|q| q.queue.joined()));
            if let Some(level) = joined {
                self.undo_all(held, args, now_ns);
                return Err(Refusal {
                    level,
                    deny: Deny::Wait(0),
                });
            }
        }
        if r.is_ok() {
            self.admitted.fetch_add(1, Ordering::Relaxed);
        }
        r
    }

    /// Admits now on every level or on none, like [`Policy::try_acquire`] but without
    /// counting a refusal (an acquire's fast path: it waits instead). The caller checks
    /// first that nobody waits on any level.
    pub fn try_now(&self, args: &[LevelArgs], now_ns: u64) -> Option<Vec<Held>> {
        self.check_costs(args, now_ns).ok()?;
        let held = self.take_all(args, now_ns, now_ns, false, false).ok()?;
        self.admitted.fetch_add(1, Ordering::Relaxed);
        Some(held)
    }

    /// A cost above any level's burst (or limit) can never be admitted: refused as
    /// such, whatever the other levels' state.
    fn check_costs(&self, args: &[LevelArgs], now_ns: u64) -> Result<(), Refusal> {
        for (i, l) in self.levels.iter().enumerate() {
            let too_large = |cost: u64, burst: u64| Refusal {
                level: i,
                deny: Deny::TooLarge { cost, burst, unit: 0 },
            };
            match &l.kind {
                LevelKind::Rate(r) => {
                    if let Err(d @ Deny::TooLarge { .. }) = r.delay_at(now_ns, &args[i].costs) {
                        return Err(Refusal { level: i, deny: d });
                    }
                }
                LevelKind::KeyedRate(k) if args[i].costs[0] > k.rate().burst => {
                    return Err(too_large(args[i].costs[0], k.rate().burst));
                }
                LevelKind::Concurrency(s) if args[i].costs[0] > s.limit() => {
                    return Err(too_large(args[i].costs[0], s.limit()));
                }
                LevelKind::KeyedConcurrency(s) if args[i].costs[0] > s.limit() => {
                    return Err(too_large(args[i].costs[0], s.limit()));
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// The latest delay any enforced rate level needs from `now_ns` (concurrency
    /// levels are not waited on here).
    pub fn rate_delay(&self, args: &[LevelArgs], now_ns: u64) -> Result<u64, Refusal> {
        let mut wait = 0;
        for (i, l) in self.levels.iter().enumerate() {
            let d = match &l.kind {
                LevelKind::Rate(r) => r.delay_at(now_ns, &args[i].costs),
                LevelKind::KeyedRate(k) => k.delay_for(args[i].key, now_ns, args[i].costs[0]),
                _ => Ok(0),
            };
            match d {
                Ok(d) if !l.shadow => wait = wait.max(d),
                Ok(_) => {}
                Err(d @ Deny::TooLarge { .. }) => return Err(Refusal { level: i, deny: d }),
                Err(_) => {}
            }
        }
        Ok(wait)
    }

    /// Reserves every level for one grant at the latest time any rate level needs,
    /// refusing (nothing held) if that is more than `max_wait_ns` away. Concurrency
    /// levels must be free at once, or with `rates_only` are left to the caller (who
    /// waited for them in their queues first). Returns the delay and what is held.
    pub fn reserve(
        &self,
        args: &[LevelArgs],
        now_ns: u64,
        max_wait_ns: u64,
        rates_only: bool,
    ) -> Result<(u64, Vec<Held>), Refusal> {
        // A level refused at the common time needs at least its wait more (another
        // caller took capacity, or levels share a limiter and stack on each other).
        let mut floor = 0u64;
        for _ in 0..64 {
            let delay = self.rate_delay(args, now_ns)?.max(floor);
            if delay > max_wait_ns {
                let level = self.slowest(args, now_ns).unwrap_or(0);
                self.refused[level].fetch_add(1, Ordering::Relaxed);
                return Err(Refusal {
                    level,
                    deny: Deny::Wait(delay),
                });
            }
            match self.take_all(args, now_ns, now_ns.saturating_add(delay), false, rates_only) {
                Ok(held) => {
                    self.admitted.fetch_add(1, Ordering::Relaxed);
                    return Ok((delay, held));
                }
                // Another caller took rate capacity in between: decide again.
                Err(Refusal {
                    deny: Deny::Wait(d),
                    level,
                }) if matches!(self.levels[level].kind, LevelKind::Rate(_) | LevelKind::KeyedRate(_)) => {
                    floor = delay.saturating_add(d.max(1));
                }
                Err(r) => {
                    self.refused[r.level].fetch_add(1, Ordering::Relaxed);
                    return Err(r);
                }
            }
        }
        Err(Refusal {
            level: 0,
            deny: Deny::Wait(u64::MAX),
        })
    }

    /// The queue of level `i` for `key`, if the level has queues and the key one now.
    fn queue_of(&self, i: usize, key: u64) -> Option<QueueRef> {
        self.levels[i].queues.as_ref().and_then(|q| q.existing(key))
    }

    /// The earliest time level `i` (a rate) could grant `a` behind its queued waiters
    /// and reservations, read at `now_ns`.
    fn level_ready_at(&self, i: usize, a: &LevelArgs, now_ns: u64) -> Result<u64, Deny> {
        if let Some(q) = self.queue_of(i, a.key) {
            if q.queue.waiting() != 0 {
                if let Some(t) = q.queue.backlog_ready_at(&a.costs)? {
                    return Ok(t.max(now_ns));
                }
            }
        }
        let d = match &self.levels[i].kind {
            LevelKind::Rate(r) => r.delay_at(now_ns, &a.costs)?,
            LevelKind::KeyedRate(k) => k.delay_for(a.key, now_ns, a.costs[0])?,
            _ => 0,
        };
        Ok(now_ns.saturating_add(d))
    }

    /// Holds every rate level for one grant at a common time without passing anyone:
    /// on a level where requests wait (or reservations are promised), a reservation
    /// joins its queue behind them and the queue debits it at that time; elsewhere the
    /// level is debited for that time at once. The time is the latest any enforced
    /// rate level needs behind its own queue; beyond `max_wait_ns` refused, holding
    /// nothing. Concurrency levels are the caller's (it waited in their queues first).
    /// Returns the delay and what is held; [`Policy::undo_all`] gives it all back (a
    /// queued reservation leaves its queue before its time and is kept after it).
    pub fn reserve_queued(
        &self,
        args: &[LevelArgs],
        now_ns: u64,
        max_wait_ns: u64,
    ) -> Result<(u64, Vec<Held>), Refused> {
        self.check_costs(args, now_ns).map_err(Refused::Level)?;
        let mut floor = now_ns;
        for _ in 0..64 {
            let mut at = floor;
            let mut slowest = 0;
            for (i, l) in self.levels.iter().enumerate() {
                if l.shadow || l.is_concurrency() {
                    continue;
                }
                match self.level_ready_at(i, &args[i], now_ns) {
                    Ok(t) if t > at => (at, slowest) = (t, i),
                    Ok(_) => {}
                    Err(deny) => return Err(Refused::Level(Refusal { level: i, deny })),
                }
            }
            let delay = at - now_ns;
            if delay > max_wait_ns {
                self.refused[slowest].fetch_add(1, Ordering::Relaxed);
                return Err(Refused::Level(Refusal {
                    level: slowest,
                    deny: Deny::Wait(delay),
                }));
            }
            match self.hold_all_at(args, now_ns, at) {
                Ok(held) => {
                    self.admitted.fetch_add(1, Ordering::Relaxed);
                    return Ok((delay, held));
                }
                Err(Ok(later)) => floor = later.max(at.saturating_add(1)),
                Err(Err(r)) => {
                    let level = match &r {
                        Refused::Level(x) => x.level,
                        Refused::Queue { level, .. } => *level,
                    };
                    self.refused[level].fetch_add(1, Ordering::Relaxed);
                    return Err(r);
                }
            }
        }
        Err(Refused::Level(Refusal {
            level: 0,
            deny: Deny::Wait(u64::MAX),
        }))
    }

    /// One attempt of [`Policy::reserve_queued`] at `at_ns`: every rate level held for
    /// that time, or nothing held and `Err(Ok(t))`, a later time a level needs.
    fn hold_all_at(&self, args: &[LevelArgs], now_ns: u64, at_ns: u64) -> Result<Vec<Held>, Result<u64, Refused>> {
        let mut held: Vec<Held> = Vec::with_capacity(self.levels.len());
        let mut shadowed = Vec::new();
        for (i, l) in self.levels.iter().enumerate() {
            let a = &args[i];
            let step: Result<Held, Result<u64, Refused>> = if l.is_concurrency() {
                Ok(Held::Nothing)
            } else if l.shadow {
                match self.take_level(i, a, at_ns) {
                    Ok(h) => Ok(h),
                    Err(_) => {
                        shadowed.push(i);
                        Ok(Held::Nothing)
                    }
                }
            } else if let Some(q) = self.queue_of(i, a.key) {
                let limit = l.kind.limit();
                match q.queue.reserve_at(&a.costs, 0, at_ns, |t| limit.take(a, t)) {
                    Ok(Joined::Held(Reserved::Now(h))) => Ok(h),
                    Ok(Joined::Held(Reserved::Queued(r))) => Ok(Held::Queued(Box::new(QueuedHold {
                        queue: q.clone(),
                        r,
                        costs: a.costs.clone(),
                        grant: None,
                        owed: None,
                        over: false,
                    }))),
                    Ok(Joined::Later(t)) => Err(Ok(t)),
                    Err(error) => Err(Err(Refused::Queue { level: i, error })),
                }
            } else {
                match self.take_level(i, a, at_ns) {
                    Ok(h) => Ok(h),
                    Err(Deny::Wait(d)) => Err(Ok(at_ns.saturating_add(d.max(1)))),
                    Err(deny) => Err(Err(Refused::Level(Refusal { level: i, deny }))),
                }
            };
            match step {
                Ok(h) => held.push(h),
                Err(e) => {
                    self.undo_all(&mut held, args, now_ns);
                    return Err(e);
                }
            }
        }
        for i in shadowed {
            self.shadow_refused[i].fetch_add(1, Ordering::Relaxed);
        }
        Ok(held)
    }

    fn slowest(&self, args: &[LevelArgs], now_ns: u64) -> Option<usize> {
        (0..self.levels.len())
            .filter(|i| !self.levels[*i].shadow)
            .max_by_key(|i| match &self.levels[*i].kind {
                LevelKind::Rate(r) => r.delay_at(now_ns, &args[*i].costs).unwrap_or(0),
                LevelKind::KeyedRate(k) => k.delay_for(args[*i].key, now_ns, args[*i].costs[0]).unwrap_or(0),
                _ => 0,
            })
    }
}
