//! A lock-free log-linear histogram of durations in nanoseconds, decimal: three
//! significant digits (900 linear sub-buckets per decade), so a bucket is at most 1 %
//! of its value wide, a percentile read at the bucket's midpoint is within 0.5 % of the
//! truth, and every boundary with three significant digits (1 ms, 2.5 ms, 300 s, …) is
//! a bucket edge: Prometheus `le` buckets are read off exactly. Exact below 1 µs;
//! tracked up to 10^19 ns (317 years, beyond 2^63 ns: every wait a rate the library
//! accepts can give); longer values go into the top bucket and are counted as
//! overflow; values under 1 µs are counted as underflow (and still recorded exactly).
//! Sum, min and max are exact for every value (the sum is 128 bits wide: waits of
//! centuries, counted billions of times).
//!
//! Recording is wait-free: relaxed atomic adds (sum; min/max only when they move), then
//! the bucket, then its group's subtotal (one group per 128 buckets) with Release. The
//! group subtotals are what reads count: a record counts once its subtotal add lands,
//! and by then its bucket, sum, min and max are visible to a reader that read that
//! subtotal (Acquire). So `count` reads 121 subtotals, and a percentile walks the
//! subtotals and then only the buckets of the group holding its rank (exact ranks, as
//! before), never all 15,401 buckets.
//!
//! Every read guarantees: count = 0 gives min = u64::MAX and max = 0; count ≥ 1 gives
//! min ≤ max, min in the lowest non-empty bucket and max in the highest (one moved by a
//! record still in progress, or emptied by a racing reset, is read off that bucket's
//! edge, within 1 % of it); percentiles rank exactly against the count of the same read
//! and lie within its [min, max]; the sum includes every counted value and may include
//! values still being recorded. A snapshot copies the buckets of the non-empty groups,
//! and its count is its buckets' total. A reset lowers each subtotal by exactly what it
//! took from the buckets, so subtotals and buckets agree again once records in progress
//! complete (meanwhile a rank may fall on its group's highest non-empty bucket).
//! Counts stick at u64::MAX rather than wrap.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::Error;

/// Number of buckets: 1001 exact ones up to 1 µs, then 900 per decade up to 10^19 ns.
pub const BUCKETS: usize = 1001 + 16 * 900;
/// The largest value a bucket tracks (larger ones go into the top bucket), in ns.
pub const MAX_TRACKED_NS: u64 = 10_000_000_000_000_000_000;
/// Values below this (1 µs) are counted as underflow.
pub const UNDERFLOW_NS: u64 = 1_000;

const POW10: [u64; 20] = [
    1,
    10,
    100,
    1_000,
    10_000,
    100_000,
    1_000_000,
    10_000_000,
    100_000_000,
    1_000_000_000,
    10_000_000_000,
    100_000_000_000,
    1_000_000_000_000,
    10_000_000_000_000,
    100_000_000_000_000,
    1_000_000_000_000_000,
    10_000_000_000_000_000,
    100_000_000_000_000_000,
    1_000_000_000_000_000_000,
    10_000_000_000_000_000_000,
];

const INV_POW10: [f64; 17] = [
    1.0, 1e-1, 1e-2, 1e-3, 1e-4, 1e-5, 1e-6, 1e-7, 1e-8, 1e-9, 1e-10, 1e-11, 1e-12, 1e-13, 1e-14, 1e-15, 1e-16,
];

/// The bucket holding `v` nanoseconds. Buckets above 1 µs are closed at the top,
/// (L, H] with L and H of three significant digits, as Prometheus' `le` buckets are.
#[inline]
pub fn index_of(v: u64) -> usize {
    let v = v.min(MAX_TRACKED_NS);
    if v <= 1000 {
        return v as usize;
    }
    let w = v - 1;
    // Decade d with 10^d <= w < 10^(d+1), from the bit length, corrected once.
    let bits = 64 - w.leading_zeros();
    let mut d = (((bits - 1) * 1233) >> 12) as usize;
    d += (w >= POW10[d + 1]) as usize;
    // w / 10^(d-2) without a division: a float estimate (exact but for the last ulp),
    // then branch-free correction by one either way.
    let p = POW10[d - 2];
    let mut sub = (w as f64 * INV_POW10[d - 2]) as u64;
    sub -= (sub * p > w) as u64;
    sub += ((sub + 1) * p <= w) as u64;
    1001 + (d - 3) * 900 + (sub as usize - 100)
}

/// The top edge H of decade bucket `k` (its values are (H − width, H]).
#[inline]
fn top_of(k: usize) -> u64 {
    let k = k + 1;
    let d = 3 + k / 900;
    (100 + (k % 900) as u64) * POW10[d - 2]
}

/// The lowest value of bucket `i`.
#[inline]
pub fn lower_of(i: usize) -> u64 {
    match i {
        0..=1000 => i as u64,
        1001 => 1001,
        _ => top_of(i - 1002) + 1,
    }
}

/// One past the highest value of bucket `i`.
#[inline]
pub fn upper_of(i: usize) -> u64 {
    match i {
        0..=1000 => i as u64 + 1,
        _ => top_of(i - 1001) + 1,
    }
}

/// Adds `x` to the 128-bit sum kept as two words (`lo`, `hi`); the common case is one
/// fetch_add, a carry or a wide `x` adds to `hi` (2^128 ns is never reached).
#[inline]
fn add_wide(lo: &AtomicU64, hi: &AtomicU64, x: u128) {
    let (xl, xh) = (x as u64, (x >> 64) as u64);
    let prev = lo.fetch_add(xl, Ordering::Relaxed);
    let up = xh.wrapping_add(prev.checked_add(xl).is_none() as u64);
    if up != 0 {
        hi.fetch_add(up, Ordering::Relaxed);
    }
}

/// Reads the two-word sum (retried while its high word moves under the read).
#[inline]
fn load_wide(lo: &AtomicU64, hi: &AtomicU64) -> u128 {
    loop {
        let h = hi.load(Ordering::Relaxed);
        let l = lo.load(Ordering::Relaxed);
        if hi.load(Ordering::Relaxed) == h {
            return (h as u128) << 64 | l as u128;
        }
    }
}

/// Adds to an atomic counter, sticking at u64::MAX instead of wrapping (a CAS loop, for
/// merges rather than recording).
fn add_sticky(c: &AtomicU64, x: u64) {
    if x != 0 {
        let _ = c.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| Some(v.saturating_add(x)));
    }
}

/// Adds `n` to a count: one fetch_add for a single value, sticking at u64::MAX for a
/// batch (and restored to u64::MAX should a single value ever land on a stuck count).
#[inline]
fn add_count(c: &AtomicU64, n: u64) {
    if n == 1 {
        if c.fetch_add(1, Ordering::Relaxed) == u64::MAX {
            c.store(u64::MAX, Ordering::Relaxed);
        }
    } else {
        add_sticky(c, n);
    }
}

/// Buckets per group: each group keeps the subtotal of its buckets, so a read walks the
/// groups and then the buckets of one group instead of every bucket.
pub const GROUP_BUCKETS: usize = 128;
/// Number of groups.
pub const GROUPS: usize = BUCKETS.div_ceil(GROUP_BUCKETS);
/// A group subtotal at or above this (only reached by merging absurd counts) is not
/// trusted: readers sum that group's buckets instead.
const GROUP_SATURATED: u64 = 1 << 62;

/// Adds `n` to a group subtotal with Release ordering, after the bucket add: a reader
/// that acquires the subtotal sees the buckets' adds it counts. Batches stop at
/// `GROUP_SATURATED`.
#[inline]
fn add_group(g: &AtomicU64, n: u64) {
    if n == 1 {
        g.fetch_add(1, Ordering::Release);
    } else if n != 0 {
        let _ = g.fetch_update(Ordering::Release, Ordering::Relaxed, |v| {
            Some(if (v as i64) < 0 {
                v.wrapping_add(n)
            } else {
                v.saturating_add(n).min(GROUP_SATURATED)
            })
        });
    }
}

/// Group of bucket `i`.
#[inline]
fn group_of(i: usize) -> usize {
    i / GROUP_BUCKETS
}

/// The buckets of group `g`.
#[inline]
fn group_range(g: usize) -> std::ops::Range<usize> {
    g * GROUP_BUCKETS..((g + 1) * GROUP_BUCKETS).min(BUCKETS)
}

/// Count, sum, min, max, underflow and overflow read without copying the buckets; see
/// [`Histogram::summary`] for how they agree.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Summary {
    /// Number of recorded values (sticking at u64::MAX).
    pub count: u64,
    /// Sum of recorded values, nanoseconds (exact: 128 bits).
    pub sum: u128,
    /// Smallest recorded value (u64::MAX when empty).
    pub min: u64,
    /// Largest recorded value (0 when empty).
    pub max: u64,
    /// Values under 1 µs.
    pub underflow: u64,
    /// Values over the tracked range (clamped).
    pub overflow: u64,
}

/// The group subtotals as read at one pass (Acquire), each clamped to what it can mean.
struct Groups {
    counts: [u64; GROUPS],
    total: u128,
}

/// A concurrent histogram of nanosecond durations.
pub struct Histogram {
    counts: Box<[AtomicU64]>,
    /// Subtotal of each group of `GROUP_BUCKETS` buckets, added after the bucket
    /// (Release) and, on reset, lowered by what was taken out of the buckets: read as
    /// a signed number, momentarily negative while a reset races a record.
    groups: Box<[AtomicU64]>,
    sum: AtomicU64,
    /// The high word of the sum.
    sum_hi: AtomicU64,
    min: AtomicU64,
    max: AtomicU64,
    underflow: AtomicU64,
    overflow: AtomicU64,
}

impl Default for Histogram {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for Histogram {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = self.summary();
        write!(f, "Histogram(count={}, sum={}ns)", s.count, s.sum)
    }
}

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

    /// The group subtotals; a negative one (a reset racing a record) reads as 0, a
    /// saturated one as the sum of its buckets.
    fn groups(&self) -> Groups {
        let mut counts = [0u64; GROUPS];
        let mut total = 0u128;
        let mut saturated = false;
        for (c, slot) in counts.iter_mut().zip(self.groups.iter()) {
            let raw = slot.load(Ordering::Acquire);
            *c = if (raw as i64) < 0 { 0 } else { raw };
            saturated |= *c >= GROUP_SATURATED;
            total += *c as u128;
        }
        if saturated {
            total = 0;
            for (g, c) in counts.iter_mut().enumerate() {
                if *c >= GROUP_SATURATED {
                    let sum: u128 = group_range(g)
                        .map(|i| self.counts[i].load(Ordering::Relaxed) as u128)
                        .sum();
                    *c = u64::try_from(sum).unwrap_or(u64::MAX);
                }
                total += *c as u128;
            }
        }
        Groups { counts, total }
    }

    /// The lowest (or highest) non-empty bucket as the group subtotals say: the first
    /// (last) non-empty bucket of the first (last) non-empty group, or that group's
    /// first (last) bucket should a racing reset have emptied it.
    fn extreme_bucket(&self, gs: &Groups, highest: bool) -> Option<usize> {
        let nonzero = |g: &usize| gs.counts[*g] != 0;
        let g = if highest {
            (0..GROUPS).rev().find(nonzero)?
        } else {
            (0..GROUPS).find(nonzero)?
        };
        let r = group_range(g);
        let busy = |i: &usize| self.counts[*i].load(Ordering::Relaxed) != 0;
        Some(if highest {
            r.clone().rev().find(busy).unwrap_or(r.end - 1)
        } else {
            r.clone().find(busy).unwrap_or(r.start)
        })
    }

    fn summary_of(&self, gs: &Groups) -> Summary {
        let (min, max) = match (self.extreme_bucket(gs, false), self.extreme_bucket(gs, true)) {
            (Some(lo), Some(hi)) => consistent_range(
                self.min.load(Ordering::Relaxed),
                self.max.load(Ordering::Relaxed),
                lo,
                hi,
            ),
            _ => (u64::MAX, 0),
        };
        Summary {
            count: u64::try_from(gs.total).unwrap_or(u64::MAX),
            sum: load_wide(&self.sum, &self.sum_hi),
            min,
            max,
            underflow: self.underflow.load(Ordering::Relaxed),
            overflow: self.overflow.load(Ordering::Relaxed),
        }
    }

    /// Number of recorded values, read off the group subtotals (no bucket is read):
    /// a value counts once its record has completed, and never before its bucket does.
    pub fn count(&self) -> u64 {
        u64::try_from(self.groups().total).unwrap_or(u64::MAX)
    }

    /// Sum of recorded values, nanoseconds (exact; may include a value whose record is
    /// still in progress).
    pub fn sum(&self) -> u128 {
        load_wide(&self.sum, &self.sum_hi)
    }

    /// Values under 1 µs (one atomic load).
    pub fn underflow(&self) -> u64 {
        self.underflow.load(Ordering::Relaxed)
    }

    /// Values over the tracked range (one atomic load).
    pub fn overflow(&self) -> u64 {
        self.overflow.load(Ordering::Relaxed)
    }

    /// Count, sum, min, max without copying the buckets, as a snapshot guarantees them:
    /// count = 0 gives min = u64::MAX and max = 0; count ≥ 1 gives min ≤ max, min in
    /// the lowest and max in the highest non-empty bucket (a min or max not yet written
    /// by a racing record is read off that bucket's edge). The count is the group
    /// subtotals' total, the same total `percentiles` ranks against.
    pub fn summary(&self) -> Summary {
        self.summary_of(&self.groups())
    }

    /// Percentiles as [`Snapshot::percentiles`] gives them, without copying the buckets:
    /// the ranks are exact against the count of [`Histogram::summary`] read in the same
    /// pass, and each value is clamped to that read's min and max; walks the group
    /// subtotals, then the buckets of the groups holding the ranks.
    pub fn percentiles(&self, qs: &[f64]) -> (Summary, Vec<Option<f64>>) {
        let gs = self.groups();
        let s = self.summary_of(&gs);
        if s.count == 0 {
            return (s, vec![None; qs.len()]);
        }
        let mut order: Vec<(usize, u128)> = qs
            .iter()
            .enumerate()
            .map(|(k, q)| (k, rank(*q, s.count) as u128))
            .collect();
        order.sort_by_key(|(_, r)| *r);
        let mut out = vec![None; qs.len()];
        let mut before = 0u128; // values in the groups before `g`
        let mut g = 0usize;
        let mut j = 0usize;
        while j < order.len() && g < GROUPS {
            let here = gs.counts[g] as u128;
            if before + here < order[j].1 {
                before += here;
                g += 1;
                continue;
            }
            // Group g holds rank order[j]; walk its buckets once for every rank it holds.
            let r = group_range(g);
            let mut seen = before;
            let mut last = None;
            for i in r.clone() {
                let c = self.counts[i].load(Ordering::Relaxed) as u128;
                if c == 0 {
                    continue;
                }
                seen += c;
                last = Some(i);
                while j < order.len() && order[j].1 <= seen.min(before + here) {
                    out[order[j].0] = Some(midpoint(i, s.min, s.max));
                    j += 1;
                }
            }
            // Buckets behind their subtotal (a reset racing a record): the group's
            // highest non-empty bucket, or its top, takes the ranks it owes.
            let fallback = last.unwrap_or(r.end - 1);
            while j < order.len() && order[j].1 <= before + here {
                out[order[j].0] = Some(midpoint(fallback, s.min, s.max));
                j += 1;
            }
            before += here;
            g += 1;
        }
        (s, out)
    }

    /// Values at or below each of `les` (ns), as [`Snapshot::count_le`] counts them,
    /// against the group subtotals of one read: never more than that read's count.
    pub fn cumulative(&self, les: &[u64]) -> Vec<u64> {
        let gs = self.groups();
        les.iter()
            .map(|&le| {
                if le >= MAX_TRACKED_NS {
                    return gs.total;
                }
                let k = index_of(le);
                let g = group_of(k);
                let below: u128 = gs.counts[..g].iter().map(|c| *c as u128).sum();
                let upto = if includes_bucket(k, le) { k + 1 } else { k };
                let within: u128 = (g * GROUP_BUCKETS..upto)
                    .map(|i| self.counts[i].load(Ordering::Relaxed) as u128)
                    .sum();
                below + within.min(gs.counts[g] as u128)
            })
            .map(|c| u64::try_from(c).unwrap_or(u64::MAX))
            .collect()
    }

    /// Values at or below `le_ns` (see [`Histogram::cumulative`]).
    pub fn count_le(&self, le_ns: u64) -> u64 {
        self.cumulative(&[le_ns])[0]
    }

    /// A copy of the counters, consistent as the module doc says (the buckets of a
    /// group whose subtotal reads 0 are not read: they hold only records in progress).
    pub fn snapshot(&self) -> Snapshot {
        let gs = self.groups();
        let mut counts = vec![0u64; BUCKETS];
        for g in 0..GROUPS {
            if gs.counts[g] != 0 {
                for i in group_range(g) {
                    counts[i] = self.counts[i].load(Ordering::Relaxed);
                }
            }
        }
        Snapshot {
            counts,
            sum: load_wide(&self.sum, &self.sum_hi),
            min: self.min.load(Ordering::Relaxed),
            max: self.max.load(Ordering::Relaxed),
            underflow: self.underflow.load(Ordering::Relaxed),
            overflow: self.overflow.load(Ordering::Relaxed),
        }
        .with_consistent_range()
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

/// The value reported for bucket `i`: its midpoint, clamped to [min, max] (max/min
/// first: no panic even if a racing read saw max < min).
#[inline]
fn midpoint(i: usize, min: u64, max: u64) -> f64 {
    let (lo, hi) = (lower_of(i), upper_of(i));
    let mid = if hi - lo <= 1 {
        lo as f64
    } else {
        (lo as f64 + (hi - 1) as f64) / 2.0
    };
    mid.min(max as f64).max(min.min(max) as f64)
}

/// Whether `count_le(le)` counts bucket `k` = index_of(le): `le` is its top edge, or
/// at or above its midpoint.
#[inline]
fn includes_bucket(k: usize, le: u64) -> bool {
    let (lo, hi) = (lower_of(k), upper_of(k));
    le + 1 >= hi || (lo + hi - 1) / 2 <= le
}

/// Min and max made to agree with the lowest (`lo`) and highest (`hi`) non-empty
/// buckets: one outside its bucket becomes that bucket's outer edge (the top bucket's
/// is open: it holds values beyond the range).
fn consistent_range(mut min: u64, mut max: u64, lo: usize, hi: usize) -> (u64, u64) {
    let top = |i: usize| if i == BUCKETS - 1 { u64::MAX } else { upper_of(i) - 1 };
    if !(lower_of(lo)..=top(lo)).contains(&min) {
        min = lower_of(lo);
    }
    if !(lower_of(hi)..=top(hi)).contains(&max) {
        max = upper_of(hi) - 1;
    }
    (min, max.max(min))
}

/// A plain (non-atomic) copy of a histogram: percentiles, merge, serialisation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Snapshot {
    /// Count per bucket (`BUCKETS` entries).
    pub counts: Vec<u64>,
    /// Sum of recorded values, nanoseconds (exact: 128 bits).
    pub sum: u128,
    /// Smallest recorded value (u64::MAX when empty).
    pub min: u64,
    /// Largest recorded value (0 when empty).
    pub max: u64,
    /// Values under 1 µs.
    pub underflow: u64,
    /// Values over the tracked range (clamped).
    pub overflow: u64,
}

impl Default for Snapshot {
    fn default() -> Self {
        Snapshot {
            counts: vec![0; BUCKETS],
            sum: 0,
            min: u64::MAX,
            max: 0,
            underflow: 0,
            overflow: 0,
        }
    }
}

const MAGIC: &[u8; 4] = b"RQH1";
/// The form whose header adds the sum's high word (written only when it is not 0, so
/// every sum below 2^64 ns keeps the first form).
const MAGIC_WIDE: &[u8; 4] = b"RQH2";

impl Snapshot {
    /// Number of recorded values (sticking at u64::MAX).
    pub fn count(&self) -> u64 {
        u64::try_from(self.total()).unwrap_or(u64::MAX)
    }

    fn total(&self) -> u128 {
        self.counts.iter().map(|c| *c as u128).sum()
    }

    /// Min and max made to agree with the bucket counts (see the module doc): empty
    /// gives (u64::MAX, 0); otherwise a min or max outside its extreme non-empty bucket
    /// (not yet written, or written by a record whose count was not read) becomes that
    /// bucket's outer edge (the top bucket's is open: it holds values beyond the range).
    fn with_consistent_range(mut self) -> Snapshot {
        match self.counts.iter().position(|c| *c != 0) {
            None => {
                self.min = u64::MAX;
                self.max = 0;
            }
            Some(lo) => {
                let hi = self.counts.iter().rposition(|c| *c != 0).unwrap_or(lo);
                (self.min, self.max) = consistent_range(self.min, self.max, lo, hi);
            }
        }
        self
    }

    /// Records `v` (non-atomic; for batch filling).
    #[inline]
    pub fn record(&mut self, v: u64) {
        if v < UNDERFLOW_NS {
            self.underflow += 1;
        } else if v > MAX_TRACKED_NS {
            self.overflow += 1;
        }
        self.counts[index_of(v)] += 1;
        self.sum = self.sum.saturating_add(v as u128);
        self.min = self.min.min(v);
        self.max = self.max.max(v);
    }

    /// A snapshot of `values` given in seconds, filled without atomics (the batch path
    /// of `record_many`); `Err(v)` names the first value that is negative or not finite.
    pub fn from_seconds(values: &[f64]) -> Result<Snapshot, f64> {
        let mut s = Snapshot::default();
        let (mut sum, mut min, mut max, mut over) = (0u128, u64::MAX, 0u64, 0u64);
        for &v in values {
            if !(v >= 0.0 && v.is_finite()) {
                return Err(v);
            }
            let ns = (v * 1e9 + 0.5) as u64; // saturating cast
            over += (ns > MAX_TRACKED_NS) as u64;
            s.counts[index_of(ns)] += 1;
            sum = sum.saturating_add(ns as u128);
            min = min.min(ns);
            max = max.max(ns);
        }
        s.sum = sum;
        s.min = min;
        s.max = max;
        s.overflow = over;
        s.underflow = s.counts[..UNDERFLOW_NS as usize].iter().sum();
        Ok(s)
    }

    /// Adds `other` into this one; counts stick at u64::MAX rather than wrap.
    pub fn merge(&mut self, other: &Snapshot) {
        for (a, b) in self.counts.iter_mut().zip(&other.counts) {
            *a = a.saturating_add(*b);
        }
        self.sum = self.sum.saturating_add(other.sum);
        self.min = self.min.min(other.min);
        self.max = self.max.max(other.max);
        self.underflow = self.underflow.saturating_add(other.underflow);
        self.overflow = self.overflow.saturating_add(other.overflow);
    }

    /// The value (ns) at percentile `q` in [0, 100]: the midpoint of the bucket holding
    /// the nearest rank (see [`rank`]), clamped to [min, max]; None when empty.
    pub fn percentile(&self, q: f64) -> Option<f64> {
        self.percentiles(&[q]).pop().flatten()
    }

    /// Several percentiles in one pass over the buckets (each as `percentile`).
    pub fn percentiles(&self, qs: &[f64]) -> Vec<Option<f64>> {
        let n = self.count();
        if n == 0 {
            return vec![None; qs.len()];
        }
        let mut order: Vec<(usize, u128)> = qs.iter().enumerate().map(|(k, q)| (k, rank(*q, n) as u128)).collect();
        order.sort_by_key(|(_, r)| *r);
        let mut out = vec![None; qs.len()];
        let mut seen = 0u128;
        let mut j = 0;
        for (i, c) in self.counts.iter().enumerate() {
            seen += *c as u128;
            while j < order.len() && order[j].1 <= seen {
                out[order[j].0] = Some(midpoint(i, self.min, self.max));
                j += 1;
            }
            if j == order.len() {
                break;
            }
        }
        out
    }

    /// Values at or below `le_ns`, read off the buckets: exact when `le_ns` is a bucket's
    /// top edge (every value with at most three significant digits is, as is every
    /// value up to 1 µs); a `le` inside a bucket counts that bucket when its midpoint is
    /// at or below `le`.
    pub fn count_le(&self, le_ns: u64) -> u64 {
        if le_ns >= MAX_TRACKED_NS {
            return self.count();
        }
        let k = index_of(le_ns);
        let below: u64 = self.counts[..k].iter().sum();
        if includes_bucket(k, le_ns) {
            below + self.counts[k]
        } else {
            below
        }
    }

    /// A compact byte form (sparse, varint) for shipping between processes.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(64);
        let hi = (self.sum >> 64) as u64;
        out.extend_from_slice(if hi == 0 { MAGIC } else { MAGIC_WIDE });
        for v in [self.sum as u64, self.min, self.max, self.underflow, self.overflow] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        if hi != 0 {
            out.extend_from_slice(&hi.to_le_bytes());
        }
        let mut last = 0usize;
        for (i, c) in self.counts.iter().enumerate() {
            if *c != 0 {
                put_varint(&mut out, (i - last) as u64);
                put_varint(&mut out, *c);
                last = i;
            }
        }
        out
    }

    /// Parses `to_bytes` output; an error names what is wrong.
    pub fn from_bytes(b: &[u8]) -> Result<Snapshot, Error> {
        let bad = |why: &str| Error::invalid("data", format!("<{} bytes>", b.len()), why);
        let header = match b.get(..4) {
            Some(m) if m == MAGIC => 44,
            Some(m) if m == MAGIC_WIDE => 52,
            _ => 0,
        };
        if header == 0 || b.len() < header {
            return Err(bad("is not a serialised ratequeue histogram"));
        }
        let word = |k: usize| u64::from_le_bytes(b[4 + 8 * k..12 + 8 * k].try_into().expect("8 bytes"));
        let hi = if header == 52 { word(5) as u128 } else { 0 };
        let mut s = Snapshot {
            sum: hi << 64 | word(0) as u128,
            min: word(1),
            max: word(2),
            underflow: word(3),
            overflow: word(4),
            ..Snapshot::default()
        };
        if s.min != u64::MAX && s.min > s.max {
            return Err(bad("has an inconsistent min/max header"));
        }
        let mut pos = header;
        let mut idx = 0u64;
        let mut total = 0u64;
        while pos < b.len() {
            let entry = pos;
            // A varint that runs off the end: the last entry is incomplete (bytes missing,
            // or stray bytes after the last whole entry); one that never ends is malformed.
            let cut = |pos: usize| {
                if pos >= b.len() {
                    bad(&format!(
                        "ends with {} byte(s) that are not a whole bucket entry (truncated, or extra bytes)",
                        b.len() - entry
                    ))
                } else {
                    bad("has a varint longer than 64 bits")
                }
            };
            let delta = get_varint(b, &mut pos).ok_or_else(|| cut(pos))?;
            let c = get_varint(b, &mut pos).ok_or_else(|| cut(pos))?;
            idx = idx
                .checked_add(delta)
                .filter(|i| *i < BUCKETS as u64)
                .ok_or_else(|| bad("has a bucket out of range"))?;
            total = total
                .checked_add(c)
                .ok_or_else(|| bad("has counts that sum past 2**64 - 1"))?;
            s.counts[idx as usize] += c;
        }
        Ok(s.with_consistent_range())
    }
}

/// The nearest rank of percentile `q` among `n` ≥ 1 values: ceil(q·n/100), at least 1,
/// computed exactly with `q` read as the shortest decimal that prints as it (7 is 7,
/// 99.9 is 999/10), so binary rounding never moves a rank.
pub fn rank(q: f64, n: u64) -> u64 {
    if q.is_nan() || q <= 0.0 {
        return 1;
    }
    if q >= 100.0 {
        return n.max(1);
    }
    // Fast path: q has at most four decimals (r/m is then the only such decimal that
    // reads as q, hence its shortest form: q < 100 keeps q's ulp far below 1/m).
    for m in [1u32, 10, 100, 1000, 10_000] {
        let r = (q * m as f64).round();
        if r / m as f64 == q {
            let r = (r as u128 * n as u128).div_ceil(100 * m as u128);
            return u64::try_from(r).unwrap_or(u64::MAX).clamp(1, n.max(1));
        }
    }
    let text = format!("{q:e}");
    let parsed = text.split_once('e').and_then(|(mantissa, exp)| {
        let exp: i32 = exp.parse().ok()?;
        let (int, frac) = mantissa.split_once('.').unwrap_or((mantissa, ""));
        let digits: u128 = format!("{int}{frac}").parse().ok()?;
        Some((digits, exp - frac.len() as i32))
    });
    let Some((digits, exp)) = parsed else {
        return ((q / 100.0 * n as f64).ceil() as u64).clamp(1, n.max(1));
    };
    // q·n/100 = digits·n·10^(exp−2), and exp − 2 < 0 since q < 100; digits < 10^17, so
    // digits·n < 2^121 fits.
    let scale = (2 - exp) as u32;
    let num = digits * n as u128;
    let r = if scale > 38 { 1 } else { num.div_ceil(10u128.pow(scale)) };
    u64::try_from(r).unwrap_or(u64::MAX).clamp(1, n.max(1))
}

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn get_varint(b: &[u8], pos: &mut usize) -> Option<u64> {
    let mut v = 0u64;
    for shift in (0..64).step_by(7) {
        let byte = *b.get(*pos)?;
        *pos += 1;
        v |= ((byte & 0x7f) as u64) << shift;
        if byte < 0x80 {
            return Some(v);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_contiguous_and_narrow() {
        let mut prev_upper = 0;
        for i in 0..BUCKETS {
            let (lo, hi) = (lower_of(i), upper_of(i));
            assert_eq!(lo, prev_upper, "bucket {i}");
            assert!(hi > lo);
            assert_eq!(index_of(lo), i);
            assert_eq!(index_of(hi - 1), i);
            if lo >= 100 {
                assert!((hi - lo) as f64 / lo as f64 <= 0.01 + 1e-12);
            }
            prev_upper = hi;
        }
    }

    #[test]
    fn percentiles_within_half_percent() {
        let h = Histogram::new();
        let vals: Vec<u64> = (1..=100_000u64).map(|i| i * 37_123).collect();
        for v in &vals {
            h.record(*v);
        }
        let s = h.snapshot();
        for q in [1.0, 50.0, 90.0, 99.0, 99.9, 100.0] {
            let rank = ((q / 100.0 * vals.len() as f64).ceil() as usize).max(1);
            let want = vals[rank - 1] as f64;
            let got = s.percentile(q).unwrap();
            assert!((got - want).abs() / want < 0.01, "q={q} got={got} want={want}");
        }
        assert_eq!(s.count(), 100_000);
        assert_eq!(s.min, 37_123);
    }

    #[test]
    fn every_bucket_edge_maps_to_its_bucket_up_to_the_top() {
        for i in 0..BUCKETS {
            let (lo, hi) = (lower_of(i), upper_of(i));
            assert!(lo < hi, "bucket {i}");
            assert_eq!(index_of(lo), i, "lower edge of {i}");
            assert_eq!(index_of(hi - 1), i, "upper edge of {i}");
            if i + 1 < BUCKETS {
                assert_eq!(lower_of(i + 1), hi, "bucket {i} meets the next");
            }
        }
        assert_eq!(upper_of(BUCKETS - 1) - 1, MAX_TRACKED_NS);
        const { assert!(MAX_TRACKED_NS > 1 << 63) };
    }

    #[test]
    fn sum_min_max_are_exact_beyond_the_hours() {
        let h = Histogram::new();
        for v in [86_400_000_000_000u64, 1 << 63] {
            h.record(v);
        }
        let s = h.snapshot();
        assert_eq!(
            (s.sum, s.min, s.max, s.overflow),
            (86_400_000_000_000 + (1 << 63), 86_400_000_000_000, 1 << 63, 0)
        );
        let p = s.percentile(100.0).unwrap();
        assert!((p - (1u64 << 63) as f64).abs() / (1u64 << 63) as f64 <= 0.005);
        let f = Snapshot::from_seconds(&[86_400.0, 1e10]).unwrap();
        assert_eq!((f.max, f.overflow), (10_000_000_000_000_000_000, 0));
    }

    #[test]
    fn the_sum_is_exact_past_64_bits_and_survives_bytes() {
        let h = Histogram::new();
        let day = 86_400_000_000_000u64;
        // A 1/day limiter with a thousand waiters: 500,500 days of waiting in all.
        for k in 1..=1000u64 {
            h.record(k * day);
        }
        h.record_n(u64::MAX, 3);
        let want = 500_500u128 * day as u128 + 3 * u64::MAX as u128;
        let s = h.snapshot();
        assert_eq!(s.sum, want);
        let back = Snapshot::from_bytes(&s.to_bytes()).unwrap();
        assert_eq!(back, s);
        let copy = Histogram::new();
        copy.add_snapshot(&s);
        copy.add_snapshot(&s);
        assert_eq!(copy.snapshot().sum, 2 * want);
        assert_eq!(copy.reset().sum, 2 * want);
        assert_eq!(copy.snapshot().sum, 0);
        let small = Histogram::new();
        small.record(5);
        assert_eq!(&small.snapshot().to_bytes()[..4], b"RQH1");
    }

    #[test]
    fn clamps_and_counts_out_of_range() {
        let h = Histogram::new();
        h.record(5);
        h.record(u64::MAX);
        let s = h.snapshot();
        assert_eq!((s.underflow, s.overflow), (1, 1));
        assert_eq!(s.max, u64::MAX);
        assert_eq!(s.counts[BUCKETS - 1], 1);
        let h = Histogram::new();
        h.record(15_000_000_000_000_000_000);
        let s = h.snapshot();
        assert_eq!((s.min, s.max), (15_000_000_000_000_000_000, 15_000_000_000_000_000_000));
        assert_eq!(s.percentile(50.0), Some(15e18));
    }

    #[test]
    fn bytes_round_trip_and_merge() {
        let h = Histogram::new();
        for v in [0, 1, 999, 1_000, 123_456_789, 1 << 40, u64::MAX] {
            h.record(v);
        }
        let s = h.snapshot();
        let back = Snapshot::from_bytes(&s.to_bytes()).unwrap();
        assert_eq!(s, back);
        let mut m = s.clone();
        m.merge(&back);
        assert_eq!(m.count(), 2 * s.count());
        assert!(Snapshot::from_bytes(b"nope").is_err());
        let mut bad = s.to_bytes();
        bad.push(0xff);
        assert!(Snapshot::from_bytes(&bad).is_err());
    }

    #[test]
    fn ranks_are_exact() {
        for n in [1u64, 2, 3, 7, 10, 99, 100, 101, 333, 1000, 1 << 40, u64::MAX] {
            for q in 0..=100u64 {
                let want = u64::try_from((q as u128 * n as u128).div_ceil(100)).unwrap().max(1);
                assert_eq!(rank(q as f64, n), want, "q={q} n={n}");
            }
        }
        assert_eq!(rank(7.0, 100), 7);
        assert_eq!(rank(99.9, 1000), 999);
        assert_eq!(rank(99.99, 10_000), 9999);
        assert_eq!(rank(0.1, 1000), 1);
        assert_eq!(rank(0.1, 1001), 2);
        assert_eq!(rank(12.5, 16), 2);
        assert_eq!(rank(1e-300, u64::MAX), 1);
        assert_eq!(rank(f64::MIN_POSITIVE, 5), 1);
        assert_eq!(rank(f64::NAN, 5), 1);
    }

    #[test]
    fn the_fast_rank_agrees_with_the_shortest_decimal() {
        for k in 0..=1_000_000u64 {
            let q = k as f64 / 10_000.0;
            for n in [1u64, 7, 100, 1001, 123_456_789, u64::MAX] {
                let want = (k as u128 * n as u128).div_ceil(1_000_000).clamp(1, n as u128) as u64;
                assert_eq!(rank(q, n), want, "q={q} n={n}");
            }
        }
        assert_eq!(rank(1.0 / 3.0, 3_000_000_000_000_000), 10_000_000_000_000);
        assert_eq!(rank(99.99999, 10_000_000), 9_999_999_900 / 1000);
    }

    #[test]
    fn percentile_of_1_to_100_is_the_exact_rank() {
        let h = Histogram::new();
        for v in 1..=100 {
            h.record(v);
        }
        let s = h.snapshot();
        for q in 0..=100u64 {
            assert_eq!(s.percentile(q as f64), Some(q.max(1) as f64), "q={q}");
        }
    }

    #[test]
    fn a_snapshot_mid_record_is_consistent() {
        // A record that has reached its bucket and subtotal but whose min and max were
        // swapped out by a racing reset.
        let h = Histogram::new();
        h.counts[index_of(123_456)].fetch_add(1, Ordering::Relaxed);
        h.groups[group_of(index_of(123_456))].fetch_add(1, Ordering::Relaxed);
        let m = h.summary();
        assert_eq!(
            (m.count, m.min, m.max),
            (1, lower_of(index_of(123_456)), upper_of(index_of(123_456)) - 1)
        );
        let s = h.snapshot();
        assert_eq!(s.count(), 1);
        let b = index_of(123_456);
        assert_eq!((s.min, s.max), (lower_of(b), upper_of(b) - 1));
        let p = s.percentile(50.0).unwrap();
        assert!(s.min as f64 <= p && p <= s.max as f64);
        // A min and max that ran ahead of the bucket counts read are pulled back.
        h.record(5);
        h.min.store(1, Ordering::Relaxed);
        h.max.store(MAX_TRACKED_NS, Ordering::Relaxed);
        let s = h.reset();
        assert_eq!((s.min, s.max), (5, upper_of(b) - 1));
        let e = h.snapshot();
        assert_eq!((e.count(), e.min, e.max), (0, u64::MAX, 0));
    }

    #[test]
    fn counts_never_wrap() {
        let mut s = Snapshot::default();
        s.counts[500] = u64::MAX;
        s.min = 500;
        s.max = 500;
        let mut m = s.clone();
        m.merge(&s);
        assert_eq!(m.counts[500], u64::MAX);
        let h = Histogram::new();
        h.add_snapshot(&s);
        h.add_snapshot(&s);
        assert_eq!(h.snapshot().count(), u64::MAX);
        h.record_n(500, u64::MAX);
        h.record_n(5, u64::MAX);
        h.record_n(5, 2);
        let r = h.snapshot();
        assert_eq!(
            (r.counts[500], r.counts[5], r.underflow),
            (u64::MAX, u64::MAX, u64::MAX)
        );
        let mut two = s.clone();
        two.counts[501] = 1;
        assert_eq!(two.count(), u64::MAX);
        assert!(Snapshot::from_bytes(&two.to_bytes()).is_err());
        assert_eq!(Snapshot::from_bytes(&s.to_bytes()).unwrap(), s);
    }

    #[test]
    fn count_le_exact_at_edges() {
        let h = Histogram::new();
        for v in [10, 500_000, 1_000_000_000, 2_000_000_000] {
            h.record(v);
        }
        let s = h.snapshot();
        assert_eq!(s.count_le(1_000_000_000), 3);
        assert_eq!(s.count_le(999_000_000), 2);
        assert_eq!(s.count_le(1_000), 1);
        assert_eq!(s.count_le(499_000), 1);
        assert_eq!(s.count_le(500_000), 2);
        assert_eq!(s.count_le(2_500_000), 2);
        assert_eq!(s.count_le(u64::MAX), 4);
    }

    /// A spread of values from 0 to beyond the tracked range, from a fixed LCG.
    fn spread(n: usize, seed: u64) -> Vec<u64> {
        let mut x = seed;
        (0..n)
            .map(|_| {
                x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                (x >> 1) >> (x % 64)
            })
            .collect()
    }

    #[test]
    fn reads_agree_with_the_snapshot() {
        let h = Histogram::new();
        let qs: Vec<f64> = (0..=1000)
            .map(|k| k as f64 / 10.0)
            .chain([7.0, 14.0, 28.0, 55.0, 56.0, 99.99])
            .collect();
        let les = [
            0,
            1,
            999,
            1_000,
            1_001,
            123_456,
            1_000_000_000,
            2_500_000,
            u64::MAX >> 3,
            MAX_TRACKED_NS,
            u64::MAX,
        ];
        let e = h.summary();
        assert_eq!((e.count, e.sum, e.min, e.max), (0, 0, u64::MAX, 0));
        assert_eq!(h.percentiles(&[50.0]).1, vec![None]);
        for (round, n) in [1usize, 2, 3, 100, 5_000].into_iter().enumerate() {
            for v in spread(n, round as u64) {
                h.record(v);
            }
            h.record_n(5_000_000, 3);
            let s = h.snapshot();
            let m = h.summary();
            assert_eq!(
                (m.count, m.sum, m.min, m.max, m.underflow, m.overflow),
                (s.count(), s.sum, s.min, s.max, s.underflow, s.overflow)
            );
            assert_eq!(h.count(), s.count());
            assert_eq!(h.percentiles(&qs).1, s.percentiles(&qs), "round {round}");
            let want: Vec<u64> = les.iter().map(|le| s.count_le(*le)).collect();
            assert_eq!(h.cumulative(&les), want);
            assert_eq!(h.count_le(1_000_000_000), s.count_le(1_000_000_000));
        }
        // Merged and reset histograms keep subtotals and buckets in agreement.
        let copy = Histogram::new();
        copy.add_snapshot(&h.snapshot());
        assert_eq!(copy.summary(), h.summary());
        assert_eq!(copy.percentiles(&qs), h.percentiles(&qs));
        let before = h.snapshot();
        assert_eq!(h.reset(), before);
        assert_eq!(h.summary().count, 0);
        h.record(42_000);
        assert_eq!(h.percentiles(&[0.0, 100.0]).1, vec![Some(42_000.0), Some(42_000.0)]);
        assert_eq!(h.summary().count, 1);
    }

    #[test]
    fn saturated_subtotals_fall_back_to_the_buckets() {
        let mut s = Snapshot::default();
        s.counts[500] = u64::MAX;
        s.counts[501] = 7;
        s.min = 500;
        s.max = 501;
        let h = Histogram::new();
        h.add_snapshot(&s);
        h.add_snapshot(&s);
        h.record(500);
        assert_eq!(h.count(), u64::MAX);
        assert_eq!(h.percentiles(&[0.0, 100.0]).1, h.snapshot().percentiles(&[0.0, 100.0]));
        assert_eq!(h.cumulative(&[500, 501]), vec![u64::MAX, u64::MAX]);
        h.reset();
        assert_eq!(h.count(), 0);
        h.record(7);
        assert_eq!((h.count(), h.summary().min), (1, 7));
    }

    #[test]
    fn a_subtotal_ahead_of_its_buckets_still_reads_sanely() {
        // A reset took a bucket whose record had not yet added to its subtotal: the
        // subtotal then runs one ahead (or below zero) until that add lands.
        let h = Histogram::new();
        h.record(2_000_000);
        let g = group_of(index_of(2_000_000));
        h.groups[g].fetch_add(1, Ordering::Relaxed);
        let (m, p) = h.percentiles(&[0.0, 50.0, 100.0]);
        assert_eq!(m.count, 2);
        assert!(p
            .iter()
            .all(|v| v.is_some_and(|v| m.min as f64 <= v && v <= m.max as f64)));
        h.reset();
        h.groups[g].fetch_sub(2, Ordering::Relaxed);
        let m = h.summary();
        assert_eq!((m.count, m.min, m.max), (0, u64::MAX, 0));
        assert_eq!(h.percentiles(&[50.0]).1, vec![None]);
        h.groups[g].fetch_add(1, Ordering::Relaxed);
        assert_eq!(h.count(), 0);
        h.groups[g].fetch_add(1, Ordering::Relaxed);
        let (m, p) = h.percentiles(&[50.0]);
        assert_eq!(m.count, 1);
        assert!(m.min <= m.max && m.min != u64::MAX);
        assert!(p[0].is_some_and(|v| m.min as f64 <= v && v <= m.max as f64));
    }

    #[test]
    fn concurrent_writers_and_readers_see_consistent_reads() {
        use std::sync::atomic::AtomicBool;
        use std::sync::Arc;
        const WRITERS: usize = 3;
        const PER: usize = 300_000;
        let h = Arc::new(Histogram::new());
        let done = Arc::new(AtomicBool::new(false));
        let writers: Vec<_> = (0..WRITERS)
            .map(|t| {
                let h = Arc::clone(&h);
                std::thread::spawn(move || {
                    for v in spread(PER, t as u64 + 11) {
                        h.record(v);
                    }
                })
            })
            .collect();
        let reader = {
            let (h, done) = (Arc::clone(&h), Arc::clone(&done));
            std::thread::spawn(move || {
                let (mut last, mut reads) = (0u64, 0u64);
                while !done.load(Ordering::Relaxed) || reads == 0 {
                    let (m, p) = h.percentiles(&[0.0, 1.0, 50.0, 99.0, 100.0]);
                    assert!(m.count >= last, "count went back: {} < {last}", m.count);
                    assert!(m.count <= (WRITERS * PER) as u64);
                    last = m.count;
                    if m.count == 0 {
                        assert_eq!((m.min, m.max), (u64::MAX, 0));
                        assert!(p.iter().all(Option::is_none));
                    } else {
                        assert!(m.min <= m.max && m.min != u64::MAX, "{m:?}");
                        let p: Vec<f64> = p.into_iter().map(|v| v.expect("non-empty")).collect();
                        assert!(p.windows(2).all(|w| w[0] <= w[1]), "{p:?}");
                        assert!(m.min as f64 <= p[0] && p[4] <= m.max as f64, "{m:?} {p:?}");
                    }
                    let c = h.cumulative(&[1_000, 1_000_000, u64::MAX]);
                    assert!(c[0] <= c[1] && c[1] <= c[2] && c[2] >= last);
                    let s = h.snapshot();
                    assert!(s.count() >= last);
                    assert!(s.count() == 0 || s.min <= s.max && s.min != u64::MAX);
                    reads += 1;
                }
                reads
            })
        };
        for w in writers {
            w.join().unwrap();
        }
        done.store(true, Ordering::Relaxed);
        assert!(reader.join().unwrap() > 0);
        let all: Vec<u64> = (0..WRITERS).flat_map(|t| spread(PER, t as u64 + 11)).collect();
        let m = h.summary();
        assert_eq!(m.count, all.len() as u64);
        assert_eq!(m.sum, all.iter().map(|v| *v as u128).sum::<u128>());
        assert_eq!((m.min, m.max), (*all.iter().min().unwrap(), *all.iter().max().unwrap()));
        assert_eq!(h.percentiles(&[50.0, 99.9]).1, h.snapshot().percentiles(&[50.0, 99.9]));
    }

    #[test]
    fn resets_racing_writers_lose_nothing_and_never_panic() {
        use std::sync::Arc;
        const PER: usize = 200_000;
        let h = Arc::new(Histogram::new());
        let writers: Vec<_> = (0..2)
            .map(|t| {
                let h = Arc::clone(&h);
                std::thread::spawn(move || {
                    for v in spread(PER, t as u64 + 3) {
                        h.record(v);
                    }
                })
            })
            .collect();
        let mut taken = 0u64;
        while !writers.iter().all(|w| w.is_finished()) {
            let (m, p) = h.percentiles(&[50.0, 100.0]);
            if m.count > 0 {
                assert!(m.min <= m.max && m.min != u64::MAX);
                assert!(p
                    .iter()
                    .all(|v| v.is_some_and(|v| m.min as f64 <= v && v <= m.max as f64)));
            }
            taken += h.reset().count();
        }
        for w in writers {
            w.join().unwrap();
        }
        // Every record landed either in a reset or in what is left; subtotals agree.
        let left = h.snapshot();
        assert_eq!(taken + left.count(), 2 * PER as u64);
        assert_eq!(h.count(), left.count());
        assert_eq!(h.percentiles(&[50.0]).1, left.percentiles(&[50.0]));
    }
}
