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

use std::collections::hash_map::RandomState;
use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};

use crate::bucket::{epoch_for, needs_rebase, Deny, Params, Undo};
use crate::clock::AnyClock;
use crate::error::Error;
use crate::queue::GrantRef;
use crate::rate::Rate;

const EMPTY: u64 = 0;
/// A key's TAT fits 60 bits; a token carries the shard's rebase count (mod 4) and its
/// live evictions (mod 4) above.
const ERA_SHIFT: u32 = 62;
const ERA_MASK: u64 = 0x3;
const SAMPLE: usize = 32;
const TOKEN_SHIFT: u32 = 60;
const TOKEN_EVICTIONS: u64 = 0x3;
/// Evictions of a debit known only by its grant time (not checked).
const UNKNOWN_EVICTIONS: u64 = u64::MAX;

#[derive(Clone, Copy, Default)]
struct Slot {
    key: u64,
    tat: u64,
}

/// One shard: linear probing, backward-shift deletion, grows up to its cap.
#[derive(Default)]
struct Table {
    slots: Vec<Slot>,
    len: usize,
    cursor: usize,
    /// No bucket is full again before this tick (from the last sweep).
    next_full: u64,
    /// Live keys dropped from this shard so far: a key held before one may be a new
    /// bucket now.
    evicted_live: u64,
    /// Clock nanoseconds of tick 0 for this shard's TATs (see [`crate::Bucket`]).
    epoch: u64,
    /// Rebases so far, and the ticks the last one moved every TAT by.
    rebases: u64,
    last_shift: u64,
    /// Per key, the latest clock time a debit was scheduled at by a time its TAT does
    /// not show (a policy's other level set it): refunds leave everything before it in
    /// place (see [`crate::Bucket::note_ahead`]). Only keys with such a debit to come.
    ahead: std::collections::HashMap<u64, u64>,
}

impl Table {
    fn find(&self, key: u64) -> Option<usize> {
        if self.slots.is_empty() {
            return None;
        }
        let mask = self.slots.len() - 1;
        let mut i = (key as usize) & mask;
        loop {
            let s = self.slots[i];
            if s.key == key {
                return Some(i);
            }
            if s.key == EMPTY {
                return None;
            }
            i = (i + 1) & mask;
        }
    }

    fn insert_new(&mut self, key: u64, tat: u64) {
        let mask = self.slots.len() - 1;
        let mut i = (key as usize) & mask;
        while self.slots[i].key != EMPTY {
            i = (i + 1) & mask;
        }
        self.slots[i] = Slot { key, tat };
        self.len += 1;
        self.next_full = self.next_full.min(tat);
    }

    fn remove_at(&mut self, mut i: usize) {
        let mask = self.slots.len() - 1;
        self.slots[i] = Slot::default();
        self.len -= 1;
        let mut j = i;
        loop {
            j = (j + 1) & mask;
            let s = self.slots[j];
            if s.key == EMPTY {
                return;
            }
            let home = (s.key as usize) & mask;
            // Move s back into the hole if its home is not within (i, j].
            let between = if i <= j {
                home > i && home <= j
            } else {
                home > i || home <= j
            };
            if !between {
                self.slots[i] = s;
                self.slots[j] = Slot::default();
                i = j;
            }
        }
    }

    /// Hints the CPU to fetch the home slot of `key`.
    #[inline]
    fn prefetch(&self, key: u64) {
        if self.slots.is_empty() {
            return;
        }
        let p = &self.slots[(key as usize) & (self.slots.len() - 1)] as *const Slot;
        #[cfg(target_arch = "x86_64")]
        // SAFETY: a prefetch of a valid address has no effect but on the cache.
        unsafe {
            std::arch::x86_64::_mm_prefetch(p as *const i8, std::arch::x86_64::_MM_HINT_T0);
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = p;
    }

    /// Moves the epoch to suit a reading at `at_ns`, shifting every TAT by exactly the
    /// ticks between the epochs (a TAT before the new epoch becomes 0: full either way).
    #[cold]
    fn rebase(&mut self, params: &Params, at_ns: u64) {
        let epoch = epoch_for(at_ns);
        let shift = params.at_epoch(self.epoch).shift_to(epoch);
        for s in self.slots.iter_mut().filter(|s| s.key != EMPTY) {
            s.tat = s.tat.saturating_sub(shift);
        }
        self.next_full = self.next_full.saturating_sub(shift);
        self.epoch = epoch;
        self.rebases += 1;
        self.last_shift = shift;
    }

    /// Brings a debit recorded before the latest rebase(s) to this shard's epoch: exact
    /// across one rebase; across more (years later) it holds nothing any more.
    fn align(&self, t: &mut KeyTaken) {
        let era = self.rebases & ERA_MASK;
        if t.era == era {
            return;
        }
        if (t.era + 1) & ERA_MASK == era {
            t.after = t.after.saturating_sub(self.last_shift);
            t.before = t.before.map(|b| b.saturating_sub(self.last_shift));
        } else {
            (t.after, t.before, t.latest) = (0, None, false);
        }
        t.era = era;
    }

    fn grow(&mut self, cap: usize) {
        let old = std::mem::replace(&mut self.slots, vec![Slot::default(); cap]);
        self.len = 0;
        for s in old.into_iter().filter(|s| s.key != EMPTY) {
            self.insert_new(s.key, s.tat);
        }
    }
}

/// Hashing of keys, one identity per key: an integer by its exact value, a string by its
/// UTF-8 text and a byte string by its bytes, each kind in a domain of its own.
///
/// Distinct integers in [0, 2^64) never share a hash, nor do distinct integers in
/// [-2^63, 0); any other two distinct keys share one only by chance (about 2^-64 a pair,
/// the price of keeping a 64-bit hash per key).
#[derive(Clone, Debug)]
pub struct KeyHasher {
    state: RandomState,
    k0: u64,
    k1: u64,
    /// The seed of negative integers: never `k0`, so -1 and 2^64 - 1 stay apart.
    k_neg: u64,
}

impl Default for KeyHasher {
    fn default() -> Self {
        let state = RandomState::new();
        let k0 = state.hash_one(0x5eed_u64);
        let k1 = state.hash_one(0x5eed_5eed_u64) | 1;
        let mut k_neg = state.hash_one(0x5eed_5eed_5eed_u64);
        if k_neg == k0 {
            k_neg ^= 1;
        }
        KeyHasher { state, k0, k1, k_neg }
    }
}

impl KeyHasher {
    #[inline]
    fn mix(&self, k: u64, seed: u64) -> u64 {
        let mut x = (k ^ seed).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        x ^= x >> 32;
        x = x.wrapping_mul(self.k1);
        x ^= x >> 29;
        x.max(1)
    }

    /// The key of a non-negative integer `k` (a uint64 value).
    #[inline]
    pub fn int(&self, k: u64) -> u64 {
        self.mix(k, self.k0)
    }

    /// The key of the integer `v` (an int64 value): equal to `int(v)` when `v >= 0`,
    /// never to `int(v as u64)` when `v < 0`.
    #[inline]
    pub fn signed(&self, v: i64) -> u64 {
        if v >= 0 {
            self.mix(v as u64, self.k0)
        } else {
            self.mix(v as u64, self.k_neg)
        }
    }

    /// The key of a string (never equal to the same text as bytes or an int, but by chance).
    #[inline]
    pub fn str(&self, s: &str) -> u64 {
        self.state.hash_one((1u8, s)).max(1)
    }

    /// The key of an integer outside [-2^63, 2^64), from its decimal digits (with a sign).
    #[inline]
    pub fn big_int(&self, digits: &str) -> u64 {
        self.state.hash_one((3u8, digits)).max(1)
    }

    /// The key of a byte string.
    #[inline]
    pub fn bytes(&self, b: &[u8]) -> u64 {
        self.state.hash_one((2u8, b)).max(1)
    }
}

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
            delay_ns: 0,
        }
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
            if t.len + 1 > t.slots.len() * 3 / 4 {
                let cap = (t.slots.len() * 2).clamp(8, self.cap);
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
                .filter(|s| s.key != EMPTY)
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
            if s.key != EMPTY && nearest.is_none_or(|(tat, _)| s.tat < tat) {
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
                // Bounded by the keys with a debit still to come.
                t.ahead.retain(|_, a| *a > now);
            }
            let a = t.ahead.entry(key).or_insert(0);
            *a = (*a).max(at_ns);
        }
        Ok(taken)
    }

    /// The latest time a debit on `key` was scheduled at past `at_ns` (0: none).
    fn ahead_of(t: &mut Table, key: u64, at_ns: u64) -> u64 {
        match t.ahead.get(&key) {
            Some(&a) if a > at_ns => a,
            Some(_) => {
                t.ahead.remove(&key);
                0
            }
            None => 0,
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

    fn take_in(
        &self,
        t: &mut Table,
        key: u64,
        at_ns: u64,
        cost: u64,
        max_delay_ns: u64,
        scheduled: bool,
    ) -> Result<KeyTaken, Deny> {
        let p = self.params_at(t, at_ns);
        let found = t.find(key);
        let before = found.map_or(0, |i| t.slots[i].tat);
        let (new, delay_ns) = p.step(before, at_ns, cost, max_delay_ns, scheduled)?;
        match found {
            Some(i) => t.slots[i].tat = new,
            None => {
                self.make_room(t, p.ticks(at_ns));
                t.insert_new(key, new);
            }
        }
        Ok(KeyTaken {
            key,
            before: Some(before),
            after: new,
            cost,
            latest: true,
            evictions: t.evicted_live,
            token: false,
            era: t.rebases & ERA_MASK,
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
        // shard's lock once per chunk and walk its group, prefetching a few slots ahead.
        const CHUNK: usize = 4096;
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
                let p = self.params_at(&mut t, now);
                let now_ticks = p.ticks(now);
                for (j, &i) in group.iter().enumerate() {
                    if let Some(&ahead) = group.get(j + 8) {
                        t.prefetch(chunk[ahead as usize]);
                    }
                    let (i, key) = (base + i as usize, chunk[i as usize]);
                    let found = t.find(key);
                    let before = found.map_or(0, |x| t.slots[x].tat);
                    out[i] = match p.step(before, now, cost_of(i), 0, false) {
                        Ok((new, _)) => {
                            match found {
                                Some(x) => t.slots[x].tat = new,
                                None => {
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

    /// The one undo rule on `t`'s key (as [`crate::Bucket::give_back`], under the
    /// shard's lock): gives back `ret` at `at_ns`, exactly while `t` is the key's latest
    /// change, else by the refund rule capped by what `t` can still hold, else kept and
    /// counted. `t` is updated, so a later give-back starts from here.
    pub fn give_back(&self, t: &mut KeyTaken, ret: u64, at_ns: u64) -> Undo {
        let ret = ret.min(t.cost);
        if ret == 0 {
            return Undo::Nothing;
        }
        let mut g = self.shard(t.key);
        let p = self.params_at(&mut g, at_ns);
        g.align(t);
        let evictions = if t.token {
            g.evicted_live & TOKEN_EVICTIONS
        } else {
            g.evicted_live
        };
        let found = g
            .find(t.key)
            .filter(|_| t.evictions == UNKNOWN_EVICTIONS || evictions == t.evictions);
        let Some(i) = found else {
            // Dropped as full (nothing is held on the key any more), or a live key was
            // dropped since (the key's bucket may be a new one, holding others' debits).
            t.latest = false;
            t.cost -= ret;
            return Undo::Nothing;
        };
        let tat = g.slots[i].tat;
        let exact = t.latest && tat == t.after;
        let (new, how) = if exact {
            let new = match t.before {
                Some(b) if ret == t.cost => b,
                _ => tat.saturating_sub(self.params.cost_ticks(ret)),
            };
            t.after = new;
            (new, Undo::Exact)
        } else {
            t.latest = false;
            let ahead = Self::ahead_of(&mut g, t.key, at_ns);
            match p.refund_tat(tat, at_ns, self.params.cost_ticks(ret), Some(t.after), ahead) {
                Some(new) => {
                    t.after -= (tat - new).min(t.after);
                    (new, Undo::Refunded)
                }
                None => {
                    t.cost -= ret;
                    self.refunds_dropped.fetch_add(1, Ordering::Relaxed);
                    return Undo::Dropped;
                }
            }
        };
        t.cost -= ret;
        if new == tat {
            return Undo::Nothing;
        }
        g.slots[i].tat = new;
        g.next_full = g.next_full.min(new);
        self.given.fetch_max(at_ns, Ordering::AcqRel);
        how
    }

    /// The latest clock time at which an undo or refund gave capacity back on any key: a
    /// key's grant scheduled in the past is never dated before it.
    pub fn given_at(&self) -> u64 {
        self.given.load(Ordering::Acquire)
    }

    /// Refunds `cost` to `key` at `at_ns` by the refund rule (for a debit not held, e.g.
    /// a permit settled without its grant's token).
    pub fn refund(&self, key: u64, cost: u64) -> Undo {
        let now = self.clock.now_ns();
        let mut t = self.shard(key);
        let p = self.params_at(&mut t, now);
        let Some(i) = t.find(key) else {
            return Undo::Nothing;
        };
        let tat = t.slots[i].tat;
        let ahead = Self::ahead_of(&mut t, key, now);
        let Some(new) = p.refund_tat(tat, now, self.params.cost_ticks(cost), None, ahead) else {
            self.refunds_dropped.fetch_add(1, Ordering::Relaxed);
            return Undo::Dropped;
        };
        if new == tat {
            return Undo::Nothing;
        }
        t.slots[i].tat = new;
        t.next_full = t.next_full.min(new);
        self.given.fetch_max(now, Ordering::AcqRel);
        Undo::Refunded
    }

    /// Charges `cost` to `key` now regardless of conformance (it may go into debt).
    pub fn charge(&self, key: u64, cost: u64) {
        self.charge_tat(key, self.clock.now_ns(), cost, None);
    }

    /// Charges `extra` more on the debit `t` at `at_ns` (may go into debt); `t` stays
    /// exactly undoable while it is still its key's latest change.
    pub fn charge_more(&self, t: &mut KeyTaken, extra: u64, at_ns: u64) {
        let (old, new) = self.charge_tat(t.key, at_ns, extra, Some(t));
        if t.latest && old == Some(t.after) {
            t.after = new;
        } else {
            t.latest = false;
        }
        t.cost = t.cost.saturating_add(extra);
    }

    /// Returns the key's TAT before (None: not held) and after the charge, with `held`
    /// brought to the shard's epoch.
    fn charge_tat(&self, key: u64, at_ns: u64, cost: u64, held: Option<&mut KeyTaken>) -> (Option<u64>, u64) {
        let mut t = self.shard(key);
        let now_ticks = self.params_at(&mut t, at_ns).ticks(at_ns);
        if let Some(h) = held {
            t.align(h);
        }
        let add = self.params.cost_ticks(cost);
        match t.find(key) {
            Some(i) => {
                let old = t.slots[i].tat;
                let new = (old.max(now_ticks) + add).min(crate::bucket::TAT_LIMIT);
                t.slots[i].tat = new;
                (Some(old), new)
            }
            None => {
                self.make_room(&mut t, now_ticks);
                let new = (now_ticks + add).min(crate::bucket::TAT_LIMIT);
                t.insert_new(key, new);
                (None, new)
            }
        }
    }

    /// The token of the least TAT a debit of `cost` on `key` taken at `at_ns` left.
    fn held_token(&self, key: u64, at_ns: u64, cost: u64) -> u64 {
        let mut t = self.shard(key);
        let p = self.params_at(&mut t, at_ns);
        let tat = p
            .ticks(at_ns)
            .saturating_add(p.cost_ticks(cost))
            .min(crate::bucket::TAT_LIMIT);
        ((t.rebases & ERA_MASK) << ERA_SHIFT) | tat
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
                .filter(|s| s.key != EMPTY && s.tat <= now)
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

/// At most `limit` permits held per key; keys with none held take no memory.
pub struct KeyedSemaphore {
    limit: u64,
    hasher: KeyHasher,
    shards: Box<[Shard<HashMap<u64, u64>>]>,
    shard_bits: u32,
    serial: u64,
}

impl KeyedSemaphore {
    /// Its place in the one order every policy waits for its concurrency levels in
    /// (made earlier, waited for first; one key after another).
    pub fn serial(&self) -> u64 {
        self.serial
    }

    /// `limit` permits per key.
    pub fn new(limit: u64) -> Result<KeyedSemaphore, Error> {
        if limit == 0 {
            return Err(Error::invalid("limit", 0, "must be an integer >= 1"));
        }
        let n = 64usize;
        Ok(KeyedSemaphore {
            limit,
            hasher: KeyHasher::default(),
            shards: (0..n).map(|_| Shard(Mutex::new(HashMap::new()))).collect(),
            shard_bits: n.trailing_zeros(),
            serial: crate::concurrency::next_serial(),
        })
    }

    /// The hasher that turns keys into map keys.
    pub fn hasher(&self) -> &KeyHasher {
        &self.hasher
    }

    /// The per-key limit.
    pub fn limit(&self) -> u64 {
        self.limit
    }

    fn shard(&self, key: u64) -> MutexGuard<'_, HashMap<u64, u64>> {
        lock(&self.shards[(key >> (64 - self.shard_bits)) as usize].0)
    }

    /// Takes `n` permits on `key` now or refuses.
    pub fn try_take(&self, key: u64, n: u64) -> Result<(), Deny> {
        self.take_in(&mut self.shard(key), key, n)
    }

    /// [`KeyedSemaphore::try_take`] without waiting for the key's shard lock: None
    /// (nothing changed) when it is busy.
    #[inline]
    pub fn try_take_nowait(&self, key: u64, n: u64) -> Option<Result<(), Deny>> {
        let mut m = try_lock(&self.shards[(key >> (64 - self.shard_bits)) as usize].0)?;
        Some(self.take_in(&mut m, key, n))
    }

    fn take_in(&self, m: &mut HashMap<u64, u64>, key: u64, n: u64) -> Result<(), Deny> {
        if n > self.limit {
            return Err(Deny::TooLarge {
                cost: n,
                burst: self.limit,
                unit: 0,
            });
        }
        let cur = m.get(&key).copied().unwrap_or(0);
        if !crate::concurrency::fits(cur, n, self.limit) {
            return Err(Deny::Wait(u64::MAX));
        }
        m.insert(key, cur + n);
        Ok(())
    }

    /// Returns `n` permits on `key`.
    pub fn release(&self, key: u64, n: u64) {
        let mut m = self.shard(key);
        if let Some(v) = m.get_mut(&key) {
            *v = v.saturating_sub(n);
            if *v == 0 {
                m.remove(&key);
            }
        }
    }

    /// Permits held on `key`.
    pub fn in_use(&self, key: u64) -> u64 {
        self.shard(key).get(&key).copied().unwrap_or(0)
    }

    /// Keys holding permits now.
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| lock(&s.0).len()).sum()
    }

    /// True when no key holds a permit.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
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

/// A keyed semaphore's shard held across a fork; in the child every permit is free (see
/// [`crate::Semaphore`]'s fork note).
struct ShardReset<'a>(MutexGuard<'a, HashMap<u64, u64>>);

impl crate::fork::Held for ShardReset<'_> {
    fn in_child(&mut self) {
        self.0.clear();
    }
}

impl crate::fork::ForkLocks for KeyedSemaphore {
    fn rank(&self) -> crate::fork::Rank {
        crate::fork::Rank::Resource
    }

    fn lock_for_fork<'a>(&'a self, held: &mut Vec<Box<dyn crate::fork::Held + 'a>>) {
        let shards: Vec<_> = self.shards.iter().map(|s| ShardReset(lock(&s.0))).collect();
        held.push(Box::new(shards));
    }
}

/// One key of a [`KeyedLimiter`] as a queue resource (waiting per key).
pub struct KeyBucket {
    /// The map.
    pub keyed: std::sync::Arc<KeyedLimiter>,
    /// The hashed key.
    pub key: u64,
}

impl crate::queue::Resource for KeyBucket {
    fn try_take(&self, now_ns: u64, costs: &[u64]) -> Result<(), Deny> {
        self.keyed.take(self.key, now_ns, costs[0], 0).map(|_| ())
    }

    fn ready_at(&self, at_ns: u64, costs: &[u64]) -> Result<Option<u64>, Deny> {
        // Never before capacity given back since: it was not free at an earlier time.
        let at = at_ns.max(self.keyed.given_at());
        Ok(Some(at.saturating_add(self.keyed.delay_for(self.key, at, costs[0])?)))
    }

    fn take_at(&self, at_ns: u64, costs: &[u64]) -> Result<u64, Deny> {
        self.keyed
            .take_with(self.key, at_ns, costs[0], 0, true)
            .map(|t| t.token())
    }

    fn give_back(&self, costs: &[u64], token: Option<u64>) {
        match token {
            Some(token) => {
                let mut t = KeyTaken::from_token(self.key, token, costs[0]);
                self.keyed.give_back(&mut t, costs[0], self.keyed.clock.now_ns());
            }
            None => {
                self.keyed.refund(self.key, costs[0]);
            }
        }
    }

    fn try_take_token(&self, now_ns: u64, costs: &[u64]) -> Result<Option<u64>, Deny> {
        self.keyed.take(self.key, now_ns, costs[0], 0).map(|t| Some(t.token()))
    }

    fn try_take_token_nowait(&self, now_ns: u64, costs: &[u64]) -> Option<Result<Option<u64>, Deny>> {
        self.keyed
            .take_nowait(self.key, now_ns, costs[0], 0)
            .map(|r| r.map(|t| Some(t.token())))
    }

    fn settle(&self, estimated: &[u64], actual: &[u64], grant: GrantRef) -> GrantRef {
        let (e, a) = (estimated[0], actual[0]);
        let now = self.keyed.clock.now_ns();
        // Without a token: capped by what a debit of `e` taken at `grant.at_ns` holds.
        let held = self.keyed.held_token(self.key, grant.at_ns.saturating_sub(1), e);
        let mut t = KeyTaken::from_token(self.key, grant.token.unwrap_or(held), e);
        if grant.token.is_none() {
            t.latest = false;
            t.evictions = UNKNOWN_EVICTIONS;
        }
        if a < e {
            self.keyed.give_back(&mut t, e - a, now);
        } else if a > e {
            self.keyed.charge_more(&mut t, a - e, now);
        }
        GrantRef {
            at_ns: grant.at_ns,
            token: t.latest.then_some(t.token()),
        }
    }

    fn service_ns(&self, costs: &[u64]) -> f64 {
        costs[0] as f64 * self.keyed.rate().interval_ns()
    }

    fn error_for(&self, d: Deny) -> Error {
        match d {
            Deny::TooLarge { cost, burst, .. } => Error::CostTooLarge {
                unit: "per key".into(),
                cost,
                burst,
            },
            Deny::Wait(ns) => Error::Overloaded {
                reason: "not admitted".into(),
                retry_after_ns: ns,
            },
        }
    }

    fn predict(&self, now_ns: u64, ahead: &[u64], costs: &[u64]) -> Option<u64> {
        Some(self.keyed.predict(self.key, now_ns, ahead[0].saturating_add(costs[0])))
    }

    /// The FIFO schedule played forward on a copy of the key's bucket, each queued
    /// reservation debited no earlier than its promised time (a summed prediction would
    /// count the capacity a bucket cannot keep while it waits for that time).
    fn predict_backlog(&self, now_ns: u64, backlog: &[crate::queue::Queued<'_>], costs: &[u64]) -> Option<u64> {
        let mut sim = self.keyed.sim_at(self.key, now_ns);
        let mut t = now_ns;
        let me = crate::queue::Queued {
            costs,
            due: None,
            charge: false,
        };
        for q in backlog.iter().copied().chain(std::iter::once(me)) {
            let from = t.max(q.due.unwrap_or(0));
            // An overage charge is debited in turn without waiting for conformance.
            t = if q.charge { from } else { sim.ready(from, q.costs[0])? };
            sim.take(t, q.costs[0]);
        }
        Some(t)
    }
}

/// One key of a [`KeyedSemaphore`] as a queue resource.
pub struct KeyPermits {
    /// The map.
    pub sem: std::sync::Arc<KeyedSemaphore>,
    /// The hashed key.
    pub key: u64,
}

impl crate::queue::Resource for KeyPermits {
    fn try_take(&self, _now_ns: u64, costs: &[u64]) -> Result<(), Deny> {
        self.sem.try_take(self.key, costs[0])
    }

    fn try_take_token_nowait(&self, _now_ns: u64, costs: &[u64]) -> Option<Result<Option<u64>, Deny>> {
        self.sem.try_take_nowait(self.key, costs[0]).map(|r| r.map(|_| None))
    }

    fn ready_at(&self, at_ns: u64, costs: &[u64]) -> Result<Option<u64>, Deny> {
        if costs[0] > self.sem.limit() {
            return Err(Deny::TooLarge {
                cost: costs[0],
                burst: self.sem.limit(),
                unit: 0,
            });
        }
        Ok(crate::concurrency::fits(self.sem.in_use(self.key), costs[0], self.sem.limit()).then_some(at_ns))
    }

    fn take_at(&self, at_ns: u64, costs: &[u64]) -> Result<u64, Deny> {
        self.try_take(at_ns, costs).map(|_| 0)
    }

    fn schedules_in_time(&self) -> bool {
        false
    }

    fn give_back(&self, costs: &[u64], _token: Option<u64>) {
        self.sem.release(self.key, costs[0]);
    }

    fn service_ns(&self, costs: &[u64]) -> f64 {
        costs[0] as f64
    }

    fn error_for(&self, d: Deny) -> Error {
        crate::concurrency::permits_error(d)
    }

    fn predict(&self, _now_ns: u64, _ahead: &[u64], _costs: &[u64]) -> Option<u64> {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Bucket, ManualClock};
    use std::sync::Arc;

    fn keyed(per_sec: f64, burst: u64, max_keys: usize) -> (KeyedLimiter, Arc<ManualClock>) {
        let c = Arc::new(ManualClock::new(0).unwrap());
        let k = KeyedLimiter::new(
            Rate::new(per_sec, 1e9, burst).unwrap(),
            max_keys,
            AnyClock::Manual(c.clone()),
        );
        (k.unwrap(), c)
    }

    #[test]
    fn decides_like_independent_buckets() {
        let (k, clock) = keyed(10.0, 3, 1000);
        let buckets: Vec<Bucket> = (0..20).map(|_| Bucket::new(k.rate())).collect();
        let mut x = 12345u64;
        for step in 0..20_000u64 {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let key = (x >> 33) % 20;
            let cost = 1 + (x >> 20) % 3;
            if step % 7 == 0 {
                clock.advance((x >> 40) % 200_000_000).unwrap();
            }
            let now = clock.now_ns();
            let a = k.try_acquire(k.hasher().int(key), cost).is_ok();
            let b = buckets[key as usize].take(now, cost, 0).is_ok();
            assert_eq!(a, b, "step {step}");
        }
    }

    #[test]
    fn eviction_of_full_buckets_changes_nothing_and_bounds_memory() {
        let (k, clock) = keyed(1.0, 1, 100);
        for i in 0..10_000u64 {
            assert!(k.try_acquire(k.hasher().int(i), 1).is_ok());
            clock.advance(1_000_000_000).unwrap();
        }
        assert!(k.len() <= k.max_keys());
        let c = k.counts();
        assert_eq!(c.evicted_live, 0);
        assert!(c.evicted_full > 0);
        // Without time passing, live keys must go: counted.
        for i in 10_000..10_500u64 {
            k.try_acquire(k.hasher().int(i), 1).unwrap();
        }
        assert!(k.len() <= k.max_keys());
        assert!(k.counts().evicted_live > 0);
    }

    #[test]
    fn remove_keeps_probe_chains() {
        let mut t = Table::default();
        t.grow(16);
        // Keys colliding on the same home slot, then removal in the middle.
        let keys: Vec<u64> = (1..=6).map(|i| i * 16 + 3).collect();
        for k in &keys {
            t.insert_new(*k, *k);
        }
        t.remove_at(t.find(keys[2]).unwrap());
        for k in keys.iter().filter(|k| **k != keys[2]) {
            assert_eq!(t.slots[t.find(*k).unwrap()].tat, *k);
        }
        assert_eq!(t.find(keys[2]), None);
    }

    #[test]
    fn one_identity_per_key() {
        let h = KeyHasher::default();
        // Negative ints never share the hash of their two's complement.
        for v in [-1i64, -2, i64::MIN, i64::MIN + 1, -12345] {
            assert_ne!(h.signed(v), h.int(v as u64), "{v}");
        }
        for v in [0i64, 1, 7, i64::MAX] {
            assert_eq!(h.signed(v), h.int(v as u64), "{v}");
        }
        // One text in three kinds: three keys.
        let kinds = [h.str("1"), h.bytes(b"1"), h.int(1), h.big_int("1")];
        for (i, a) in kinds.iter().enumerate() {
            for b in &kinds[i + 1..] {
                assert_ne!(a, b);
            }
        }
        assert_eq!(h.str("a"), h.str("a"));
        assert_ne!(h.big_int("18446744073709551616"), h.str("18446744073709551616"));
        // Distinct ints near the edges of both domains: no hash shared.
        let mut seen = HashMap::new();
        for d in 0..1000u64 {
            for x in [d, u64::MAX - d, (1 << 63) + d, (1 << 63) - 1 - d] {
                seen.insert(x as i128, h.int(x));
            }
            for v in [-1 - d as i64, i64::MIN + d as i64] {
                seen.insert(v as i128, h.signed(v));
            }
        }
        let hashes: std::collections::HashSet<u64> = seen.values().copied().collect();
        assert_eq!(hashes.len(), seen.len());
    }

    #[test]
    fn keyed_semaphore_counts_per_key() {
        let s = KeyedSemaphore::new(2).unwrap();
        let a = s.hasher().str("a");
        assert!(s.try_take(a, 2).is_ok());
        assert!(s.try_take(a, 1).is_err());
        assert!(s.try_take(s.hasher().str("b"), 1).is_ok());
        s.release(a, 2);
        assert_eq!(s.in_use(a), 0);
        assert_eq!(s.len(), 1);
    }

    #[test]
    fn keyed_semaphore_sums_never_wrap() {
        let s = Arc::new(KeyedSemaphore::new(u64::MAX).unwrap());
        let a = s.hasher().str("a");
        assert!(s.try_take(a, 1 << 63).is_ok());
        assert_eq!(s.try_take(a, (1 << 63) + 1), Err(Deny::Wait(u64::MAX)));
        assert_eq!(s.in_use(a), 1 << 63);
        let key = KeyPermits { sem: s.clone(), key: a };
        assert_eq!(crate::queue::Resource::ready_at(&key, 3, &[(1 << 63) + 1]), Ok(None));
    }
}

#[cfg(test)]
mod epoch_tests {
    use super::*;
    use crate::{Bucket, ManualClock};
    use std::sync::Arc;

    const DAY_NS: u64 = 86_400_000_000_000;
    const YEAR_NS: u64 = 365 * DAY_NS + DAY_NS / 4;

    fn keyed_at(rate: Rate, start_ns: u64) -> (KeyedLimiter, Arc<ManualClock>) {
        let c = Arc::new(ManualClock::new(start_ns).unwrap());
        (KeyedLimiter::new(rate, 1000, AnyClock::Manual(c.clone())).unwrap(), c)
    }

    /// Random operations on a keyed map and on one bucket per key, the clock jumping by
    /// up to `max_step_ns` (so shards rebase, each at its own moment): same answers.
    fn like_buckets(rate: Rate, start_ns: u64, seed: u64, steps: usize, max_step_ns: u64) {
        let (k, clock) = keyed_at(rate, start_ns);
        let buckets: Vec<Bucket> = (0..20).map(|_| Bucket::new(rate)).collect();
        let mut x = seed;
        let mut next = || {
            x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let z = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            let z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        };
        for step in 0..steps {
            let key = next() % 20;
            let (h, b) = (k.hasher().int(key), &buckets[key as usize]);
            let cost = 1 + next() % 3;
            let now = clock.now_ns();
            match next() % 12 {
                0..=3 => assert_eq!(
                    k.try_acquire(h, cost).is_ok(),
                    b.take(now, cost, 0).is_ok(),
                    "step {step}"
                ),
                4..=5 => {
                    let max = next() % (4 * max_step_ns);
                    let got = k.take(h, now, cost, max).map(|t| t.delay_ns);
                    assert_eq!(got, b.take(now, cost, max).map(|t| t.delay_ns), "step {step}");
                }
                6 => assert_eq!(k.delay_for(h, now, cost), b.delay_for(now, cost), "step {step}"),
                7 => assert_eq!(
                    k.predict(h, now, 3 * cost),
                    b.predict(now, 2 * cost, cost),
                    "step {step}"
                ),
                8 => {
                    k.charge(h, 5 * cost);
                    b.charge(now, 5 * cost);
                }
                9 => assert_eq!(k.refund(h, cost), b.refund(now, cost), "step {step}"),
                _ => {
                    let dt = next() % max_step_ns;
                    if clock.advance(dt).is_err() {
                        break;
                    }
                }
            }
            let now = clock.now_ns();
            assert_eq!(k.available(h).to_bits(), b.available(now).to_bits(), "step {step}");
        }
    }

    #[test]
    fn a_keyed_map_far_from_zero_decides_like_buckets() {
        for seed in 1..=4u64 {
            let r = Rate::new(10.0, 1e9, 3).unwrap();
            like_buckets(r, 0, seed, 20_000, 2_000_000_000);
            like_buckets(r, 1 << 62, seed, 20_000, 2_000_000_000);
            like_buckets(r, 1_764_000_000_123_456_789, seed, 20_000, 2_000_000_000);
            let slow = Rate::new(1.0, 3_600e9, 3).unwrap();
            like_buckets(slow, 1 << 62, seed, 3_000, 2 * YEAR_NS);
            like_buckets(slow, 0, seed, 1_000, 11 * YEAR_NS);
        }
    }

    /// History checker seed 729: a policy debited a key at a future time its other level
    /// set; a refund of an earlier debit on the key then freed that time too (4 units at
    /// one instant with burst 3). Like a bucket, the key keeps it from refunds.
    #[test]
    fn a_refund_leaves_a_debit_scheduled_ahead_by_another_level_in_place() {
        let (k, clock) = keyed_at(Rate::new(2.0, 1e9, 3).unwrap(), 0);
        let key = k.hasher().int(1);
        let mut a = k.take(key, 0, 2, 0).unwrap();
        k.take_at(key, 1_000_000_000, 1).unwrap();
        k.give_back(&mut a, 2, 0);
        clock.set(1_000_000_000).unwrap();
        assert!(
            k.take(key, 1_000_000_000, 3, 0).is_err(),
            "3 more units at the instant a debit of 1 was scheduled, with burst 3"
        );
        assert!(k.take(key, 1_000_000_000, 2, 0).is_ok());
    }

    #[test]
    fn a_give_back_across_a_rebase_stays_capped_by_what_the_debit_holds() {
        let (k, clock) = keyed_at(Rate::new(1.0, 1e9, 10).unwrap(), 0);
        let key = k.hasher().int(7);
        let t0 = (1 << 57) - 500_000_000;
        let mut a = k.take(key, t0, 1, 0).unwrap();
        let mut b = k.take(key, t0, 5, 0).unwrap();
        let token = b.token();
        let t1 = t0 + 750_000_000;
        clock.set(t1).unwrap();
        assert!((k.available(key) - 4.75).abs() < 1e-6);
        assert_eq!(lock(&k.shards[0].0).rebases, 1, "rebased");
        // The latest, across the rebase: undone exactly.
        assert_eq!(k.give_back(&mut b, 2, t1), Undo::Exact);
        assert!((k.available(key) - 6.75).abs() < 1e-6, "{}", k.available(key));
        // Not the latest: refunded only the 0.25 s the first debit still holds.
        assert_eq!(k.give_back(&mut a, 1, t1), Undo::Refunded);
        assert!((k.available(key) - 7.0).abs() < 1e-6, "{}", k.available(key));
        // A token from before the rebase still caps by what its debit holds.
        let mut c = KeyTaken::from_token(key, token, 5);
        assert_eq!(k.give_back(&mut c, 3, t1), Undo::Refunded);
        assert!((k.available(key) - 10.0).abs() < 1e-6, "{}", k.available(key));
    }

    #[test]
    fn a_refund_that_rebases_the_shard_refunds_in_the_new_epoch() {
        let (k, clock) = keyed_at(Rate::new(1.0, 1e9, 10).unwrap(), 0);
        let key = k.hasher().int(7);
        let t0 = (1 << 57) - 500_000_000;
        clock.set(t0).unwrap();
        k.try_acquire(key, 6).unwrap();
        clock.set(t0 + 750_000_000).unwrap();
        // The refund is the first call past the rebase point: it rebases, then refunds.
        assert_eq!(k.refund(key, 2), Undo::Refunded);
        assert_eq!(lock(&k.shards[0].0).rebases, 1, "rebased");
        assert!((k.available(key) - 6.75).abs() < 1e-6, "{}", k.available(key));
    }

    #[test]
    fn keyed_one_a_day_for_120_years() {
        for start in [0, 1_764_000_000_123_456_789, 1 << 62] {
            let (k, clock) = keyed_at(Rate::new(1.0, 86_400e9, 1).unwrap(), start);
            let (a, b) = (k.hasher().str("a"), k.hasher().str("b"));
            let days = 120 * YEAR_NS / DAY_NS;
            let mut admitted = 0;
            for d in 0..days {
                admitted += k.try_acquire(a, 1).is_ok() as u64;
                assert!(k.try_acquire(a, 1).is_err(), "day {d}");
                if d % 1000 == 0 {
                    let mut out = [false; 3];
                    k.try_acquire_many(&[b, b, a], None, &mut out).unwrap();
                    assert_eq!(out, [true, false, false], "day {d}");
                }
                clock.advance(DAY_NS).unwrap();
            }
            assert_eq!(admitted, days, "start {start}");
            assert_eq!(k.sweep(), 2);
        }
    }
}
