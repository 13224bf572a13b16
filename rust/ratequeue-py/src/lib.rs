//! ratequeue._ratequeue: thin PyO3 glue over ratequeue-core. Types, argument checks,
//! error mapping; no policy lives here.

use pyo3::prelude::*;

mod aio;
mod args;
mod blocking;
mod clock;
mod concurrency;
mod convert;
mod errors;
mod floor;
mod fork;
mod histogram;
mod keyed;
mod keyed_concurrency;
mod keyed_limiter;
mod keywords;
mod limiter;
mod limiter_entry;
mod limiter_fast;
mod limiter_ops;
mod llm;
mod llm_call;
mod llm_settle;
mod llm_stream;
mod policy;
mod policy_level;
mod policy_permit;
mod rate;
mod reservation;
mod waiting;

#[pymodule(gil_used = false)]
fn _ratequeue(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    // Fork safety lives in pthread_atfork handlers (no Python runs while they hold the
    // core's locks); see ratequeue_core::fork.
    ratequeue_core::fork::install();
    m.add_function(wrap_pyfunction!(errors::_use_errors, m)?)?;
    m.add_function(wrap_pyfunction!(fork::_hold_locks_for_test, m)?)?;
    m.add_function(wrap_pyfunction!(fork::_skip_fork_handlers_for_test, m)?)?;
    m.add_function(wrap_pyfunction!(fork::_driver_fault_for_test, m)?)?;
    aio::register(m)?;
    llm::register(m)?;
    llm_call::register(m)?;
    llm_settle::register(m)?;
    llm_stream::register(m)?;
    m.add_class::<keywords::PolicyKeywordsPy>()?;
    m.add_class::<keywords::LimiterKeywordsPy>()?;
    m.add_class::<clock::ManualClockPy>()?;
    m.add_class::<floor::FloorPy>()?;
    m.add_class::<clock::MonotonicClockPy>()?;
    m.add_class::<rate::RatePy>()?;
    m.add_class::<limiter::LimiterPy>()?;
    m.add_class::<reservation::ReservationPy>()?;
    m.add_class::<concurrency::ConcurrencyPy>()?;
    m.add_class::<histogram::HistogramPy>()?;
    m.add_class::<keyed_limiter::KeyedLimiterPy>()?;
    m.add_class::<keyed_concurrency::KeyedConcurrencyPy>()?;
    m.add_class::<policy::PolicyPy>()?;
    m.add_class::<policy_permit::PolicyPermitPy>()?;
    m.add_class::<policy_permit::PolicyAcquiringPy>()?;
    m.add_class::<waiting::PermitPy>()?;
    m.add_class::<waiting::AcquiringPy>()?;
    m.add_class::<waiting::ChannelPy>()?;
    m.add_class::<aio::LoopWaitersPy>()?;
    limiter_entry::install(m.py())?;
    limiter_fast::install(m.py())?;
    aio::install(m.py())?;
    Ok(())
}
