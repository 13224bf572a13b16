//! First-time uint64 keys through `KeyedLimiter::try_acquire_many`, the Rust side of
//! `benches/bench_keyed.py`'s `rq-u64-big` row (issue 13: ≥ 20 M/s new keys): a fresh map,
//! N keys `i * golden` hashed as the binding hashes a uint64 array, decided in batches of
//! 65,536; then N decisions over 1,000 hot keys; then the N keys again (held keys, a
//! lookup each); then, after every bucket is full again and swept, N other new keys into
//! the map's tables already grown (the first-touch and growth costs left out).
//!
//! `cargo bench -p ratequeue-core --bench keyed_new [-- N ROUNDS MAX_KEYS]` (defaults
//! 1,000,000, 5 and 2^21: at 2^20, the Python default, one of the 256 shards of ~3,900
//! keys reaches its cap of 4,096 in about a third of the seeds and sweeps itself, which
//! is not what is measured here). Prints ns per key of each phase, wall and CPU time of
//! the thread (the CPU time does not count waits for a core on a loaded machine). Also
//! the workload for `valgrind --tool=callgrind` and `perf record` (`-- 1000000 1`).

use std::hint::black_box;
use std::time::{Duration, Instant};

use ratequeue_core::{AnyClock, KeyedLimiter, Rate};

const CHUNK: usize = 65_536;
const HOT: u64 = 1_000;
const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

fn decide(kl: &KeyedLimiter, keys: &[u64], out: &mut Vec<bool>) -> usize {
    let mut admitted = 0;
    for chunk in keys.chunks(CHUNK) {
        // As the binding does per call: hash the array into a fresh vector, decide into
        // a fresh output.
        let h = kl.hasher();
        let hashed: Vec<u64> = chunk.iter().map(|k| h.int(*k)).collect();
        out.clear();
        out.resize(hashed.len(), false);
        kl.try_acquire_many(&hashed, None, out).unwrap();
        admitted += out.iter().filter(|x| **x).count();
    }
    admitted
}

/// CPU time of this thread so far (user + system), in nanoseconds.
fn cpu_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: a valid clock id and a pointer to a timespec of ours.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Runs `f` (which must admit all `n` keys), returns (wall, cpu) ns per key.
fn timed(n: u64, what: &str, f: impl FnOnce() -> usize) -> (f64, f64) {
    let (w, c) = (Instant::now(), cpu_ns());
    let got = f();
    let (w, c) = (w.elapsed().as_nanos() as f64, (cpu_ns() - c) as f64);
    assert_eq!(got as u64, n, "every {what} key admitted");
    (w / n as f64, c / n as f64)
}

fn main() {
    let args: Vec<u64> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let n = args.first().copied().unwrap_or(1_000_000);
    let rounds = args.get(1).copied().unwrap_or(5);
    let max_keys = args.get(2).copied().unwrap_or(1 << 21) as usize;
    let keys: Vec<u64> = (0..n).map(|i| i.wrapping_mul(GOLDEN)).collect();
    let hot: Vec<u64> = (0..n).map(|i| (i % HOT).wrapping_mul(GOLDEN)).collect();
    let other: Vec<u64> = (n..2 * n).map(|i| i.wrapping_mul(GOLDEN)).collect();
    let mut out = Vec::new();
    println!("ns per key, wall / CPU: new keys | hot keys | held keys | new keys, tables grown");
    for round in 0..rounds {
        let rate = Rate::new(1e9, 1e9, 1_000_000_000).unwrap();
        let kl = KeyedLimiter::new(rate, max_keys, AnyClock::Monotonic).unwrap();
        let new = timed(n, "new", || decide(&kl, &keys, &mut out));
        assert_eq!(kl.len() as u64, n, "no key evicted");
        let hot = timed(n, "hot", || decide(&kl, black_box(&hot), &mut out));
        let held = timed(n, "held", || decide(&kl, black_box(&keys), &mut out));
        std::thread::sleep(Duration::from_millis(2));
        assert_eq!(kl.sweep() as u64, n);
        let grown = timed(n, "other new", || decide(&kl, &other, &mut out));
        let f = |(w, c): (f64, f64)| format!("{w:5.1} / {c:5.1}");
        println!("round {round}: {} | {} | {} | {}", f(new), f(hot), f(held), f(grown));
    }
}
