//! Shared by the randomized undo checks: a seeded generator and the window bound.
#![allow(dead_code)]

/// Nanoseconds in one second.
pub const S: u64 = 1_000_000_000;

/// A tiny seeded generator (reproducible per seed, no dependency).
pub struct Lcg(pub u64);

impl Lcg {
    pub fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 33
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// Asserts net admitted in [s, s + d] ≤ burst + rate·d over every window of the
/// grants `(schedule time ns, net cost)`.
pub fn check_windows(grants: impl IntoIterator<Item = (u64, f64)>, per_sec: f64, burst: u64) {
    let mut g: Vec<(u64, f64)> = grants.into_iter().collect();
    g.sort_by_key(|x| x.0);
    for i in 0..g.len() {
        let mut total = 0.0;
        for j in i..g.len() {
            total += g[j].1;
            let d = (g[j].0 - g[i].0) as f64 / S as f64;
            let bound = burst as f64 + per_sec * d + 1e-6;
            assert!(total <= bound, "window [{}, {}]: {total} > {bound}", g[i].0, g[j].0);
        }
    }
}
