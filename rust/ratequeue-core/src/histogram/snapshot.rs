//! Snapshots: plain copies for percentiles, merging and the binary format.

use super::*;

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
    pub(super) fn with_consistent_range(mut self) -> Snapshot {
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
