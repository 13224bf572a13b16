//! Keyed concurrency: one permit count per key in a sharded map.

use std::collections::HashMap;

use super::*;

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
