//! A rate: `amount` per `period`, with a `burst` capacity, validated once.

use crate::error::Error;

/// The largest burst window (burst × interval) a bucket supports: 2^56 ns ≈ 2.3 years.
pub const MAX_WINDOW_NS: f64 = (1u64 << 56) as f64;

/// A validated rate: `amount` units per `period_ns`, at most `burst` at once.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Rate {
    /// Units admitted per period (> 0).
    pub amount: f64,
    /// The period in nanoseconds (> 0).
    pub period_ns: f64,
    /// Capacity: the most that may be admitted at one instant (≥ 1).
    pub burst: u64,
}

impl Rate {
    /// Validates and builds a rate; the error names the offending argument.
    pub fn new(amount: f64, period_ns: f64, burst: u64) -> Result<Self, Error> {
        if !amount.is_finite() || amount <= 0.0 {
            return Err(Error::invalid("amount", amount, "must be a finite number > 0"));
        }
        if !period_ns.is_finite() || period_ns <= 0.0 {
            return Err(Error::invalid(
                "per",
                period_ns / 1e9,
                "must be a finite number of seconds > 0",
            ));
        }
        if burst < 1 {
            return Err(Error::invalid("burst", burst, "must be an integer >= 1"));
        }
        let r = Rate {
            amount,
            period_ns,
            burst,
        };
        let interval = r.interval_ns();
        if interval < 1.0 {
            return Err(Error::invalid(
                "amount",
                amount,
                "is above the fastest supported rate of 1e9 per second",
            ));
        }
        if interval * burst as f64 > MAX_WINDOW_NS {
            return Err(Error::invalid(
                "burst",
                burst,
                "makes the burst window (burst / rate) longer than 2**56 ns (about 2.3 years)",
            ));
        }
        Ok(r)
    }

    /// Nanoseconds between two unit admissions at the long-run rate.
    #[inline]
    pub fn interval_ns(&self) -> f64 {
        self.period_ns / self.amount
    }

    /// Units per second.
    pub fn per_second(&self) -> f64 {
        self.amount * 1e9 / self.period_ns
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_bad_values() {
        assert!(Rate::new(0.0, 1e9, 1).is_err());
        assert!(Rate::new(f64::NAN, 1e9, 1).is_err());
        assert!(Rate::new(f64::INFINITY, 1e9, 1).is_err());
        assert!(Rate::new(1.0, -1.0, 1).is_err());
        assert!(Rate::new(1.0, 1e9, 0).is_err());
        assert!(Rate::new(2e9, 1e9, 1).is_err());
        assert!(Rate::new(1.0, 86_400e9, 10_000).is_err());
        assert!(Rate::new(1.0, 86_400e9, 100).is_ok());
        assert!(Rate::new(1e8, 1e9, 1).is_ok());
    }
}
