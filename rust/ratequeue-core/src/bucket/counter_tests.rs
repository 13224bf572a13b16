//! The one-multiply conversion from the monotonic clock's counter to a bucket's ticks
//! ([`CounterTicks`]) against the two-step conversion it replaces (counter to
//! nanoseconds, nanoseconds to ticks): never later, at most 4 ticks earlier, and the
//! same decisions from every state.

use proptest::prelude::*;

use super::*;
use crate::clock::{counter_ticks, scale_to_ns, tsc_scale};

/// The two-step reading: `monotonic_ns` of a counter `e` ticks past the origin, then
/// `Params::ticks` from epoch 0.
fn two_step(e: u64, mult: u64, q_ticks: u64) -> u64 {
    let p = Params {
        m: 1,
        tau: 0,
        burst: 0,
        q_ticks,
        epoch: 0,
    };
    p.ticks(scale_to_ns(e, mult))
}

/// The q_ticks of a rate with one interval of `t_ns` nanoseconds.
fn q_ticks_of(t_ns: f64) -> u64 {
    Params::of(&Rate::new(1.0, t_ns, 1).unwrap()).q_ticks
}

/// Checks the conversion at `e` counter ticks past `origin`; true when inside its span.
fn check_at(origin: u64, mult: u64, q: u64, c: &CounterTicks, e: u64) -> bool {
    let Some(raw) = origin.checked_add(e) else {
        return false;
    };
    let old = two_step(e, mult, q);
    match c.ticks(raw) {
        Some(new) => {
            assert!(
                new <= old,
                "later than two-step: e={e} new={new} old={old} mult={mult} q={q}"
            );
            assert!(
                old - new <= 4,
                "more than 4 ticks early: e={e} new={new} old={old} mult={mult} q={q}"
            );
            assert!(
                scale_to_ns(e, mult) < REBASE_NS,
                "span past the rebase threshold: e={e}"
            );
            true
        }
        None => false,
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 4000, ..ProptestConfig::default() })]

    /// Counters from 0.5 to 8 GHz, any rate, readings anywhere in the span and at its
    /// edges (the origin, the offset, the rebase threshold).
    #[test]
    fn never_later_than_two_step_and_at_most_4_ticks_earlier(
        origin in 0u64..(1 << 56),
        ghz in 0.5f64..8.0,
        t_exp in 0.0f64..50.0,
        fracs in proptest::collection::vec(0.0f64..1.0, 32),
        small in proptest::collection::vec(0u64..64, 8),
    ) {
        let mult = ((1u64 << 40) as f64 / ghz) as u64;
        let q = q_ticks_of(2f64.powf(t_exp));
        let Some(c) = counter_ticks(origin, mult, q, REBASE_NS) else {
            // Only when a bucket tick is shorter than a counter tick.
            prop_assert!(mult as u128 * q as u128 >= 1u128 << 92);
            return Ok(());
        };
        let lead = c.zero - origin;
        prop_assert!(lead <= 8, "offset of {lead} counter ticks");
        let end = lead + c.span;
        // The span ends where the clock reaches the rebase threshold.
        prop_assert!(scale_to_ns(end, mult) >= REBASE_NS || c.span == u64::MAX - c.zero);
        let mut inside = 0;
        for e in small.iter().copied().chain(small.iter().map(|s| end.saturating_sub(*s))) {
            inside += check_at(origin, mult, q, &c, e) as u32;
        }
        for f in &fracs {
            inside += check_at(origin, mult, q, &c, (end as f64 * f) as u64) as u32;
        }
        prop_assert!(inside > 0);
        // Before the origin: outside the span (the nanosecond path reads 0 there).
        for back in 1..=origin.min(4) {
            prop_assert_eq!(c.ticks(origin - back), None);
        }
    }
}

#[test]
fn every_reading_over_a_range_of_counter_ticks() {
    // Exhaustive over the first 2^16 counter ticks and a window near the rebase
    // threshold, for a few clock and rate scales (fast, slow, power-of-two intervals).
    for &(ghz, t_ns) in &[
        (2.445406, 1.0),
        (2.445406, 7.0),
        (3.0, 1.5),
        (1.0, 1.999),
        (4.2, 1e9),
        (0.6, 3.3e7),
    ] {
        let mult = ((1u64 << 40) as f64 / ghz) as u64;
        let q = q_ticks_of(t_ns);
        let origin = 123_456_789;
        let Some(c) = counter_ticks(origin, mult, q, REBASE_NS) else {
            continue;
        };
        let end = c.zero - origin + c.span;
        for e in (0..1 << 16).chain(end - (1 << 16)..end + 16) {
            check_at(origin, mult, q, &c, e);
        }
    }
}

/// A bucket reading the real clock's counter, and one deciding in nanoseconds, put in
/// the same state before every decision: the same answer, and the state left at most 4
/// ticks earlier.
#[test]
fn same_decisions_as_the_nanosecond_path_from_every_state() {
    let Some(scale) = tsc_scale() else {
        return; // no TSC: limiters never read the counter
    };
    let mut x = 7u64;
    let mut next = || {
        x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let z = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        let z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    };
    let mut admitted = 0;
    for (per_sec, burst) in [(1e9, 1u64), (4e8, 3), (1e6, 5), (3.0, 2), (123_457.0, 9)] {
        let rate = Rate::new(per_sec, 1e9, burst).unwrap();
        let fused = Bucket::new_on(rate, 0, Some(scale));
        let plain = Bucket::new_at(rate, 0);
        let interval_raw = ((1e9 / per_sec) * (1u64 << 40) as f64 / scale.1 as f64) as u64 + 1;
        let mut raw = scale.0;
        for step in 0..20_000 {
            raw += next() % (3 * interval_raw);
            let cost = next() % (burst + 2);
            let w = fused.word.load(Ordering::Relaxed);
            plain.word.store(w, Ordering::Relaxed);
            let a = fused.try_take_words_counter(raw, cost);
            let ns = crate::clock::counter_ns(raw);
            assert_eq!(fused.counter_ns(raw), ns, "the bucket's copy of the clock's scale");
            let b = plain.try_take_words(ns, cost);
            match (a, b) {
                (Ok((wa0, wa)), Ok((wb0, wb))) => {
                    assert_eq!((wa0, wa >> GEN_SHIFT), (wb0, wb >> GEN_SHIFT), "step {step}");
                    let (ta, tb) = (wa & TAT_MASK, wb & TAT_MASK);
                    assert!(ta <= tb && tb - ta <= 4, "step {step}: TAT {ta} vs {tb}");
                    admitted += 1;
                }
                (a, b) => assert_eq!(a, b, "step {step}, cost {cost}"),
            }
        }
    }
    assert!(admitted > 1000);
}
