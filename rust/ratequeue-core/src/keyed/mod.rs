//! Per-key limits: one GCRA bucket per key (user, API key, tenant) in a sharded map,
//! and one permit count per key for keyed concurrency.
//!
//! Keys are stored as 64-bit keyed hashes of their identity (kind and exact value, see
//! [`KeyHasher`]; random seed per map), so a key costs a fixed
//! 16 bytes in an open-addressing table whatever its length; two keys colliding would
//! share a bucket (probability about n²/2^65: 3·10⁻⁸ at a million keys). Memory is
//! bounded by `max_keys`: when a shard is full, keys whose bucket is full again are
//! dropped first (a dropped full bucket and a new one decide alike), then the bucket
//! nearest to full among a small sample (the change in decisions is smallest), counted.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};

use crate::bucket::{epoch_for, needs_rebase, Deny, Params};
use crate::clock::AnyClock;
use crate::error::Error;
use crate::rate::Rate;
use crate::wait::GrantRef;

mod give_back;
mod hasher;
mod resources;
mod semaphore;
mod table;
#[cfg(test)]
mod tests;

pub use hasher::KeyHasher;
pub use resources::{KeyBucket, KeyPermits};
pub use semaphore::KeyedSemaphore;
use table::Table;

/// A key's TAT fits 60 bits; a token carries the shard's rebase count (mod 4) and its
/// live evictions (mod 4) above.
const ERA_SHIFT: u32 = 62;
const ERA_MASK: u64 = 0x3;
const SAMPLE: usize = 32;
/// How much a shard's table grows at a time (see [`KeyedLimiter::make_room`]).
const GROWTH: usize = 4;
const TOKEN_SHIFT: u32 = 60;
const TOKEN_EVICTIONS: u64 = 0x3;
/// Evictions of a debit known only by its grant time (not checked).
const UNKNOWN_EVICTIONS: u64 = u64::MAX;

#[repr(align(64))]
struct Shard<T>(Mutex<T>);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn try_lock<T>(m: &Mutex<T>) -> Option<MutexGuard<'_, T>> {
    match m.try_lock() {
        Ok(g) => Some(g),
        Err(std::sync::TryLockError::Poisoned(e)) => Some(e.into_inner()),
        Err(std::sync::TryLockError::WouldBlock) => None,
    }
}

/// Who waits on which key of a keyed map ([`crate::KeyQueues`]): what its fast paths
/// must not overtake.
pub trait KeyWaiters {
    /// True when no key has a queue (nobody waits, and no decision that may queue
    /// someone is under way, on any key).
    fn none(&self) -> bool;
    /// True when someone waits on `key`.
    fn has_waiters(&self, key: u64) -> bool;
    /// The re-check after a fast take on `key` (see [`crate::KeyQueues::joined`]).
    fn joined(&self, key: u64) -> bool;
}

/// Eviction counters of a keyed map.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KeyedCounts {
    /// Keys in the map now.
    pub keys: u64,
    /// Keys dropped because their bucket was full again (no decision changes).
    pub evicted_full: u64,
    /// Keys dropped while not full, to stay within max_keys.
    pub evicted_live: u64,
    /// Give-backs kept because a later grant stood on them.
    pub refunds_dropped: u64,
}

fn shard_layout(max_keys: usize) -> (usize, usize) {
    let shards = (max_keys / 1024).next_power_of_two().clamp(1, 256);
    (shards, max_keys.div_ceil(shards).max(1))
}

/// A debit on one key, held so that it can be given back by the one undo rule
/// ([`KeyedLimiter::give_back`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KeyTaken {
    key: u64,
    before: Option<u64>,
    after: u64,
    cost: u64,
    latest: bool,
    /// The shard's live evictions when taken (only its low bits for a token).
    evictions: u64,
    token: bool,
    /// The shard's rebase count (mod 16) when `before` and `after` were read.
    era: u64,
    /// The least TAT the debit can end at now (in `era`'s ticks): its time plus its
    /// cost. Refunds of debits below it since it was taken moved it down from `after`,
    /// never below this; a refund that is not exact is capped by it.
    held: u64,
    /// The ticket of an overage settled on it still owed in its key's queue (see
    /// [`crate::WaitQueue::settle_by`]): a policy's, not debited yet.
    pub(crate) owed: Option<u64>,
    /// Nanoseconds from the arrival until the grant.
    pub delay_ns: u64,
}

impl KeyTaken {
    /// A debit of `cost` on `key` known only by its grant's token ([`KeyTaken::token`]).
    pub fn from_token(key: u64, token: u64, cost: u64) -> KeyTaken {
        KeyTaken {
            key,
            before: None,
            after: token & crate::bucket::TAT_LIMIT,
            cost,
            latest: true,
            evictions: (token >> TOKEN_SHIFT) & TOKEN_EVICTIONS,
            token: true,
            era: token >> ERA_SHIFT,
            // Nothing better known (see `bound_by`).
            held: token & crate::bucket::TAT_LIMIT,
            owed: None,
            delay_ns: 0,
        }
    }

    /// Caps what a refund of this debit can give back by `held_token`, the token of the
    /// least TAT the debit can end at (its grant time plus its cost).
    pub fn bound_by(mut self, held_token: u64) -> KeyTaken {
        let era = held_token >> ERA_SHIFT;
        let held = held_token & crate::bucket::TAT_LIMIT;
        if era == self.era {
            self.held = self.held.min(held);
        } else {
            // A rebase came between the grant and now: nothing is known of where it sits.
            self.held = 0;
        }
        self
    }

    /// The state this debit left on its key (its TAT, the shard's epoch and the low bits
    /// of its live evictions), as a token.
    pub fn token(&self) -> u64 {
        (self.era << ERA_SHIFT) | ((self.evictions & TOKEN_EVICTIONS) << TOKEN_SHIFT) | self.after
    }

    /// The cost this debit stands for now (after any settle).
    pub fn cost(&self) -> u64 {
        self.cost
    }
}

/// One GCRA bucket per key, in a bounded sharded map.
pub struct KeyedLimiter {
    params: Params,
    rate: Rate,
    clock: AnyClock,
    hasher: KeyHasher,
    shards: Box<[Shard<Table>]>,
    shard_bits: u32,
    per_shard: usize,
    cap: usize,
    evicted_full: AtomicU64,
    evicted_live: AtomicU64,
    refunds_dropped: AtomicU64,
    /// The latest clock time at which an undo or refund gave capacity back on any key.
    given: AtomicU64,
}

impl std::fmt::Debug for KeyedLimiter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "KeyedLimiter({:?}, keys={})", self.rate, self.len())
    }
}

impl KeyedLimiter {
    /// A keyed limiter at `rate` per key, holding at most about `max_keys` keys.
    pub fn new(rate: Rate, max_keys: usize, clock: AnyClock) -> Result<KeyedLimiter, Error> {
        if max_keys == 0 {
            return Err(Error::invalid("max_keys", 0, "must be >= 1"));
        }
        let (n, per_shard) = shard_layout(max_keys);
        let cap = (per_shard * 4 / 3 + 1).next_power_of_two().max(8);
        let epoch = epoch_for(clock.now_ns());
        let table = || Table {
            epoch,
            ..Table::default()
        };
        Ok(KeyedLimiter {
            params: Params::of(&rate),
            rate,
            clock,
            hasher: KeyHasher::default(),
            shards: (0..n).map(|_| Shard(Mutex::new(table()))).collect(),
            shard_bits: n.trailing_zeros(),
            per_shard,
            cap,
            evicted_full: AtomicU64::new(0),
            evicted_live: AtomicU64::new(0),
            refunds_dropped: AtomicU64::new(0),
            given: AtomicU64::new(0),
        })
    }

    /// The rate of every key.
    pub fn rate(&self) -> Rate {
        self.rate
    }

    /// The hasher that turns keys into map keys.
    pub fn hasher(&self) -> &KeyHasher {
        &self.hasher
    }

    /// The clock.
    pub fn clock(&self) -> &AnyClock {
        &self.clock
    }

    /// The most keys held at once (max_keys rounded up to a multiple of the shards,
    /// sticking at usize::MAX).
    pub fn max_keys(&self) -> usize {
        self.per_shard.saturating_mul(self.shards.len())
    }

    fn shard_index(&self, key: u64) -> usize {
        if self.shard_bits == 0 {
            0
        } else {
            (key >> (64 - self.shard_bits)) as usize
        }
    }

    fn shard(&self, key: u64) -> MutexGuard<'_, Table> {
        lock(&self.shards[self.shard_index(key)].0)
    }

    /// The arithmetic of shard `t` for a reading at `at_ns`, rebasing the shard first
    /// when `at_ns` lies far past its epoch.
    #[inline]
    fn params_at(&self, t: &mut Table, at_ns: u64) -> Params {
        if needs_rebase(t.epoch, at_ns) {
            t.rebase(&self.params, at_ns);
        }
        self.params.at_epoch(t.epoch)
    }

    /// Keys held now.
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| lock(&s.0).len).sum()
    }

    /// True when no key is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Eviction counters and the number of keys.
    pub fn counts(&self) -> KeyedCounts {
        KeyedCounts {
            keys: self.len() as u64,
            evicted_full: self.evicted_full.load(Ordering::Relaxed),
            evicted_live: self.evicted_live.load(Ordering::Relaxed),
            refunds_dropped: self.refunds_dropped.load(Ordering::Relaxed),
        }
    }

    /// Makes room for one more key in `t` at `now_ticks`.
    fn make_room(&self, t: &mut Table, now_ticks: u64) {
        if t.len < self.per_shard {
            if !t.fits_one_more() {
                // Four times larger at each step: a new key is moved by a growth about
                // 0.5 times on average instead of 1.5 (growth was a fifth of a first-time
                // key's cost, keys17.md); never past the shard's cap, so the bound on
                // memory is unchanged (a table between steps may be up to 4x its keys'
                // 16 bytes / 0.75 instead of 2x).
                let cap = (t.slots.len() * GROWTH).clamp(8, self.cap);
                if cap > t.slots.len() {
                    t.grow(cap);
                }
            }
            return;
        }
        // Full. Drop every bucket that is full again (no decision changes) — a sweep of
        // the shard, skipped until the earliest TAT the last sweep saw has passed, so a
        // shard of live buckets costs one sweep per refill, not one per insert.
        if now_ticks >= t.next_full {
            let mut next_full = u64::MAX;
            let full: Vec<u64> = t
                .slots
                .iter()
                .filter(|s| s.used())
                .filter(|s| {
                    if s.tat > now_ticks {
                        next_full = next_full.min(s.tat);
                    }
                    s.tat <= now_ticks
                })
                .map(|s| s.key)
                .collect();
            for key in &full {
                if let Some(i) = t.find(*key) {
                    t.remove_at(i);
                }
            }
            self.evicted_full.fetch_add(full.len() as u64, Ordering::Relaxed);
            t.next_full = next_full;
            if !full.is_empty() {
                return;
            }
        }
        // Every bucket is live: drop the one nearest to full among a sample (the
        // smallest change in decisions), counted.
        let n = t.slots.len();
        let mut nearest: Option<(u64, usize)> = None;
        let mut k = 0;
        while k < n && (k < SAMPLE || nearest.is_none()) {
            let i = (t.cursor + k) % n;
            let s = t.slots[i];
            if s.used() && nearest.is_none_or(|(tat, _)| s.tat < tat) {
                nearest = Some((s.tat, i));
            }
            k += 1;
        }
        t.cursor = (t.cursor + k) % n;
        if let Some((_, i)) = nearest {
            t.remove_at(i);
            t.evicted_live += 1;
            self.evicted_live.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Debits `cost` on `key` for an arrival at `at_ns` if granted within `max_delay_ns`.
    #[inline]
    pub fn take(&self, key: u64, at_ns: u64, cost: u64, max_delay_ns: u64) -> Result<KeyTaken, Deny> {
        self.take_with(key, at_ns, cost, max_delay_ns, false)
    }

    /// [`KeyedLimiter::take`] at `at_ns` set by something other than this key's own
    /// schedule (a policy's slowest level): a time after now is kept from refunds.
    pub fn take_at(&self, key: u64, at_ns: u64, cost: u64) -> Result<KeyTaken, Deny> {
        let mut t = self.shard(key);
        let taken = self.take_in(&mut t, key, at_ns, cost, 0, false)?;
        let now = self.clock.now_ns();
        if at_ns > now {
            if t.ahead.len() >= 64 && t.ahead.len() >= t.len {
                t.ahead.retain(|_, a| *a > now);
                if t.ahead.len() >= (2 * self.per_shard).max(64) {
                    // Still all to come (keys dropped from the table meanwhile): fold
                    // them into one time for the shard, so memory stays bounded.
                    let latest = t.ahead.drain().map(|(_, a)| a).max().unwrap_or(0);
                    t.ahead_all = t.ahead_all.max(latest);
                }
            }
            let a = t.ahead.entry(key).or_insert(0);
            *a = (*a).max(at_ns);
        }
        Ok(taken)
    }

    /// The latest time a debit on `key` was scheduled at past `at_ns` (0: none).
    fn ahead_of(t: &mut Table, key: u64, at_ns: u64) -> u64 {
        let own = match t.ahead.get(&key) {
            Some(&a) if a > at_ns => a,
            Some(_) => {
                t.ahead.remove(&key);
                0
            }
            None => 0,
        };
        if t.ahead_all > at_ns {
            own.max(t.ahead_all)
        } else {
            own
        }
    }

    /// [`KeyedLimiter::take`], for a grant time the queue scheduled or an arrival.
    pub fn take_with(
        &self,
        key: u64,
        at_ns: u64,
        cost: u64,
        max_delay_ns: u64,
        scheduled: bool,
    ) -> Result<KeyTaken, Deny> {
        let mut t = self.shard(key);
        self.take_in(&mut t, key, at_ns, cost, max_delay_ns, scheduled)
    }

    /// [`KeyedLimiter::take`] without waiting for the key's shard lock: None (nothing
    /// changed) when it is busy.
    #[inline]
    pub fn take_nowait(&self, key: u64, at_ns: u64, cost: u64, max_delay_ns: u64) -> Option<Result<KeyTaken, Deny>> {
        let mut t = try_lock(&self.shards[self.shard_index(key)].0)?;
        Some(self.take_in(&mut t, key, at_ns, cost, max_delay_ns, false))
    }

    /// [`KeyedLimiter::try_acquire`] without waiting for a lock: None when it is busy.
    #[inline]
    pub fn try_acquire_nowait(&self, key: u64, cost: u64) -> Option<Result<(), Deny>> {
        self.take_nowait(key, self.clock.now_ns(), cost, 0)
            .map(|r| r.map(|_| ()))
    }

    /// [`KeyedLimiter::take_nowait`] (no delay) for a fast path that checked that nobody
    /// waits on `key`: `joined()` (the key queue's, see [`crate::KeyQueues::joined`]) is
    /// asked again right after the take, under the shard's lock that a joiner's reads of
    /// the key take after it announced itself; when true, the take is undone exactly and
    /// refused with `Deny::Wait(0)`, so no time scheduled for a joiner moves.
    #[inline]
    pub fn take_idle_nowait(
        &self,
        key: u64,
        at_ns: u64,
        cost: u64,
        joined: impl Fn() -> bool,
    ) -> Option<Result<KeyTaken, Deny>> {
        let mut t = try_lock(&self.shards[self.shard_index(key)].0)?;
        let taken = self.take_in(&mut t, key, at_ns, cost, 0, false);
        Some(match taken {
            Ok(taken) if joined() => {
                Self::undo_in(&mut t, key, taken.before.unwrap_or(0));
                Err(Deny::Wait(0))
            }
            r => r,
        })
    }

    /// [`KeyedLimiter::try_acquire`] re-checked as [`KeyedLimiter::take_idle_nowait`].
    pub fn try_acquire_idle(&self, key: u64, cost: u64, joined: impl Fn() -> bool) -> Result<(), Deny> {
        let now = self.clock.now_ns();
        self.try_idle_in(&mut self.shard(key), key, now, cost, joined)
    }

    /// [`KeyedLimiter::try_acquire_idle`] without waiting for a lock: None when it is busy.
    #[inline]
    pub fn try_acquire_idle_nowait(&self, key: u64, cost: u64, joined: impl Fn() -> bool) -> Option<Result<(), Deny>> {
        let now = self.clock.now_ns();
        let mut t = try_lock(&self.shards[self.shard_index(key)].0)?;
        Some(self.try_idle_in(&mut t, key, now, cost, joined))
    }

    /// The take of [`KeyedLimiter::take_idle_nowait`] for a caller that keeps no debit
    /// (a try): only the TAT it moved, re-checked and undone alike. Inlined into the
    /// bindings' try_acquire: no KeyTaken built, no call (regress16.md).
    #[inline(always)]
    fn try_idle_in(
        &self,
        t: &mut Table,
        key: u64,
        at_ns: u64,
        cost: u64,
        joined: impl Fn() -> bool,
    ) -> Result<(), Deny> {
        let (_, before, _, _) = self.debit_in(t, key, at_ns, cost, 0, false)?;
        if joined() {
            Self::undo_in(t, key, before);
            return Err(Deny::Wait(0));
        }
        Ok(())
    }

    /// Puts `key`'s TAT back to `before` (a take undone for a joiner; the lock held since).
    #[cold]
    #[inline(never)]
    fn undo_in(t: &mut Table, key: u64, before: u64) {
        if let Some(i) = t.find(key) {
            t.slots[i].tat = before;
        }
    }

    /// Debits `cost` on `key` in `t`: the shard's arithmetic, the TAT before and after,
    /// and the delay (what [`KeyedLimiter::take_in`] records of it).
    #[inline(always)]
    fn debit_in(
        &self,
        t: &mut Table,
        key: u64,
        at_ns: u64,
        cost: u64,
        max_delay_ns: u64,
        scheduled: bool,
    ) -> Result<(Params, u64, u64, u64), Deny> {
        let p = self.params_at(t, at_ns);
        let found = t.probe(key);
        let before = found.map_or(0, |i| t.slots[i].tat);
        let (new, delay_ns) = p.step(before, at_ns, cost, max_delay_ns, scheduled)?;
        match found {
            Ok(i) => t.slots[i].tat = new,
            Err(vacant) if t.len < self.per_shard && t.fits_one_more() => t.insert_at(vacant, key, new),
            Err(_) => {
                self.make_room(t, p.ticks(at_ns));
                t.insert_new(key, new);
            }
        }
        Ok((p, before, new, delay_ns))
    }

    fn take_in(
        &self,
        t: &mut Table,
        key: u64,
        at_ns: u64,
        cost: u64,
        max_delay_ns: u64,
        scheduled: bool,
    ) -> Result<KeyTaken, Deny> {
        let (p, before, new, delay_ns) = self.debit_in(t, key, at_ns, cost, max_delay_ns, scheduled)?;
        Ok(KeyTaken {
            key,
            before: Some(before),
            held: p
                .ticks(at_ns.saturating_sub(1))
                .saturating_add(p.cost_ticks(cost))
                .min(new),
            after: new,
            cost,
            latest: true,
            evictions: t.evicted_live,
            token: false,
            era: t.rebases & ERA_MASK,
            owed: None,
            delay_ns,
        })
    }

    /// Admits `cost` on `key` now or refuses (nothing changes on refusal).
    #[inline]
    pub fn try_acquire(&self, key: u64, cost: u64) -> Result<(), Deny> {
        self.take(key, self.clock.now_ns(), cost, 0).map(|_| ())
    }

    /// Decides `keys[i]` with `costs[i]` (or 1) in order, as the loop of single calls
    /// would, reading the clock once; writes the decisions to `out`.
    pub fn try_acquire_many(&self, keys: &[u64], costs: Option<&[u64]>, out: &mut [bool]) -> Result<(), Deny> {
        self.many_in(keys, costs, out, None)
    }

    /// The batch of [`KeyedLimiter::try_acquire_many`]; with `waiters`, each shard's
    /// group is decided only while no key has a queue, asked under the shard's lock
    /// before its takes (a joiner reads its key under that lock after announcing itself,
    /// so either it sees the group's takes or the group sees its queue); from the first
    /// group that sees a queue on, key by key as [`KeyedLimiter::try_acquire_many_idle`].
    fn many_in(
        &self,
        keys: &[u64],
        costs: Option<&[u64]>,
        out: &mut [bool],
        waiters: Option<&dyn KeyWaiters>,
    ) -> Result<(), Deny> {
        let now = self.clock.now_ns();
        let cost_of = |i: usize| costs.map_or(1, |c| c[i]);
        if let Some(i) = (0..keys.len()).find(|i| cost_of(*i) > self.params.burst) {
            return Err(Deny::TooLarge {
                cost: cost_of(i),
                burst: self.params.burst,
                unit: 0,
            });
        }
        // In chunks that stay in cache, group the requests by shard, each group in its
        // original order (a key always falls in the same shard, so every key sees its
        // own requests in order: the decisions are those of the loop), then take each
        // shard's lock once per chunk and walk its group, prefetching slots ahead. A
        // group's first keys wait for their slots from memory (the prefetches start
        // with the group): chunks of 16,384 keys make groups of ~64 keys at 256 shards,
        // and 16 slots in flight keep the misses overlapping (the 4,096 / 8 of before
        // spent ~5-10 ns more per key held in a map of a million, keys17.md).
        const CHUNK: usize = 16_384;
        const AHEAD: usize = 16;
        let n = self.shards.len();
        let shard_of = |k: u64| {
            if self.shard_bits == 0 {
                0
            } else {
                (k >> (64 - self.shard_bits)) as usize
            }
        };
        let mut start = vec![0usize; n + 1];
        let mut order = vec![0u32; CHUNK.min(keys.len())];
        let mut one_by_one = false;
        for base in (0..keys.len()).step_by(CHUNK) {
            let chunk = &keys[base..(base + CHUNK).min(keys.len())];
            start.iter_mut().for_each(|x| *x = 0);
            for k in chunk {
                start[shard_of(*k) + 1] += 1;
            }
            for sh in 0..n {
                start[sh + 1] += start[sh];
            }
            let mut fill = start.clone();
            for (i, k) in chunk.iter().enumerate() {
                let sh = shard_of(*k);
                order[fill[sh]] = i as u32;
                fill[sh] += 1;
            }
            for sh in 0..n {
                let group = &order[start[sh]..start[sh + 1]];
                if group.is_empty() {
                    continue;
                }
                let mut t = lock(&self.shards[sh].0);
                if let Some(w) = waiters.filter(|w| one_by_one || !w.none()) {
                    drop(t);
                    one_by_one = true;
                    for &i in group {
                        let i = base + i as usize;
                        out[i] = self.decide_idle(keys[i], cost_of(i), w)?;
                    }
                    continue;
                }
                let p = self.params_at(&mut t, now);
                let now_ticks = p.ticks(now);
                // The group's first slots all at once (their misses overlap), then each
                // one a few keys ahead.
                for &ahead in group.iter().take(AHEAD) {
                    t.prefetch(chunk[ahead as usize]);
                }
                for (j, &i) in group.iter().enumerate() {
                    if let Some(&ahead) = group.get(j + AHEAD) {
                        t.prefetch(chunk[ahead as usize]);
                    }
                    let (i, key) = (base + i as usize, chunk[i as usize]);
                    let found = t.probe(key);
                    let before = found.map_or(0, |x| t.slots[x].tat);
                    out[i] = match p.step(before, now, cost_of(i), 0, false) {
                        Ok((new, _)) => {
                            match found {
                                Ok(x) => t.slots[x].tat = new,
                                // Room without growing or evicting: where the probe
                                // ended (make_room would do nothing).
                                Err(vacant) if t.len < self.per_shard && t.fits_one_more() => {
                                    t.insert_at(vacant, key, new)
                                }
                                Err(_) => {
                                    self.make_room(&mut t, now_ticks);
                                    t.insert_new(key, new);
                                }
                            }
                            true
                        }
                        Err(_) => false,
                    };
                }
            }
        }
        Ok(())
    }

    /// [`KeyedLimiter::try_acquire_many`] for keys that may have waiters in `waiters`:
    /// a key where someone waits, or joins before its take, is refused (nobody
    /// overtakes a waiter, and no time scheduled for one moves). While no key has a
    /// queue, the batch; else key by key, each re-checked after its take.
    pub fn try_acquire_many_idle(
        &self,
        keys: &[u64],
        costs: Option<&[u64]>,
        out: &mut [bool],
        waiters: &dyn KeyWaiters,
    ) -> Result<(), Deny> {
        if !waiters.none() {
            for (i, k) in keys.iter().enumerate() {
                out[i] = self.decide_idle(*k, costs.map_or(1, |c| c[i]), waiters)?;
            }
            return Ok(());
        }
        self.many_in(keys, costs, out, Some(waiters))
    }

    /// One key of [`KeyedLimiter::try_acquire_many_idle`] decided on its own.
    fn decide_idle(&self, key: u64, cost: u64, waiters: &dyn KeyWaiters) -> Result<bool, Deny> {
        if waiters.has_waiters(key) {
            return Ok(false);
        }
        match self.try_acquire_idle(key, cost, || waiters.joined(key)) {
            Ok(()) => Ok(true),
            Err(Deny::Wait(_)) => Ok(false),
            Err(d) => Err(d),
        }
    }

    /// Nanoseconds from `at_ns` until `cost` would conform on `key`; changes nothing.
    pub fn delay_for(&self, key: u64, at_ns: u64, cost: u64) -> Result<u64, Deny> {
        let mut t = self.shard(key);
        let p = self.params_at(&mut t, at_ns);
        let tat = t.find(key).map_or(0, |i| t.slots[i].tat);
        match p.step(tat, at_ns, cost, u64::MAX, false) {
            Ok((_, d)) => Ok(d),
            Err(e) => Err(e),
        }
    }

    /// A private copy of `key`'s schedule read at `at_ns`, to play a backlog forward.
    pub(crate) fn sim_at(&self, key: u64, at_ns: u64) -> crate::bucket::SimBucket {
        let mut t = self.shard(key);
        let p = self.params_at(&mut t, at_ns);
        let tat = t.find(key).map_or(0, |i| t.slots[i].tat);
        crate::bucket::SimBucket::new(tat, p)
    }

    /// When a backlog of `total` cost on `key`, served back to back from `at_ns`, would
    /// have its last grant.
    pub fn predict(&self, key: u64, at_ns: u64, total: u64) -> u64 {
        let mut t = self.shard(key);
        let p = self.params_at(&mut t, at_ns);
        let tat = t.find(key).map_or(0, |i| t.slots[i].tat);
        p.predict(tat, at_ns, total)
    }

    /// Give-backs kept so far because a later grant stood on them.
    pub fn refunds_dropped(&self) -> u64 {
        self.refunds_dropped.load(Ordering::Relaxed)
    }

    /// Units `key` could be admitted now (a key not held has a full bucket).
    pub fn available(&self, key: u64) -> f64 {
        let now = self.clock.now_ns();
        let mut t = self.shard(key);
        let p = self.params_at(&mut t, now);
        let tat = t.find(key).map_or(0, |i| t.slots[i].tat);
        p.available(tat, now)
    }

    /// Test hook: holds every shard's lock for `d` (as a long decision would).
    #[doc(hidden)]
    pub fn hold_locks_for(&self, d: std::time::Duration) {
        let held: Vec<_> = self.shards.iter().map(|s| lock(&s.0)).collect();
        std::thread::sleep(d);
        drop(held);
    }

    /// Drops every key whose bucket is full again; returns how many.
    pub fn sweep(&self) -> usize {
        let now_ns = self.clock.now_ns();
        let mut dropped = 0;
        for s in self.shards.iter() {
            let mut t = lock(&s.0);
            let now = self.params_at(&mut t, now_ns).ticks(now_ns);
            let full: Vec<u64> = t
                .slots
                .iter()
                .filter(|s| s.used() && s.tat <= now)
                .map(|s| s.key)
                .collect();
            for k in &full {
                if let Some(i) = t.find(*k) {
                    t.remove_at(i);
                }
            }
            dropped += full.len();
        }
        self.evicted_full.fetch_add(dropped as u64, Ordering::Relaxed);
        dropped
    }
}

impl crate::fork::ForkLocks for KeyedLimiter {
    fn rank(&self) -> crate::fork::Rank {
        crate::fork::Rank::Resource
    }

    fn lock_for_fork<'a>(&'a self, held: &mut Vec<Box<dyn crate::fork::Held + 'a>>) {
        let shards: Vec<_> = self.shards.iter().map(|s| lock(&s.0)).collect();
        held.push(Box::new(shards));
    }
}
