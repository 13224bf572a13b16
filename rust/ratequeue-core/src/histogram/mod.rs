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
//!
//! Here: the bucket layout and the shared state; `record.rs` writes, `read.rs` reads,
//! `snapshot.rs` holds the plain copy and its binary format.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::Error;

mod read;
mod record;
mod snapshot;

pub use snapshot::Snapshot;

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

#[cfg(test)]
mod tests;
