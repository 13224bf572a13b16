//! Time sources: the process-wide monotonic clock and a manual clock advanced by hand
//! (tests, simulators). Both count nanoseconds as `u64`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use crate::error::Error;

/// The process-wide time source: the invariant TSC calibrated to nanoseconds when the
/// CPU has one (about 8 ns a read, against about 20 ns for clock_gettime in a VM), the
/// OS monotonic clock otherwise.
static SOURCE: OnceLock<(quanta::Clock, u64)> = OnceLock::new();

/// Monotonic nanoseconds since the first call in this process (never goes back).
#[inline]
pub fn monotonic_ns() -> u64 {
    let (clock, origin) = SOURCE.get_or_init(|| {
        let c = quanta::Clock::new();
        let origin = c.raw();
        (c, origin)
    });
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
}
