//! ratequeue._ratequeue: thin PyO3 glue over ratequeue-core. Types, argument checks,
//! error mapping; no policy lives here.

use pyo3::prelude::*;

mod args;
mod clock;
mod concurrency;
mod errors;
mod histogram;
mod keyed;
mod limiter;
mod policy;
mod waiting;

/// Call in a forked child (ratequeue registers it with os.register_at_fork): waiters
/// queued in the parent are dropped, the driver restarts on first use.
#[pyfunction]
fn _after_fork() {
    ratequeue_core::queue::after_fork_in_child();
}

/// Call right before fork: takes every queue's lock so none is copied mid-change.
#[pyfunction]
fn _before_fork() {
    ratequeue_core::queue::before_fork();
}

/// Call in the parent right after fork.
#[pyfunction]
fn _after_fork_parent() {
    ratequeue_core::queue::after_fork_in_parent();
}

#[pymodule(gil_used = false)]
fn _ratequeue(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_function(wrap_pyfunction!(_after_fork, m)?)?;
    m.add_function(wrap_pyfunction!(_before_fork, m)?)?;
    m.add_function(wrap_pyfunction!(_after_fork_parent, m)?)?;
    m.add_class::<clock::ManualClockPy>()?;
    m.add_class::<clock::MonotonicClockPy>()?;
    m.add_class::<limiter::RatePy>()?;
    m.add_class::<limiter::LimiterPy>()?;
    m.add_class::<limiter::ReservationPy>()?;
    m.add_class::<concurrency::ConcurrencyPy>()?;
    m.add_class::<histogram::HistogramPy>()?;
    m.add_class::<keyed::KeyedLimiterPy>()?;
    m.add_class::<keyed::KeyedConcurrencyPy>()?;
    m.add_class::<policy::PolicyPy>()?;
    m.add_class::<policy::PolicyPermitPy>()?;
    m.add_class::<waiting::PermitPy>()?;
    m.add_class::<waiting::AcquiringPy>()?;
    m.add_class::<waiting::ChannelPy>()?;
    Ok(())
}
