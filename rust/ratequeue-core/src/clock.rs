//! Time sources: the process-wide monotonic clock and a manual clock advanced by hand
//! (tests, simulators). Both count nanoseconds as `u64`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use crate::error::Error;

/// The process-wide time source: the invariant TSC calibrated to nanoseconds when the
/// CPU has one (about 8 ns a read, against about 20 ns for clock_gettime in a VM), the
/// OS monotonic clock otherwise; with its reading at the origin (time 0).
static SOURCE: OnceLock<(quanta::Clock, u64)> = OnceLock::new();

/// Bits of the fixed-point TSC scale: nanoseconds = (ticks · `TSC_MULT`) >> `TSC_SHIFT`.
const TSC_SHIFT: u32 = 40;

/// Nanoseconds per 2^40 TSC ticks, once calibrated; 0 before, and for good when the
/// source is not the TSC. With it, a reading is one `rdtsc`, one subtraction and one
/// 64×64→128-bit multiply-shift: no lazy-init check, no branch on the source's kind.
///
/// Bounds: a TSC of at least 2^-8 GHz keeps `TSC_MULT` below 2^48, so the product of a
/// tick count (< 2^64) and it stays below 2^112 (fits a u128); the nanoseconds fit a
/// u64 while the TSC has counted fewer ticks than 2^64 / (ns per tick) — over 195 years
/// at 3 GHz — and saturate at u64::MAX beyond (never wrap).
static TSC_MULT: AtomicU64 = AtomicU64::new(0);
/// The TSC's reading at the origin (published before `TSC_MULT`).
static TSC_ORIGIN: AtomicU64 = AtomicU64::new(0);

/// Nanoseconds of `ticks` TSC ticks at `mult` (see [`TSC_MULT`]): floor(ticks · mult /
/// 2^40), saturating. Monotonic in `ticks`.
#[inline]
fn tsc_ns(ticks: u64, mult: u64) -> u64 {
    u64::try_from((u128::from(ticks) * u128::from(mult)) >> TSC_SHIFT).unwrap_or(u64::MAX)
}

#[cfg(target_arch = "x86_64")]
#[inline]
fn read_tsc() -> u64 {
    // SAFETY: rdtsc has no preconditions on x86_64.
    unsafe { std::arch::x86_64::_rdtsc() }
}

/// Monotonic nanoseconds since the first call in this process (never goes back; a
/// forked child continues its parent's clock).
#[inline]
pub fn monotonic_ns() -> u64 {
    #[cfg(target_arch = "x86_64")]
    {
        let mult = TSC_MULT.load(Ordering::Acquire);
        if mult != 0 {
            // A core whose counter reads below the origin (a skew of a few ticks right
            // after calibration) counts as the origin.
            let ticks = read_tsc().saturating_sub(TSC_ORIGIN.load(Ordering::Relaxed));
            return tsc_ns(ticks, mult);
        }
    }
    monotonic_ns_slow()
}

/// The first reading (calibrating the source), and every reading of a source that is
/// not the TSC.
#[cold]
#[inline(never)]
fn monotonic_ns_slow() -> u64 {
    let (clock, origin) = SOURCE.get_or_init(|| {
        let c = quanta::Clock::new();
        let origin = c.raw();
        #[cfg(target_arch = "x86_64")]
        {
            // quanta's source is the TSC when its raw reading is the counter itself and
            // its scale is not the identity (the OS clock's raw readings are nanoseconds).
            let mult = c.delta_as_nanos(0, 1 << TSC_SHIFT);
            let same_counter = read_tsc().wrapping_sub(origin) < 1 << 32;
            if mult != 1 << TSC_SHIFT && mult != 0 && mult < 1 << 48 && same_counter {
                TSC_ORIGIN.store(origin, Ordering::Relaxed);
                TSC_MULT.store(mult, Ordering::Release);
            }
        }
        (c, origin)
    });
    #[cfg(target_arch = "x86_64")]
    {
        let mult = TSC_MULT.load(Ordering::Acquire);
        if mult != 0 {
            return tsc_ns(read_tsc().saturating_sub(*origin), mult);
        }
    }
    clock.delta_as_nanos(*origin, clock.raw())
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
    fn monotonic_never_goes_back() {
        let a = monotonic_ns();
        let b = monotonic_ns();
        assert!(b >= a);
    }

    #[test]
    fn monotonic_never_goes_back_across_threads() {
        let start = monotonic_ns();
        let ends: Vec<u64> = (0..4)
            .map(|_| {
                std::thread::spawn(move || {
                    let mut last = monotonic_ns();
                    assert!(last >= start);
                    for _ in 0..100_000 {
                        let t = monotonic_ns();
                        assert!(t >= last, "{t} < {last}");
                        last = t;
                    }
                    last
                })
            })
            .map(|h| h.join().unwrap())
            .collect();
        let after = monotonic_ns();
        assert!(ends.iter().all(|e| *e <= after));
    }

    #[test]
    fn monotonic_agrees_with_the_os_clock() {
        let (t0, i0) = (monotonic_ns(), std::time::Instant::now());
        std::thread::sleep(std::time::Duration::from_millis(20));
        let (t1, e) = (monotonic_ns(), i0.elapsed());
        let ours = (t1 - t0) as f64;
        let os = e.as_nanos() as f64;
        // Two readings apart, under any load: within 2 ms and 1 %.
        assert!((ours - os).abs() < 2e6 + os * 0.01, "ours {ours} ns, the OS's {os} ns");
    }

    #[test]
    fn the_tsc_scale_is_exact_floor_multiply_shift() {
        // 3 GHz: 1/3 ns per tick.
        let mult = (1u64 << TSC_SHIFT) / 3;
        assert_eq!(tsc_ns(0, mult), 0);
        assert_eq!(tsc_ns(3, mult), 0); // floor(3 * floor(2^40 / 3) / 2^40) = 0
        assert_eq!(tsc_ns(3_000_000_000, mult), 999_999_999);
        for ticks in [1u64, 7, 1 << 20, 1 << 40, 1 << 62, u64::MAX / 2] {
            let want = (u128::from(ticks) * u128::from(mult)) >> TSC_SHIFT;
            assert_eq!(u128::from(tsc_ns(ticks, mult)), want);
        }
        // Monotonic in ticks, and never wraps: saturates past u64::MAX nanoseconds.
        assert!(tsc_ns(1001, mult) >= tsc_ns(1000, mult));
        let slow = 1u64 << 47; // 128 ns per tick: the largest product in range
        assert_eq!(tsc_ns(u64::MAX, slow), u64::MAX);
        assert_eq!(tsc_ns(1 << 50, slow), 1 << 57);
    }
}
