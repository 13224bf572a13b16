//! ratequeue._ratequeue: thin PyO3 glue over ratequeue-core. Types, argument checks,
//! error mapping; no policy lives here.

use pyo3::prelude::*;

mod args;
mod clock;
mod concurrency;
mod errors;
mod histogram;
mod limiter;
mod waiting;

#[pymodule(gil_used = false)]
fn _ratequeue(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_class::<clock::ManualClockPy>()?;
    m.add_class::<clock::MonotonicClockPy>()?;
    m.add_class::<limiter::RatePy>()?;
    m.add_class::<limiter::LimiterPy>()?;
    m.add_class::<limiter::ReservationPy>()?;
    m.add_class::<concurrency::ConcurrencyPy>()?;
    m.add_class::<histogram::HistogramPy>()?;
    m.add_class::<waiting::PermitPy>()?;
    m.add_class::<waiting::AcquiringPy>()?;
    m.add_class::<waiting::ChannelPy>()?;
    Ok(())
}
