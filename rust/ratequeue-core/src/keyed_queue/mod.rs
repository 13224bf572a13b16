//! The wait queues of a keyed limit: one [`WaitQueue`] per key that has waiters, made
//! on demand, dropped when idle, bounded in number, held across a fork like every core
//! lock. The keyed limit's own map (buckets or permits per key) stays in `keyed.rs`.
//!
//! # When a queue may go
//!
//! Every [`KeyQueue`] handle outside the map comes from the map, under its lock
//! ([`KeyQueues::get`], [`KeyQueues::existing`]), and a queue leaves the map only under
//! that lock while the map holds its one handle and nobody waits in it. So a queue
//! somebody could still join (holding a handle) is never dropped: no waiter is left in a
//! queue the map no longer knows (where a give-back on its key would never wake it).
//! The driver's references to the queue itself are not handles: they never keep it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, TryLockError};

use crate::bucket::Deny;
use crate::clock::{AnyClock, ManualClock};
use crate::error::Error;
use crate::histogram::Histogram;
use crate::policy::{LevelQueues, QueueRef};
use crate::wait::{GrantRef, QueueConfig, Resource, Stalled, WaitQueue};

/// Makes the queue resource of one key.
pub type MakeResource = Box<dyn Fn(u64) -> Arc<dyn Resource> + Send + Sync>;

/// A fast-path decision: the grant time and token, or `Err(None)` (must queue) or
/// `Err(Some(d))` (can never be granted).
pub type NowOrQueue = Result<(u64, Option<u64>), Option<Deny>>;

/// The map sweeps its idle queues when it grows to a power of two from this size.
const SWEEP_FROM: usize = 64;

/// One key's queue, as the map hands it out: holding it keeps the queue in the map.
pub struct KeyQueue {
    queue: Arc<WaitQueue>,
}

impl KeyQueue {
    /// The wait queue of the key.
    #[inline]
    pub fn queue(&self) -> &Arc<WaitQueue> {
        &self.queue
    }
}

/// The queues of the keys that have waiters, all recording into one wait histogram.
pub struct KeyQueues {
    map: Mutex<HashMap<u64, Arc<KeyQueue>>>,
    live: AtomicUsize,
    clock: AnyClock,
    config: QueueConfig,
    wait: Arc<Histogram>,
    max_queues: usize,
    make: MakeResource,
    tried_admitted: AtomicU64,
    tried_refused: AtomicU64,
}

impl KeyQueues {
    /// Queues of `make(key)` on `clock` with `config` each, at most `max_queues` keys at
    /// once; registered for the fork handlers.
    pub fn new(
        clock: AnyClock,
        config: QueueConfig,
        max_queues: usize,
        make: MakeResource,
    ) -> Result<Arc<KeyQueues>, Error> {
        if max_queues == 0 {
            return Err(Error::invalid("max_keys", 0, "must be >= 1"));
        }
        let q = Arc::new(KeyQueues {
            map: Mutex::new(HashMap::new()),
            live: AtomicUsize::new(0),
            clock,
            config,
            wait: Arc::new(Histogram::new()),
            max_queues,
            make,
            tried_admitted: AtomicU64::new(0),
            tried_refused: AtomicU64::new(0),
        });
        crate::fork::register_arc(&q);
        Ok(q)
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<u64, Arc<KeyQueue>>> {
        self.map.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The clock every key's queue reads.
    pub fn clock(&self) -> &AnyClock {
        &self.clock
    }

    /// The resource `key`'s waiters take from.
    pub fn resource(&self, key: u64) -> Arc<dyn Resource> {
        (self.make)(key)
    }

    /// The live histogram of queue waits, all keys together (0 for an immediate grant).
    pub fn wait_histogram(&self) -> &Arc<Histogram> {
        &self.wait
    }

    /// The most keys with a queue at once.
    pub fn max_queues(&self) -> usize {
        self.max_queues
    }

    /// Keys with a queue now.
    pub fn len(&self) -> usize {
        self.live.load(Ordering::Acquire)
    }

    /// True when no key has a queue.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// [`KeyQueues::existing`] without waiting for the map's lock: None when it is busy.
    #[inline]
    pub fn try_existing(&self, key: u64) -> Option<Option<Arc<KeyQueue>>> {
        if self.is_empty() {
            return Some(None);
        }
        match self.map.try_lock() {
            Ok(m) => Some(m.get(&key).cloned()),
            Err(TryLockError::Poisoned(e)) => Some(e.into_inner().get(&key).cloned()),
            Err(TryLockError::WouldBlock) => None,
        }
    }

    /// The queue of `key` if it has one (keeping it alive keeps it in the map).
    pub fn existing(&self, key: u64) -> Option<Arc<KeyQueue>> {
        if self.is_empty() {
            return None;
        }
        self.lock().get(&key).cloned()
    }

    /// [`KeyQueues::has_waiters`] without waiting for the map's lock: None when it is busy.
    #[inline]
    pub fn try_has_waiters(&self, key: u64) -> Option<bool> {
        self.try_existing(key)
            .map(|q| q.is_some_and(|q| q.queue.waiting() != 0))
    }

    /// True when someone waits on `key` or a decision that may queue someone there is
    /// under way (see [`WaitQueue::joined`]), or when the map's lock is busy (then the
    /// caller cannot tell): a fast path asks it after its take. Never waits for a lock.
    #[inline(always)]
    pub fn joined(&self, key: u64) -> bool {
        !self.is_empty() && self.joined_in_map(key)
    }

    /// [`KeyQueues::joined`] once some key has a queue: asked of the key's queue.
    fn joined_in_map(&self, key: u64) -> bool {
        match self.map.try_lock() {
            Ok(m) => m.get(&key).is_some_and(|q| q.queue.joined()),
            Err(TryLockError::Poisoned(e)) => e.into_inner().get(&key).is_some_and(|q| q.queue.joined()),
            Err(TryLockError::WouldBlock) => true,
        }
    }

    /// True when someone waits on `key` (nobody overtakes them).
    pub fn has_waiters(&self, key: u64) -> bool {
        self.existing(key).is_some_and(|q| q.queue.waiting() != 0)
    }

    /// Drops every queue that nobody waits in and nobody holds.
    fn sweep_idle(m: &mut HashMap<u64, Arc<KeyQueue>>) {
        m.retain(|_, q| Arc::strong_count(q) > 1 || q.queue.waiting() != 0);
    }

    /// The queue of `key`, made if needed; refused (`Overloaded`) when `max_queues`
    /// keys have queues in use already. Pair it with [`KeyQueues::done`].
    pub fn get(&self, key: u64) -> Result<Arc<KeyQueue>, Error> {
        if let Some(q) = self.lock().get(&key) {
            return Ok(q.clone());
        }
        // Made outside the map's lock: a new queue registers for the fork handlers, and
        // their registry comes first in the lock order.
        let fresh = Arc::new(KeyQueue {
            queue: WaitQueue::with_histograms(
                (self.make)(key),
                1,
                self.clock.clone(),
                self.config.clone(),
                vec![self.wait.clone()],
            ),
        });
        let mut m = self.lock();
        if !m.contains_key(&key) {
            if m.len() >= self.max_queues {
                Self::sweep_idle(&mut m);
            } else if m.len() >= SWEEP_FROM && m.len().is_power_of_two() {
                // Amortised: the map stays within about twice the keys in use.
                Self::sweep_idle(&mut m);
            }
            if m.len() >= self.max_queues {
                self.live.store(m.len(), Ordering::Release);
                return Err(Error::Overloaded {
                    reason: format!("{} keys have waiters already, the most this limit queues", m.len()),
                    retry_after_ns: 0,
                });
            }
        }
        let q = m.entry(key).or_insert(fresh).clone();
        self.live.store(m.len(), Ordering::Release);
        Ok(q)
    }

    /// A use of `key`'s queue ended: drops it if nobody waits in it and nobody holds a
    /// handle to it but the map and the `held` handles the caller still has.
    pub fn done(&self, key: u64, held: usize) {
        let mut m = self.lock();
        if let Some(q) = m.get(&key) {
            if Arc::strong_count(q) <= 1 + held && q.queue.waiting() == 0 {
                m.remove(&key);
            }
        }
        self.live.store(m.len(), Ordering::Release);
    }

    /// Settles a grant on `key` from its `estimated` costs to the `actual` ones (see
    /// [`WaitQueue::settle`]), decided as [`KeyQueues::settle_by`] decides it.
    pub fn settle(&self, key: u64, estimated: &[u64], actual: &[u64], grant: GrantRef) -> GrantRef {
        self.decide(key, estimated, actual, |q| match q {
            Some(q) => q.settle(estimated, actual, grant),
            None => (self.make)(key).settle(estimated, actual, GrantRef { owed: None, ..grant }),
        })
    }

    /// [`WaitQueue::settle_by`] on `key` (a policy's debit there): `owed` is the ticket of
    /// what the debit still owes in the key's queue, `debit(held, keep)` settles the debit
    /// itself. An overage is decided under a lock that orders it with every wait joining
    /// the key's queue: that queue's lock when the key has one (the overage then waits
    /// behind the reservations promised a time there), else the map's, so that no queue
    /// and no promise can be made on the key before the charge lands. It makes no queue:
    /// a full map changes nothing. Returns what `debit` returned and what the debit owes
    /// now.
    pub fn settle_by<R>(
        &self,
        key: u64,
        estimated: &[u64],
        actual: &[u64],
        owed: Option<u64>,
        debit: impl FnOnce(&[u64], &[u64]) -> R,
    ) -> (R, Option<u64>) {
        self.decide(key, estimated, actual, |q| match q {
            Some(q) => q.settle_by(estimated, actual, owed, debit),
            // Without a queue nothing is owed: a charge leaves its queue only once
            // debited, and a queue with a charge in it is never dropped.
            None => (debit(estimated, actual), None),
        })
    }

    /// Runs `settle` with `key`'s queue if it has one: for an overage without a queue,
    /// under the map's lock (no queue can be made on the key meanwhile); for a refund
    /// without one, after it (a refund never moves a promised time later), then grants
    /// whoever it lets through.
    fn decide<T>(
        &self,
        key: u64,
        estimated: &[u64],
        actual: &[u64],
        settle: impl FnOnce(Option<&Arc<WaitQueue>>) -> T,
    ) -> T {
        let over = actual.iter().zip(estimated).any(|(a, e)| a > e);
        let m = self.lock();
        let Some(handle) = m.get(&key).cloned() else {
            if over {
                return settle(None);
            }
            drop(m);
            let out = settle(None);
            self.poll(key);
            return out;
        };
        drop(m);
        let out = settle(Some(handle.queue()));
        drop(handle);
        self.done(key, 0);
        out
    }

    /// Grants whatever can now be granted on `key` (after capacity came back to it).
    pub fn poll(&self, key: u64) {
        if let Some(q) = self.existing(key) {
            q.queue.poll_now();
        }
    }

    /// The queues of every key that has one now (not handles: they keep nothing).
    fn all(&self) -> Vec<Arc<WaitQueue>> {
        self.lock().values().map(|q| q.queue.clone()).collect()
    }

    /// Grants and expires what is due now on every key, then drops idle queues; the
    /// next due time, if any.
    pub fn poll_all(&self) -> Option<u64> {
        let next = self.all().iter().filter_map(|q| q.poll_now()).min();
        let mut m = self.lock();
        Self::sweep_idle(&mut m);
        self.live.store(m.len(), Ordering::Release);
        next
    }

    /// On a ManualClock: moves the clock through every due time of every key's queue up
    /// to `until_ns`, polling there (the virtual-time driver of a keyed limit). Never
    /// spins (see [`WaitQueue::run_until`]).
    pub fn run_until(&self, clock: &ManualClock, until_ns: u64) -> Result<usize, Error> {
        crate::clock::check_time("until", until_ns)?;
        let mut n = 0;
        let mut stalled = Stalled::default();
        loop {
            let queues = self.all();
            match queues.iter().filter_map(|q| q.next_wake()).min() {
                Some(t) if t <= until_ns => {
                    let progress = || queues.iter().fold(0u64, |a, q| a.wrapping_add(q.progress()));
                    let before = (clock.now_ns(), progress());
                    let now = clock.set(t.max(before.0))?;
                    for q in &queues {
                        q.poll(now);
                    }
                    n += 1;
                    stalled.check(before != (now, progress()), until_ns, now)?;
                }
                _ => break,
            }
        }
        clock.set(until_ns.max(clock.now_ns()))?;
        self.poll_all();
        Ok(n)
    }

    /// The fast path of an acquire on `key` without waiting for any lock: the grant
    /// time and token when nobody waits on the key and its resource admits `costs` now
    /// (recorded as a wait of 0); `Err(None)` when it must queue, `Err(Some(d))` when it
    /// never can. None (nothing changed) when a lock was busy.
    #[inline]
    pub fn try_now_nowait(&self, key: u64, costs: &[u64]) -> Option<NowOrQueue> {
        if self.try_has_waiters(key)? {
            return Some(Err(None));
        }
        let at_ns = self.clock.now_ns();
        let joined = || self.joined(key);
        let taken = self.resource(key).try_take_token_idle_nowait(at_ns, costs, &joined)?;
        Some(self.granted_now(at_ns, taken))
    }

    /// [`KeyQueues::try_now_nowait`], waiting for the locks it needs.
    pub fn try_now(&self, key: u64, costs: &[u64]) -> NowOrQueue {
        if self.has_waiters(key) {
            return Err(None);
        }
        let at_ns = self.clock.now_ns();
        let joined = || self.joined(key);
        // A busy lock: the caller's slow path decides under the locks.
        let Some(taken) = self.resource(key).try_take_token_idle_nowait(at_ns, costs, &joined) else {
            return Err(None);
        };
        self.granted_now(at_ns, taken)
    }

    fn granted_now(&self, at_ns: u64, taken: Result<Option<u64>, Deny>) -> NowOrQueue {
        match taken {
            Ok(token) => {
                self.wait.record(0);
                Ok((at_ns, token))
            }
            Err(Deny::Wait(_)) => Err(None),
            Err(d) => Err(Some(d)),
        }
    }

    /// Nanoseconds until `costs` on `key` would be granted behind the key's waiters;
    /// None when nobody waits on it (or when that depends on releases: permits).
    pub fn backlog_delay_ns(&self, key: u64, costs: &[u64]) -> Result<Option<u64>, Deny> {
        match self.existing(key).filter(|q| q.queue.waiting() != 0) {
            Some(q) => q.queue.predict_delay(costs).map(|p| p.map(|(_, d)| d)),
            None => Ok(None),
        }
    }

    /// Counts a `try_acquire` decision.
    #[inline]
    pub fn note_try(&self, admitted: bool) {
        self.note_tries(admitted as u64, !admitted as u64);
    }

    /// Counts `admitted` and `refused` `try_acquire` decisions.
    #[inline]
    pub fn note_tries(&self, admitted: u64, refused: u64) {
        if admitted != 0 {
            self.tried_admitted.fetch_add(admitted, Ordering::Relaxed);
        }
        if refused != 0 {
            self.tried_refused.fetch_add(refused, Ordering::Relaxed);
        }
    }

    /// `try_acquire` decisions so far: (admitted, refused).
    pub fn tries(&self) -> (u64, u64) {
        (
            self.tried_admitted.load(Ordering::Relaxed),
            self.tried_refused.load(Ordering::Relaxed),
        )
    }
}

impl crate::keyed::KeyWaiters for KeyQueues {
    #[inline]
    fn none(&self) -> bool {
        self.is_empty()
    }
    fn has_waiters(&self, key: u64) -> bool {
        KeyQueues::has_waiters(self, key)
    }
    fn joined(&self, key: u64) -> bool {
        KeyQueues::joined(self, key)
    }
}

/// A keyed level's queues, as a policy joins them: a key's queue is kept in the map
/// while the policy holds it; a key the map has no room for has none, so the level
/// refuses a wait there.
impl LevelQueues for KeyQueues {
    fn existing(&self, key: u64) -> Option<QueueRef> {
        KeyQueues::existing(self, key).map(kept)
    }

    fn queue(&self, key: u64) -> Option<QueueRef> {
        self.get(key).ok().map(kept)
    }

    fn done(&self, key: u64) {
        KeyQueues::done(self, key, 0);
    }

    fn settle_by(
        &self,
        key: u64,
        estimated: &[u64],
        actual: &[u64],
        owed: Option<u64>,
        debit: &mut dyn FnMut(&[u64], &[u64]) -> bool,
    ) -> (bool, Option<u64>) {
        KeyQueues::settle_by(self, key, estimated, actual, owed, debit)
    }
}

/// A key's queue with its handle (the queue stays in its map while the handle lives).
fn kept(handle: Arc<KeyQueue>) -> QueueRef {
    QueueRef {
        queue: handle.queue().clone(),
        keep: Some(handle),
    }
}

impl crate::fork::ForkLocks for KeyQueues {
    fn rank(&self) -> crate::fork::Rank {
        crate::fork::Rank::KeyMap
    }

    fn lock_for_fork<'a>(&'a self, held: &mut Vec<Box<dyn crate::fork::Held + 'a>>) {
        held.push(Box::new(self.lock()));
    }
}

#[cfg(test)]
mod tests;
