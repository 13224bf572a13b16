//! Python clocks: ManualClock (moved by hand) and MonotonicClock (real time).

use std::sync::Arc;

use pyo3::prelude::*;
use ratequeue_core::clock::monotonic_ns;
use ratequeue_core::{AnyClock, ManualClock};

use crate::args::seconds_ns;
use crate::errors::to_py;

/// A clock that moves only when told to.
#[pyclass(frozen, name = "ManualClock", module = "ratequeue")]
pub struct ManualClockPy {
    pub inner: Arc<ManualClock>,
}

#[pymethods]
impl ManualClockPy {
    #[new]
    #[pyo3(signature = (start = None))]
    fn new(py: Python<'_>, start: Option<&Bound<'_, PyAny>>) -> PyResult<Self> {
        let ns = start.map(|s| seconds_ns("start", s)).transpose()?.unwrap_or(0);
        Ok(Self {
            inner: Arc::new(ManualClock::new(ns).map_err(|e| to_py(py, e))?),
        })
    }

    /// Seconds shown.
    fn now(&self) -> f64 {
        self.inner.now_ns() as f64 / 1e9
    }

    /// Nanoseconds shown.
    fn now_ns(&self) -> u64 {
        self.inner.now_ns()
    }

    /// Moves forward by `seconds`; returns the new time.
    fn advance(&self, py: Python<'_>, seconds: &Bound<'_, PyAny>) -> PyResult<f64> {
        let d = seconds_ns("seconds", seconds)?;
        Ok(self.inner.advance(d).map_err(|e| to_py(py, e))? as f64 / 1e9)
    }

    /// Sets the time to `seconds` (never earlier than now); returns it.
    fn set(&self, py: Python<'_>, seconds: &Bound<'_, PyAny>) -> PyResult<f64> {
        let mut t = seconds_ns("seconds", seconds)?;
        let shown = self.inner.now_ns();
        // Far from zero a float second is coarser than a nanosecond: the clock's own
        // reading (as `now()` gives it) stands for the time it shows, not a step back.
        if t != shown && seconds.extract::<f64>()? == shown as f64 / 1e9 {
            t = shown;
        }
        Ok(self.inner.set(t).map_err(|e| to_py(py, e))? as f64 / 1e9)
    }

    fn __repr__(&self) -> String {
        format!("ManualClock({})", self.now())
    }
}

/// The real monotonic clock (the default of every limiter).
#[pyclass(frozen, name = "MonotonicClock", module = "ratequeue")]
pub struct MonotonicClockPy;

#[pymethods]
impl MonotonicClockPy {
    #[new]
    fn new() -> Self {
        MonotonicClockPy
    }

    /// Seconds since an arbitrary origin fixed for the process.
    fn now(&self) -> f64 {
        monotonic_ns() as f64 / 1e9
    }

    /// Nanoseconds since that origin.
    fn now_ns(&self) -> u64 {
        monotonic_ns()
    }

    fn __repr__(&self) -> &'static str {
        "MonotonicClock()"
    }
}

/// Clock seconds of a due time `ns`, rounded up so that passing them back (e.g. to
/// `run_until`) reaches it: far from zero a float second is coarser than a nanosecond.
pub fn due_seconds(ns: u64) -> f64 {
    let mut s = ns as f64 / 1e9;
    while ((s * 1e9).round() as u64) < ns {
        s = f64::from_bits(s.to_bits() + 1);
    }
    s
}

/// The core clock behind a Python clock object (None = monotonic).
pub fn any_clock(clock: Option<&Bound<'_, PyAny>>) -> PyResult<AnyClock> {
    match clock {
        None => Ok(AnyClock::Monotonic),
        Some(c) if c.is_instance_of::<MonotonicClockPy>() => Ok(AnyClock::Monotonic),
        Some(c) => match c.cast::<ManualClockPy>() {
            Ok(m) => Ok(AnyClock::Manual(m.get().inner.clone())),
            Err(_) => Err(crate::errors::type_err("clock", "a ManualClock or MonotonicClock", c)),
        },
    }
}
