//! Criterion benches of the core decisions (the hot path of every acquire).

use std::hint::black_box;
use std::sync::Arc;

use criterion::{criterion_group, criterion_main, Criterion};
use ratequeue_core::{AnyClock, Bucket, Limiter, ManualClock, Rate};

fn bench(c: &mut Criterion) {
    let always = Rate::new(1e9, 1e9, 1 << 20).unwrap();
    let bucket = Bucket::new(always);
    let mut t = 0u64;
    c.bench_function("bucket_take_admit", |b| {
        b.iter(|| {
            t += 1;
            black_box(bucket.take(black_box(t), 1, 0)).ok()
        })
    });
    assert!(
        bucket.take(t + 1, 1, 0).is_ok(),
        "bucket_take_admit must time admissions"
    );
    let tight = Bucket::new(Rate::new(1.0, 1e9, 1).unwrap());
    tight.take(0, 1, 0).unwrap();
    c.bench_function("bucket_take_refuse", |b| {
        b.iter(|| black_box(tight.take(black_box(1), 1, 0)).is_err())
    });

    // The manual clock never moves: a burst of 2^50 (13 days at 1e9/s) keeps every
    // iteration admitted (2^20 ran dry after ~1M iterations and then timed refusals).
    let frozen = Rate::new(1e9, 1e9, 1 << 50).unwrap();
    let clock = Arc::new(ManualClock::new(0).unwrap());
    let one = Limiter::new(vec![("requests".into(), frozen)], AnyClock::Manual(clock.clone())).unwrap();
    c.bench_function("limiter_try_acquire_manual_clock", |b| {
        b.iter(|| one.try_acquire(black_box(&[1])).is_ok())
    });
    assert!(one.try_acquire(&[1]).is_ok(), "manual-clock bench must time admissions");
    let real = Limiter::new(vec![("requests".into(), always)], AnyClock::Monotonic).unwrap();
    c.bench_function("limiter_try_acquire_monotonic", |b| {
        b.iter(|| real.try_acquire(black_box(&[1])).is_ok())
    });
    assert!(real.try_acquire(&[1]).is_ok(), "monotonic bench must time admissions");
    let two = Limiter::new(
        vec![
            ("requests".into(), frozen),
            ("tokens".into(), Rate::new(1e9, 1e9, 1 << 55).unwrap()),
        ],
        AnyClock::Manual(clock),
    )
    .unwrap();
    c.bench_function("limiter_try_acquire_two_rates", |b| {
        b.iter(|| two.try_acquire(black_box(&[1, 100])).is_ok())
    });
    assert!(
        two.try_acquire(&[1, 100]).is_ok(),
        "two-rate bench must time admissions"
    );
}

criterion_group!(benches, bench);
criterion_main!(benches);
