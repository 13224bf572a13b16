//! The one undo rule under random schedules: takes (now or reserved ahead), exact and
//! partial give-backs of any held debit at any later time, and refunds of debits not
//! held as records. Whatever is given back is taken off its grant; the grants' net
//! costs must then never exceed the rate in any window of schedule time:
//! net admitted in [s, s + d] ≤ burst + rate·d.

use ratequeue_core::bucket::{Taken, Undo};
use ratequeue_core::{Bucket, Rate};

mod common;
use common::{check_windows, Lcg, S};

struct Grant {
    at: u64,
    taken_at: u64,
    cost: u64,
    net: f64,
    /// None: settled without its record (`refund_since`, from its time and cost).
    held: Option<Taken>,
}

fn run(seed: u64, per_sec: f64, burst: u64) {
    let mut rng = Lcg(seed);
    let b = Bucket::new(Rate::new(per_sec, 1e9, burst).unwrap());
    let mut now = 0u64;
    let mut grants: Vec<Grant> = Vec::new();
    let mut dropped = 0;
    for _ in 0..1500 {
        match rng.below(10) {
            0..=2 => now += rng.below(2 * S / per_sec as u64 + 1),
            3..=5 => {
                let cost = 1 + rng.below(burst);
                let max = if rng.below(2) == 0 { 0 } else { rng.below(4 * S) };
                if let Ok(t) = b.take(now, cost, max) {
                    grants.push(Grant {
                        at: now + t.delay_ns,
                        taken_at: now,
                        cost,
                        net: cost as f64,
                        held: (rng.below(3) != 0).then_some(t),
                    });
                }
            }
            6..=9 if !grants.is_empty() => {
                let k = rng.below(grants.len() as u64) as usize;
                let g = &mut grants[k];
                let before = b.available(now);
                match &mut g.held {
                    Some(t) => {
                        let ret = rng.below(t.cost() + 1);
                        dropped += usize::from(b.give_back(t, ret, now) == Undo::Dropped);
                    }
                    None => {
                        let ret = rng.below(g.cost + 1);
                        dropped += usize::from(b.refund_since(now, ret, g.taken_at, g.cost) == Undo::Dropped);
                        g.cost -= ret;
                    }
                }
                g.net -= b.available(now) - before;
                assert!(g.net >= -1e-9, "gave back more than was taken");
            }
            _ => {}
        }
    }
    assert!(dropped > 0, "the schedule never exercised a kept give-back");
    check_windows(grants.iter().map(|g| (g.at, g.net)), per_sec, burst);
}

#[test]
fn give_backs_never_let_a_window_exceed_the_rate() {
    for seed in 0..12 {
        run(seed, 1.0, 3);
        run(seed + 100, 10.0, 1);
        run(seed + 200, 7.0, 12);
    }
}
