//! Criterion benches of histogram recording and of its reads (count, summary, one and
//! four percentiles, snapshot) on a histogram holding 10^6 spread values.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion};
use ratequeue_core::Histogram;

fn bench(c: &mut Criterion) {
    let h = Histogram::new();
    let mut v = 1_234u64;
    c.bench_function("histogram_record", |b| {
        b.iter(|| {
            v = v.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            h.record(black_box(v >> 30));
        })
    });
    let full = Histogram::new();
    let mut x = 99u64;
    for _ in 0..1_000_000 {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        // Roughly log-uniform from 1 µs to ~1000 s.
        full.record(1_000u64 << ((x >> 59) as u32 + 10).min(40) >> 10 | (x >> 40) & 0xfff);
    }
    c.bench_function("histogram_read_count", |b| b.iter(|| black_box(full.count())));
    c.bench_function("histogram_read_summary", |b| b.iter(|| black_box(full.summary())));
    c.bench_function("histogram_read_p99", |b| {
        b.iter(|| black_box(full.percentiles(&[99.0])))
    });
    c.bench_function("histogram_read_4_percentiles", |b| {
        b.iter(|| black_box(full.percentiles(&[50.0, 90.0, 99.0, 99.9])))
    });
    c.bench_function("histogram_read_snapshot", |b| b.iter(|| black_box(full.snapshot())));
}

criterion_group!(benches, bench);
criterion_main!(benches);
