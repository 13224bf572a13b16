//! The threads harness of `benches/bench_waiting.py` without Python: `THREADS` threads
//! share `N` blocking acquires at `RATE`/s (burst 10) and each grant's wake lateness
//! (the waiter back from `acquire_blocking` minus the grant's schedule time) is recorded:
//! `cargo run --release --example thread_lateness -- [threads] [n] [rate] [gil]`.
//! With `gil`, one mutex stands in for Python's GIL: held between acquires, released
//! around every wait (as the bindings' `py.detach`), taken again before returning.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Barrier, Mutex};
use std::time::Duration;

use ratequeue_core::wait::{Detach, Gate, Host};
use ratequeue_core::{AnyClock, Limiter, QueueConfig, Rate, WaitQueue};

struct NoHost<'a> {
    gil: Option<&'a Mutex<()>>,
}

impl Detach for NoHost<'_> {
    fn detached<T: Send, F: FnOnce() -> T + Send>(&self, f: F) -> T {
        f()
    }
}

impl Host for NoHost<'_> {
    type Interrupt = ();
    fn slice(&mut self) -> Result<Option<Duration>, ()> {
        Ok(None)
    }
    fn check(&mut self) -> Result<(), ()> {
        Ok(())
    }
}

fn pct(xs: &[u64], q: f64) -> f64 {
    xs[((xs.len() as f64 - 1.0) * q).round() as usize] as f64 / 1e3
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let threads: usize = args.get(1).map_or(8, |s| s.parse().unwrap());
    let n: u64 = args.get(2).map_or(20_000, |s| s.parse().unwrap());
    let rate: f64 = args.get(3).map_or(10_000.0, |s| s.parse().unwrap());
    let gil_mode = args.get(4).is_some_and(|s| s == "gil");
    let lim = Limiter::new(
        vec![("requests".into(), Rate::new(rate, 1e9, 10).unwrap())],
        AnyClock::Monotonic,
    )
    .unwrap();
    let queue = WaitQueue::new(
        Arc::new(lim),
        1,
        AnyClock::Monotonic,
        QueueConfig::new(vec![], 100_000, None).unwrap(),
    );
    let gate = Gate::new(queue.clone(), vec!["requests".into()], false);
    let tickets = Arc::new(AtomicU64::new(0));
    let start = Arc::new(Barrier::new(threads));
    let gil = Arc::new(Mutex::new(()));
    let t0 = AnyClock::Monotonic.now_ns();
    let handles: Vec<_> = (0..threads)
        .map(|_| {
            let (gate, tickets, start, gil) = (gate.clone(), tickets.clone(), start.clone(), gil.clone());
            std::thread::spawn(move || {
                let mut late = Vec::new();
                start.wait();
                let mut held = gil_mode.then(|| gil.lock().unwrap());
                while tickets.fetch_add(1, Ordering::Relaxed) < n {
                    drop(held.take());
                    let mut host = NoHost {
                        gil: gil_mode.then_some(&*gil),
                    };
                    let p = gate.acquire_blocking(&mut host, &[1], 0, None).unwrap();
                    if let Some(g) = host.gil {
                        held = Some(g.lock().unwrap());
                    }
                    let woke = AnyClock::Monotonic.now_ns();
                    if p.waited_ns() > 0 {
                        late.push(woke.saturating_sub(p.held(&ratequeue_core::wait::Inline).1.at_ns));
                    }
                }
                late
            })
        })
        .collect();
    let mut late: Vec<u64> = handles.into_iter().flat_map(|h| h.join().unwrap()).collect();
    let elapsed = (AnyClock::Monotonic.now_ns() - t0) as f64 / 1e9;
    late.sort_unstable();
    println!(
        "{threads} threads, {n} at {rate}/s{}: elapsed {elapsed:.3} s, {} queued; lateness µs p50 {:.1} p90 {:.1} p99 {:.1} max {:.1}",
        if gil_mode { " (gil)" } else { "" },
        late.len(),
        pct(&late, 0.5),
        pct(&late, 0.9),
        pct(&late, 0.99),
        pct(&late, 1.0),
    );
}
