//! Time sources: the process-wide monotonic clock and a manual clock advanced by hand
//! (tests, simulators). Both count nanoseconds as `u64`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use crate::error::Error;

/// The process-wide time source: the invariant TSC calibrated to nanoseconds when the
/// CPU has one (about 8 ns a read, against about 20 ns for clock_gettime in a VM), the
/// OS monotonic clock otherwise. Set by the first reading in a process; a forked child
/// inherits it, origin included, so its clock goes on from the parent's.
static SOURCE: OnceLock<Source> = OnceLock::new();

/// Bits of the fixed-point factor from counter ticks to nanoseconds.
const SCALE_BITS: u32 = 40;

/// quanta's calibration, kept as one multiply by a constant shift: quanta's own scaling
/// (a shift chosen at run time, a second match on the kind of clock, a check that the
/// reading is not before the origin) costs a third of a decision.
struct Source {
    clock: quanta::Clock,
    /// The counter's reading at the first call (time 0).
    origin: u64,
    /// Nanoseconds per 2^40 counter ticks (2^40 when the counter counts nanoseconds).
    mult: u64,
    /// quanta reads the TSC (checked by reading it around quanta's reading): read it here
    /// without going through quanta's choice of source.
    tsc: bool,
}

impl Source {
    fn new() -> Source {
        let clock = quanta::Clock::new();
        let origin = clock.raw();
        let mult = clock.delta_as_nanos(0, 1 << SCALE_BITS);
        Source {
            tsc: Self::reads_tsc(&clock),
            clock,
            origin,
            mult,
        }
    }

    /// True when quanta's raw reading is the TSC: three readings each fall between two
    /// TSC readings taken around it (nanoseconds of the OS clock do not: they count on
    /// another scale from another start). An attempt the thread was descheduled in says
    /// nothing; with no answer, quanta's reading it is (slower, as right).
    #[cfg(all(target_arch = "x86_64", target_feature = "sse2"))]
    fn reads_tsc(clock: &quanta::Clock) -> bool {
        let mut inside = 0;
        for _ in 0..32 {
            // SAFETY: RDTSC exists on every x86_64 CPU and has no side effects.
            let before = unsafe { core::arch::x86_64::_rdtsc() };
            let raw = clock.raw();
            let after = unsafe { core::arch::x86_64::_rdtsc() };
            if after < before || after - before >= 1 << 20 {
                continue;
            }
            if raw < before || raw > after {
                return false;
            }
            inside += 1;
            if inside == 3 {
                return true;
            }
        }
        false
    }

    #[cfg(not(all(target_arch = "x86_64", target_feature = "sse2")))]
    fn reads_tsc(_clock: &quanta::Clock) -> bool {
        false
    }

    #[inline(always)]
    fn raw(&self) -> u64 {
        #[cfg(all(target_arch = "x86_64", target_feature = "sse2"))]
        if self.tsc {
            // SAFETY: as in `reads_tsc`.
            return unsafe { core::arch::x86_64::_rdtsc() };
        }
        self.clock.raw()
    }

    /// Nanoseconds from the origin to the counter reading `raw` (0 before it).
    #[inline(always)]
    fn ns(&self, raw: u64) -> u64 {
        scale_to_ns(raw.saturating_sub(self.origin), self.mult)
    }
}

/// Nanoseconds in `ticks` counter ticks at `mult` nanoseconds per 2^40 ticks (rounded
/// down). Below 2^64 for any reading within 2^64 ns (584 years) of the origin.
#[inline(always)]
pub(crate) fn scale_to_ns(ticks: u64, mult: u64) -> u64 {
    ((ticks as u128 * mult as u128) >> SCALE_BITS) as u64
}

/// Monotonic nanoseconds since the first call in this process (never goes back).
#[inline]
pub fn monotonic_ns() -> u64 {
    let s = SOURCE.get_or_init(Source::new);
    s.ns(s.raw())
}

/// The monotonic clock's counter and its scale, `(origin, nanoseconds per 2^40 counter
/// ticks)`, when the clock reads the TSC (None otherwise: [`read_counter`] would not be
/// its source). Calibrates the clock if no reading came before.
pub(crate) fn tsc_scale() -> Option<(u64, u64)> {
    let s = SOURCE.get_or_init(Source::new);
    s.tsc.then_some((s.origin, s.mult))
}

/// The counter the monotonic clock reads when [`tsc_scale`] is `Some` (the TSC); any
/// other use is meaningless.
#[inline(always)]
pub(crate) fn read_counter() -> u64 {
    #[cfg(all(target_arch = "x86_64", target_feature = "sse2"))]
    {
        // SAFETY: as in `Source::reads_tsc`.
        unsafe { core::arch::x86_64::_rdtsc() }
    }
    #[cfg(not(all(target_arch = "x86_64", target_feature = "sse2")))]
    {
        monotonic_ns()
    }
}

/// [`monotonic_ns`] for the counter reading `raw` (of [`read_counter`]).
#[inline]
pub(crate) fn counter_ns(raw: u64) -> u64 {
    SOURCE.get_or_init(Source::new).ns(raw)
}

/// Bits of the fixed-point factor from counter ticks straight to a bucket's ticks: the
/// high word of a 64x64 multiply, no shift.
pub(crate) const COUNTER_BITS: u32 = 64;

/// The conversion from counter readings straight to a bucket's ticks, in one multiply,
/// for a bucket whose epoch is the clock's origin: `ticks = (raw - zero) * k >> 64` for
/// `raw - zero < span` (wrapping; otherwise the two-step conversion decides).
///
/// Never later than the two-step conversion it replaces (`ticks(ns(raw))`, the bucket's
/// `Params::ticks` of [`monotonic_ns`]'s reading) and at most 4 ticks earlier (proof at
/// [`counter_ticks`]; checked by the property tests): every decision it admits, the
/// two-step reading admits too.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct CounterTicks {
    pub(crate) zero: u64,
    pub(crate) k: u64,
    pub(crate) span: u64,
}

impl CounterTicks {
    /// Ticks for the counter reading `raw`, None outside the span.
    #[inline(always)]
    pub(crate) fn ticks(&self, raw: u64) -> Option<u64> {
        let d = raw.wrapping_sub(self.zero);
        (d < self.span).then(|| ((d as u128 * self.k as u128) >> COUNTER_BITS) as u64)
    }
}

/// The one-multiply conversion for a clock with counter origin `origin` and `mult`
/// nanoseconds per 2^40 ticks (see `Source`) to a bucket counting `q_ticks` ticks per
/// 2^52 ns from the clock's origin, valid while the clock is under `max_ns` (the
/// bucket's rebase threshold). None when the factor does not fit 64 bits (a bucket tick
/// shorter than a counter tick, e.g. a TSC under 2 GHz): the two-step conversion then.
///
/// Why it never reads later than the two-step conversion: with e = raw − origin and
/// X = e·mult·q/2^92 (the exact product), the two-step reading is
/// floor(floor(e·mult/2^40)·q/2^52) ≥ floor(X − q/2^52), as the inner floor loses under
/// one nanosecond. With k = floor(mult·q/2^28) ≤ mult·q/2^28 and zero = origin + c,
/// c = ceil(q·2^12/k) counter ticks (c·k/2^64 ≥ q/2^52), the reading is
/// floor((e − c)·k/2^64) ≤ floor(X − q/2^52). It is at most 4 ticks earlier: it exceeds
/// X − e/2^64 − c·k/2^64 − 1 > X − 1/16 − q/2^52 − k/2^64 − 1 (e < 2^60 under max_ns =
/// 2^57 for any counter under 8 GHz), with q/2^52 ≤ 2 + 2^-51
/// (a tick lasts at least half a nanosecond) and k < 2^64.
pub(crate) fn counter_ticks(origin: u64, mult: u64, q_ticks: u64, max_ns: u64) -> Option<CounterTicks> {
    let k = (mult as u128 * q_ticks as u128) >> (SCALE_BITS + 52 - COUNTER_BITS);
    if k == 0 || k > u64::MAX as u128 || mult == 0 {
        return None;
    }
    let c = ((q_ticks as u128) << (COUNTER_BITS - 52)).div_ceil(k);
    let zero = (origin as u128).checked_add(c).filter(|z| *z <= u64::MAX as u128)? as u64;
    // The largest e with e·mult < max_ns·2^40 (so the clock shows under max_ns), less c.
    let e_max = (((max_ns as u128) << SCALE_BITS) - 1) / mult as u128;
    // Counted from zero, and never wrapping past 2^64 (a reading before zero then wraps
    // to at least 2^64 − zero, outside the span).
    let span = (e_max + 1).saturating_sub(c).min((u64::MAX - zero) as u128) as u64;
    Some(CounterTicks {
        zero,
        k: k as u64,
        span,
    })
}

/// The largest time a clock may show: 2^63 ns, about 292 years, so a manual clock set
/// to a Unix timestamp (or even 2^62 ns) still has well over a century ahead of it.
pub const MAX_CLOCK_NS: u64 = 1 << 63;

/// A clock that moves only when told to; safe to share between threads.
#[derive(Debug, Default)]
pub struct ManualClock {
    ns: AtomicU64,
}

impl ManualClock {
    /// A manual clock showing `start_ns`.
    pub fn new(start_ns: u64) -> Result<Self, Error> {
        check_time("start", start_ns)?;
        Ok(Self {
            ns: AtomicU64::new(start_ns),
        })
    }

    /// The time it shows.
    #[inline]
    pub fn now_ns(&self) -> u64 {
        self.ns.load(Ordering::Acquire)
    }

    /// Moves the clock forward by `delta_ns`; returns the new time.
    pub fn advance(&self, delta_ns: u64) -> Result<u64, Error> {
        let mut cur = self.ns.load(Ordering::Acquire);
        loop {
            let next = cur
                .checked_add(delta_ns)
                .filter(|t| *t <= MAX_CLOCK_NS)
                .ok_or_else(|| Error::invalid("seconds", delta_ns as f64 / 1e9, "moves the clock past its range"))?;
            match self
                .ns
                .compare_exchange_weak(cur, next, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => return Ok(next),
                Err(seen) => cur = seen,
            }
        }
    }

    /// Sets the clock to `t_ns`, which may not be earlier than the time it shows.
    pub fn set(&self, t_ns: u64) -> Result<u64, Error> {
        check_time("seconds", t_ns)?;
        let prev = self.ns.fetch_max(t_ns, Ordering::AcqRel);
        if t_ns < prev {
            return Err(Error::invalid(
                "seconds",
                t_ns as f64 / 1e9,
                &format!(
                    "is earlier than the clock's time {} s; a clock never goes back",
                    prev as f64 / 1e9
                ),
            ));
        }
        Ok(t_ns)
    }
}

/// Checks that a time `name` = `t_ns` lies within every clock's range.
pub fn check_time(name: &str, t_ns: u64) -> Result<(), Error> {
    if t_ns > MAX_CLOCK_NS {
        return Err(Error::invalid(
            name,
            t_ns as f64 / 1e9,
            "is beyond the clock's range (2**63 ns, about 292 years)",
        ));
    }
    Ok(())
}

/// The clock a limiter reads: the real monotonic clock or a shared manual one.
#[derive(Clone, Debug, Default)]
pub enum AnyClock {
    /// Real time.
    #[default]
    Monotonic,
    /// Time moved by hand.
    Manual(Arc<ManualClock>),
}

impl AnyClock {
    /// Current time in nanoseconds.
    #[inline]
    pub fn now_ns(&self) -> u64 {
        match self {
            AnyClock::Monotonic => monotonic_ns(),
            AnyClock::Manual(c) => c.now_ns(),
        }
    }

    /// True for a manual clock.
    pub fn is_manual(&self) -> bool {
        matches!(self, AnyClock::Manual(_))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manual_clock_moves_only_forward() {
        let c = ManualClock::new(5).unwrap();
        assert_eq!(c.advance(10).unwrap(), 15);
        assert!(c.set(3).is_err());
        assert_eq!(c.now_ns(), 15);
        assert_eq!(c.set(100).unwrap(), 100);
        assert!(c.advance(u64::MAX).is_err());
        assert_eq!(c.now_ns(), 100);
    }

    #[test]
    fn monotonic_scales_as_quanta() {
        // The fixed-point factor matches quanta's own scaling of the same readings.
        let s = SOURCE.get_or_init(Source::new);
        for delta in [0u64, 1, 1 << 20, 3_000_000_000, 1 << 40, 1 << 50] {
            let ours = s.ns(s.origin + delta);
            let theirs = s.clock.delta_as_nanos(s.origin, s.origin + delta);
            assert!(
                ours.abs_diff(theirs) <= 1 + theirs / (1 << 30),
                "{delta}: {ours} vs {theirs}"
            );
        }
        assert_eq!(s.ns(s.origin.saturating_sub(5)), 0, "a reading before the origin is 0");
        let (a, q, b) = (
            monotonic_ns(),
            s.clock.delta_as_nanos(s.origin, s.clock.raw()),
            monotonic_ns(),
        );
        let slack = 1 + q / (1 << 30);
        assert!(a <= q + slack && q <= b + slack, "{a} {q} {b}: the source quanta reads");
    }

    #[test]
    fn monotonic_never_goes_back() {
        let a = monotonic_ns();
        let b = monotonic_ns();
        assert!(b >= a);
    }
}
