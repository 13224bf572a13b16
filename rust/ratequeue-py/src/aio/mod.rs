//! asyncio from Rust: the awaitable of acquire_async (the fast path at the call; a
//! queued wait as one future of the running loop, resolved natively in one call per
//! batch), the event-loop channel and the loop's table of waiting futures.
//!
//! The await lifecycle itself (states, the leave rule, the ticket tables) is the core's
//! [`Awaiting`]; this module gives it the running loop and its futures ([`PyLoop`]) and
//! the awaitable protocol (`__await__`, `send`, `throw`, `close`, `async with`).

use std::cell::RefCell;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, OnceLock};

use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyString, PyTuple, PyWeakrefReference};
use pyo3::{intern, PyTraverseError, PyVisit};
use ratequeue_core::policy::PolicyAcquire;
use ratequeue_core::wait::awaiting::{Acquire, Awaiting, Failed, LevelAcquire, Loop, Native, Next, Waits};
use ratequeue_core::wait::Channel;
use ratequeue_core::{GrantRef, Outcome};

use crate::blocking::unblocked;
use crate::errors::{channel_closed, misuse, no_descriptor, to_py};
use crate::policy_permit::PolicyAcquiringPy;
use crate::waiting::{Gate, GatePy, PermitOwner, PermitPy, Unblocked};

mod bridge;
mod channel;
mod grants;
mod ready;
mod running;
mod send;

pub use bridge::register;
pub use channel::{submit, ChannelPy, LoopWaitersPy};
use grants::{PyLevel, PyPolicy};
pub use ready::Ready;
use ready::{done_false, thrown};
use running::*;
pub use send::install;
use send::*;

/// The tables of a loop's waits: its futures, and the grants its tasks get.
pub(crate) type PyWaits = Waits<Py<PyAny>, Py<PyAny>>;
/// A channel's table of waits.
pub(crate) type PyNative = Native<Py<PyAny>>;

/// The running event loop as the core's await lifecycle sees it: its tables of waits,
/// and its futures.
struct PyLoop<'py> {
    py: Python<'py>,
}

impl Loop for PyLoop<'_> {
    type Future = Py<PyAny>;
    type Grant = Py<PyAny>;
    type Error = PyErr;

    fn running(&mut self) -> PyResult<(Arc<PyWaits>, Py<PyAny>)> {
        let py = self.py;
        let (event_loop, waiters, plain) = running_waiters(py)?;
        let waits = waiters.get().inner.clone();
        if waits.chan.is_closed() {
            return Err(channel_closed());
        }
        let fut = if plain {
            let kw = PyDict::new(py);
            kw.set_item(intern!(py, "loop"), &event_loop)?;
            FUTURE.import(py, "asyncio.futures", "Future")?.call((), Some(&kw))?
        } else {
            event_loop.call_method0(intern!(py, "create_future"))?
        };
        Ok((waits, fut.unbind()))
    }

    fn share(&mut self, fut: &Py<PyAny>) -> Py<PyAny> {
        fut.clone_ref(self.py)
    }
}

/// What is awaited: one level, or a policy's levels (its steps; `PolicyAcquiring` makes
/// the permit).
enum Awaited {
    Level(Awaiting<PyLevel, Py<PyAny>>),
    Policy(Awaiting<PyPolicy, Py<PyAny>>),
}

/// The result of acquire_async: await it for a Permit, or use `async with`. Awaiting
/// it queues once and yields one future of the running loop, resolved by one wake-up.
#[pyclass(frozen, name = "Acquiring", module = "ratequeue")]
pub struct AcquiringPy {
    awaited: Awaited,
    /// The permit, once granted (kept for `async with` and a second await).
    permit: OnceLock<Py<PyAny>>,
    /// Run when this object goes away (e.g. drop a per-key queue nobody uses).
    on_drop: Option<Box<dyn Fn() + Send + Sync>>,
}

impl Drop for AcquiringPy {
    fn drop(&mut self) {
        // Collected without close(): leave the queue like close() would.
        self.end();
        if let Some(f) = self.on_drop.take() {
            f();
        }
    }
}

impl AcquiringPy {
    fn level(acquire: LevelAcquire) -> AcquiringPy {
        AcquiringPy {
            awaited: Awaited::Level(Awaiting::new(PyLevel(acquire))),
            permit: OnceLock::new(),
            on_drop: None,
        }
    }

    /// The steps of a policy acquire that must wait (its permit made by `policy`).
    pub(crate) fn policy(acq: &Bound<'_, PolicyAcquiringPy>) -> AcquiringPy {
        AcquiringPy {
            awaited: Awaited::Policy(Awaiting::new(PyPolicy {
                core: acq.get().core().clone(),
                acq: acq.clone().unbind(),
            })),
            permit: OnceLock::new(),
            on_drop: None,
        }
    }

    /// Queues on `gate` without a fast path (the caller tried it), with permits owned by
    /// `owner` and `on_drop` run when the awaitable goes away.
    pub fn queued(
        gate: &Arc<Gate>,
        costs: &[u64],
        timeout_ns: Option<u64>,
        owner: Arc<dyn PermitOwner>,
        on_drop: Box<dyn Fn() + Send + Sync>,
    ) -> AcquiringPy {
        let mut a = AcquiringPy::level(LevelAcquire::new(gate, costs, 0, timeout_ns).owned_by(owner));
        a.on_drop = Some(on_drop);
        a
    }

    /// One step of the wait: the future to wait for, or the end (the permit, or the
    /// error).
    fn step(&self, py: Python<'_>) -> PyResult<Step> {
        match &self.awaited {
            Awaited::Level(a) => self.step_of(py, a),
            Awaited::Policy(a) => self.step_of(py, a),
        }
    }

    fn step_of<A: Acquire<Grant = Py<PyAny>>>(&self, py: Python<'_>, a: &Awaiting<A, Py<PyAny>>) -> PyResult<Step> {
        match a.step(&mut PyLoop { py }, &Unblocked) {
            Ok(Next::Wait(f)) => match f.bind(py).setattr(intern!(py, "_asyncio_future_blocking"), true) {
                Ok(()) => Ok(Step::Yield(f)),
                Err(e) => {
                    a.end(&Unblocked);
                    Err(e)
                }
            },
            Ok(Next::Granted(p)) => {
                let _ = self.permit.set(p.clone_ref(py));
                Ok(Step::Return(p))
            }
            Ok(Next::Over) => match self.permit.get() {
                Some(p) => Ok(Step::Return(p.clone_ref(py))),
                None => Err(misuse(
                    "this acquire already ended without a permit: call acquire_async() again",
                )),
            },
            Err(Failed::Refused(e)) => Err(to_py(py, e)),
            Err(Failed::Host(e)) => Err(e),
            Err(Failed::Closed) => Err(channel_closed()),
            Err(Failed::Busy) => Err(misuse("this acquire is already being awaited")),
            Err(Failed::Lost) => Err(misuse("this acquire's wait ended without a permit")),
        }
    }

    /// Ends the wait from outside (an exception thrown in, close, collected): leaves
    /// the queue, or gives back the grant that raced the exit, exactly once.
    fn end(&self) {
        match &self.awaited {
            Awaited::Level(a) => a.end(&Unblocked),
            Awaited::Policy(a) => a.end(&Unblocked),
        }
    }
}

/// acquire_async: on the fast path an already-done awaitable holding the permit (no
/// ticket, no queue, one object), else an Acquiring that queues when awaited.
pub fn acquire_async(
    py: Python<'_>,
    gate: &Arc<Gate>,
    costs: &[u64],
    class: usize,
    timeout_ns: Option<u64>,
) -> PyResult<Py<PyAny>> {
    match gate.permit_now(py, costs, class) {
        Ok(Some(permit)) => {
            let permit = Py::new(py, permit)?;
            Ok(Py::new(py, Ready::new(permit.into_any()))?.into_any())
        }
        Err(e) => Err(to_py(py, e)),
        Ok(None) => {
            let a = AcquiringPy::level(LevelAcquire::new(gate, costs, class, timeout_ns));
            Ok(Py::new(py, a)?.into_any())
        }
    }
}

#[pymethods]
impl AcquiringPy {
    fn __await__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __iter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __next__(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.step(py)?.into_next(py)
    }

    /// Coroutine protocol (so `asyncio.create_task` accepts it): the first send queues,
    /// the next one (after the future's wake-up) ends with the permit.
    #[pyo3(signature = (value, /))]
    fn send(&self, py: Python<'_>, value: &Bound<'_, PyAny>) -> PyResult<Py<PyAny>> {
        let _ = value;
        self.step(py)?.into_next(py)
    }

    /// Coroutine protocol: raises what is thrown in, after leaving the queue cleanly
    /// (a cancel removes the waiter or gives back the grant that raced it).
    #[pyo3(signature = (typ, val = None, tb = None, /))]
    fn throw(
        &self,
        typ: &Bound<'_, PyAny>,
        val: Option<&Bound<'_, PyAny>>,
        tb: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Py<PyAny>> {
        let _ = tb;
        self.end();
        Err(thrown(typ, val))
    }

    /// Coroutine protocol: leaves the queue if the wait started.
    fn close(&self) {
        self.end();
    }

    fn __aenter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_exc))]
    fn __aexit__(&self, py: Python<'_>, _exc: &Bound<'_, PyTuple>) -> PyResult<Py<Ready>> {
        if let Some(p) = self.permit.get() {
            if let Ok(p) = p.bind(py).cast::<PermitPy>() {
                p.get().release();
            }
        }
        done_false(py)
    }
}
