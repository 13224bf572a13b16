//! Multi-level policies: one request passes several limits at once (user quota →
//! tenant concurrency → cluster bucket), all or nothing. Rate levels are debited at one
//! common grant time (the latest any of them needs); a *shadow* level is evaluated and
//! debited like the others but its refusals are only counted, never enforced.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::bucket::Deny;
use crate::clock::AnyClock;
use crate::concurrency::Semaphore;
use crate::error::Error;
use crate::keyed::{KeyTaken, KeyedLimiter, KeyedSemaphore};
use crate::limiter::{Limiter, Reservation};
use crate::queue::{
    Cancelled, GrantRef, Joined, Outcome, QueuedReservation, Reserved, Resource, Slot, Submitted, WaitQueue, Wake,
};

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

/// A policy's reservation in one level's queue (see [`Policy::reserve_queued`]).
#[derive(Clone)]
pub struct QueuedHold {
    queue: QueueRef,
    r: QueuedReservation,
    /// The costs the queue debits (a settle before the grant only charges more).
    costs: Vec<u64>,
    /// The grant once seen, as settles left it.
    grant: Option<GrantRef>,
}

impl std::fmt::Debug for QueuedHold {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QueuedHold")
            .field("r", &self.r)
            .field("costs", &self.costs)
            .field("grant", &self.grant)
            .finish()
    }
}

impl QueuedHold {
    /// The grant, once the queue made it.
    fn grant(&self) -> Option<GrantRef> {
        self.grant.or_else(|| match self.r.outcome() {
            Some(Outcome::Granted { at_ns, token, .. }) => Some(GrantRef {
                at_ns,
                token: Some(token),
            }),
            _ => None,
        })
    }

    /// The one undo rule for a queued reservation: before its grant it leaves the queue
    /// (nothing was debited, the waiters behind move up); once granted — at its time,
    /// which the holder may have used — it is kept. True when it left the queue.
    fn undo(&self) -> bool {
        self.queue.queue.cancel(self.r.ticket) == Cancelled::Removed
    }

    /// Settles to `actual`: once granted by the one undo rule on the grant; before, the
    /// queue debits the estimate when it grants, so only an overage is charged now.
    fn settle(&mut self, actual: &[u64], now_ns: u64) {
        match self.grant() {
            Some(g) => {
                self.grant = Some(self.queue.queue.settle(&self.costs, actual, g));
                self.costs = actual.to_vec();
            }
            None => {
                let up: Vec<u64> = self.costs.iter().zip(actual).map(|(e, a)| *e.max(a)).collect();
                if up != self.costs {
                    let charge = GrantRef {
                        at_ns: now_ns,
                        token: None,
                    };
                    self.queue.queue.settle(&self.costs, &up, charge);
                }
            }
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
        KeyedLimiter::take(self, a.key, at_ns, a.costs[0], 0).map(Held::KeyedRate)
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
    /// rate level ([`Limit::settle`]), waking a level's queue when capacity came back.
    /// Levels already given back (`Nothing`) are skipped.
    pub fn settle(&self, held: &mut [Held], args: &[LevelArgs], actual: &[LevelArgs], now_ns: u64) {
        for (i, h) in held.iter_mut().enumerate() {
            if let Held::Queued(q) = h {
                q.settle(&actual[i].costs, now_ns);
                continue;
            }
            if self.levels[i]
                .kind
                .limit()
                .settle(h, &args[i].costs, &actual[i].costs, now_ns)
            {
                self.wake(i, args[i].key);
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
    pub fn try_acquire(&self, args: &[LevelArgs], now_ns: u64) -> Result<Vec<Held>, Refusal> {
        self.check_costs(args, now_ns)?;
        let r = self.take_all(args, now_ns, now_ns, true, false);
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

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// What [`PolicyAcquire::advance`] reached.
#[derive(Debug)]
pub enum Step {
    /// Waiting in a concurrency level's queue under this ticket; the outcome arrives
    /// through the [`Wake`] given, and goes to [`PolicyAcquire::outcome`].
    Queued(u64),
    /// Every level held: concurrency permits taken, rate levels held for the common
    /// time `delay_ns` from now (see [`Policy::reserve_queued`]).
    Done {
        /// From now until the common grant time of the rate levels.
        delay_ns: u64,
        /// From the start of the acquire until now.
        waited_ns: u64,
        /// What is held, per level (the caller's to release, settle or undo).
        held: Vec<Held>,
    },
}

struct Waiting {
    level: usize,
    queue: QueueRef,
    ticket: u64,
}

struct AcquireState {
    next: usize,
    held: Vec<Held>,
    waiting: Option<Waiting>,
    /// A wait abandoned after its queue decided: its grant, when it arrives, goes back.
    raced: Option<Waiting>,
    done: bool,
}

/// One policy acquire under way: the one lifecycle of a blocking and an asyncio
/// `Policy.acquire`. It waits in the queue of each enforced concurrency level in order
/// (in the level's first class, behind its waiters, like any of them), then holds every
/// rate level for one common time without passing anyone ([`Policy::reserve_queued`]).
/// Whoever waits drives it: [`PolicyAcquire::advance`] starts the next wait or finishes,
/// [`PolicyAcquire::outcome`] takes the outcome of the wait under way, and
/// [`PolicyAcquire::abandon`] gives back everything held, exactly once, when the wait ends
/// any other way (cancellation, interruption, a closed event loop). A refusal or a
/// timeout gives everything back before it is returned.
pub struct PolicyAcquire {
    policy: Arc<Policy>,
    args: Vec<LevelArgs>,
    clock: AnyClock,
    start_ns: u64,
    deadline_ns: Option<u64>,
    st: Mutex<AcquireState>,
}

impl PolicyAcquire {
    /// An acquire of `args` on `policy` starting now on `clock`, within `timeout_ns`.
    pub fn new(policy: Arc<Policy>, args: Vec<LevelArgs>, clock: AnyClock, timeout_ns: Option<u64>) -> PolicyAcquire {
        let start_ns = clock.now_ns();
        let n = policy.levels.len();
        PolicyAcquire {
            policy,
            args,
            clock,
            start_ns,
            deadline_ns: timeout_ns.map(|t| start_ns.saturating_add(t)),
            st: Mutex::new(AcquireState {
                next: 0,
                held: (0..n).map(|_| Held::Nothing).collect(),
                waiting: None,
                raced: None,
                done: false,
            }),
        }
    }

    /// When the acquire started, on its clock.
    pub fn start_ns(&self) -> u64 {
        self.start_ns
    }

    /// The costs and keys it asks for, per level.
    pub fn args(&self) -> &[LevelArgs] {
        &self.args
    }

    fn permits(&self, i: usize) -> Held {
        let a = &self.args[i];
        match self.policy.levels[i].kind {
            LevelKind::KeyedConcurrency(_) => Held::KeyedPermits(a.key, a.costs[0]),
            _ => Held::Permits(a.costs[0]),
        }
    }

    fn level_error(&self, r: Refusal, max_wait_ns: u64) -> Error {
        let name = &self.policy.levels[r.level].name;
        match r.deny {
            Deny::TooLarge { cost, burst, .. } => Error::CostTooLarge {
                unit: format!("(level {name:?})"),
                cost,
                burst,
            },
            Deny::Wait(ns) => Error::Overloaded {
                reason: format!("refused by level {name:?}"),
                retry_after_ns: if ns == u64::MAX {
                    0
                } else {
                    ns.saturating_sub(max_wait_ns)
                },
            },
        }
    }

    /// Ends the wait under way (its queue ref dropped, the level told).
    fn end_wait(&self, w: Waiting) {
        let Waiting { level, queue, .. } = w;
        drop(queue);
        if let Some(qs) = &self.policy.levels[level].queues {
            qs.done(self.args[level].key);
        }
    }

    fn give_back_locked(&self, st: &mut AcquireState) {
        st.done = true;
        self.policy.undo_all(&mut st.held, &self.args, self.clock.now_ns());
    }

    /// Goes as far as it can without waiting: queues in the next enforced concurrency
    /// level that cannot grant at once (`wake` says how its outcome is delivered), or
    /// holds the rate levels and finishes. An error (refused, queue full, timed out)
    /// gives back everything first.
    pub fn advance(&self, wake: &dyn Fn() -> Wake) -> Result<Step, Error> {
        let mut st = lock(&self.st);
        if st.done || st.waiting.is_some() {
            return Err(Error::invalid("acquire", "advance", "is finished or waiting already"));
        }
        if st.next == 0 {
            if let Err(r) = self.policy.check_costs(&self.args, self.start_ns) {
                st.done = true;
                return Err(self.level_error(r, 0));
            }
        }
        let levels = &self.policy.levels;
        while st.next < levels.len() {
            let i = st.next;
            let l = &levels[i];
            if !l.is_concurrency() || l.shadow {
                st.next += 1;
                continue;
            }
            let a = &self.args[i];
            let now = self.clock.now_ns();
            let q = match l.queues.as_ref() {
                Some(qs) => match qs.existing(a.key) {
                    Some(q) => Some(q),
                    // A key nobody waits on: taken now without making it a queue.
                    None => match self.policy.take_level(i, a, now) {
                        Ok(h) => {
                            st.held[i] = h;
                            st.next += 1;
                            continue;
                        }
                        Err(_) => qs.queue(a.key),
                    },
                },
                None => None,
            };
            let Some(q) = q else {
                // A level nobody waits on: taken now or refused.
                match self.policy.take_level(i, a, now) {
                    Ok(h) => {
                        st.held[i] = h;
                        st.next += 1;
                        continue;
                    }
                    Err(deny) => {
                        self.policy.refused[i].fetch_add(1, Ordering::Relaxed);
                        self.give_back_locked(&mut st);
                        return Err(self.level_error(Refusal { level: i, deny }, 0));
                    }
                }
            };
            let timeout = self.deadline_ns.map(|d| d.saturating_sub(now));
            let submitted = q.queue.submit(&a.costs, 0, timeout, wake);
            match submitted {
                Ok(Submitted::Granted { .. }) => {
                    st.held[i] = self.permits(i);
                    st.next += 1;
                    self.end_wait(Waiting {
                        level: i,
                        queue: q,
                        ticket: 0,
                    });
                }
                Ok(Submitted::Queued(ticket)) => {
                    st.waiting = Some(Waiting {
                        level: i,
                        queue: q,
                        ticket,
                    });
                    return Ok(Step::Queued(ticket));
                }
                Err(e) => {
                    self.end_wait(Waiting {
                        level: i,
                        queue: q,
                        ticket: 0,
                    });
                    self.policy.refused[i].fetch_add(1, Ordering::Relaxed);
                    self.give_back_locked(&mut st);
                    return Err(match e {
                        Error::WaitTimeout { retry_after_ns, .. } => Error::WaitTimeout {
                            waited_ns: now.saturating_sub(self.start_ns),
                            retry_after_ns,
                        },
                        e => e,
                    });
                }
            }
        }
        let now = self.clock.now_ns();
        let max_wait = self.deadline_ns.map_or(u64::MAX, |d| d.saturating_sub(now));
        match self.policy.reserve_queued(&self.args, now, max_wait) {
            Ok((delay_ns, rates)) => {
                for (h, r) in st.held.iter_mut().zip(rates) {
                    if !matches!(r, Held::Nothing) {
                        *h = r;
                    }
                }
                st.done = true;
                Ok(Step::Done {
                    delay_ns,
                    waited_ns: now.saturating_sub(self.start_ns),
                    held: std::mem::take(&mut st.held),
                })
            }
            Err(r) => {
                self.give_back_locked(&mut st);
                Err(match r {
                    Refused::Level(r) => self.level_error(r, max_wait),
                    Refused::Queue { error, .. } => error,
                })
            }
        }
    }

    /// The ticket of the wait under way, if any.
    pub fn waiting_ticket(&self) -> Option<u64> {
        lock(&self.st).waiting.as_ref().map(|w| w.ticket)
    }

    /// The outcome of the wait under way: granted, the permits are held and
    /// [`PolicyAcquire::advance`] goes on; timed out, everything is given back and the
    /// error returned. A grant after [`PolicyAcquire::abandon`] is given back.
    pub fn outcome(&self, o: Outcome) -> Result<(), Error> {
        let mut st = lock(&self.st);
        let Some(w) = st.waiting.take() else {
            drop(st);
            if let Outcome::Granted { token, .. } = o {
                self.give_back_late(token);
            }
            return Ok(());
        };
        let level = w.level;
        self.end_wait(w);
        match o {
            Outcome::Granted { .. } => {
                st.held[level] = self.permits(level);
                st.next = level + 1;
                Ok(())
            }
            Outcome::TimedOut { .. } => {
                self.give_back_locked(&mut st);
                let now = self.clock.now_ns();
                Err(Error::WaitTimeout {
                    waited_ns: now.saturating_sub(self.start_ns),
                    retry_after_ns: 0,
                })
            }
        }
    }

    /// Gives back everything held, once: the wait under way leaves its queue (true), or
    /// — its queue decided already (false) — a grant it got goes back through
    /// [`PolicyAcquire::give_back_late`] when it arrives.
    pub fn abandon(&self) -> bool {
        let mut st = lock(&self.st);
        if st.done && st.waiting.is_none() {
            return true;
        }
        let removed = match st.waiting.take() {
            Some(w) if w.queue.queue.cancel(w.ticket) == Cancelled::Removed => {
                self.end_wait(w);
                true
            }
            Some(w) => {
                st.raced = Some(w);
                false
            }
            None => true,
        };
        self.give_back_locked(&mut st);
        removed
    }

    /// Abandons (see [`PolicyAcquire::abandon`]) and gives back the grant `token` of
    /// the wait that was under way, which arrived after its waiter left (once).
    pub fn give_back_late(&self, token: u64) {
        self.abandon();
        let raced = lock(&self.st).raced.take();
        if let Some(w) = raced {
            w.queue.queue.give_back(&self.args[w.level].costs, Some(token));
            self.end_wait(w);
        }
    }

    /// [`PolicyAcquire::abandon`] for a blocked thread whose outcomes go to `slot`: a
    /// grant that raced the abandon is given back at once.
    pub fn abandon_slot(&self, slot: &Slot) {
        if !self.abandon() {
            if let Some(Outcome::Granted { token, .. }) = slot.take() {
                self.give_back_late(token);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{AnyClock, ManualClock, Rate};

    #[test]
    fn all_or_nothing_and_shadow() {
        let clock = Arc::new(ManualClock::new(0).unwrap());
        let c = AnyClock::Manual(clock.clone());
        let user = Arc::new(KeyedLimiter::new(Rate::new(1.0, 1e9, 2).unwrap(), 100, c.clone()).unwrap());
        let tenant = Arc::new(KeyedSemaphore::new(1).unwrap());
        let cluster = Arc::new(
            Limiter::new(
                vec![("requests".into(), Rate::new(100.0, 1e9, 100).unwrap())],
                c.clone(),
            )
            .unwrap(),
        );
        let p = Policy::new(vec![
            Level {
                name: "user".into(),
                kind: LevelKind::KeyedRate(user.clone()),
                shadow: false,
                wake: None,
                queues: None,
            },
            Level {
                name: "tenant".into(),
                kind: LevelKind::KeyedConcurrency(tenant.clone()),
                shadow: false,
                wake: None,
                queues: None,
            },
            Level {
                name: "cluster".into(),
                kind: LevelKind::Rate(cluster.clone()),
                shadow: false,
                wake: None,
                queues: None,
            },
        ])
        .unwrap();
        let u = user.hasher().str("alice");
        let t = tenant.hasher().str("acme");
        let args = vec![
            LevelArgs { key: u, costs: vec![1] },
            LevelArgs { key: t, costs: vec![1] },
            LevelArgs { key: 0, costs: vec![1] },
        ];
        let held = p.try_acquire(&args, 0).unwrap();
        // Tenant concurrency is taken: refused, and the user's debit is undone.
        let r = p.try_acquire(&args, 0).unwrap_err();
        assert_eq!(r.level, 1);
        assert_eq!(user.available(u), 1.0);
        assert_eq!(cluster.available(0), 99.0);
        let mut held = held;
        p.release(1, &mut held[1]);
        assert!(p.try_acquire(&args, 0).is_ok());
        assert_eq!(p.counts(1).refused, 1);
    }

    fn one_level(kind: LevelKind, wake: Option<Waker>) -> Policy {
        Policy::new(vec![Level {
            name: "l".into(),
            kind,
            shadow: false,
            wake,
            queues: None,
        }])
        .unwrap()
    }

    #[test]
    fn cancel_under_a_later_reservation_keeps_the_slot_and_settle_after_it_does_nothing() {
        let clock = Arc::new(ManualClock::new(0).unwrap());
        let lim = Arc::new(
            Limiter::new(
                vec![("requests".into(), Rate::new(1.0, 1e9, 1).unwrap())],
                AnyClock::Manual(clock.clone()),
            )
            .unwrap(),
        );
        let p = one_level(LevelKind::Rate(lim.clone()), None);
        let args = vec![LevelArgs { key: 0, costs: vec![1] }];
        let (d1, mut h1) = p.reserve(&args, 0, u64::MAX, false).unwrap();
        let (d2, _) = p.reserve(&args, 0, u64::MAX, false).unwrap();
        p.undo(0, &mut h1[0], &args[0], 0);
        let (d3, _) = p.reserve(&args, 0, u64::MAX, false).unwrap();
        assert_eq!((d1, d2, d3), (0, 1_000_000_000, 2_000_000_000));
        let zero = vec![LevelArgs { key: 0, costs: vec![0] }];
        p.settle(&mut h1, &args, &zero, 0);
        p.undo(0, &mut h1[0], &args[0], 0);
        assert_eq!(lim.refunds_dropped(), 1);
        assert_eq!(lim.delay_at(0, &[1]).unwrap(), 3_000_000_000);
    }

    #[test]
    fn release_wakes_the_level_queue() {
        use crate::queue::{Outcome, QueueConfig, Slot, Submitted, WaitQueue, Wake};
        let clock = AnyClock::Manual(Arc::new(ManualClock::new(0).unwrap()));
        let sem = Arc::new(Semaphore::new(1).unwrap());
        let q = WaitQueue::new(sem.clone(), 1, clock, QueueConfig::new(vec![], 10, None).unwrap());
        let q2 = q.clone();
        let wake: Waker = Arc::new(move |_| {
            q2.poll_now();
        });
        let p = one_level(LevelKind::Concurrency(sem.clone()), Some(wake));
        let args = vec![LevelArgs { key: 0, costs: vec![1] }];
        let mut held = p.try_acquire(&args, 0).unwrap();
        let slot = Slot::new();
        let s2 = slot.clone();
        let sub = q.submit(&[1], 0, None, || Wake::Thread(s2)).unwrap();
        assert!(matches!(sub, Submitted::Queued(_)));
        p.release(0, &mut held[0]);
        assert!(matches!(slot.take(), Some(Outcome::Granted { .. })));
        assert_eq!(sem.in_use(), 1);
        p.release(0, &mut held[0]); // released once
        assert_eq!(sem.in_use(), 1);
    }

    // ---------------------------------------------------------------------------------
    // a policy's wait joins its rate levels' queues (issue 10)

    use crate::queue::{QueueConfig, Slot, Submitted, Wake};

    const MS: u64 = 1_000_000;

    struct Queues(Arc<WaitQueue>);

    impl LevelQueues for Queues {
        fn existing(&self, _key: u64) -> Option<QueueRef> {
            Some(QueueRef::new(self.0.clone()))
        }
    }

    /// A Limiter of `per_sec` with `burst` and its queue, on `clock`.
    fn queued_limiter(clock: &Arc<ManualClock>, per_sec: f64, burst: u64) -> (Arc<Limiter>, Arc<WaitQueue>) {
        let lim = Arc::new(
            Limiter::new(
                vec![("requests".into(), Rate::new(per_sec, 1e9, burst).unwrap())],
                AnyClock::Manual(clock.clone()),
            )
            .unwrap(),
        );
        let q = WaitQueue::new(
            lim.clone(),
            1,
            AnyClock::Manual(clock.clone()),
            QueueConfig::new(vec![], 100, None).unwrap(),
        );
        (lim, q)
    }

    fn rate_level(name: &str, lim: &Arc<Limiter>, q: &Arc<WaitQueue>) -> Level {
        Level {
            name: name.into(),
            kind: LevelKind::Rate(lim.clone()),
            shadow: false,
            wake: None,
            queues: Some(Arc::new(Queues(q.clone()))),
        }
    }

    fn waiter(q: &Arc<WaitQueue>) -> Arc<Slot> {
        let s = Slot::new();
        let s2 = s.clone();
        assert!(matches!(
            q.submit(&[1], 0, None, || Wake::Thread(s2)).unwrap(),
            Submitted::Queued(_)
        ));
        s
    }

    fn granted(s: &Slot) -> Option<u64> {
        match s.take() {
            Some(Outcome::Granted { at_ns, .. }) => Some(at_ns),
            _ => None,
        }
    }

    /// Rate(10, burst 1) used at 0, a waiter due at 0.1 s and a reservation promised at
    /// 0.2 s queued.
    fn backlogged() -> (
        Arc<ManualClock>,
        Arc<Limiter>,
        Arc<WaitQueue>,
        Arc<Slot>,
        QueuedReservation,
    ) {
        let clock = Arc::new(ManualClock::new(0).unwrap());
        let (lim, q) = queued_limiter(&clock, 10.0, 1);
        lim.try_acquire(&[1]).unwrap();
        let w = waiter(&q);
        let l = lim.clone();
        let Ok(Reserved::Queued(r)) = q.reserve(&[1], 0, None, move |_| l.reserve(&[1], None)) else {
            panic!("queued")
        };
        assert_eq!(r.at_ns, 200 * MS);
        (clock, lim, q, w, r)
    }

    fn one() -> Vec<LevelArgs> {
        vec![LevelArgs { key: 0, costs: vec![1] }]
    }

    #[test]
    fn a_policy_waits_behind_a_levels_waiter_and_promised_reservation() {
        let (clock, lim, q, w, r) = backlogged();
        let p = Policy::new(vec![rate_level("l", &lim, &q)]).unwrap();
        let (delay, held) = p.reserve_queued(&one(), 0, u64::MAX).unwrap();
        assert_eq!(delay, 300 * MS, "behind the waiter (0.1 s) and the reservation (0.2 s)");
        assert!(matches!(held[0], Held::Queued(_)));
        let behind = waiter(&q);
        q.run_until(&clock, 1_000 * MS).unwrap();
        assert_eq!(granted(&w), Some(100 * MS));
        assert!(matches!(r.outcome(), Some(Outcome::Granted { at_ns, .. }) if at_ns == 200 * MS));
        let Held::Queued(h) = &held[0] else { unreachable!() };
        assert_eq!(h.grant().map(|g| g.at_ns), Some(300 * MS));
        assert_eq!(granted(&behind), Some(400 * MS));
    }

    #[test]
    fn an_idle_level_is_debited_at_once_for_the_common_time() {
        let clock = Arc::new(ManualClock::new(0).unwrap());
        let (busy, bq) = queued_limiter(&clock, 10.0, 1);
        let (idle, iq) = queued_limiter(&clock, 1.0, 2);
        busy.try_acquire(&[1]).unwrap();
        let w = waiter(&bq);
        let p = Policy::new(vec![rate_level("idle", &idle, &iq), rate_level("busy", &busy, &bq)]).unwrap();
        let args = vec![
            LevelArgs { key: 0, costs: vec![1] },
            LevelArgs { key: 0, costs: vec![1] },
        ];
        let (delay, held) = p.reserve_queued(&args, 0, u64::MAX).unwrap();
        assert_eq!(delay, 200 * MS);
        assert!(matches!(held[0], Held::Rate(_)), "nobody waits there: debited at once");
        assert!(matches!(held[1], Held::Queued(_)));
        assert_eq!(idle.delay_at(200 * MS, &[1]).unwrap(), 0);
        assert!(idle.delay_at(200 * MS, &[2]).unwrap() > 0, "one unit held for 0.2 s");
        q_run(&bq, &clock, 1_000 * MS);
        assert_eq!(granted(&w), Some(100 * MS));
    }

    fn q_run(q: &Arc<WaitQueue>, clock: &ManualClock, until: u64) {
        q.run_until(clock, until).unwrap();
    }

    #[test]
    fn a_later_level_moves_the_common_time_and_nothing_is_left_behind() {
        let clock = Arc::new(ManualClock::new(0).unwrap());
        let (busy, bq) = queued_limiter(&clock, 10.0, 1);
        let (slow, sq) = queued_limiter(&clock, 1.0, 1);
        busy.try_acquire(&[1]).unwrap();
        slow.try_acquire(&[1]).unwrap();
        let w = waiter(&bq);
        let p = Policy::new(vec![rate_level("busy", &busy, &bq), rate_level("slow", &slow, &sq)]).unwrap();
        let args = vec![
            LevelArgs { key: 0, costs: vec![1] },
            LevelArgs { key: 0, costs: vec![1] },
        ];
        let (delay, held) = p.reserve_queued(&args, 0, u64::MAX).unwrap();
        assert_eq!(delay, 1_000 * MS, "the slow level's time");
        let Held::Queued(h) = &held[0] else {
            panic!("queued behind the waiter")
        };
        assert_eq!(h.r.at_ns, 1_000 * MS);
        assert_eq!(bq.waiting(), 2);
        q_run(&bq, &clock, 2_000 * MS);
        assert_eq!(granted(&w), Some(100 * MS));
        assert_eq!(h.grant().map(|g| g.at_ns), Some(1_000 * MS));
    }

    #[test]
    fn beyond_max_wait_nothing_is_held() {
        let (clock, lim, q, w, _r) = backlogged();
        let p = Policy::new(vec![rate_level("l", &lim, &q)]).unwrap();
        let Err(Refused::Level(r)) = p.reserve_queued(&one(), 0, 250 * MS) else {
            panic!("refused")
        };
        assert_eq!(r.deny, Deny::Wait(300 * MS));
        assert_eq!(q.waiting(), 2);
        assert_eq!(p.counts(0).refused, 1);
        q_run(&q, &clock, 1_000 * MS);
        assert_eq!(granted(&w), Some(100 * MS));
        assert!(lim.try_acquire(&[1]).is_ok());
    }

    #[test]
    fn undo_before_the_time_leaves_the_queue_and_after_it_keeps_the_slot() {
        let (clock, lim, q, _w, _r) = backlogged();
        let p = Policy::new(vec![rate_level("l", &lim, &q)]).unwrap();
        let (_, mut held) = p.reserve_queued(&one(), 0, u64::MAX).unwrap();
        let behind = waiter(&q);
        p.undo_all(&mut held, &one(), 0);
        p.undo_all(&mut held, &one(), 0); // once
        q_run(&q, &clock, 1_000 * MS);
        assert_eq!(granted(&behind), Some(300 * MS), "moved up into the policy's slot");

        let (delay, mut held) = p.reserve_queued(&one(), clock.now_ns(), u64::MAX).unwrap();
        assert_eq!(delay, 0, "idle: debited at once");
        let now = clock.now_ns();
        p.undo_all(&mut held, &one(), now);
        assert!(lim.try_acquire(&[1]).is_ok(), "exact undo of the latest debit");

        let (clock, lim, q, _w, _r) = backlogged();
        let p = Policy::new(vec![rate_level("l", &lim, &q)]).unwrap();
        let (_, mut held) = p.reserve_queued(&one(), 0, u64::MAX).unwrap();
        q_run(&q, &clock, 300 * MS);
        p.undo_all(&mut held, &one(), 300 * MS);
        assert_eq!(
            lim.delay_at(300 * MS, &[1]).unwrap(),
            100 * MS,
            "kept: granted at its time"
        );
    }

    #[test]
    fn settle_charges_before_the_grant_and_refunds_after_it() {
        let clock = Arc::new(ManualClock::new(0).unwrap());
        let (lim, q) = queued_limiter(&clock, 10.0, 5);
        lim.try_acquire(&[5]).unwrap();
        let _w = waiter(&q);
        let p = Policy::new(vec![rate_level("l", &lim, &q)]).unwrap();
        let est = vec![LevelArgs { key: 0, costs: vec![3] }];
        let (delay, mut held) = p.reserve_queued(&est, 0, u64::MAX).unwrap();
        assert_eq!(delay, 400 * MS);
        let less = vec![LevelArgs { key: 0, costs: vec![1] }];
        p.settle(&mut held, &est, &less, 0);
        q_run(&q, &clock, 400 * MS);
        assert_eq!(
            lim.delay_at(400 * MS, &[1]).unwrap(),
            100 * MS,
            "no refund before the grant"
        );
        p.settle(&mut held, &est, &less, 400 * MS);
        assert_eq!(lim.delay_at(400 * MS, &[2]).unwrap(), 0, "refunded once granted");
    }

    // ---------------------------------------------------------------------------------
    // the one policy acquire lifecycle (PolicyAcquire)

    fn sem_level(clock: &Arc<ManualClock>, limit: u64) -> (Level, Arc<Semaphore>, Arc<WaitQueue>) {
        let sem = Arc::new(Semaphore::new(limit).unwrap());
        let q = WaitQueue::new(
            sem.clone(),
            1,
            AnyClock::Manual(clock.clone()),
            QueueConfig::new(vec![], 100, None).unwrap(),
        );
        let q2 = q.clone();
        let wake: Waker = Arc::new(move |_| {
            q2.poll_now();
        });
        let level = Level {
            name: "slots".into(),
            kind: LevelKind::Concurrency(sem.clone()),
            shadow: false,
            wake: Some(wake),
            queues: Some(Arc::new(Queues(q.clone()))),
        };
        (level, sem, q)
    }

    fn thread_wake(slot: &Arc<Slot>) -> impl Fn() -> Wake + '_ {
        move || Wake::Thread(slot.clone())
    }

    #[test]
    fn an_acquire_waits_in_the_concurrency_queue_behind_its_waiter_then_holds_the_rate() {
        let (clock, lim, lq, w, _r) = backlogged();
        let (slots, sem, sq) = sem_level(&clock, 1);
        let p = Arc::new(Policy::new(vec![slots, rate_level("api", &lim, &lq)]).unwrap());
        let args = vec![
            LevelArgs { key: 0, costs: vec![1] },
            LevelArgs { key: 0, costs: vec![1] },
        ];
        // A holder and a plain waiter on the semaphore before the policy.
        sq.try_now(&[1], 0).unwrap();
        let first = waiter(&sq);
        let acq = PolicyAcquire::new(p.clone(), args.clone(), AnyClock::Manual(clock.clone()), None);
        let slot = Slot::new();
        let Step::Queued(_) = acq.advance(&thread_wake(&slot)).unwrap() else {
            panic!("the semaphore is taken")
        };
        sq.give_back(&[1], None); // the holder leaves: the plain waiter goes first
        assert_eq!(granted(&first), Some(0));
        assert!(slot.take().is_none(), "FIFO: the policy is behind the waiter");
        clock.advance(50 * MS).unwrap();
        sq.give_back(&[1], None);
        let o = slot.take().expect("granted when the waiter left");
        acq.outcome(o).unwrap();
        let Step::Done {
            delay_ns,
            waited_ns,
            mut held,
        } = acq.advance(&thread_wake(&slot)).unwrap()
        else {
            panic!("every level held")
        };
        assert_eq!((waited_ns, delay_ns), (50 * MS, 250 * MS), "rate level behind its two");
        assert!(matches!(held[0], Held::Permits(1)) && matches!(held[1], Held::Queued(_)));
        assert_eq!(sem.in_use(), 1);
        q_run(&lq, &clock, 1_000 * MS);
        assert_eq!(granted(&w), Some(100 * MS));
        p.release(0, &mut held[0]);
        assert_eq!(sem.in_use(), 0);
    }

    #[test]
    fn a_timeout_in_a_queue_gives_everything_back() {
        let clock = Arc::new(ManualClock::new(0).unwrap());
        let (a, sem_a, _qa) = sem_level(&clock, 1);
        let (b, sem_b, qb) = sem_level(&clock, 1);
        let p = Arc::new(Policy::new(vec![a, b]).unwrap());
        let args = vec![
            LevelArgs { key: 0, costs: vec![1] },
            LevelArgs { key: 0, costs: vec![1] },
        ];
        qb.try_now(&[1], 0).unwrap();
        let acq = PolicyAcquire::new(p, args, AnyClock::Manual(clock.clone()), Some(200 * MS));
        let slot = Slot::new();
        assert!(matches!(acq.advance(&thread_wake(&slot)).unwrap(), Step::Queued(_)));
        assert_eq!(
            sem_a.in_use(),
            1,
            "the first level is held while waiting for the second"
        );
        q_run(&qb, &clock, 200 * MS);
        let e = acq.outcome(slot.take().expect("timed out")).unwrap_err();
        assert!(
            matches!(e, Error::WaitTimeout { waited_ns, .. } if waited_ns == 200 * MS),
            "{e:?}"
        );
        assert_eq!((sem_a.in_use(), sem_b.in_use()), (0, 1));
        assert!(acq.advance(&thread_wake(&slot)).is_err(), "finished");
    }

    #[test]
    fn abandon_leaves_the_queue_or_gives_back_the_grant_that_raced_it_once() {
        let clock = Arc::new(ManualClock::new(0).unwrap());
        let (a, sem_a, _qa) = sem_level(&clock, 1);
        let (b, sem_b, qb) = sem_level(&clock, 1);
        let p = Arc::new(Policy::new(vec![a, b]).unwrap());
        let args = vec![
            LevelArgs { key: 0, costs: vec![1] },
            LevelArgs { key: 0, costs: vec![1] },
        ];
        qb.try_now(&[1], 0).unwrap();

        let acq = PolicyAcquire::new(p.clone(), args.clone(), AnyClock::Manual(clock.clone()), None);
        let slot = Slot::new();
        acq.advance(&thread_wake(&slot)).unwrap();
        let behind = waiter(&qb);
        assert!(acq.abandon(), "left the queue");
        assert!(acq.abandon(), "once");
        assert_eq!(sem_a.in_use(), 0);
        qb.give_back(&[1], None);
        assert_eq!(granted(&behind), Some(0), "the waiter behind moved up");

        // The queue grants the acquire, then the waiter abandons before seeing it.
        let acq = PolicyAcquire::new(p, args, AnyClock::Manual(clock.clone()), None);
        let slot = Slot::new();
        acq.advance(&thread_wake(&slot)).unwrap();
        assert_eq!((sem_a.in_use(), sem_b.in_use()), (1, 1));
        qb.give_back(&[1], None); // released by the waiter that moved up: granted to the acquire
        assert_eq!(sem_b.in_use(), 1);
        acq.abandon_slot(&slot);
        assert_eq!((sem_a.in_use(), sem_b.in_use()), (0, 0));
        acq.abandon_slot(&slot);
        assert_eq!((sem_a.in_use(), sem_b.in_use()), (0, 0));
    }

    #[test]
    fn a_grant_to_a_closed_channel_goes_back_and_abandon_frees_the_rest() {
        let clock = Arc::new(ManualClock::new(0).unwrap());
        let (a, sem_a, _qa) = sem_level(&clock, 1);
        let (b, sem_b, qb) = sem_level(&clock, 1);
        let p = Arc::new(Policy::new(vec![a, b]).unwrap());
        let args = vec![
            LevelArgs { key: 0, costs: vec![1] },
            LevelArgs { key: 0, costs: vec![1] },
        ];
        qb.try_now(&[1], 0).unwrap();
        let acq = PolicyAcquire::new(p, args, AnyClock::Manual(clock), None);
        let ch = crate::queue::Channel::new();
        let c2 = ch.clone();
        let Step::Queued(_) = acq.advance(&move || Wake::Channel(c2.clone())).unwrap() else {
            panic!("queued")
        };
        assert!(ch.close().is_empty());
        qb.give_back(&[1], None); // granted to the closed channel: back to the queue
        assert_eq!(sem_b.in_use(), 0);
        assert!(!acq.abandon(), "the queue decided already");
        assert_eq!((sem_a.in_use(), sem_b.in_use()), (0, 0));
        assert!(qb.try_now(&[1], 0).is_ok());
    }

    #[test]
    fn a_cost_no_level_can_ever_grant_is_refused_before_any_wait() {
        let clock = Arc::new(ManualClock::new(0).unwrap());
        let (a, sem_a, qa) = sem_level(&clock, 1);
        let (lim, lq) = queued_limiter(&clock, 10.0, 1);
        let p = Arc::new(Policy::new(vec![a, rate_level("api", &lim, &lq)]).unwrap());
        qa.try_now(&[1], 0).unwrap();
        let args = vec![
            LevelArgs { key: 0, costs: vec![1] },
            LevelArgs { key: 0, costs: vec![2] },
        ];
        let acq = PolicyAcquire::new(p, args, AnyClock::Manual(clock), None);
        let e = acq.advance(&|| Wake::Thread(Slot::new())).unwrap_err();
        assert!(matches!(e, Error::CostTooLarge { .. }), "{e:?}");
        assert_eq!((qa.waiting(), sem_a.in_use()), (0, 1));
    }
}
