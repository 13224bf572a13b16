//! One shard's table: open addressing with linear probing and backward-shift deletion,
//! 16 bytes per key (its hash and its TAT). Every 64-bit hash is a key (0 included): a
//! slot is empty when its TAT is [`VACANT`], a value no TAT takes (they fit 60 bits).

use super::*;

/// The TAT of an empty slot.
pub(super) const VACANT: u64 = u64::MAX;

#[derive(Clone, Copy)]
pub(super) struct Slot {
    pub(super) key: u64,
    pub(super) tat: u64,
}

/// An empty slot whose bytes are all 0xFF (its key is never read while it is empty).
const CLEARED: Slot = Slot {
    key: u64::MAX,
    tat: VACANT,
};

impl Default for Slot {
    fn default() -> Self {
        Slot { key: 0, tat: VACANT }
    }
}

impl Slot {
    /// True when the slot holds a key.
    #[inline]
    pub(super) fn used(&self) -> bool {
        self.tat != VACANT
    }
}

/// One shard: linear probing, backward-shift deletion, grows up to its cap.
#[derive(Default)]
pub(super) struct Table {
    pub(super) slots: Vec<Slot>,
    pub(super) len: usize,
    pub(super) cursor: usize,
    /// No bucket is full again before this tick (from the last sweep).
    pub(super) next_full: u64,
    /// Live keys dropped from this shard so far: a key held before one may be a new
    /// bucket now.
    pub(super) evicted_live: u64,
    /// Clock nanoseconds of tick 0 for this shard's TATs (see [`crate::Bucket`]).
    pub(super) epoch: u64,
    /// Rebases so far, and the ticks the last one moved every TAT by.
    pub(super) rebases: u64,
    pub(super) last_shift: u64,
    /// Per key, the latest clock time a debit was scheduled at by a time its TAT does
    /// not show (a policy's other level set it): refunds leave everything before it in
    /// place (see [`crate::Bucket::note_ahead`]). Only keys with such a debit to come.
    pub(super) ahead: std::collections::HashMap<u64, u64>,
    /// The latest such time of keys folded out of `ahead` when it grew past its bound:
    /// it then holds for every key of the shard (conservative: fewer refunds, never more).
    pub(super) ahead_all: u64,
}

impl Table {
    pub(super) fn find(&self, key: u64) -> Option<usize> {
        self.probe(key).ok()
    }

    /// The slot of `key` (Ok), or the empty slot that ends its probe (Err: where
    /// [`Table::insert_at`] puts it while the table does not change; `usize::MAX` when
    /// the table has no slots yet).
    #[inline]
    pub(super) fn probe(&self, key: u64) -> Result<usize, usize> {
        if self.slots.is_empty() {
            return Err(usize::MAX);
        }
        let mask = self.slots.len() - 1;
        let mut i = (key as usize) & mask;
        loop {
            let s = self.slots[i];
            if !s.used() {
                return Err(i);
            }
            if s.key == key {
                return Ok(i);
            }
            i = (i + 1) & mask;
        }
    }

    /// True when one more key fits without growing (what [`Table::insert_at`] needs:
    /// the load stays at most 3/4, and a slot is free).
    #[inline]
    pub(super) fn fits_one_more(&self) -> bool {
        self.len < self.slots.len() * 3 / 4
    }

    /// Puts new `key` in `vacant`, the empty slot its [`Table::probe`] ended at, the
    /// table unchanged since: what [`Table::insert_new`] does, without probing again.
    #[inline]
    pub(super) fn insert_at(&mut self, vacant: usize, key: u64, tat: u64) {
        debug_assert!(tat <= crate::bucket::TAT_LIMIT);
        debug_assert!(!self.slots[vacant].used() && self.probe(key) == Err(vacant));
        self.slots[vacant] = Slot { key, tat };
        self.len += 1;
        self.next_full = self.next_full.min(tat);
    }

    pub(super) fn insert_new(&mut self, key: u64, tat: u64) {
        debug_assert!(tat <= crate::bucket::TAT_LIMIT);
        let mask = self.slots.len() - 1;
        let mut i = (key as usize) & mask;
        while self.slots[i].used() {
            i = (i + 1) & mask;
        }
        self.slots[i] = Slot { key, tat };
        self.len += 1;
        self.next_full = self.next_full.min(tat);
    }

    pub(super) fn remove_at(&mut self, mut i: usize) {
        let mask = self.slots.len() - 1;
        self.slots[i] = Slot::default();
        self.len -= 1;
        let mut j = i;
        loop {
            j = (j + 1) & mask;
            let s = self.slots[j];
            if !s.used() {
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
    pub(super) fn prefetch(&self, key: u64) {
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
    pub(super) fn rebase(&mut self, params: &Params, at_ns: u64) {
        let epoch = epoch_for(at_ns);
        let shift = params.at_epoch(self.epoch).shift_to(epoch);
        for s in self.slots.iter_mut().filter(|s| s.used()) {
            s.tat = s.tat.saturating_sub(shift);
        }
        self.next_full = self.next_full.saturating_sub(shift);
        self.epoch = epoch;
        self.rebases += 1;
        self.last_shift = shift;
    }

    /// Brings a debit recorded before the latest rebase(s) to this shard's epoch: exact
    /// across one rebase; across more (years later) it holds nothing any more.
    pub(super) fn align(&self, t: &mut KeyTaken) {
        let era = self.rebases & ERA_MASK;
        if t.era == era {
            return;
        }
        if (t.era + 1) & ERA_MASK == era {
            t.after = t.after.saturating_sub(self.last_shift);
            t.held = t.held.saturating_sub(self.last_shift);
            t.before = t.before.map(|b| b.saturating_sub(self.last_shift));
        } else {
            (t.after, t.held, t.before, t.latest) = (0, 0, None, false);
        }
        t.era = era;
    }

    /// Moves every key into `cap` (a power of two, more than the keys) slots: the same
    /// keys, TATs and `len`, as [`Table::insert_new`] of each would leave them.
    pub(super) fn grow(&mut self, cap: usize) {
        debug_assert!(cap.is_power_of_two() && cap > self.len);
        // Every byte 0xFF: filled as one memset, not slot by slot.
        let old = std::mem::replace(&mut self.slots, vec![CLEARED; cap]);
        let mask = cap - 1;
        let mut next_full = self.next_full;
        for s in old.iter().filter(|s| s.used()) {
            let mut i = (s.key as usize) & mask;
            while self.slots[i].used() {
                i = (i + 1) & mask;
            }
            self.slots[i] = *s;
            next_full = next_full.min(s.tat);
        }
        self.next_full = next_full;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grow_keeps_every_key_its_tat_and_the_counts() {
        let mut t = Table::default();
        t.grow(8);
        // Colliding homes, a cluster that wraps past the end, and hash 0.
        let keys = [7u64, 15, 23, 0, 8, 3, 11];
        for (n, k) in keys.iter().enumerate() {
            t.insert_new(*k, 100 + n as u64);
        }
        t.remove_at(t.find(15).unwrap());
        t.next_full = 500;
        for cap in [16, 64, 1024] {
            t.grow(cap);
            assert_eq!((t.slots.len(), t.len), (cap, keys.len() - 1));
            assert_eq!(t.next_full, 100);
            for (n, k) in keys.iter().enumerate().filter(|(_, k)| **k != 15) {
                assert_eq!(t.slots[t.find(*k).unwrap()].tat, 100 + n as u64);
            }
            assert_eq!(t.find(15), None);
            assert_eq!(t.slots.iter().filter(|s| s.used()).count(), t.len);
        }
    }

    #[test]
    fn insert_at_the_probe_end_matches_insert_new() {
        // Colliding homes, a cluster that wraps past the end, hash 0, a hole left by a
        // removal: each key put where its probe ended, as insert_new would put it.
        let keys = [7u64, 15, 23, 0, 8, 3, 11, 31, 6, 5, 14, 22];
        let mut by_probe = Table::default();
        by_probe.grow(16);
        let mut by_insert = Table::default();
        by_insert.grow(16);
        for (n, k) in keys.iter().enumerate() {
            assert!(by_probe.fits_one_more());
            let vacant = by_probe.probe(*k).unwrap_err();
            by_probe.insert_at(vacant, *k, 10 + n as u64);
            by_insert.insert_new(*k, 10 + n as u64);
            if n == 5 {
                by_probe.remove_at(by_probe.find(15).unwrap());
                by_insert.remove_at(by_insert.find(15).unwrap());
            }
        }
        let used = |t: &Table| {
            t.slots
                .iter()
                .map(|s| s.used().then_some((s.key, s.tat)))
                .collect::<Vec<_>>()
        };
        assert_eq!(used(&by_probe), used(&by_insert));
        assert_eq!((by_probe.len, by_probe.next_full), (by_insert.len, by_insert.next_full));
        // 12 keys in 16 slots are 3/4: one more fits after 11, none after 12.
        assert_eq!(by_probe.len, 11);
        assert!(by_probe.fits_one_more());
        by_probe.insert_at(by_probe.probe(30).unwrap_err(), 30, 1);
        assert!(!by_probe.fits_one_more());
        assert_eq!(by_probe.probe(7), Ok(by_probe.find(7).unwrap()));
        assert_eq!(Table::default().probe(7), Err(usize::MAX));
        assert!(!Table::default().fits_one_more());
    }

    #[test]
    fn grow_matches_inserting_each_key_again() {
        let mut grown = Table::default();
        grown.grow(64);
        let keys: Vec<u64> = (0..40u64).map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 3).collect();
        for (n, k) in keys.iter().enumerate() {
            grown.insert_new(*k, n as u64);
        }
        let mut rebuilt = Table {
            slots: vec![Slot::default(); 256],
            ..Table::default()
        };
        for s in grown.slots.iter().filter(|s| s.used()) {
            rebuilt.insert_new(s.key, s.tat);
        }
        grown.grow(256);
        let used = |t: &Table| {
            t.slots
                .iter()
                .map(|s| s.used().then_some((s.key, s.tat)))
                .collect::<Vec<_>>()
        };
        assert_eq!(used(&grown), used(&rebuilt));
    }
}
