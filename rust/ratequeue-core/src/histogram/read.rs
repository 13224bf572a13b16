//! Reading a histogram: counts, percentiles, cumulative buckets and snapshots, consistent
//! as the module doc says.

use super::*;

impl Histogram {
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
}
