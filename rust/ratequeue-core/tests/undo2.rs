//! The one undo rule after the review's fixes: a refund's cap counts the refunds since
//! its take, a partial give-back of a grant still ahead keeps its slot, a token-less
//! refund converts what its grant holds across rate changes, a late multi-rate
//! give-back uses its own debits, and a keyed undo never reaches a re-created key.

use ratequeue_core::bucket::{Taken, Undo};
use ratequeue_core::keyed::KeyTaken;
use ratequeue_core::{AnyClock, Bucket, KeyedLimiter, Limiter, ManualClock, Rate, Resource};
use std::sync::Arc;

const S: u64 = 1_000_000_000;

struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 33
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

struct Grant {
    at: u64,
    cost: u64,
    net: f64,
    /// None: given back without its record (`refund_since`, from its time and cost).
    held: Option<Taken>,
}

fn check_windows(grants: &[Grant], per_sec: f64, burst: u64) {
    let mut g: Vec<(u64, f64)> = grants.iter().map(|g| (g.at, g.net)).collect();
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

/// Takes now or ahead; give-backs by the full record, by a token (a grant whose time
/// has come, as the queue hands them out) or by grant time only; rate changes to the
/// same rate (or none).
fn run(seed: u64, per_sec: f64, burst: u64, rate_changes: bool) {
    let mut rng = Lcg(seed);
    let rate = Rate::new(per_sec, 1e9, burst).unwrap();
    let b = Bucket::new(rate);
    let mut now = 0u64;
    let mut grants: Vec<Grant> = Vec::new();
    for _ in 0..1200 {
        match rng.below(12) {
            0..=2 => now += rng.below(2 * S / per_sec as u64 + 1),
            3..=5 => {
                let cost = 1 + rng.below(burst);
                let max = if rng.below(2) == 0 { 0 } else { rng.below(4 * S) };
                if let Ok(t) = b.take(now, cost, max) {
                    let held = match rng.below(3) {
                        0 if t.delay_ns == 0 => Some(Taken::from_token(t.after_word(), cost)),
                        1 if t.delay_ns == 0 => None,
                        _ => Some(t),
                    };
                    grants.push(Grant {
                        at: now + t.delay_ns,
                        cost,
                        net: cost as f64,
                        held,
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
                        b.give_back(t, ret, now);
                    }
                    None if g.at <= now && g.cost > 0 => {
                        let ret = 1 + rng.below(g.cost);
                        b.refund_since(now, ret, g.at, g.cost);
                        g.cost -= ret;
                    }
                    None => {}
                }
                g.net -= b.available(now) - before;
                assert!(g.net >= -1e-9, "gave back more than was taken");
            }
            10 if rate_changes => b.set_rate(now, rate),
            _ => {}
        }
    }
    check_windows(&grants, per_sec, burst);
}

#[test]
fn give_backs_of_every_kind_never_let_a_window_exceed_the_rate() {
    for seed in 0..600 {
        for rate_changes in [false, true] {
            run(seed, 1.0, 3, rate_changes);
            run(seed + 1000, 10.0, 1, rate_changes);
            run(seed + 2000, 7.0, 12, rate_changes);
        }
    }
}

/// A grant due at 1 s given back in part at 0 s keeps its slot: the part stays taken
/// until the grant's time (the TAT would otherwise no longer say a grant is ahead, and
/// a refund under it would let a newcomer share its slot).
#[test]
fn partial_give_back_of_a_grant_still_ahead_keeps_its_slot() {
    let b = Bucket::new(Rate::new(1.0, 1e9, 4).unwrap());
    let mut a = b.take(0, 2, 0).unwrap();
    let mut r = b.take(0, 3, u64::MAX).unwrap();
    assert_eq!(r.delay_ns, S);
    assert_eq!(b.give_back(&mut r, 2, 0), Undo::Dropped);
    assert_eq!(b.give_back(&mut a, 2, 0), Undo::Dropped);
    assert_eq!(b.available(0), -1.0);
    // The rest of it, still latest but no longer spanning the whole debit, keeps too.
    assert_eq!(b.give_back(&mut r, 1, 0), Undo::Dropped);
    // At its time the grant is not ahead any more: a give-back is exact again.
    b.take(10 * S, 4, 0).unwrap();
    let mut c = b.take(10 * S, 2, u64::MAX).unwrap();
    assert_eq!(c.delay_ns, 2 * S);
    assert_eq!(b.give_back(&mut c, 1, 12 * S), Undo::Exact);
}

/// Two rate changes between a token-less grant and its settle: what it holds is carried
/// through each change (1 unit at 0 s at 1/s holds 0.5 at 0.5 s; at 2/s that lasts until
/// 0.75 s; at 4/s from 0.6 s what is left, 0.3 units, lasts until 0.675 s).
#[test]
fn refund_since_carries_the_hold_through_rate_changes() {
    let b = Bucket::new(Rate::new(1.0, 1e9, 4).unwrap());
    b.take(0, 1, 0).unwrap();
    b.set_rate(S / 2, Rate::new(2.0, 1e9, 4).unwrap());
    b.set_rate(6 * S / 10, Rate::new(4.0, 1e9, 4).unwrap());
    let before = b.available(6 * S / 10);
    assert_eq!(b.refund_since(6 * S / 10, 1, 0, 1), Undo::Refunded);
    let gave = b.available(6 * S / 10) - before;
    assert!((gave - 0.3).abs() < 1e-6, "{gave}");
    // Taken after the last change: capped at the current rate only.
    let b = Bucket::new(Rate::new(1.0, 1e9, 4).unwrap());
    b.set_rate(S, Rate::new(1.0, 1e9, 4).unwrap());
    b.take(2 * S, 2, 0).unwrap();
    let before = b.available(2 * S + S / 2);
    b.refund_since(2 * S + S / 2, 2, 2 * S, 2);
    assert!((b.available(2 * S + S / 2) - before - 1.5).abs() < 1e-6);
}

/// A multi-rate grant no longer remembered (more than `RECENT` tokened grants later)
/// gives nothing back; a remembered one follows the rule with its own debits.
#[test]
fn multi_rate_give_back_of_a_forgotten_grant_gives_nothing() {
    let clock = Arc::new(ManualClock::new(0).unwrap());
    let l = Limiter::new(
        vec![
            ("requests".into(), Rate::new(1000.0, 1e9, 1000).unwrap()),
            ("tokens".into(), Rate::new(1e6, 1e9, 1_000_000).unwrap()),
        ],
        AnyClock::Manual(clock.clone()),
    )
    .unwrap();
    let old = Resource::take_at(&l, 0, &[1, 1]).unwrap();
    for _ in 0..ratequeue_core::limiter::RECENT {
        Resource::take_at(&l, 0, &[1, 1]).unwrap();
    }
    let before = l.available(0);
    Resource::give_back(&l, &[1, 1], Some(old));
    assert_eq!(l.available(0), before);
    assert_eq!(l.refunds_dropped(), 2);
    let recent = Resource::take_at(&l, 0, &[1, 1]).unwrap();
    Resource::take_at(&l, 0, &[1, 1]).unwrap();
    // Not the latest on either rate, nothing scheduled ahead: refunded.
    Resource::give_back(&l, &[1, 1], Some(recent));
    assert_eq!(l.available(0), before - 1.0);
    assert_eq!(l.refunds_dropped(), 2);
}

/// A token (and a held record) names the shard's live evictions: after "a" was dropped
/// live and re-created with the very TAT the token names, the give-back gives nothing.
#[test]
fn keyed_undo_after_a_live_eviction_gives_nothing() {
    let clock = Arc::new(ManualClock::new(0).unwrap());
    let k = KeyedLimiter::new(Rate::new(1.0, 1e9, 1).unwrap(), 1, AnyClock::Manual(clock)).unwrap();
    let mut held = k.take(1, 0, 1, 0).unwrap();
    let token = held.token();
    k.take(2, 0, 1, 0).unwrap();
    k.take(1, 0, 1, 0).unwrap();
    assert_eq!(k.give_back(&mut held, 1, 0), Undo::Nothing);
    let mut t = KeyTaken::from_token(1, token, 1);
    assert_eq!(k.give_back(&mut t, 1, 0), Undo::Nothing);
    assert!(k.take(1, 0, 1, 0).is_err());
    // With no eviction in between the token is exact.
    let t = k.take(3, 0, 1, 0).unwrap();
    let mut t = KeyTaken::from_token(3, t.token(), 1);
    assert_eq!(k.give_back(&mut t, 1, 0), Undo::Exact);
}
