//! The calls `ratequeue.aio` makes for a policy's queued acquire, and the hooks that
//! drive a limiter's acquire on a channel by hand (tests): private functions of the
//! native module, so the public classes show only their API.

use pyo3::prelude::*;
use pyo3::wrap_pyfunction;

use super::running::RUNNING_WAITERS;
use super::{AcquiringPy, Awaited, ChannelPy};
use crate::errors::{channel_closed, to_py, type_err};
use crate::policy_permit::{PolicyAcquiringPy, POLICY_WAIT};
use crate::waiting::{PermitPy, Unblocked};
use ratequeue_core::wait::awaiting::{Acquire, Begun, LevelAcquire};
use ratequeue_core::{Outcome, Wake};

/// The level an `Acquiring` of a limiter acquires.
fn level<'a>(acq: &'a Bound<'_, AcquiringPy>) -> PyResult<&'a LevelAcquire> {
    match &acq.get().awaited {
        Awaited::Level(a) => Ok(&a.acquire().0),
        Awaited::Policy(..) => Err(type_err("acq", "an Acquiring of a limiter", acq)),
    }
}

/// Queues a limiter's `acq` on `channel` by hand (the caller drains it): its Permit if
/// it is granted at once, else the ticket.
#[pyfunction]
fn _wait_submit(py: Python<'_>, acq: &Bound<'_, AcquiringPy>, channel: &Bound<'_, ChannelPy>) -> PyResult<Py<PyAny>> {
    let chan = channel.get().inner.clone();
    if chan.is_closed() {
        return Err(channel_closed());
    }
    match level(acq)?.submit(&Unblocked, || Wake::Channel(chan)) {
        Ok(Begun::Done(p)) => Ok(Py::new(py, PermitPy::from(p))?.into_any()),
        Ok(Begun::Queued(t)) => Ok(t.into_pyobject(py)?.into_any().unbind()),
        Err(e) => Err(to_py(py, e)),
    }
}

/// The Permit of a grant of `acq` (by hand) after waiting `waited_ns` (`token`: the
/// grant).
#[pyfunction]
#[pyo3(signature = (acq, waited_ns, token = None))]
fn _wait_granted(
    py: Python<'_>,
    acq: &Bound<'_, AcquiringPy>,
    waited_ns: u64,
    token: Option<u64>,
) -> PyResult<PermitPy> {
    let o = Outcome::Granted {
        at_ns: 0,
        waited_ns,
        token: token.unwrap_or(0),
    };
    match level(acq)?.finish(&Unblocked, 0, o) {
        Ok(Some(p)) => Ok(PermitPy::from(p)),
        Ok(None) => Err(type_err("acq", "an Acquiring of a limiter", acq)),
        Err(e) => Err(to_py(py, e)),
    }
}

/// Leaves the queue by hand: a limiter's `acq` takes `ticket` out (False: decided
/// already); a policy's gives back everything it holds, its wait under way included.
#[pyfunction]
fn _wait_cancel(py: Python<'_>, acq: &Bound<'_, PyAny>, ticket: u64) -> PyResult<bool> {
    if let Ok(p) = acq.cast::<PolicyAcquiringPy>() {
        let core = p.get().core().clone();
        return Ok(py.detach(move || core.abandon()));
    }
    let a = acq.cast::<AcquiringPy>()?;
    Ok(level(a)?.leave(&Unblocked, ticket))
}

/// Gives back, once, a grant of `acq` (by hand) that reached its channel after its
/// waiter left.
#[pyfunction]
#[pyo3(signature = (acq, token = None))]
fn _wait_give_back(acq: &Bound<'_, AcquiringPy>, token: Option<u64>) -> PyResult<()> {
    let a = level(acq)?;
    match token {
        Some(token) => a.give_back(
            &Unblocked,
            0,
            Outcome::Granted {
                at_ns: 0,
                waited_ns: 0,
                token,
            },
        ),
        None => a.give_back_untracked(&Unblocked),
    }
    Ok(())
}

/// The awaitable of a policy acquire's waits: awaited, it waits level by level on the
/// running loop (the core's await lifecycle) and ends with the PolicyPermit.
#[pyfunction]
fn _wait_policy(acq: &Bound<'_, PolicyAcquiringPy>) -> AcquiringPy {
    AcquiringPy::policy(acq)
}

/// Seconds a policy's acquire sleeps after its last step, until its levels' common time
/// (0 on a ManualClock).
#[pyfunction]
fn _wait_left(acq: &Bound<'_, PolicyAcquiringPy>) -> f64 {
    acq.get().left()
}

/// Takes the two Python halves of the bridge (ratequeue.aio hands them over once, at
/// import; later calls change nothing): the coroutine function a queued policy acquire
/// awaits, and the function that returns the running loop and its table of waits. The
/// native module never imports the package itself.
#[pyfunction]
fn _use_aio(py: Python<'_>, policy_wait: Bound<'_, PyAny>, running_waiters: Bound<'_, PyAny>) {
    let _ = POLICY_WAIT.set(py, policy_wait.unbind());
    let _ = RUNNING_WAITERS.set(py, running_waiters.unbind());
}

/// Adds the bridge's functions to the native module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(_use_aio, m)?)?;
    m.add_function(wrap_pyfunction!(_wait_policy, m)?)?;
    m.add_function(wrap_pyfunction!(_wait_left, m)?)?;
    m.add_function(wrap_pyfunction!(_wait_submit, m)?)?;
    m.add_function(wrap_pyfunction!(_wait_granted, m)?)?;
    m.add_function(wrap_pyfunction!(_wait_give_back, m)?)?;
    m.add_function(wrap_pyfunction!(_wait_cancel, m)?)?;
    Ok(())
}
