//! The core's decision against governor's, side by side in one run: one rate on the
//! monotonic clock, both always admitting (1e9/s with a burst of 2^30, one second, so a
//! thread descheduled between its clock reading and its decision is still admitted), on
//! one thread and as the total throughput of two threads hammering one limiter.
//!
//! The group `queue_recheck` puts the queue-guarded fast path (Python's `try_acquire`:
//! "nobody waits", then the take) beside itself with the re-check after the take that
//! closes the race with a joining waiter (one more atomic load), in the same run.
//!
//! `cargo bench -p ratequeue-core --bench governor`. Each two-thread figure is the wall
//! time of both threads divided by the decisions they made together (1 / throughput).

use std::hint::black_box;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use governor::{Quota, RateLimiter};
use ratequeue_core::{AnyClock, Limiter, QueueConfig, Rate, WaitQueue};

const BURST: u32 = 1 << 30;

fn ratequeue() -> Limiter {
    let rate = Rate::new(1e9, 1e9, BURST as u64).unwrap();
    Limiter::new(vec![("requests".into(), rate)], AnyClock::Monotonic).unwrap()
}

type Governor = RateLimiter<
    governor::state::NotKeyed,
    governor::state::InMemoryState,
    governor::clock::DefaultClock,
    governor::middleware::NoOpMiddleware<<governor::clock::DefaultClock as governor::clock::Clock>::Instant>,
>;

fn governor() -> Governor {
    let quota = Quota::with_period(Duration::from_nanos(1))
        .unwrap()
        .allow_burst(NonZeroU32::new(BURST).unwrap());
    RateLimiter::direct(quota)
}

#[path = "common/together.rs"]
mod common;

/// Wall time per thread of `threads` threads each making `iters` decisions together.
fn together(threads: usize, iters: u64, decide: Arc<dyn Fn() -> bool + Send + Sync>) -> Duration {
    common::together(threads, iters, decide) / threads as u32
}

fn bench(c: &mut Criterion) {
    let mut one = c.benchmark_group("one_thread");
    one.throughput(Throughput::Elements(1));
    let g = governor();
    one.bench_function("governor_check", |b| b.iter(|| black_box(g.check()).is_ok()));
    assert!(g.check().is_ok(), "governor must time admissions");
    let r = ratequeue();
    one.bench_function("ratequeue_try_acquire", |b| {
        b.iter(|| black_box(r.try_acquire(black_box(&[1]))).is_ok())
    });
    assert!(r.try_acquire(&[1]).is_ok(), "ratequeue must time admissions");
    one.finish();

    let mut two = c.benchmark_group("two_threads_total");
    two.throughput(Throughput::Elements(1));
    let g = Arc::new(governor());
    let decide: Arc<dyn Fn() -> bool + Send + Sync> = Arc::new(move || g.check().is_ok());
    two.bench_function("governor_check", |b| {
        b.iter_custom(|iters| together(2, iters, decide.clone()))
    });
    let r = Arc::new(ratequeue());
    let decide: Arc<dyn Fn() -> bool + Send + Sync> = Arc::new(move || r.try_acquire(&[1]).is_ok());
    two.bench_function("ratequeue_try_acquire", |b| {
        b.iter_custom(|iters| together(2, iters, decide.clone()))
    });
    two.finish();

    let mut recheck = c.benchmark_group("queue_recheck");
    recheck.throughput(Throughput::Elements(1));
    let r = Arc::new(ratequeue());
    let q = WaitQueue::new(
        r.clone(),
        1,
        AnyClock::Monotonic,
        QueueConfig::new(vec![], 100, None).unwrap(),
    );
    recheck.bench_function("check_then_take", |b| {
        b.iter(|| q.waiting() == 0 && black_box(r.try_acquire_nowait(black_box(&[1]))).is_some_and(|x| x.is_ok()))
    });
    recheck.bench_function("check_take_recheck", |b| {
        b.iter(|| {
            q.waiting() == 0
                && black_box(r.try_acquire_idle_nowait(black_box(&[1]), || q.joined())).is_some_and(|x| x.is_ok())
        })
    });
    assert!(r.try_acquire_idle_nowait(&[1], || q.joined()) == Some(Ok(())));
    recheck.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
