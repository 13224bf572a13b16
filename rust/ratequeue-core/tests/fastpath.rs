//! The decision fast paths decide exactly as the general ones: `Bucket::try_take` as
//! `Bucket::take` with no delay allowed, `Limiter::try_acquire` as a take, and the keyed
//! batch as the loop of single decisions (first-time keys included).

use std::sync::Arc;

use ratequeue_core::{AnyClock, Bucket, Deny, KeyedLimiter, Limiter, ManualClock, Rate};

struct Mix(u64);

impl Mix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let z = (self.0 ^ (self.0 >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        let z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

fn rate(per_sec: f64, burst: u64) -> Rate {
    Rate::new(per_sec, 1e9, burst).unwrap()
}

#[test]
fn try_take_decides_and_leaves_the_word_as_take_does() {
    const YEAR: u64 = 365 * 86_400_000_000_000;
    for (seed, start) in [(1u64, 0u64), (2, 1 << 62), (3, 1_764_000_000_123_456_789), (4, 0)] {
        let mut r = Mix(seed);
        let first = rate(0.5 + (r.next() % 1000) as f64, 1 + r.next() % 20);
        let (a, b) = (Bucket::new_at(first, start), Bucket::new_at(first, start));
        let mut t = start;
        for step in 0..200_000 {
            let cost = r.next() % 6;
            match r.next() % 64 {
                0 => {
                    let next = rate(0.001 + (r.next() % 100_000) as f64 / 10.0, 1 + r.next() % 30);
                    a.set_rate(t, next);
                    b.set_rate(t, next);
                }
                // Years at once: both rebase their epochs.
                1 if t < (1 << 62) + 50 * YEAR => t += r.next() % (6 * YEAR),
                2 => {
                    a.charge(t, cost * 3);
                    b.charge(t, cost * 3);
                }
                3..=20 => t += r.next() % 2_000_000_000,
                _ => {}
            }
            let want = a.take(t, cost, 0).map(|_| ());
            let got = b.try_take(t, cost);
            assert_eq!(got, want, "step {step} at {t}");
            assert_eq!(b.word(), a.word(), "step {step}");
        }
    }
}

#[test]
fn try_take_refuses_a_cost_above_the_burst_and_reports_the_true_wait() {
    let b = Bucket::new(rate(10.0, 3));
    assert_eq!(
        b.try_take(0, 4),
        Err(Deny::TooLarge {
            cost: 4,
            burst: 3,
            unit: 0
        })
    );
    assert_eq!(
        b.try_take(0, u64::MAX),
        Err(Deny::TooLarge {
            cost: u64::MAX,
            burst: 3,
            unit: 0
        })
    );
    for _ in 0..3 {
        assert_eq!(b.try_take(0, 1), Ok(()));
    }
    let w = b.word();
    assert_eq!(b.try_take(0, 1), Err(Deny::Wait(100_000_000)));
    assert_eq!(b.try_take(50_000_000, 2), Err(Deny::Wait(150_000_000)));
    assert_eq!(b.word(), w, "a refusal changes nothing");
    assert_eq!(b.try_take(100_000_000, 1), Ok(()));
}

#[test]
fn two_threads_of_try_acquire_never_admit_more_than_the_burst() {
    let clock = Arc::new(ManualClock::new(0).unwrap());
    let lim = Arc::new(Limiter::new(vec![("requests".into(), rate(1.0, 50_000))], AnyClock::Manual(clock)).unwrap());
    let ts: Vec<_> = (0..2)
        .map(|_| {
            let lim = lim.clone();
            std::thread::spawn(move || (0..100_000).filter(|_| lim.try_acquire(&[1]).is_ok()).count())
        })
        .collect();
    let admitted: usize = ts.into_iter().map(|t| t.join().unwrap()).sum();
    assert_eq!(admitted, 50_000);
}

#[test]
fn the_keyed_batch_decides_as_the_loop_first_time_keys_included() {
    for (seed, burst, max_keys) in [(1u64, 1u64, 1 << 20), (2, 3, 1 << 20), (3, 2, 5_000), (4, 1, 300)] {
        let clock = Arc::new(ManualClock::new(1 << 40).unwrap());
        let r = rate(20.0, burst);
        let batch = KeyedLimiter::new(r, max_keys, AnyClock::Manual(clock.clone())).unwrap();
        let single = KeyedLimiter::new(r, max_keys, AnyClock::Manual(clock.clone())).unwrap();
        let mut mix = Mix(seed);
        for round in 0..40 {
            let n = 1 + (mix.next() % 6_000) as usize;
            let span = 1 + mix.next() % 20_000;
            let keys: Vec<u64> = (0..n)
                .map(|_| (mix.next() % span).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
                .collect();
            let costs: Option<Vec<u64>> =
                (mix.next() % 2 == 0).then(|| keys.iter().map(|_| mix.next() % (burst + 1)).collect());
            let mut out = vec![false; n];
            batch.try_acquire_many(&keys, costs.as_deref(), &mut out).unwrap();
            let want: Vec<bool> = keys
                .iter()
                .enumerate()
                .map(|(i, k)| single.try_acquire(*k, costs.as_ref().map_or(1, |c| c[i])).is_ok())
                .collect();
            if max_keys >= 1 << 20 {
                // Nothing is dropped: every decision is the loop's.
                assert_eq!(out, want, "seed {seed} round {round}");
                assert_eq!(batch.len(), single.len());
            } else {
                assert!(batch.len() <= batch.max_keys(), "bounded");
            }
            clock.advance(mix.next() % 200_000_000).unwrap();
        }
    }
}
