//! Criterion benches of histogram recording (filled in by the histogram benchmarks).

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
}

criterion_group!(benches, bench);
criterion_main!(benches);
