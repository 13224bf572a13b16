//! `n` always-admitting decisions in a loop, for counting CPU cycles per decision with
//! `perf stat -e cycles:u,instructions:u` (robust to other load, unlike wall time):
//! `cargo run --release --example decide_loop -- {ratequeue|governor|none} N`.
//! `check_then_take` and `check_take_recheck` are the queue-guarded fast path (Python's
//! `try_acquire`) without and with the re-check after the take that closes the race with
//! a joining waiter.

use std::hint::black_box;
use std::num::NonZeroU32;
use std::time::Duration;

use governor::{Quota, RateLimiter};
use std::sync::Arc;

use ratequeue_core::{AnyClock, Limiter, QueueConfig, Rate, WaitQueue};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let which = args.get(1).map_or("ratequeue", String::as_str);
    let n: u64 = args.get(2).map_or(100_000_000, |s| s.parse().unwrap());
    let burst = 1u32 << 30;
    let admitted = match which {
        "ratequeue" => {
            let r = Limiter::new(
                vec![("requests".into(), Rate::new(1e9, 1e9, burst as u64).unwrap())],
                AnyClock::Monotonic,
            )
            .unwrap();
            (0..n)
                .filter(|_| black_box(r.try_acquire(black_box(&[1]))).is_ok())
                .count()
        }
        "governor" => {
            let quota = Quota::with_period(Duration::from_nanos(1))
                .unwrap()
                .allow_burst(NonZeroU32::new(burst).unwrap());
            let g = RateLimiter::direct(quota);
            (0..n).filter(|_| black_box(g.check()).is_ok()).count()
        }
        "check_then_take" | "check_take_recheck" => {
            let r = Arc::new(
                Limiter::new(
                    vec![("requests".into(), Rate::new(1e9, 1e9, burst as u64).unwrap())],
                    AnyClock::Monotonic,
                )
                .unwrap(),
            );
            let cfg = QueueConfig::new(vec![], 100, None).unwrap();
            let q = WaitQueue::new(r.clone(), 1, AnyClock::Monotonic, cfg);
            if which == "check_then_take" {
                (0..n)
                    .filter(|_| q.waiting() == 0 && black_box(r.try_acquire_nowait(black_box(&[1]))) == Some(Ok(())))
                    .count()
            } else {
                (0..n)
                    .filter(|_| {
                        q.waiting() == 0
                            && black_box(r.try_acquire_idle_nowait(black_box(&[1]), || q.joined())) == Some(Ok(()))
                    })
                    .count()
            }
        }
        _ => (0..n).filter(|i| black_box(*i) < u64::MAX).count(),
    };
    assert_eq!(admitted as u64, n, "every decision must be an admission");
}
