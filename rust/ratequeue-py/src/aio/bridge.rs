//! The calls `ratequeue.aio` makes on a queued wait (a limiter's `Acquiring` or a
//! policy's `PolicyAcquiring`): private functions of the native module, so the public
//! classes show only their API.

use pyo3::prelude::*;
use pyo3::wrap_pyfunction;

use super::running::RUNNING_WAITERS;
use super::{AcquiringPy, ChannelPy};
use crate::errors::type_err;
use crate::policy_permit::{PolicyAcquiringPy, POLICY_WAIT};
use crate::waiting::PermitPy;

/// A queued wait of either kind.
enum Waitable<'a, 'py> {
    Level(&'a Bound<'py, AcquiringPy>),
    Policy(&'a Bound<'py, PolicyAcquiringPy>),
}

fn waitable<'a, 'py>(acq: &'a Bound<'py, PyAny>) -> PyResult<Waitable<'a, 'py>> {
    if let Ok(a) = acq.cast::<AcquiringPy>() {
        return Ok(Waitable::Level(a));
    }
    if let Ok(p) = acq.cast::<PolicyAcquiringPy>() {
        return Ok(Waitable::Policy(p));
    }
    Err(type_err("acq", "an Acquiring or PolicyAcquiring", acq))
}

/// Queues `acq` on `channel`: its permit if it is granted at once (None: a policy's next
/// step is `_wait_submit` again), else the ticket whose outcome the channel brings.
#[pyfunction]
fn _wait_submit(py: Python<'_>, acq: &Bound<'_, PyAny>, channel: &Bound<'_, ChannelPy>) -> PyResult<Py<PyAny>> {
    match waitable(acq)? {
        Waitable::Level(a) => a.get().submit(py, channel),
        Waitable::Policy(p) => p.get().submit(py, channel),
    }
}

/// The permit of a grant after waiting `waited_ns` (`token`: the grant); None for a
/// policy step.
#[pyfunction]
#[pyo3(signature = (acq, waited_ns, token = None))]
fn _wait_granted(py: Python<'_>, acq: &Bound<'_, PyAny>, waited_ns: u64, token: Option<u64>) -> PyResult<Py<PyAny>> {
    match waitable(acq)? {
        Waitable::Level(a) => Ok(a.get().granted(py, waited_ns, token)?.into_any()),
        Waitable::Policy(p) => Ok(p.get().granted(py, waited_ns, token)?.unwrap_or_else(|| py.None())),
    }
}

/// The WaitTimeout for a wait that expired after `waited_ns` (a policy gives back
/// everything it held first).
#[pyfunction]
fn _wait_timeout_error(py: Python<'_>, acq: &Bound<'_, PyAny>, waited_ns: u64) -> PyResult<PyErr> {
    Ok(match waitable(acq)? {
        Waitable::Level(a) => a.get().timeout_error(py, waited_ns),
        Waitable::Policy(p) => p.get().timeout_error(py, waited_ns),
    })
}

/// Takes the ticket out of its queue; False if the queue decided it already (its
/// outcome is on the way and settles through `_wait_give_back`).
#[pyfunction]
fn _wait_cancel(py: Python<'_>, acq: &Bound<'_, PyAny>, ticket: u64) -> PyResult<bool> {
    Ok(match waitable(acq)? {
        Waitable::Level(a) => a.get().cancel(py, ticket),
        Waitable::Policy(p) => p.get().cancel(py, ticket),
    })
}

/// Gives back, once, a grant that reached its channel after its waiter left.
#[pyfunction]
#[pyo3(signature = (acq, token = None))]
fn _wait_give_back(py: Python<'_>, acq: &Bound<'_, PyAny>, token: Option<u64>) -> PyResult<()> {
    match waitable(acq)? {
        Waitable::Level(a) => a.get().give_back(token),
        Waitable::Policy(p) => p.get().give_back(py, token),
    }
    Ok(())
}

/// Gives back, once, what a wait was granted when its task left before resuming
/// (`result`: the Permit a limiter's future was resolved with; None for a policy).
#[pyfunction]
fn _wait_abandon(py: Python<'_>, acq: &Bound<'_, PyAny>, result: &Bound<'_, PyAny>) -> PyResult<()> {
    match waitable(acq)? {
        Waitable::Level(a) => a.get().abandon(result.cast::<PermitPy>()?),
        Waitable::Policy(p) => p.get().abandon(py, result),
    }
    Ok(())
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
    m.add_function(wrap_pyfunction!(_wait_submit, m)?)?;
    m.add_function(wrap_pyfunction!(_wait_granted, m)?)?;
    m.add_function(wrap_pyfunction!(_wait_timeout_error, m)?)?;
    m.add_function(wrap_pyfunction!(_wait_cancel, m)?)?;
    m.add_function(wrap_pyfunction!(_wait_give_back, m)?)?;
    m.add_function(wrap_pyfunction!(_wait_abandon, m)?)?;
    m.add_function(wrap_pyfunction!(_wait_left, m)?)?;
    Ok(())
}
