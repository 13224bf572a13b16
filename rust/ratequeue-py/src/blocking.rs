//! The GIL rule: no thread waits for a core lock while holding the GIL.
//!
//! A core call that may wait for a lock runs whole detached from Python ([`unblocked`]):
//! it takes and releases its locks before the thread asks for the GIL again, so no core
//! lock is ever held while waiting for the GIL either (which is what lets the fork
//! handlers, run by a thread that holds the GIL, take every core lock). Hot paths first
//! try a core variant that never waits and changes nothing when a lock is busy
//! ([`try_or_unblocked`]), so the uncontended case costs no GIL round trip.

use pyo3::prelude::*;

/// Runs `f`, detached from Python if this thread is attached.
#[inline]
pub fn unblocked<T, F>(f: F) -> T
where
    F: FnOnce() -> T + Send,
    T: Send,
{
    // SAFETY: PyGILState_Check only reads this thread's state.
    if unsafe { pyo3::ffi::PyGILState_Check() } == 1 {
        // SAFETY: this thread is attached (checked just above); the token is used only
        // to detach around `f` and does not escape.
        unsafe { Python::assume_attached() }.detach(f)
    } else {
        f()
    }
}

/// `try_f()` (a call that never waits for a lock: None when one is busy), else
/// [`unblocked`] `f`.
#[inline]
pub fn try_or_unblocked<T, F>(try_f: impl FnOnce() -> Option<T>, f: F) -> T
where
    F: FnOnce() -> T + Send,
    T: Send,
{
    match try_f() {
        Some(v) => v,
        None => unblocked(f),
    }
}
