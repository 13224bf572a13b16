//! `n` always-admitting decisions in a loop, for counting CPU cycles per decision with
//! `perf stat -e cycles:u,instructions:u` (robust to other load, unlike wall time):
//! `cargo run --release --example decide_loop -- {ratequeue|governor|none} N`.

use std::hint::black_box;
use std::num::NonZeroU32;
use std::time::Duration;

use governor::{Quota, RateLimiter};
use ratequeue_core::{AnyClock, Limiter, Rate};

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
        _ => (0..n).filter(|i| black_box(*i) < u64::MAX).count(),
    };
    assert_eq!(admitted as u64, n, "every decision must be an admission");
}
