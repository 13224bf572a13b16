//! Invariants of the core on a manual clock, checked with proptest over random schedules.
//!
//! (a) admitted cost in any window [s, s+d] is at most burst + rate·d;
//! (b) a refused call changes nothing;
//! (c) after set_rate the invariant holds with the new rate and burst;
//! (d) several rates are decided all-or-nothing;
//! (e) the long-run admitted rate equals the configured rate, from 1/day to 1e8/s;
//! plus races between real threads on a frozen clock.
//!
//! About the tolerance of (a): the bucket reads the clock in ticks of 0.5 to 1 ns
//! (bucket.rs), so two admissions may land up to one tick closer together than the exact
//! GCRA would put them. The bound is therefore checked as burst + rate·d + 1e-6 + rate·(1 ns)
//! over the whole range of rates, and with the strict 1e-6 units for rates up to 1e2 per
//! second, where a tick is worth at most 1e-7 units. `quantisation_excess_*` below shows
//! the effect at its largest.

use std::sync::{Arc, Barrier};
use std::thread;

use proptest::prelude::*;
use ratequeue_core::{AnyClock, Bucket, Deny, Error, Limiter, ManualClock, Rate};

const NS: u64 = 1_000_000_000;
const DAY_S: f64 = 86_400.0;

// ---------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------

/// A rate in the form the strategies generate: `per_sec` units a second, expressed over
/// one of the usual periods.
#[derive(Clone, Copy, Debug)]
struct RateSpec {
    per_sec: f64,
    period_s: f64,
    burst: u64,
}

impl RateSpec {
    fn rate(&self) -> Rate {
        Rate::new(self.per_sec * self.period_s, self.period_s * 1e9, self.burst)
            .expect("strategy only builds valid rates")
    }
    fn interval_ns(&self) -> f64 {
        self.rate().interval_ns()
    }
    /// Units per nanosecond, as the invariant's `rate`.
    fn per_ns(&self) -> f64 {
        let r = self.rate();
        r.amount / r.period_ns
    }
}

/// Rates from `lo` to `hi` per second (log-uniform), over a second, minute, hour or day,
/// with a burst in `bursts`.
fn rate_spec(lo: f64, hi: f64, bursts: std::ops::RangeInclusive<u64>) -> impl Strategy<Value = RateSpec> {
    (
        lo.log10()..=hi.log10(),
        prop::sample::select(vec![1.0, 60.0, 3600.0, DAY_S]),
        bursts,
    )
        .prop_map(|(e, period_s, burst)| RateSpec {
            per_sec: 10f64.powf(e),
            period_s,
            burst,
        })
        .prop_filter("burst window within 2^56 ns", |s| {
            Rate::new(s.per_sec * s.period_s, s.period_s * 1e9, s.burst).is_ok()
        })
}

fn manual(start_ns: u64) -> (Arc<ManualClock>, AnyClock) {
    let c = Arc::new(ManualClock::new(start_ns).unwrap());
    (c.clone(), AnyClock::Manual(c))
}

/// The tolerance of the window check, in units (see the module comment).
fn tolerance(per_ns: f64) -> f64 {
    1e-6 + per_ns
}

/// How much over the bound a window may go.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Tol {
    /// 1e-6 units, for float rounding only.
    Strict,
    /// 1e-6 units plus one nanosecond's worth of rate (one clock tick at most).
    Tick,
}

/// The largest excess of admitted cost over `burst + per_ns·d` across all windows
/// [s, s+d] whose ends are admission times, with the window where it happens.
fn worst_window(grants: &[(u64, u64)], per_ns: f64, burst: u64) -> (f64, u64, u64, u64) {
    let mut g: Vec<(u64, u64)> = grants.to_vec();
    g.sort_unstable();
    // Admissions at the same instant all fall in any window that holds that instant.
    let mut at: Vec<(u64, u64)> = Vec::with_capacity(g.len());
    for (t, c) in g {
        match at.last_mut() {
            Some(last) if last.0 == t => last.1 += c,
            _ => at.push((t, c)),
        }
    }
    let mut worst = (f64::NEG_INFINITY, 0, 0, 0);
    for i in 0..at.len() {
        let mut sum = 0u64;
        for j in i..at.len() {
            sum += at[j].1;
            let d = (at[j].0 - at[i].0) as f64;
            let excess = sum as f64 - burst as f64 - per_ns * d;
            if excess > worst.0 {
                worst = (excess, at[i].0, at[j].0, sum);
            }
        }
    }
    worst
}

fn assert_windows(grants: &[(u64, u64)], spec: &RateSpec, tol: Tol, what: &str) -> Result<(), TestCaseError> {
    let per_ns = spec.per_ns();
    let (excess, s, e, sum) = worst_window(grants, per_ns, spec.burst);
    let allowed = match tol {
        Tol::Strict => 1e-6,
        Tol::Tick => tolerance(per_ns),
    };
    prop_assert!(
        excess <= allowed,
        "{what}: {sum} units admitted in [{s}, {e}] ns, {excess} above burst {} + rate·d \
         (rate {} /s)",
        spec.burst,
        spec.per_sec
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Single-rate schedules: (a), (b), (c)
// ---------------------------------------------------------------------------------------

#[derive(Clone, Debug)]
enum Op {
    /// Move the clock by this many emission intervals (rounded to whole nanoseconds).
    Advance(f64),
    /// Move the clock by a few nanoseconds (exercises sub-interval clock reads).
    Nudge(u64),
    TryAcquire(u64),
    /// Cost and max_wait in emission intervals (None: unbounded).
    Reserve(u64, Option<f64>),
    SetRate(RateSpec),
    /// Move the clock by this many nanoseconds (years: the bucket rebases its epoch).
    Leap(u64),
}

fn op(burst_hi: u64) -> impl Strategy<Value = Op> {
    let cost = 0..=burst_hi + 2;
    prop_oneof![
        4 => (0.0..3.0f64).prop_map(Op::Advance),
        1 => (0u64..4).prop_map(Op::Nudge),
        6 => cost.clone().prop_map(Op::TryAcquire),
        4 => (cost.clone(), prop::option::weighted(0.85, 0.0..20.0f64))
            .prop_map(|(c, m)| Op::Reserve(c, m)),
        1 => rate_spec(1.0 / DAY_S, 1e8, 1..=burst_hi).prop_map(Op::SetRate),
    ]
}

/// Runs `ops` on a one-rate limiter and checks (a), (b) and (c) along the way.
fn run_single(first: RateSpec, start_ns: u64, ops: &[Op], allow_set_rate: bool, tol: Tol) -> Result<(), TestCaseError> {
    let (clock, any) = manual(start_ns);
    let l = Limiter::new(vec![("requests".into(), first.rate())], any).unwrap();
    let mut spec = first;
    // Admissions decided under the current rate, as (grant time, cost).
    let mut grants: Vec<(u64, u64)> = Vec::new();
    for op in ops {
        let before = l.available(0);
        match op {
            Op::Advance(k) => {
                let dt = (k * spec.interval_ns()).round() as u64;
                let _ = clock.advance(dt); // beyond the clock's range: ignored
            }
            Op::Nudge(ns) | Op::Leap(ns) => {
                let _ = clock.advance(*ns);
            }
            Op::TryAcquire(c) => match l.try_acquire(&[*c]) {
                Ok(()) => {
                    prop_assert!(*c <= spec.burst);
                    grants.push((clock.now_ns(), *c));
                }
                Err(d) => {
                    if *c > spec.burst {
                        prop_assert!(
                            matches!(d, Deny::TooLarge { cost, burst, unit: 0 }
                            if cost == *c && burst == spec.burst),
                            "{d:?}"
                        );
                    } else {
                        prop_assert!(matches!(d, Deny::Wait(ns) if ns > 0), "{d:?}");
                        // The wait it tells is the true one: from then on it conforms.
                        if let Deny::Wait(ns) = d {
                            let at = clock.now_ns().saturating_add(ns);
                            prop_assert_eq!(l.delay_at(at, &[*c]), Ok(0), "retry after {} ns", ns);
                        }
                    }
                    // (b): nothing changed, and the same call says the same thing.
                    prop_assert_eq!(l.available(0).to_bits(), before.to_bits());
                    prop_assert_eq!(l.try_acquire(&[*c]), Err(d));
                    prop_assert_eq!(l.available(0).to_bits(), before.to_bits());
                }
            },
            Op::Reserve(c, max) => {
                let max_ns = max.map(|k| (k * spec.interval_ns()).round() as u64);
                let now = clock.now_ns();
                match l.reserve(&[*c], max_ns) {
                    Ok(r) => {
                        prop_assert!(*c <= spec.burst);
                        prop_assert_eq!(r.at_ns, now + r.delay_ns);
                        prop_assert!(r.delay_ns <= max_ns.unwrap_or(u64::MAX));
                        grants.push((r.at_ns, *c));
                    }
                    Err(e) => {
                        match &e {
                            Error::CostTooLarge { cost, burst, unit } => {
                                prop_assert!(*c > spec.burst);
                                prop_assert_eq!((*cost, *burst, unit.as_str()), (*c, spec.burst, "requests"));
                            }
                            Error::Overloaded { retry_after_ns, .. } => {
                                prop_assert!(*c <= spec.burst);
                                prop_assert!(*retry_after_ns > 0, "{e:?}");
                            }
                            other => prop_assert!(false, "unexpected error {other:?}"),
                        }
                        // (b)
                        prop_assert_eq!(l.available(0).to_bits(), before.to_bits());
                        prop_assert_eq!(l.reserve(&[*c], max_ns).unwrap_err(), e);
                        prop_assert_eq!(l.available(0).to_bits(), before.to_bits());
                    }
                }
            }
            Op::SetRate(next) => {
                if !allow_set_rate {
                    continue;
                }
                // (a) for the epoch that ends here, then (c): a new epoch with the new
                // rate, holding only admissions decided from the change on.
                assert_windows(&grants, &spec, tol, "before set_rate")?;
                grants.clear();
                l.set_rate(0, next.rate()).unwrap();
                prop_assert_eq!(l.rate(0).unwrap().1, next.rate());
                // The content used so far (in units) carries over: never gained, and
                // lost by at most the rounding up to a whole new tick, unless the queue
                // already reaches beyond the bucket's range.
                let used = spec.burst as f64 - before;
                let want = next.burst as f64 - used;
                let got = l.available(0);
                let slack = 1e-9 * (1.0 + used.abs());
                prop_assert!(got <= want + slack, "set_rate gained content: {got} > {want}");
                if used * next.interval_ns() < 1e17 {
                    prop_assert!(
                        got >= want - tolerance(next.per_ns()) - slack,
                        "set_rate lost content: {got} < {want}"
                    );
                }
                spec = *next;
            }
        }
    }
    assert_windows(&grants, &spec, tol, "end of schedule")
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1000, ..ProptestConfig::default() })]

    /// (a) + (b) on one rate, any rate from 1/day to 1e8/s.
    #[test]
    fn window_bound_and_refusals_change_nothing(
        spec in rate_spec(1.0 / DAY_S, 1e8, 1..=20),
        start_s in prop::sample::select(vec![0u64, 1, 1_000_000]),
        ops in prop::collection::vec(op(20), 1..120),
    ) {
        run_single(spec, start_s * NS, &ops, false, Tol::Tick)?;
    }

    /// (c): rate and burst changes at run time, checked from each change on.
    #[test]
    fn window_bound_after_set_rate(
        spec in rate_spec(1.0 / DAY_S, 1e8, 1..=20),
        ops in prop::collection::vec(op(20), 1..120),
    ) {
        run_single(spec, 0, &ops, true, Tol::Tick)?;
    }

    /// (a) with the strict tolerance of 1e-6 units where clock ticks are too fine to
    /// matter (at most 1e2 units per second).
    #[test]
    fn window_bound_strict_for_everyday_rates(
        spec in rate_spec(1.0 / DAY_S, 1e2, 1..=50),
        ops in prop::collection::vec(op(50), 1..120),
    ) {
        prop_assert!(spec.per_ns() <= 1e-7);
        run_single(spec, 0, &ops, false, Tol::Strict)?;
    }
}

/// Leaps of up to 12 years between ordinary operations.
fn op_or_leap(burst_hi: u64) -> impl Strategy<Value = Op> {
    prop_oneof![
        12 => op(burst_hi),
        1 => (0u64..12 * 366 * 86_400 * NS).prop_map(Op::Leap),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1000, ..ProptestConfig::default() })]

    /// (a) + (b) on a clock started anywhere in its range (epoch timestamps, 2^62 ns and
    /// beyond), leaping years at a time: a bucket counts from its own epoch.
    #[test]
    fn window_bound_from_any_start_time(
        spec in rate_spec(1.0 / DAY_S, 1e8, 1..=20),
        start_ns in prop_oneof![0u64..1 << 63, Just(1u64 << 62), Just(1_764_000_000_123_456_789u64)],
        ops in prop::collection::vec(op_or_leap(20), 1..120),
        rate_changes in any::<bool>(),
    ) {
        run_single(spec, start_ns, &ops, rate_changes, Tol::Tick)?;
    }
}

/// The bound holds exactly on a clock read in whole ticks; on integer nanoseconds the
/// excess at the fastest rates is below one tick. At T = 1.5 ns (2 ticks of 0.75 ns),
/// burst 1, admissions at 2 ns and 3 ns are both allowed: 2 units within 1 ns, where
/// exact GCRA (and the contract) allow 1 + 1/1.5. The excess stays below rate·1 ns.
#[test]
fn quantisation_excess_is_below_one_nanosecond_of_rate() {
    let spec = RateSpec {
        per_sec: 2.0 / 3.0 * 1e9,
        period_s: 1.0,
        burst: 1,
    };
    let b = Bucket::new(Rate::new(2.0, 3.0, 1).unwrap());
    let grants: Vec<(u64, u64)> = (0..10_000u64)
        .filter(|t| b.take(*t, 1, 0).is_ok())
        .map(|t| (t, 1))
        .collect();
    let (excess, ..) = worst_window(&grants, spec.per_ns(), 1);
    assert!(excess < spec.per_ns(), "excess {excess}");
    // Long-run: exactly 2 per 3 ns.
    assert!(grants.len().abs_diff(10_000 * 2 / 3) <= 1, "{}", grants.len());
}

// ---------------------------------------------------------------------------------------
// Several rates at once: (d)
// ---------------------------------------------------------------------------------------

#[derive(Clone, Debug)]
enum MultiOp {
    Advance(f64),
    TryAcquire(Vec<u64>),
    Reserve(Vec<u64>, Option<f64>),
}

fn multi_op(units: usize, burst_hi: u64) -> impl Strategy<Value = MultiOp> {
    let costs = prop::collection::vec(0..=burst_hi + 1, units);
    prop_oneof![
        3 => (0.0..2.0f64).prop_map(MultiOp::Advance),
        5 => costs.clone().prop_map(MultiOp::TryAcquire),
        4 => (costs, prop::option::weighted(0.85, 0.0..10.0f64)).prop_map(|(c, m)| MultiOp::Reserve(c, m)),
    ]
}

fn multi_case() -> impl Strategy<Value = (Vec<RateSpec>, Vec<MultiOp>)> {
    prop::collection::vec(rate_spec(1e-2, 1e6, 1..=12), 2..=3).prop_flat_map(|specs| {
        let n = specs.len();
        (Just(specs), prop::collection::vec(multi_op(n, 12), 1..100))
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1000, ..ProptestConfig::default() })]

    /// (d): with two or three units, a refusal leaves every unit's available() as it was
    /// and the same call refused the same way; each bucket keeps its own window bound.
    #[test]
    fn multi_rate_all_or_nothing((specs, ops) in multi_case()) {
        let (clock, any) = manual(0);
        let names = ["requests", "tokens", "bytes"];
        let l = Limiter::new(
            specs.iter().zip(names).map(|(s, u)| (u.to_string(), s.rate())).collect(),
            any,
        ).unwrap();
        let n = specs.len();
        prop_assert_eq!(l.units().len(), n);
        // The slowest unit's interval, to scale time steps.
        let step = specs.iter().map(|s| s.interval_ns()).fold(0.0, f64::max);
        let mut grants: Vec<Vec<(u64, u64)>> = vec![Vec::new(); n];
        for op in &ops {
            let before: Vec<u64> = (0..n).map(|u| l.available(u).to_bits()).collect();
            let too_large = |c: &[u64]| (0..n).any(|u| c[u] > specs[u].burst);
            match op {
                MultiOp::Advance(k) => { let _ = clock.advance((k * step).round() as u64); }
                MultiOp::TryAcquire(c) => match l.try_acquire(c) {
                    Ok(()) => {
                        prop_assert!(!too_large(c));
                        let now = clock.now_ns();
                        for u in 0..n { grants[u].push((now, c[u])); }
                    }
                    Err(d) => {
                        if too_large(c) {
                            prop_assert!(matches!(d, Deny::TooLarge { unit, .. } if c[unit] > specs[unit].burst), "{d:?}");
                        } else {
                            prop_assert!(matches!(d, Deny::Wait(ns) if ns > 0), "{d:?}");
                        }
                        let after: Vec<u64> = (0..n).map(|u| l.available(u).to_bits()).collect();
                        prop_assert_eq!(&after, &before, "a refused try_acquire debited a unit");
                        prop_assert_eq!(l.try_acquire(c), Err(d));
                    }
                },
                MultiOp::Reserve(c, max) => {
                    let max_ns = max.map(|k| (k * step).round() as u64);
                    let now = clock.now_ns();
                    match l.reserve(c, max_ns) {
                        Ok(r) => {
                            prop_assert!(!too_large(c));
                            prop_assert_eq!(r.at_ns, now + r.delay_ns);
                            for u in 0..n { grants[u].push((r.at_ns, c[u])); }
                        }
                        Err(e) => {
                            prop_assert!(matches!(e, Error::CostTooLarge { .. } | Error::Overloaded { .. }), "{e:?}");
                            let after: Vec<u64> = (0..n).map(|u| l.available(u).to_bits()).collect();
                            prop_assert_eq!(&after, &before, "a refused reserve debited a unit");
                            prop_assert_eq!(l.reserve(c, max_ns).unwrap_err(), e);
                        }
                    }
                }
            }
        }
        for u in 0..n {
            assert_windows(&grants[u], &specs[u], Tol::Tick, names[u])?;
        }
    }
}

// ---------------------------------------------------------------------------------------
// Long-run rate: (e)
// ---------------------------------------------------------------------------------------

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    /// (e): back-to-back reservations, the clock moved to each grant: after the first
    /// burst the grants are spaced exactly by the costs, so the k-th grant comes at
    /// (Σcost − burst)·T with no drift, and the admitted rate is the configured one.
    #[test]
    fn long_run_rate_is_the_configured_rate(
        spec in rate_spec(1.0 / DAY_S, 1e8, 1..=100),
        seed_costs in prop::collection::vec(1u64..=100, 1..64),
        start_s in prop::sample::select(vec![0u64, 7, 123_456]),
    ) {
        let (clock, any) = manual(start_s * NS);
        let l = Limiter::new(vec![("requests".into(), spec.rate())], any).unwrap();
        let t = spec.interval_ns();
        let t0 = clock.now_ns();
        // At least 1000 units and 10 ms of schedule (or 20,000 grants), at most ~3 years.
        let want_units = (1e7 / t).max(1000.0).min(3.0 * 365.0 * DAY_S * 1e9 / t);
        let mut total = 0u64;
        let mut grants = 0usize;
        let mut last_at = t0;
        while (total as f64) < want_units && grants < 20_000 {
            let c = 1 + (seed_costs[grants % seed_costs.len()] - 1) % spec.burst;
            let r = l.reserve(&[c], None).unwrap();
            total += c;
            grants += 1;
            prop_assert!(r.at_ns >= last_at, "grants out of order");
            // No drift: each grant is where the exact schedule puts it.
            let exact = t0 as f64 + (total.saturating_sub(spec.burst)) as f64 * t;
            let err = r.at_ns as f64 - exact;
            prop_assert!(err.abs() <= 2.0 + 1e-12 * exact,
                "grant {grants} at {} ns, exact {exact} (err {err} ns)", r.at_ns);
            clock.set(r.at_ns).unwrap();
            last_at = r.at_ns;
        }
        prop_assume!(total > spec.burst);
        let elapsed = (last_at - t0) as f64;
        let measured = (total - spec.burst) as f64 / elapsed; // units per ns
        let rel = (measured / spec.per_ns() - 1.0).abs();
        prop_assert!(rel < 1e-4, "rate {} /s: measured {} /s ({} grants, rel err {rel})",
            spec.per_sec, measured * 1e9, grants);
    }
}

/// (e) at the two ends named in the contract, deterministically.
#[test]
fn long_run_rate_at_the_extremes() {
    for (amount, period_ns, burst, n) in [
        (1.0, DAY_S * 1e9, 1u64, 2_000u64),
        (1e8, 1e9, 1, 200_000),
        (1e8, 1e9, 64, 200_000),
    ] {
        let (clock, any) = manual(0);
        let rate = Rate::new(amount, period_ns, burst).unwrap();
        let l = Limiter::new(vec![("requests".into(), rate)], any).unwrap();
        let mut at = 0;
        for _ in 0..n {
            at = l.reserve(&[1], None).unwrap().at_ns;
            clock.set(at).unwrap();
        }
        let measured = (n - burst) as f64 / at as f64;
        let configured = amount / period_ns;
        let rel = (measured / configured - 1.0).abs();
        assert!(rel < 1e-4, "{amount} per {period_ns} ns: rel err {rel}");
    }
}

// ---------------------------------------------------------------------------------------
// Real threads on a frozen clock
// ---------------------------------------------------------------------------------------

const THREADS: usize = 8;
const CALLS: usize = 200_000;

fn race<F, R>(f: F) -> Vec<R>
where
    F: Fn(usize) -> R + Send + Sync + 'static,
    R: Send + 'static,
{
    let f = Arc::new(f);
    let start = Arc::new(Barrier::new(THREADS));
    let hs: Vec<_> = (0..THREADS)
        .map(|k| {
            let f = f.clone();
            let start = start.clone();
            thread::spawn(move || {
                start.wait();
                f(k)
            })
        })
        .collect();
    hs.into_iter().map(|h| h.join().unwrap()).collect()
}

#[test]
fn race_try_acquire_admits_exactly_the_burst() {
    let (_clock, any) = manual(5 * NS);
    let l = Arc::new(Limiter::new(vec![("requests".into(), Rate::new(1.0, 1e9, 1000).unwrap())], any).unwrap());
    let l2 = l.clone();
    let admitted: usize = race(move |_| (0..CALLS).filter(|_| l2.try_acquire(&[1]).is_ok()).count())
        .into_iter()
        .sum();
    assert_eq!(admitted, 1000);
    assert_eq!(l.available(0), 0.0);
}

#[test]
fn race_multi_rate_leaves_no_partial_debit() {
    let (_clock, any) = manual(0);
    let l = Arc::new(
        Limiter::new(
            vec![
                ("requests".into(), Rate::new(10.0, 1e9, 1000).unwrap()),
                ("tokens".into(), Rate::new(100.0, 1e9, 2000).unwrap()),
            ],
            any,
        )
        .unwrap(),
    );
    let l2 = l.clone();
    // Thread k asks for 1 request and 1 + k % 5 tokens (some calls cost more tokens).
    let per_thread = race(move |k| {
        let costs = [1u64, 1 + (k % 5) as u64];
        let n = (0..CALLS).filter(|_| l2.try_acquire(&costs).is_ok()).count() as u64;
        (n * costs[0], n * costs[1])
    });
    let requests: u64 = per_thread.iter().map(|p| p.0).sum();
    let tokens: u64 = per_thread.iter().map(|p| p.1).sum();
    assert!(
        requests <= 1000 && tokens <= 2000,
        "{requests} requests, {tokens} tokens"
    );
    assert_eq!(l.available(0), (1000 - requests) as f64);
    assert_eq!(l.available(1), (2000 - tokens) as f64);
}

#[test]
fn race_reserve_grants_the_sequential_schedule() {
    // Frozen clock at 0, burst 10, 1000/s, cost 1: whatever the interleaving, the grant
    // times are those of a single queue: 10 at once, then one every millisecond.
    let (_clock, any) = manual(0);
    let l = Arc::new(Limiter::new(vec![("requests".into(), Rate::new(1000.0, 1e9, 10).unwrap())], any).unwrap());
    let l2 = l.clone();
    let per = 5_000;
    let mut at: Vec<u64> = race(move |_| {
        (0..per)
            .map(|_| l2.reserve(&[1], None).unwrap().at_ns)
            .collect::<Vec<_>>()
    })
    .into_iter()
    .flatten()
    .collect();
    at.sort_unstable();
    for (n, t) in at.iter().enumerate() {
        let want = (n as u64).saturating_sub(9) * 1_000_000;
        assert!(t.abs_diff(want) <= 1, "grant {n} at {t} ns, want {want}");
    }
}
