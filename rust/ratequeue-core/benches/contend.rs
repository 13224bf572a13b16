//! Two threads on one limiter, governor 0.10 and the core in interleaved rounds: the
//! total throughput of both threads (wall time of the round / decisions made together),
//! so that a round's machine noise falls on both and their ratio is read round by round.
//!
//! `cargo bench -p ratequeue-core --bench contend --no-run`, then
//! `<binary> ROUNDS N [THREADS]`: ROUNDS rounds, each timing governor then ratequeue (the
//! order alternates between rounds), each thread making N decisions (all admissions:
//! 1e9/s with a burst of 2^30, as in the `governor` bench). Prints every round, then the
//! min and median ns per decision of each and the ratio of governor's time to ours per
//! round (≥ 1.5 is the goal of issue 13).

use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use governor::{Quota, RateLimiter};
use ratequeue_core::{AnyClock, Limiter, Rate};

const BURST: u32 = 1 << 30;

#[path = "common/together.rs"]
mod common;

/// Wall ns per decision of `threads` threads each making `n` decisions together.
fn together(threads: usize, n: u64, decide: Arc<dyn Fn() -> bool + Send + Sync>) -> f64 {
    common::together(threads, n, decide).as_nanos() as f64 / (threads as u64 * n) as f64
}

fn stats(v: &[f64]) -> (f64, f64) {
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.partial_cmp(b).unwrap());
    (s[0], s[s.len() / 2])
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.iter().any(|a| a == "--bench") {
        return; // `cargo bench` runs every bench target: nothing to time here.
    }
    let rounds: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(10);
    let n: u64 = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(5_000_000);
    let threads: usize = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(2);

    let quota = Quota::with_period(Duration::from_nanos(1))
        .unwrap()
        .allow_burst(NonZeroU32::new(BURST).unwrap());
    let g = Arc::new(RateLimiter::direct(quota));
    let gov: Arc<dyn Fn() -> bool + Send + Sync> = Arc::new(move || g.check().is_ok());
    let rate = Rate::new(1e9, 1e9, BURST as u64).unwrap();
    let r = Arc::new(Limiter::new(vec![("requests".into(), rate)], AnyClock::Monotonic).unwrap());
    let rq: Arc<dyn Fn() -> bool + Send + Sync> = Arc::new(move || r.try_acquire(&[1]).is_ok());

    let (mut gs, mut rs, mut ratios) = (vec![], vec![], vec![]);
    for round in 0..rounds {
        let (a, b) = if round % 2 == 0 {
            let a = together(threads, n, gov.clone());
            (a, together(threads, n, rq.clone()))
        } else {
            let b = together(threads, n, rq.clone());
            (together(threads, n, gov.clone()), b)
        };
        println!(
            "round {round}: governor {a:.2} ns, ratequeue {b:.2} ns, ratio {:.2}",
            a / b
        );
        gs.push(a);
        rs.push(b);
        ratios.push(a / b);
    }
    let ((gmin, gmed), (rmin, rmed), (qmin, qmed)) = (stats(&gs), stats(&rs), stats(&ratios));
    println!("governor  min {gmin:.2} median {gmed:.2} ns/decision ({threads} threads total)");
    println!("ratequeue min {rmin:.2} median {rmed:.2} ns/decision");
    println!("ratio governor/ratequeue per round: min {qmin:.2} median {qmed:.2}");
}
