//! Instruction counts of one decision, for `valgrind --tool=callgrind` (which does not
//! move with the machine's load): runs `N` decisions of the kind named by the first
//! argument; the count per decision is the difference between two runs with different
//! `N`, divided by the difference in `N`.
//!
//! `cargo bench -p ratequeue-core --bench decide_insns --no-run`, then
//! `valgrind --tool=callgrind --toggle-collect='*timed*' <binary> KIND N` (only the timed
//! loop counted, not the set-up or the clock's calibration) with KIND one of: `governor` (governor
//! 0.10's `check()`), `try_acquire` (`Limiter::try_acquire(&[1])`, monotonic clock),
//! `try_acquire_manual` (the same on a ManualClock), `clock` (`monotonic_ns()`),
//! `quanta_raw` (the TSC read alone), `quanta_scaled` (read and scale), `nothing`.

use std::hint::black_box;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use governor::{Quota, RateLimiter};
use ratequeue_core::clock::monotonic_ns;
use ratequeue_core::{AnyClock, Limiter, ManualClock, Rate};

const BURST: u32 = 1 << 30;

fn limiter(clock: AnyClock) -> Limiter {
    let rate = Rate::new(1e9, 1e9, BURST as u64).unwrap();
    Limiter::new(vec![("requests".into(), rate)], clock).unwrap()
}

/// The timed loop: `n` calls of `decide`, counting those that returned 1.
#[inline(never)]
fn timed(n: u64, mut decide: impl FnMut() -> u64) -> u64 {
    let mut ok = 0;
    for _ in 0..n {
        ok += decide();
    }
    ok
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.iter().any(|a| a == "--bench") {
        // `cargo bench` runs every bench target: nothing to time here.
        return;
    }
    let kind = args.get(1).map(String::as_str).unwrap_or("try_acquire");
    let n: u64 = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(1_000_000);
    // The clock's calibration happens on its first read, before any timed loop.
    let _ = monotonic_ns();
    let ok = match kind {
        "governor" => {
            let quota = Quota::with_period(Duration::from_nanos(1))
                .unwrap()
                .allow_burst(NonZeroU32::new(BURST).unwrap());
            let g = RateLimiter::direct(quota);
            timed(n, || black_box(g.check()).is_ok() as u64)
        }
        "try_acquire" => {
            let r = limiter(AnyClock::Monotonic);
            timed(n, || black_box(r.try_acquire(black_box(&[1]))).is_ok() as u64)
        }
        "try_acquire_manual" => {
            let r = limiter(AnyClock::Manual(Arc::new(ManualClock::new(1 << 40).unwrap())));
            timed(n, || black_box(r.try_acquire(black_box(&[1]))).is_ok() as u64)
        }
        "clock" => timed(n, || (black_box(monotonic_ns()) != u64::MAX) as u64),
        "quanta_raw" => {
            let c = quanta::Clock::new();
            timed(n, || (black_box(c.raw()) != u64::MAX) as u64)
        }
        "quanta_scaled" => {
            let c = quanta::Clock::new();
            let origin = c.raw();
            timed(n, || (black_box(c.delta_as_nanos(origin, c.raw())) != u64::MAX) as u64)
        }
        "nothing" => timed(n, || black_box(1u64)),
        other => panic!("unknown kind {other}"),
    };
    assert_eq!(ok, n, "every decision must be an admission");
}
