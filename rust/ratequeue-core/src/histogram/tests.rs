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
