//! Test hooks for fork safety and driver recovery (private, underscore names).

use std::time::Duration;

use crate::errors::{value_err, wrong_type};
use pyo3::prelude::*;
use ratequeue_core::wait::driver::{inject_fault, Fault};

use crate::args::seconds_ns;
use crate::keyed_limiter::KeyedLimiterPy;
use crate::limiter::LimiterPy;
use crate::policy_permit::PolicyAcquiringPy;

/// Test hook: holds the core locks of `obj` (a Limiter's queue, a KeyedLimiter's
/// shards, a policy acquire under way) for `seconds` on this thread, the GIL released, as a long decision would.
#[pyfunction]
pub fn _hold_locks_for_test(py: Python<'_>, obj: &Bound<'_, PyAny>, seconds: &Bound<'_, PyAny>) -> PyResult<()> {
    let d = Duration::from_nanos(seconds_ns("seconds", seconds)?);
    if let Ok(l) = obj.cast::<LimiterPy>() {
        let q = l.get().gate().queue.clone();
        py.detach(move || q.hold_lock_for(d));
    } else if let Ok(k) = obj.cast::<KeyedLimiterPy>() {
        let core = k.get().core().clone();
        py.detach(move || core.hold_locks_for(d));
    } else if let Ok(a) = obj.cast::<PolicyAcquiringPy>() {
        let core = a.get().core().clone();
        py.detach(move || core.hold_lock_for(d));
    } else {
        return Err(wrong_type("a Limiter, a KeyedLimiter or a PolicyAcquiring"));
    }
    Ok(())
}

/// Test hook: a Limiter's queue leaves the fork handlers (as a queue made behind their
/// back would be), so a forked child inherits its waiters and its lock as they were.
#[pyfunction]
pub fn _skip_fork_handlers_for_test(obj: &Bound<'_, PyAny>) -> PyResult<()> {
    let l = obj.cast::<LimiterPy>().map_err(|_| wrong_type("a Limiter"))?;
    l.get().gate().queue.skip_fork_handlers();
    Ok(())
}

/// Test hook: the driver's next `n` spawns fail ("fail_spawn"), wakes panic
/// ("panic_wake") or thread runs end ("exit").
#[pyfunction]
pub fn _driver_fault_for_test(kind: &str, n: u32) -> PyResult<()> {
    let f = match kind {
        "fail_spawn" => Fault::FailSpawn,
        "panic_wake" => Fault::PanicWake,
        "exit" => Fault::Exit,
        _ => return Err(value_err("kind", &format!("{kind:?}"), "is not a driver fault")),
    };
    inject_fault(f, n);
    Ok(())
}
