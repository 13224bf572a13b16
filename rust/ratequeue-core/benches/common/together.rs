//! Shared by the `governor` and `contend` benches: threads deciding on one limiter at once.

use std::hint::black_box;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

/// Wall time from a common start until `threads` threads have each made `n` decisions
/// (every one an admission: the benches time admissions only).
pub fn together(threads: usize, n: u64, decide: Arc<dyn Fn() -> bool + Send + Sync>) -> Duration {
    let start = Arc::new(Barrier::new(threads + 1));
    let handles: Vec<_> = (0..threads)
        .map(|_| {
            let (start, decide) = (start.clone(), decide.clone());
            std::thread::spawn(move || {
                start.wait();
                let mut admitted = 0u64;
                for _ in 0..n {
                    admitted += black_box(decide()) as u64;
                }
                assert_eq!(admitted, n, "the bench must time admissions");
            })
        })
        .collect();
    start.wait();
    let t0 = Instant::now();
    for h in handles {
        h.join().unwrap();
    }
    t0.elapsed()
}
