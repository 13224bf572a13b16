//! The keyed map's unit tests.

mod keys {
    use super::super::*;
    use crate::{Bucket, ManualClock};
    use std::collections::HashMap;
    use std::sync::Arc;

    fn keyed(per_sec: f64, burst: u64, max_keys: usize) -> (KeyedLimiter, Arc<ManualClock>) {
        let c = Arc::new(ManualClock::new(0).unwrap());
        let k = KeyedLimiter::new(
            Rate::new(per_sec, 1e9, burst).unwrap(),
            max_keys,
            AnyClock::Manual(c.clone()),
        );
        (k.unwrap(), c)
    }

    #[test]
    fn decides_like_independent_buckets() {
        let (k, clock) = keyed(10.0, 3, 1000);
        let buckets: Vec<Bucket> = (0..20).map(|_| Bucket::new(k.rate())).collect();
        let mut x = 12345u64;
        for step in 0..20_000u64 {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let key = (x >> 33) % 20;
            let cost = 1 + (x >> 20) % 3;
            if step % 7 == 0 {
                clock.advance((x >> 40) % 200_000_000).unwrap();
            }
            let now = clock.now_ns();
            let a = k.try_acquire(k.hasher().int(key), cost).is_ok();
            let b = buckets[key as usize].take(now, cost, 0).is_ok();
            assert_eq!(a, b, "step {step}");
        }
    }

    #[test]
    fn eviction_of_full_buckets_changes_nothing_and_bounds_memory() {
        let (k, clock) = keyed(1.0, 1, 100);
        for i in 0..10_000u64 {
            assert!(k.try_acquire(k.hasher().int(i), 1).is_ok());
            clock.advance(1_000_000_000).unwrap();
        }
        assert!(k.len() <= k.max_keys());
        let c = k.counts();
        assert_eq!(c.evicted_live, 0);
        assert!(c.evicted_full > 0);
        // Without time passing, live keys must go: counted.
        for i in 10_000..10_500u64 {
            k.try_acquire(k.hasher().int(i), 1).unwrap();
        }
        assert!(k.len() <= k.max_keys());
        assert!(k.counts().evicted_live > 0);
    }

    #[test]
    fn batches_decide_as_single_calls_while_tables_grow_and_fill() {
        // Tables grow 4x at a time and new keys go where their probe ended: the batch and
        // the single-call path agree on every decision through growth, up to the cap and
        // past it (evictions), and no table passes its cap or a load of 3/4.
        let (batch, bclock) = keyed(1000.0, 2, 5000);
        let (mut single, sclock) = keyed(1000.0, 2, 5000);
        // The same seed: the same shards, so the same keys evicted.
        single.hasher = batch.hasher.clone();
        let mut x = 99u64;
        for round in 0..12u64 {
            let keys: Vec<u64> = (0..1500)
                .map(|_| {
                    x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    (x >> 40) % (1000 + round * 700)
                })
                .collect();
            let costs: Vec<u64> = keys.iter().map(|k| 1 + k % 2).collect();
            let hashed: Vec<u64> = keys.iter().map(|k| batch.hasher().int(*k)).collect();
            let mut out = vec![false; keys.len()];
            batch.try_acquire_many(&hashed, Some(&costs), &mut out).unwrap();
            for (i, k) in keys.iter().enumerate() {
                let one = single.try_acquire(single.hasher().int(*k), costs[i]).is_ok();
                assert_eq!(out[i], one, "round {round} key {i}");
            }
            assert_eq!(batch.len(), single.len(), "round {round}");
            assert!(batch.len() <= batch.max_keys());
            for s in batch.shards.iter() {
                let t = lock(&s.0);
                assert!(t.slots.len() <= batch.cap && t.len <= t.slots.len() * 3 / 4);
            }
            bclock.advance(1_000_000).unwrap();
            sclock.advance(1_000_000).unwrap();
        }
        assert!(batch.counts().evicted_full + batch.counts().evicted_live > 0);
    }

    #[test]
    fn remove_keeps_probe_chains() {
        let mut t = Table::default();
        t.grow(16);
        // Keys colliding on the same home slot, then removal in the middle.
        let keys: Vec<u64> = (1..=6).map(|i| i * 16 + 3).collect();
        for k in &keys {
            t.insert_new(*k, *k);
        }
        t.remove_at(t.find(keys[2]).unwrap());
        for k in keys.iter().filter(|k| **k != keys[2]) {
            assert_eq!(t.slots[t.find(*k).unwrap()].tat, *k);
        }
        assert_eq!(t.find(keys[2]), None);
    }

    #[test]
    fn one_identity_per_key() {
        let h = KeyHasher::default();
        // Negative ints never share the hash of their two's complement.
        for v in [-1i64, -2, i64::MIN, i64::MIN + 1, -12345] {
            assert_ne!(h.signed(v), h.int(v as u64), "{v}");
        }
        for v in [0i64, 1, 7, i64::MAX] {
            assert_eq!(h.signed(v), h.int(v as u64), "{v}");
        }
        // One text in three kinds: three keys.
        let kinds = [h.str("1"), h.bytes(b"1"), h.int(1), h.big_int("1")];
        for (i, a) in kinds.iter().enumerate() {
            for b in &kinds[i + 1..] {
                assert_ne!(a, b);
            }
        }
        assert_eq!(h.str("a"), h.str("a"));
        assert_ne!(h.big_int("18446744073709551616"), h.str("18446744073709551616"));
        // Distinct ints near the edges of both domains: no hash shared.
        let mut seen = HashMap::new();
        for d in 0..1000u64 {
            for x in [d, u64::MAX - d, (1 << 63) + d, (1 << 63) - 1 - d] {
                seen.insert(x as i128, h.int(x));
            }
            for v in [-1 - d as i64, i64::MIN + d as i64] {
                seen.insert(v as i128, h.signed(v));
            }
        }
        let hashes: std::collections::HashSet<u64> = seen.values().copied().collect();
        assert_eq!(hashes.len(), seen.len());
    }

    #[test]
    fn the_integers_hashing_to_zero_and_one_keep_their_own_buckets() {
        let (k, _) = keyed(1.0, 1, 1000);
        let h = k.hasher();
        let (zero, one) = (h.int_preimage(0), h.int_preimage(1));
        assert_ne!(zero, one);
        assert_ne!(h.int(zero), h.int(one), "two distinct integers share a hash");
        assert!(k.try_acquire(h.int(zero), 1).is_ok());
        assert!(k.try_acquire(h.int(one), 1).is_ok(), "a fresh key found a spent bucket");
        assert!(k.try_acquire(h.int(zero), 1).is_err());
        assert!(k.try_acquire(h.int(one), 1).is_err());
        assert_eq!(k.len(), 2);
        assert_eq!(k.sweep(), 0);
    }

    #[test]
    fn the_table_holds_hash_zero_like_any_other() {
        let mut t = Table::default();
        t.grow(8);
        assert_eq!(t.find(0), None);
        for (k, tat) in [(8u64, 1u64), (0, 2), (16, 3)] {
            t.insert_new(k, tat);
        }
        assert_eq!(t.slots[t.find(0).unwrap()].tat, 2);
        t.remove_at(t.find(8).unwrap());
        assert_eq!(t.slots[t.find(0).unwrap()].tat, 2);
        assert_eq!(t.slots[t.find(16).unwrap()].tat, 3);
        t.grow(16);
        assert_eq!(t.slots[t.find(0).unwrap()].tat, 2);
        t.remove_at(t.find(0).unwrap());
        assert_eq!((t.find(0), t.len), (None, 1));
    }

    #[test]
    fn keyed_semaphore_counts_per_key() {
        let s = KeyedSemaphore::new(2).unwrap();
        let a = s.hasher().str("a");
        assert!(s.try_take(a, 2).is_ok());
        assert!(s.try_take(a, 1).is_err());
        assert!(s.try_take(s.hasher().str("b"), 1).is_ok());
        s.release(a, 2);
        assert_eq!(s.in_use(a), 0);
        assert_eq!(s.len(), 1);
    }

    #[test]
    fn keyed_semaphore_sums_never_wrap() {
        let s = Arc::new(KeyedSemaphore::new(u64::MAX).unwrap());
        let a = s.hasher().str("a");
        assert!(s.try_take(a, 1 << 63).is_ok());
        assert_eq!(s.try_take(a, (1 << 63) + 1), Err(Deny::Wait(u64::MAX)));
        assert_eq!(s.in_use(a), 1 << 63);
        let key = KeyPermits { sem: s.clone(), key: a };
        assert_eq!(crate::wait::Resource::ready_at(&key, 3, &[(1 << 63) + 1]), Ok(None));
    }

    /// The bindings' try path (`try_acquire_idle_nowait`, no debit kept) and the waiting
    /// one (`try_acquire_idle`): `joined` is asked only after a take that admitted, a
    /// take it sees a joiner after is undone exactly (an old key's TAT, a new key's
    /// full bucket), and otherwise they decide as `try_acquire`.
    #[test]
    fn the_try_path_rechecks_after_its_take_and_undoes_it_exactly() {
        let (k, clock) = keyed(1.0, 3, 1000);
        let (old, new) = (k.hasher().int(1), k.hasher().int(2));
        k.try_acquire(old, 1).unwrap();
        let tat = |key: u64| {
            let t = lock(&k.shards[k.shard_index(key)].0);
            t.find(key).map(|i| t.slots[i].tat)
        };
        let before = tat(old);
        let asked = std::cell::Cell::new(0);
        let joiner = || {
            asked.set(asked.get() + 1);
            true
        };
        assert_eq!(k.try_acquire_idle_nowait(old, 1, joiner), Some(Err(Deny::Wait(0))));
        assert_eq!(tat(old), before, "undone exactly");
        assert_eq!(k.try_acquire_idle(old, 1, joiner), Err(Deny::Wait(0)));
        assert_eq!(tat(old), before, "undone exactly");
        assert_eq!(k.try_acquire_idle_nowait(new, 3, joiner), Some(Err(Deny::Wait(0))));
        assert!((k.available(new) - 3.0).abs() < 1e-9, "a new key's bucket stays full");
        assert_eq!(asked.get(), 3);
        // Refused by the bucket: nothing taken, nobody asked.
        assert!(matches!(
            k.try_acquire_idle_nowait(old, 3, joiner),
            Some(Err(Deny::Wait(_)))
        ));
        assert!(matches!(k.try_acquire_idle(old, 4, joiner), Err(Deny::TooLarge { .. })));
        assert_eq!(asked.get(), 3);
        // Nobody joined: the same decisions as try_acquire, on a twin map.
        let (twin, twin_clock) = keyed(1.0, 3, 1000);
        twin.try_acquire(twin.hasher().int(1), 1).unwrap();
        let mut x = 99u64;
        for step in 0..2_000u64 {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let key = (x >> 33) % 5;
            let cost = 1 + (x >> 20) % 2;
            if step % 3 == 0 {
                let dt = (x >> 40) % 700_000_000;
                clock.advance(dt).unwrap();
                twin_clock.advance(dt).unwrap();
            }
            let a = if step % 2 == 0 {
                k.try_acquire_idle_nowait(k.hasher().int(key), cost, || false).unwrap()
            } else {
                k.try_acquire_idle(k.hasher().int(key), cost, || false)
            };
            let b = twin.try_acquire(twin.hasher().int(key), cost);
            assert_eq!(a.is_ok(), b.is_ok(), "step {step}");
        }
    }
}

mod epochs {
    use super::super::*;
    use crate::bucket::Undo;
    use crate::{Bucket, ManualClock};
    use std::sync::Arc;

    const DAY_NS: u64 = 86_400_000_000_000;
    const YEAR_NS: u64 = 365 * DAY_NS + DAY_NS / 4;

    fn keyed_at(rate: Rate, start_ns: u64) -> (KeyedLimiter, Arc<ManualClock>) {
        let c = Arc::new(ManualClock::new(start_ns).unwrap());
        (KeyedLimiter::new(rate, 1000, AnyClock::Manual(c.clone())).unwrap(), c)
    }

    /// Random operations on a keyed map and on one bucket per key, the clock jumping by
    /// up to `max_step_ns` (so shards rebase, each at its own moment): same answers.
    fn like_buckets(rate: Rate, start_ns: u64, seed: u64, steps: usize, max_step_ns: u64) {
        let (k, clock) = keyed_at(rate, start_ns);
        let buckets: Vec<Bucket> = (0..20).map(|_| Bucket::new(rate)).collect();
        let mut x = seed;
        let mut next = || {
            x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let z = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            let z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        };
        for step in 0..steps {
            let key = next() % 20;
            let (h, b) = (k.hasher().int(key), &buckets[key as usize]);
            let cost = 1 + next() % 3;
            let now = clock.now_ns();
            match next() % 12 {
                0..=3 => assert_eq!(
                    k.try_acquire(h, cost).is_ok(),
                    b.take(now, cost, 0).is_ok(),
                    "step {step}"
                ),
                4..=5 => {
                    let max = next() % (4 * max_step_ns);
                    let got = k.take(h, now, cost, max).map(|t| t.delay_ns);
                    assert_eq!(got, b.take(now, cost, max).map(|t| t.delay_ns), "step {step}");
                }
                6 => assert_eq!(k.delay_for(h, now, cost), b.delay_for(now, cost), "step {step}"),
                7 => assert_eq!(
                    k.predict(h, now, 3 * cost),
                    b.predict(now, 2 * cost, cost),
                    "step {step}"
                ),
                8 => {
                    k.charge(h, 5 * cost);
                    b.charge(now, 5 * cost);
                }
                9 => assert_eq!(k.refund(h, cost), b.refund(now, cost), "step {step}"),
                _ => {
                    let dt = next() % max_step_ns;
                    if clock.advance(dt).is_err() {
                        break;
                    }
                }
            }
            let now = clock.now_ns();
            assert_eq!(k.available(h).to_bits(), b.available(now).to_bits(), "step {step}");
        }
    }

    #[test]
    fn a_keyed_map_far_from_zero_decides_like_buckets() {
        for seed in 1..=4u64 {
            let r = Rate::new(10.0, 1e9, 3).unwrap();
            like_buckets(r, 0, seed, 20_000, 2_000_000_000);
            like_buckets(r, 1 << 62, seed, 20_000, 2_000_000_000);
            like_buckets(r, 1_764_000_000_123_456_789, seed, 20_000, 2_000_000_000);
            let slow = Rate::new(1.0, 3_600e9, 3).unwrap();
            like_buckets(slow, 1 << 62, seed, 3_000, 2 * YEAR_NS);
            like_buckets(slow, 0, seed, 1_000, 11 * YEAR_NS);
        }
    }

    /// History checker seed 729: a policy debited a key at a future time its other level
    /// set; a refund of an earlier debit on the key then freed that time too (4 units at
    /// one instant with burst 3). Like a bucket, the key keeps it from refunds.
    /// The per-key record of debits scheduled ahead stays bounded however many keys a
    /// caller schedules ahead (keys dropped from the table included); folded into one
    /// time per shard, it still keeps refunds from freeing what comes before it.
    #[test]
    fn debits_scheduled_ahead_on_many_keys_stay_bounded_and_kept() {
        let (k, _clock) = keyed_at(Rate::new(2.0, 1e9, 3).unwrap(), 0);
        for i in 0..20_000u64 {
            k.take_at(k.hasher().int(i), 1_000_000_000, 1).unwrap();
        }
        let most = k.shards.iter().map(|s| lock(&s.0).ahead.len()).max().unwrap();
        assert!(most <= (2 * k.per_shard).max(64), "{most}");
        // A fresh key of a shard that folded: a refund that is not exact (a debit came
        // after it) stops at the folded time, as it would at the key's own.
        let y = (1u64 << 40..)
            .map(|i| k.hasher().int(i))
            .find(|y| lock(&k.shards[k.shard_index(*y)].0).ahead_all >= 1_000_000_000)
            .expect("a shard folded");
        let mut a = k.take(y, 0, 2, 0).unwrap();
        k.take(y, 0, 1, 0).unwrap();
        k.give_back(&mut a, 2, 0);
        assert!(k.available(y) < 0.5, "refunded past a folded debit: {}", k.available(y));
    }

    #[test]
    fn a_refund_leaves_a_debit_scheduled_ahead_by_another_level_in_place() {
        let (k, clock) = keyed_at(Rate::new(2.0, 1e9, 3).unwrap(), 0);
        let key = k.hasher().int(1);
        let mut a = k.take(key, 0, 2, 0).unwrap();
        k.take_at(key, 1_000_000_000, 1).unwrap();
        k.give_back(&mut a, 2, 0);
        clock.set(1_000_000_000).unwrap();
        assert!(
            k.take(key, 1_000_000_000, 3, 0).is_err(),
            "3 more units at the instant a debit of 1 was scheduled, with burst 3"
        );
        assert!(k.take(key, 1_000_000_000, 2, 0).is_ok());
    }

    #[test]
    fn a_refund_is_capped_where_the_debit_sits_after_refunds_below_it_moved_it_down() {
        // Found by the threaded history checker (seed 62233): a debit's record keeps the
        // TAT it left, but a refund of a debit below it since moves it down; capped by the
        // stale TAT, its own refund gave back capacity that time had already repaid.
        let (k, clock) = keyed_at(Rate::new(5.0, 1e9, 4).unwrap(), 0); // 0.2 s a unit
        let key = k.hasher().int(3);
        let ms = 1_000_000;
        let mut a = k.take(key, 0, 3, 0).unwrap(); // TAT 0.6 s
        let mut b = k.take(key, 0, 1, 0).unwrap(); // TAT 0.8 s
        assert_eq!(k.give_back(&mut a, 2, 0), Undo::Refunded); // TAT 0.4 s: b ends at 0.4 s
        clock.set(450 * ms).unwrap();
        k.take(key, 450 * ms, 2, 0).unwrap(); // TAT 0.85 s
                                              // b's unit lies before now: nothing of it to give back.
        let u = k.give_back(&mut b, 1, 450 * ms);
        assert!(matches!(u, Undo::Nothing | Undo::Dropped), "{u:?}");
        assert!(
            k.take(key, 450 * ms, 3, 0).is_err(),
            "3 units at 0.45 s on a TAT of 0.85 s with burst 4 (0.2 s a unit)"
        );
    }

    #[test]
    fn a_give_back_across_a_rebase_stays_capped_by_what_the_debit_holds() {
        let (k, clock) = keyed_at(Rate::new(1.0, 1e9, 10).unwrap(), 0);
        let key = k.hasher().int(7);
        let t0 = (1 << 57) - 500_000_000;
        let mut a = k.take(key, t0, 1, 0).unwrap();
        let mut b = k.take(key, t0, 5, 0).unwrap();
        let token = b.token();
        let t1 = t0 + 750_000_000;
        clock.set(t1).unwrap();
        assert!((k.available(key) - 4.75).abs() < 1e-6);
        assert_eq!(lock(&k.shards[0].0).rebases, 1, "rebased");
        // The latest, across the rebase: undone exactly.
        assert_eq!(k.give_back(&mut b, 2, t1), Undo::Exact);
        assert!((k.available(key) - 6.75).abs() < 1e-6, "{}", k.available(key));
        // Not the latest: refunded only the 0.25 s the first debit still holds.
        assert_eq!(k.give_back(&mut a, 1, t1), Undo::Refunded);
        assert!((k.available(key) - 7.0).abs() < 1e-6, "{}", k.available(key));
        // A token from before the rebase still caps by what its debit holds.
        let mut c = KeyTaken::from_token(key, token, 5);
        assert_eq!(k.give_back(&mut c, 3, t1), Undo::Refunded);
        assert!((k.available(key) - 10.0).abs() < 1e-6, "{}", k.available(key));
    }

    #[test]
    fn a_refund_that_rebases_the_shard_refunds_in_the_new_epoch() {
        let (k, clock) = keyed_at(Rate::new(1.0, 1e9, 10).unwrap(), 0);
        let key = k.hasher().int(7);
        let t0 = (1 << 57) - 500_000_000;
        clock.set(t0).unwrap();
        k.try_acquire(key, 6).unwrap();
        clock.set(t0 + 750_000_000).unwrap();
        // The refund is the first call past the rebase point: it rebases, then refunds.
        assert_eq!(k.refund(key, 2), Undo::Refunded);
        assert_eq!(lock(&k.shards[0].0).rebases, 1, "rebased");
        assert!((k.available(key) - 6.75).abs() < 1e-6, "{}", k.available(key));
    }

    #[test]
    fn keyed_one_a_day_for_120_years() {
        for start in [0, 1_764_000_000_123_456_789, 1 << 62] {
            let (k, clock) = keyed_at(Rate::new(1.0, 86_400e9, 1).unwrap(), start);
            let (a, b) = (k.hasher().str("a"), k.hasher().str("b"));
            let days = 120 * YEAR_NS / DAY_NS;
            let mut admitted = 0;
            for d in 0..days {
                admitted += k.try_acquire(a, 1).is_ok() as u64;
                assert!(k.try_acquire(a, 1).is_err(), "day {d}");
                if d % 1000 == 0 {
                    let mut out = [false; 3];
                    k.try_acquire_many(&[b, b, a], None, &mut out).unwrap();
                    assert_eq!(out, [true, false, false], "day {d}");
                }
                clock.advance(DAY_NS).unwrap();
            }
            assert_eq!(admitted, days, "start {start}");
            assert_eq!(k.sweep(), 2);
        }
    }
}

mod fork {
    use crate::fork::{ForkLocks, Held};
    use crate::KeyedSemaphore;

    #[test]
    fn a_child_starts_with_every_key_permit_free() {
        let keyed = KeyedSemaphore::new(1).unwrap();
        let k = keyed.hasher().str("k");
        keyed.try_take(k, 1).unwrap();
        let mut held: Vec<Box<dyn Held + '_>> = Vec::new();
        keyed.lock_for_fork(&mut held);
        held.iter_mut().for_each(|h| h.in_child());
        drop(held);
        assert_eq!(keyed.in_use(k), 0);
        assert!(keyed.try_take(k, 1).is_ok());
    }
}
