//! Writing a histogram: recording, merging a snapshot in, resetting.

use super::*;

impl Histogram {
    /// An empty histogram.
    pub fn new() -> Histogram {
        Histogram {
            counts: (0..BUCKETS).map(|_| AtomicU64::new(0)).collect(),
            groups: (0..GROUPS).map(|_| AtomicU64::new(0)).collect(),
            sum: AtomicU64::new(0),
            sum_hi: AtomicU64::new(0),
            min: AtomicU64::new(u64::MAX),
            max: AtomicU64::new(0),
            underflow: AtomicU64::new(0),
            overflow: AtomicU64::new(0),
        }
    }

    /// Records one value of `v` nanoseconds.
    #[inline]
    pub fn record(&self, v: u64) {
        self.record_n(v, 1);
    }

    /// Records `n` values of `v` nanoseconds each (wait-free: a few atomic adds, a CAS
    /// loop only for a batch).
    #[inline]
    pub fn record_n(&self, v: u64, n: u64) {
        if n == 0 {
            return;
        }
        if v < UNDERFLOW_NS {
            add_count(&self.underflow, n);
        } else if v > MAX_TRACKED_NS {
            add_count(&self.overflow, n);
        }
        if v != 0 {
            // Immediate grants record 0: their sum needs no write.
            add_wide(&self.sum, &self.sum_hi, v as u128 * n as u128);
        }
        if v < self.min.load(Ordering::Relaxed) {
            self.min.fetch_min(v, Ordering::Relaxed);
        }
        if v > self.max.load(Ordering::Relaxed) {
            self.max.fetch_max(v, Ordering::Relaxed);
        }
        let i = index_of(v);
        add_count(&self.counts[i], n);
        add_group(&self.groups[group_of(i)], n);
    }

    /// Adds a batch counted elsewhere (e.g. a local array filled without atomics);
    /// counts stick at u64::MAX rather than wrap.
    pub fn add_snapshot(&self, s: &Snapshot) {
        add_wide(&self.sum, &self.sum_hi, s.sum);
        self.min.fetch_min(s.min, Ordering::Relaxed);
        self.max.fetch_max(s.max, Ordering::Relaxed);
        add_sticky(&self.underflow, s.underflow);
        add_sticky(&self.overflow, s.overflow);
        for g in 0..GROUPS {
            let mut sub = 0u64;
            for i in group_range(g) {
                add_sticky(&self.counts[i], s.counts[i]);
                sub = sub.saturating_add(s.counts[i]);
            }
            add_group(&self.groups[g], sub);
        }
    }

    /// Empties the histogram, returning what it held (each counter swapped atomically;
    /// consistent as a snapshot is). Each group's subtotal is lowered by exactly what
    /// was taken out of its buckets, so subtotals and buckets agree again once the
    /// records in progress complete.
    pub fn reset(&self) -> Snapshot {
        let mut counts = vec![0u64; BUCKETS];
        for g in 0..GROUPS {
            let mut taken = 0u64;
            for i in group_range(g) {
                let c = self.counts[i].swap(0, Ordering::Relaxed);
                counts[i] = c;
                taken = taken.wrapping_add(c);
            }
            if taken != 0 {
                let _ = self.groups[g].fetch_update(Ordering::Release, Ordering::Relaxed, |v| {
                    Some(if v >= GROUP_SATURATED && (v as i64) >= 0 {
                        0
                    } else {
                        v.wrapping_sub(taken)
                    })
                });
            }
        }
        Snapshot {
            counts,
            sum: (self.sum_hi.swap(0, Ordering::Relaxed) as u128) << 64 | self.sum.swap(0, Ordering::Relaxed) as u128,
            min: self.min.swap(u64::MAX, Ordering::Relaxed),
            max: self.max.swap(0, Ordering::Relaxed),
            underflow: self.underflow.swap(0, Ordering::Relaxed),
            overflow: self.overflow.swap(0, Ordering::Relaxed),
        }
        .with_consistent_range()
    }
}
