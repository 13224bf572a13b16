//! The bucket's unit tests: decisions, the undo rule, rate changes and epochs.

mod decisions {
    use super::super::*;

    fn rate(per_sec: f64, burst: u64) -> Rate {
        Rate::new(per_sec, 1e9, burst).unwrap()
    }

    #[test]
    fn admits_burst_then_refuses() {
        let b = Bucket::new(rate(10.0, 3));
        for _ in 0..3 {
            assert!(b.take(0, 1, 0).is_ok());
        }
        assert_eq!(b.take(0, 1, 0), Err(Deny::Wait(100_000_000)));
        assert!(b.take(100_000_000, 1, 0).is_ok());
    }

    #[test]
    fn cost_above_burst_is_too_large() {
        let b = Bucket::new(rate(10.0, 3));
        assert!(matches!(
            b.take(0, 4, u64::MAX),
            Err(Deny::TooLarge { cost: 4, burst: 3, .. })
        ));
        assert_eq!(b.available(0), 3.0);
    }

    #[test]
    fn reserve_follows_lindley() {
        let b = Bucket::new(rate(100.0, 5));
        let mut delays = vec![];
        for _ in 0..10 {
            delays.push(b.take(0, 1, u64::MAX).unwrap().delay_ns);
        }
        assert_eq!(&delays[..5], &[0; 5]);
        for (k, d) in delays[5..].iter().enumerate() {
            let want = 10_000_000 * (k as u64 + 1);
            assert!(d.abs_diff(want) <= 1, "{d} vs {want}");
        }
    }

    #[test]
    fn untake_only_when_latest() {
        let b = Bucket::new(rate(1.0, 2));
        let t1 = b.take(0, 1, 0).unwrap();
        let t2 = b.take(0, 1, 0).unwrap();
        assert!(!b.untake(&t1));
        assert!(b.untake(&t2));
        assert_eq!(b.available(0), 1.0);
    }

    const S: u64 = 1_000_000_000;

    #[test]
    fn give_back_is_exact_while_latest() {
        let b = Bucket::new(rate(1.0, 1));
        b.take(0, 1, u64::MAX).unwrap();
        let before = b.word();
        let mut t = b.take(0, 1, u64::MAX).unwrap();
        assert_eq!(t.delay_ns, S);
        assert_eq!(b.give_back(&mut t, 1, 0), Undo::Exact);
        assert_eq!(b.word(), before);
        assert_eq!(b.give_back(&mut t, 1, 0), Undo::Nothing); // nothing left to give
        assert_eq!(b.take(0, 1, u64::MAX).unwrap().delay_ns, S);
    }

    #[test]
    fn give_back_under_a_scheduled_grant_is_dropped() {
        let b = Bucket::new(rate(1.0, 1));
        let mut t1 = b.take(0, 1, u64::MAX).unwrap();
        b.take(0, 1, u64::MAX).unwrap(); // scheduled at 1 s
        let w = b.word();
        assert_eq!(b.give_back(&mut t1, 1, 0), Undo::Dropped);
        assert_eq!(b.word(), w);
        assert_eq!(b.take(0, 1, u64::MAX).unwrap().delay_ns, 2 * S);
    }

    #[test]
    fn give_back_refunds_when_nothing_is_scheduled_ahead_never_past_full() {
        let b = Bucket::new(rate(1.0, 4));
        let mut t1 = b.take(0, 2, 0).unwrap();
        b.take(0, 1, 0).unwrap();
        assert_eq!(b.give_back(&mut t1, 2, 0), Undo::Refunded);
        assert_eq!(b.available(0), 3.0);
        assert_eq!(b.give_back(&mut t1, 2, 0), Undo::Nothing); // given once
        assert_eq!(b.refund(0, 100), Undo::Refunded);
        assert_eq!(b.available(0), 4.0);
        assert_eq!(b.refund(0, 1), Undo::Nothing);
        assert_eq!(b.available(0), 4.0);
    }

    #[test]
    fn refund_is_capped_by_what_the_debit_still_holds() {
        // A grant of 1 at 0 on a bucket of burst 2 holds nothing after 1 s: refunding it
        // at 3 s, after another grant, would allow 3 grants at one instant.
        let b = Bucket::new(rate(1.0, 2));
        let mut t1 = b.take(0, 1, 0).unwrap();
        b.take(3 * S, 1, 0).unwrap();
        assert_eq!(b.give_back(&mut t1, 1, 3 * S), Undo::Nothing);
        assert_eq!(b.available(3 * S), 1.0);
        // Half of it is still held at 0.5 s: as if it had never been taken.
        let b = Bucket::new(rate(1.0, 4));
        let mut t1 = b.take(0, 1, 0).unwrap();
        b.take(S / 2, 1, 0).unwrap();
        assert_eq!(b.available(S / 2), 2.5);
        assert_eq!(b.give_back(&mut t1, 1, S / 2), Undo::Refunded);
        assert_eq!(b.available(S / 2), 3.0);
    }

    #[test]
    fn settle_then_cancel_is_exact_while_latest() {
        let b = Bucket::new(rate(10.0, 10));
        let mut t = b.take(0, 5, 0).unwrap();
        assert_eq!(b.give_back(&mut t, 3, 0), Undo::Exact);
        assert_eq!((b.available(0), t.cost()), (8.0, 2));
        b.charge_more(&mut t, 4, 0);
        assert_eq!((b.available(0), t.cost()), (4.0, 6));
        let c = t.cost();
        assert_eq!(b.give_back(&mut t, c, 0), Undo::Exact);
        assert_eq!(b.available(0), 10.0);
    }

    #[test]
    fn long_run_rate_is_exact() {
        for per_sec in [1.0 / 86_400.0, 0.37, 3.0, 999.0, 123_457.0, 33_333_333.0, 1e8] {
            let b = Bucket::new(rate(per_sec, 1));
            let mut t = 0u64;
            let n = (1e16 * per_sec / 1e9).clamp(100.0, 100_000.0) as u64;
            for _ in 0..n {
                let d = b.take(t, 1, u64::MAX).unwrap().delay_ns;
                t += d;
            }
            let want = (n - 1) as f64 * 1e9 / per_sec;
            let err = (t as f64 - want).abs() / want;
            assert!(err < 1e-6, "rate {per_sec}: err {err}");
        }
    }

    #[test]
    fn set_rate_keeps_content() {
        let b = Bucket::new(rate(10.0, 10));
        for _ in 0..4 {
            b.take(0, 1, 0).unwrap();
        }
        b.set_rate(0, rate(1000.0, 20));
        assert!((b.available(0) - 16.0).abs() < 1e-9);
        assert_eq!(b.rate().burst, 20);
        for _ in 0..40 {
            b.set_rate(0, rate(1000.0, 20));
        }
        assert!((b.available(0) - 16.0).abs() < 1e-9);
    }

    #[test]
    fn hold_until_admits_one_unit_at_the_time_and_never_adds_up() {
        let b = Bucket::new(rate(10.0, 5));
        assert!(b.hold_until(0, 2_000_000_000));
        assert!(!b.hold_until(0, 2_000_000_000)); // the same hold again changes nothing
        assert!(!b.hold_until(0, 1_000_000_000)); // an earlier one neither
        assert!((b.available(0) + 19.0).abs() < 1e-9);
        assert!(matches!(b.take(1_999_999_999, 1, 0), Err(Deny::Wait(1))));
        assert!(b.take(2_000_000_000, 1, 0).is_ok());
        assert!(b.take(2_000_000_000, 1, 0).is_err());
        let full = Bucket::new(rate(10.0, 5));
        assert!(full.hold_until(0, 0)); // until now: all but one unit used
        assert!((full.available(0) - 1.0).abs() < 1e-9);
    }

    #[test]
    fn charge_goes_into_debt_and_refund_caps_at_full() {
        let b = Bucket::new(rate(1.0, 2));
        b.charge(0, 5);
        assert_eq!(b.available(0), -3.0);
        assert_eq!(b.take(0, 1, 0), Err(Deny::Wait(4_000_000_000)));
        assert_eq!(b.refund(0, 100), Undo::Dropped); // the debt is a grant scheduled ahead
        assert_eq!(b.available(0), -3.0);
        assert_eq!(b.refund(3_000_000_000, 100), Undo::Refunded);
        assert_eq!(b.available(3_000_000_000), 2.0);
    }
}

mod epochs {
    use super::super::*;

    const DAY_NS: u64 = 86_400_000_000_000;
    const YEAR_NS: u64 = 365 * DAY_NS + DAY_NS / 4;

    fn rate(per_sec: f64, burst: u64) -> Rate {
        Rate::new(per_sec, 1e9, burst).unwrap()
    }

    /// A random schedule of every operation on two buckets whose clocks differ by
    /// `offset_b - offset_a`; every answer must be identical.
    fn differential(a: &Bucket, offset_a: u64, b: &Bucket, offset_b: u64, seed: u64, steps: usize, max_step_ns: u64) {
        let mut x = seed;
        let mut t = 0u64;
        let mut next = || {
            x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let z = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            let z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        };
        let room = u64::MAX - (1 << 61) - offset_a.max(offset_b);
        for step in 0..steps {
            let r = next();
            let (ta, tb) = (offset_a + t, offset_b + t);
            let cost = 1 + next() % 3;
            match r % 16 {
                0..=4 => assert_eq!(
                    a.take(ta, cost, 0).map(|t| t.delay_ns),
                    b.take(tb, cost, 0).map(|t| t.delay_ns),
                    "take, step {step}"
                ),
                5..=7 => {
                    let max = next() % (10 * max_step_ns);
                    let (ra, rb) = (a.take(ta, cost, max), b.take(tb, cost, max));
                    assert_eq!(ra.map(|t| t.delay_ns), rb.map(|t| t.delay_ns), "reserve, step {step}");
                }
                8 => {
                    a.charge(ta, cost * 7);
                    b.charge(tb, cost * 7);
                }
                9 => assert_eq!(a.refund(ta, cost), b.refund(tb, cost), "refund, step {step}"),
                10 => {
                    let r = rate(0.001 + (next() % 10_000) as f64 / 100.0, 1 + next() % 9);
                    a.set_rate(ta, r);
                    b.set_rate(tb, r);
                }
                11 => assert_eq!(a.delay_for(ta, cost), b.delay_for(tb, cost), "delay_for, step {step}"),
                12 => assert_eq!(
                    a.predict(ta, cost * 5, cost) - offset_a,
                    b.predict(tb, cost * 5, cost) - offset_b,
                    "predict, step {step}"
                ),
                _ => t += (next() % max_step_ns).min(room - t),
            }
            assert_eq!(
                a.available(ta).to_bits(),
                b.available(tb).to_bits(),
                "available, step {step}"
            );
        }
    }

    #[test]
    fn a_bucket_at_2_pow_62_behaves_exactly_like_one_at_0() {
        for (seed, per_sec) in [(1u64, 10.0), (2, 0.37), (3, 1.0 / 86_400.0), (4, 123_457.0)] {
            let r = rate(per_sec, 5);
            let (a, b) = (Bucket::new(r), Bucket::new(r));
            differential(&a, 0, &b, 1 << 62, seed, 20_000, 2_000_000_000);
            let (a, b) = (Bucket::new(r), Bucket::new_at(r, 1 << 62));
            differential(&a, 0, &b, 1 << 62, seed, 20_000, 2_000_000_000);
        }
    }

    #[test]
    fn rebases_keep_content_exactly() {
        // Steps of up to 2 years: both buckets rebase many times, at different moments
        // (their epochs differ), mid-debt and between rate changes.
        for seed in 1..=8u64 {
            let r = rate(1.0 / 3600.0, 3);
            let (a, b) = (Bucket::new(r), Bucket::new_at(r, 3 * YEAR_NS));
            differential(&a, 0, &b, 1 << 62, seed, 2_000, 2 * YEAR_NS);
            let (a, b) = (Bucket::new(r), Bucket::new(r));
            differential(&a, 0, &b, 5 << 52, seed, 500, 11 * YEAR_NS);
        }
    }

    #[test]
    fn rebase_mid_debt_keeps_the_debt() {
        let b = Bucket::new(rate(1.0, 2));
        let t0 = REBASE_NS - 3_000_000_000;
        b.charge(t0, 10);
        let before = b.available(t0);
        assert!((before + 8.0).abs() < 1e-6, "{before}");
        let gen = b.word() >> GEN_SHIFT;
        let (wait, tat) = (b.delay_for(t0, 1).unwrap(), b.word() & TAT_MASK);
        // 4 s later, past the rebase point: the TAT moved by exactly the epoch's shift.
        let t1 = t0 + 4_000_000_000;
        let after = b.available(t1);
        assert_ne!(b.word() >> GEN_SHIFT, gen, "rebased");
        let p = b.params(b.word());
        assert_eq!(b.word() & TAT_MASK, tat - Params::of(&rate(1.0, 2)).shift_to(p.epoch));
        assert!((after + 4.0).abs() < 1e-6, "{after}");
        assert_eq!(b.delay_for(t1, 1), Ok(wait - 4_000_000_000));
        assert_eq!(b.take(t1, 1, 0), Err(Deny::Wait(wait - 4_000_000_000)));
        assert_eq!(b.take(t1, 1, u64::MAX).map(|t| t.delay_ns), Ok(wait - 4_000_000_000));
        assert_eq!(b.available(t1 + 8_000_000_000), 2.0);
    }

    #[test]
    fn a_give_back_across_a_rebase_stays_capped_by_what_the_debit_holds() {
        let b = Bucket::new(rate(1.0, 10));
        let t0 = REBASE_NS - 500_000_000;
        let mut a = b.take(t0, 1, 0).unwrap();
        b.take(t0, 5, 0).unwrap();
        let t1 = t0 + 750_000_000;
        assert!((b.available(t1) - 4.75).abs() < 1e-6);
        assert_eq!(b.params(b.word()).epoch, epoch_for(t1), "rebased");
        // Not the latest: refunded only the 0.25 s the first debit still holds.
        assert_eq!(b.give_back(&mut a, 1, t1), Undo::Refunded);
        assert!((b.available(t1) - 5.0).abs() < 1e-6, "{}", b.available(t1));
    }

    #[test]
    fn one_a_day_for_120_years_admits_one_a_day() {
        let days = 120 * YEAR_NS / DAY_NS;
        for start in [0, 1_764_000_000_123_456_789, 1 << 62] {
            for b in [
                Bucket::new(rate(1.0 / 86_400.0, 1)),
                Bucket::new_at(rate(1.0 / 86_400.0, 1), start),
            ] {
                let mut admitted = 0;
                for d in 0..days {
                    let t = start + d * DAY_NS;
                    admitted += b.take(t, 1, 0).is_ok() as u64;
                    assert_eq!(b.take(t, 1, 0), Err(Deny::Wait(DAY_NS)), "day {d}");
                }
                assert_eq!(admitted, days, "start {start}");
            }
        }
    }

    #[test]
    fn any_time_in_u64_is_decided() {
        let b = Bucket::new(rate(10.0, 2));
        for t in [0, 1 << 59, 1 << 62, 1 << 63, u64::MAX - (1 << 40)] {
            assert!(b.take(t, 2, 0).is_ok(), "{t}");
            assert_eq!(b.delay_for(t, 1), Ok(100_000_000));
            assert_eq!(b.predict(t, 1, 1), t + 200_000_000);
        }
    }

    #[test]
    fn a_time_before_the_epoch_counts_as_the_epoch() {
        let start = 1u64 << 62;
        let b = Bucket::new_at(rate(1.0, 1), start);
        let epoch = b.params(b.word()).epoch;
        assert!(epoch <= start && start - epoch <= EPOCH_MARGIN_NS + (1 << EPOCH_BITS));
        assert!(b.take(epoch - 5, 1, 0).is_ok());
        // Counted as taken at the epoch: conforms again 1 s after the epoch.
        assert_eq!(b.delay_for(epoch - 5, 1), Ok(1_000_000_005));
        assert_eq!(b.delay_for(epoch + 1_000_000_000, 1), Ok(0));
    }

    #[test]
    fn beyond_the_word_the_wait_is_the_true_one() {
        let b = Bucket::new(rate(1.0 / 86_400.0, 1));
        let mut n = 0u64;
        let err = loop {
            match b.take(0, 1, u64::MAX) {
                Ok(t) => assert!(t.delay_ns.abs_diff(n * DAY_NS) <= 1 + n * DAY_NS / 1_000_000_000_000),
                Err(e) => break e,
            }
            n += 1;
        };
        // Years of reservations fill the word; the refusal tells the real wait.
        assert!(n * DAY_NS > 8 * YEAR_NS, "{n}");
        assert!(
            matches!(err, Deny::Wait(w) if w.abs_diff(n * DAY_NS) <= n * DAY_NS / 1_000_000_000_000),
            "{err:?}"
        );
    }

    /// The fast paths add whole words (the generation on top, see `Bucket::debit`): a
    /// word of the last generation with its TAT filled to the top, plus a debit as large
    /// as the burst allows, must not wrap past 2^64 into a small word that passes the
    /// limit. The generation value 15 is never used (GENS = 15), so the sum stays below
    /// 2^64 and the take is refused with the bucket unchanged.
    #[test]
    fn a_fast_take_on_the_last_generation_with_a_full_word_never_wraps() {
        // One unit per 2^55 ns (about 1.1 years), burst 1: a debit is 2^56 ticks.
        let r = Rate::new(1.0, (1u64 << 55) as f64, 1).unwrap();
        let b = Bucket::new(r);
        for _ in 0..200 {
            let w = b.word();
            assert!(w >> GEN_SHIFT < GENS as u64, "{w:#x}");
            for (g, s) in b.slots.iter().enumerate().take(GENS) {
                let bits = s.gen_bits.load(Ordering::Relaxed);
                assert!(bits == (g as u64) << GEN_SHIFT || (bits == 0 && s.unit.load(Ordering::Relaxed) == 0));
            }
            if w >> GEN_SHIFT == GENS as u64 - 1 {
                break;
            }
            b.set_rate(0, r);
        }
        assert_eq!(b.word() >> GEN_SHIFT, GENS as u64 - 1);
        // Reservations ahead until the word is full (the last one beyond it is refused).
        while b.take(0, 1, u64::MAX).is_ok() {}
        let w = b.word();
        assert!(w & TAT_MASK > TAT_MASK - (1 << 57), "{w:#x}");
        assert!(matches!(b.try_take(0, 1), Err(Deny::Wait(_))));
        assert!(matches!(b.try_take(1 << 50, 1), Err(Deny::Wait(_))));
        assert_eq!(b.word(), w);
        // Round the generations once more: the top value is never reached.
        for _ in 0..2 * GENS {
            b.set_rate(0, r);
            assert!(b.word() >> GEN_SHIFT < GENS as u64);
        }
    }
}
