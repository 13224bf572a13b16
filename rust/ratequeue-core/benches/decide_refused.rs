//! Instruction counts of one refused decision, for `valgrind --tool=callgrind` (see
//! `decide_insns.rs`, whose loops it would change: another call site of the decision
//! there changes what the compiler inlines into them).
//!
//! `valgrind --tool=callgrind --toggle-collect='*timed*' <binary> KIND N` with KIND one
//! of: `try_acquire` (`Limiter::try_acquire(&[1])`, monotonic clock, one per day, spent)
//! or `idle` (the bindings' `try_acquire_idle_nowait`, the same limiter).

use std::hint::black_box;

use ratequeue_core::clock::monotonic_ns;
use ratequeue_core::{AnyClock, Limiter, Rate};

/// The timed loop: `n` calls of `decide`, counting those that returned 1.
#[inline(never)]
fn timed(n: u64, mut decide: impl FnMut() -> u64) -> u64 {
    let mut refused = 0;
    for _ in 0..n {
        refused += decide();
    }
    refused
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.iter().any(|a| a == "--bench") {
        return;
    }
    let kind = args.get(1).map(String::as_str).unwrap_or("try_acquire");
    let n: u64 = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(1_000_000);
    let _ = monotonic_ns();
    let r = Limiter::new(
        vec![("requests".into(), Rate::new(1.0, 86_400e9, 1).unwrap())],
        AnyClock::Monotonic,
    )
    .unwrap();
    assert!(r.try_acquire(&[1]).is_ok());
    let refused = match kind {
        "try_acquire" => timed(n, || black_box(r.try_acquire(black_box(&[1]))).is_err() as u64),
        "idle" => timed(n, || {
            black_box(r.try_acquire_idle_nowait(black_box(&[1]), || false)).is_some_and(|d| d.is_err()) as u64
        }),
        other => panic!("unknown kind {other}"),
    };
    assert_eq!(refused, n, "every decision must be a refusal");
}
