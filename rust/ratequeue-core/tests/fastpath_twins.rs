//! The one-rate fast decision (core17's `try_take_words`, its slot read field by
//! field and its limit without a clamp) decides exactly what the general `take` decides,
//! on twin buckets driven through the same schedule (refusals, too-large costs, rate
//! changes, leaps far past the epoch that rebase it).

use proptest::prelude::*;
use ratequeue_core::{Bucket, Rate};

const NS: u64 = 1_000_000_000;

#[derive(Clone, Debug)]
enum Op {
    /// Moves the clock by this many nanoseconds.
    Advance(u64),
    /// Decides a cost at the current time.
    Try(u64),
    /// Changes the rate (amount per second, burst).
    SetRate(f64, u64),
}

fn rate(per_s: f64, burst: u64) -> Rate {
    Rate::new(per_s, 1e9, burst).unwrap()
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u64..3 * NS).prop_map(Op::Advance),
        1 => (0u64..40 * 366 * 86_400 * NS).prop_map(Op::Advance),
        1 => (0u64..4).prop_map(Op::Advance),
        8 => (0u64..12).prop_map(Op::Try),
        1 => (1e-3f64..1e9, 1u64..10).prop_map(|(r, b)| Op::SetRate(r, b)),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn the_fast_decision_is_the_general_one(
        per_s in 1e-3f64..1e9,
        burst in 1u64..10,
        start in prop_oneof![Just(0u64), 0u64..1u64 << 62],
        ops in prop::collection::vec(op(), 1..120),
    ) {
        let fast = Bucket::new_at(rate(per_s, burst), start);
        let general = Bucket::new_at(rate(per_s, burst), start);
        let mut now = start;
        for (i, o) in ops.iter().enumerate() {
            match *o {
                Op::Advance(d) => now = now.saturating_add(d).min(1 << 63),
                Op::SetRate(r, b) => {
                    fast.set_rate(now, rate(r, b));
                    general.set_rate(now, rate(r, b));
                }
                Op::Try(c) => {
                    let a = fast.try_take_words(now, c).map(|(_, after)| after);
                    let b = general.take(now, c, 0).map(|t| t.after_word());
                    prop_assert_eq!(a, b, "op {} at {} ns: {:?}", i, now, o);
                }
            }
            prop_assert_eq!(fast.word(), general.word(), "op {} at {} ns: {:?}", i, now, o);
        }
    }
}

mod keyed {
    use super::*;
    use ratequeue_core::{AnyClock, KeyedLimiter, ManualClock};
    use std::sync::Arc;

    fn twin(per_s: f64, burst: u64, max_keys: usize) -> (KeyedLimiter, KeyedLimiter, Arc<ManualClock>) {
        let c = Arc::new(ManualClock::new(5 * NS).unwrap());
        let r = rate(per_s, burst);
        let a = KeyedLimiter::new(r, max_keys, AnyClock::Manual(c.clone())).unwrap();
        let b = KeyedLimiter::new(r, max_keys, AnyClock::Manual(c.clone())).unwrap();
        (a, b, c)
    }

    /// Map keys an adversary would pick if it could choose hashes: one shard (top bits
    /// equal), one home slot (low bits equal), so every probe walks one cluster.
    fn colliding(n: u64, spread: u64) -> impl Fn(u64) -> u64 {
        move |i| (0xABu64 << 56) | ((i % n) << 20) | (i % spread)
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 60, ..ProptestConfig::default() })]

        /// A batch (chunks of 16,384, grouped by shard, growth and eviction inside a
        /// chunk, duplicate keys, costs that refuse) decides as the loop of single calls,
        /// leaves the same keys and counts the same evictions; no shard passes its cap.
        #[test]
        fn batch_is_the_loop_of_singles_under_colliding_keys(
            max_keys in prop_oneof![Just(1usize), 2usize..300, 1000usize..5000],
            distinct in 1u64..6000,
            spread in 1u64..4,
            len in 1usize..40_000,
            costs_seed in any::<u64>(),
            rounds in 1usize..3,
        ) {
            let (batch, single, clock) = twin(1000.0, 3, max_keys);
            let key = colliding(distinct, spread);
            for round in 0..rounds {
                let keys: Vec<u64> = (0..len as u64).map(|i| key(i.wrapping_mul(costs_seed | 1) >> 3)).collect();
                let costs: Vec<u64> = (0..len as u64).map(|i| (i ^ costs_seed) % 4).collect();
                let mut out = vec![false; len];
                batch.try_acquire_many(&keys, Some(&costs), &mut out).unwrap();
                for (i, k) in keys.iter().enumerate() {
                    let one = single.try_acquire(*k, costs[i]).is_ok();
                    prop_assert_eq!(out[i], one, "round {} request {}", round, i);
                }
                prop_assert_eq!(batch.counts(), single.counts(), "round {}", round);
                prop_assert!(batch.len() <= batch.max_keys());
                clock.advance(1_000_000).unwrap();
            }
        }
    }
}
