//! asyncio from Rust: the awaitable of acquire_async (the fast path at the call; a
//! queued wait as one future of the running loop, resolved natively in one call per
//! batch), the event-loop channel and the loop's table of waiting futures.
//!
//! A queued wait is split in two: what the channel must settle once the loop is gone
//! (the queue, the costs, the grant: [`AcqShared`], held by the channel's `native` map,
//! no Python object of the loop) and the loop's future (held by [`LoopWaitersPy`], which
//! the loop owns and the garbage collector traverses).

use std::cell::RefCell;
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyString, PyTuple, PyWeakrefReference};
use pyo3::{intern, PyTraverseError, PyVisit};
use ratequeue_core::wait::{Cancelled, Channel};
use ratequeue_core::{Error, GrantRef, Outcome, Submitted, Wake};

use crate::blocking::unblocked;
use crate::errors::{channel_closed, misuse, no_descriptor, to_py};
use crate::waiting::{Gate, GatePy, PermitOwner, PermitPy};

mod bridge;
mod channel;
mod running;
mod send;

pub use bridge::register;
use channel::*;
pub use channel::{submit, ChannelPy, LoopWaitersPy};
use running::*;
pub use send::install;
use send::*;

/// An awaitable that is already done; with a permit, also an async context manager
/// that releases it on exit.
#[pyclass(frozen, module = "ratequeue")]
pub struct Ready {
    value: Py<PyAny>,
}

impl Ready {
    /// Already done with `value`.
    pub fn new(value: Py<PyAny>) -> Ready {
        Ready { value }
    }
}

#[pymethods]
impl Ready {
    fn __await__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __iter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __next__(&self, py: Python<'_>) -> PyResult<()> {
        Err(stop(py, self.value.clone_ref(py)))
    }

    /// Coroutine protocol (so `asyncio.create_task` accepts it): done at once.
    fn send(&self, py: Python<'_>, _value: &Bound<'_, PyAny>) -> PyResult<()> {
        self.__next__(py)
    }

    /// Coroutine protocol: raises what is thrown in (nothing runs inside).
    #[pyo3(signature = (typ, val = None, _tb = None))]
    fn throw(
        &self,
        typ: &Bound<'_, PyAny>,
        val: Option<&Bound<'_, PyAny>>,
        _tb: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Py<PyAny>> {
        Err(thrown(typ, val))
    }

    /// Coroutine protocol: nothing to close.
    fn close(&self) {}

    fn __aenter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_exc))]
    fn __aexit__(&self, py: Python<'_>, _exc: &Bound<'_, PyTuple>) -> PyResult<Py<Ready>> {
        if let Ok(p) = self.value.bind(py).cast::<PermitPy>() {
            p.get().release();
        }
        done_false(py)
    }
}

/// The exception `throw(typ, val)` raises: `val` if given, else `typ` (an instance, or a
/// class to instantiate).
fn thrown(typ: &Bound<'_, PyAny>, val: Option<&Bound<'_, PyAny>>) -> PyErr {
    let e = match val.filter(|v| !v.is_none()) {
        Some(v) => v.clone(),
        None if typ.is_instance_of::<pyo3::types::PyType>() => match typ.call0() {
            Ok(e) => e,
            Err(e) => return e,
        },
        None => typ.clone(),
    };
    PyErr::from_value(e)
}

/// The awaitable every `__aexit__` returns: done, False (exceptions propagate). Shared:
/// awaiting it changes nothing.
fn done_false(py: Python<'_>) -> PyResult<Py<Ready>> {
    static DONE: PyOnceLock<Py<Ready>> = PyOnceLock::new();
    DONE.get_or_try_init(py, || {
        Py::new(
            py,
            Ready {
                value: false.into_pyobject(py)?.to_owned().into_any().unbind(),
            },
        )
    })
    .map(|r| r.clone_ref(py))
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Hashes tickets (one sequence for the process): consecutive tickets keep consecutive
/// slots (their low bits are kept), the top bits mixed for the table's tags.
#[derive(Default, Clone, Copy)]
struct TicketHash(u64);

impl Hasher for TicketHash {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.write_u64(self.0.rotate_left(8) ^ u64::from(*b));
        }
    }

    fn write_u64(&mut self, t: u64) {
        self.0 = t ^ (t.wrapping_mul(0x9E37_79B9_7F4A_7C15) & (0x7F << 57));
    }
}

/// A map by ticket.
type ByTicket<V> = HashMap<u64, V, BuildHasherDefault<TicketHash>>;

/// The costs of an acquire: up to two units inline (no allocation), more on the heap.
enum Costs {
    Inline([u64; 2], usize),
    Heap(Vec<u64>),
}

impl Costs {
    fn new(c: &[u64]) -> Costs {
        match *c {
            [] => Costs::Inline([0; 2], 0),
            [a] => Costs::Inline([a, 0], 1),
            [a, b] => Costs::Inline([a, b], 2),
            _ => Costs::Heap(c.to_vec()),
        }
    }
}

impl std::ops::Deref for Costs {
    type Target = [u64];

    fn deref(&self) -> &[u64] {
        match self {
            Costs::Inline(a, n) => &a[..*n],
            Costs::Heap(v) => v,
        }
    }
}

/// What a queued async acquire shares with the channel it waits on: enough to build its
/// permit, and to settle it after its loop is gone (no Python object of the loop).
pub(crate) struct AcqShared {
    gate: Arc<Gate>,
    costs: Costs,
    class: usize,
    timeout_ns: Option<u64>,
    permit: OnceLock<Py<PermitPy>>,
    token: OnceLock<u64>,
    /// The queue's clock reading at the submit (the arrival): grant time = this + wait.
    submitted_ns: OnceLock<u64>,
    /// Who the permit belongs to, when not the queue (e.g. a key of a keyed limiter).
    owner: Option<Arc<dyn PermitOwner>>,
}

impl AcqShared {
    fn make_permit(&self, waited_ns: u64) -> PermitPy {
        let p = match &self.owner {
            Some(o) => PermitPy::new(o.clone(), &self.costs, waited_ns),
            None => self.gate.permit(&self.costs, waited_ns),
        };
        let at_ns = self.submitted_ns.get().map_or(0, |s| s.saturating_add(waited_ns));
        p.with_grant(GrantRef {
            at_ns,
            token: self.token.get().copied(),
            owed: None,
        })
    }

    /// The permit of a grant after waiting `waited_ns`, kept for the awaiting task.
    fn granted(&self, py: Python<'_>, waited_ns: u64, token: Option<u64>) -> PyResult<Py<PermitPy>> {
        if let Some(t) = token {
            let _ = self.token.set(t);
        }
        let p = Py::new(py, self.make_permit(waited_ns))?;
        let _ = self.permit.set(p.clone_ref(py));
        Ok(p)
    }

    fn timeout_error(&self, py: Python<'_>, waited_ns: u64) -> PyErr {
        to_py(
            py,
            Error::WaitTimeout {
                waited_ns,
                retry_after_ns: py.detach(|| self.gate.queue.retry_after_ns(&self.costs)),
            },
        )
    }

    /// Gives a grant back to the queue (see Resource::give_back for when a rate keeps it).
    fn give_back(&self, token: Option<u64>) {
        let token = token.or_else(|| self.token.get().copied());
        unblocked(|| self.gate.queue.give_back(&self.costs, token));
    }

    /// Gives back, exactly once, a grant whose permit reached a waiter that left before
    /// using it (the permit is marked released).
    fn abandon(&self, permit: &PermitPy) {
        if permit.mark_released() && permit.granted_here() {
            self.give_back(None);
        }
    }
}

/// Where the awaitable of a queued acquire is.
enum Wait {
    /// Not awaited yet.
    Idle,
    /// Being submitted (a second, concurrent start is refused).
    Starting,
    /// In the queue under `ticket`; its future is in `side`.
    Queued { ticket: u64, side: Arc<LoopSide> },
    /// Over: granted (the permit is kept), timed out, refused or left.
    Done,
}

/// The result of acquire_async: await it for a Permit, or use `async with`. Awaiting
/// it queues once and yields one future of the running loop, resolved by one wake-up.
#[pyclass(frozen, name = "Acquiring", module = "ratequeue")]
pub struct AcquiringPy {
    shared: Arc<AcqShared>,
    wait: Mutex<Wait>,
    /// Run when this object goes away (e.g. drop a per-key queue nobody uses).
    on_drop: Option<Box<dyn Fn() + Send + Sync>>,
}

impl Drop for AcquiringPy {
    fn drop(&mut self) {
        let w = std::mem::replace(&mut *lock(&self.wait), Wait::Done);
        if let Wait::Queued { ticket, side } = w {
            // Collected without close(): leave the queue like close() would.
            leave(&self.shared, ticket, &side);
        }
        if let Some(f) = self.on_drop.take() {
            f();
        }
    }
}

impl AcquiringPy {
    /// Not started yet: queues when awaited.
    fn new(gate: &Arc<Gate>, costs: &[u64], class: usize, timeout_ns: Option<u64>) -> AcquiringPy {
        AcquiringPy {
            shared: Arc::new(AcqShared {
                gate: gate.clone(),
                costs: Costs::new(costs),
                class,
                timeout_ns,
                permit: OnceLock::new(),
                token: OnceLock::new(),
                submitted_ns: OnceLock::new(),
                owner: None,
            }),
            wait: Mutex::new(Wait::Idle),
            on_drop: None,
        }
    }

    /// The permit, once granted.
    pub(crate) fn permit(&self) -> Option<&Py<PermitPy>> {
        self.shared.permit.get()
    }

    /// Tries the fast path; the awaitable is ready at once when it admits.
    pub fn start(
        py: Python<'_>,
        gate: &Arc<Gate>,
        costs: &[u64],
        class: usize,
        timeout_ns: Option<u64>,
    ) -> PyResult<AcquiringPy> {
        let a = AcquiringPy::new(gate, costs, class, timeout_ns);
        match gate.queue.try_now_token(costs, class) {
            Ok((at_ns, token)) => {
                let _ = a.shared.permit.set(Py::new(
                    py,
                    gate.permit(costs, 0).with_grant(GrantRef::new(at_ns, token)),
                )?);
                *lock(&a.wait) = Wait::Done;
            }
            Err(Some(d)) => return Err(to_py(py, gate.queue.error_for(d))),
            Err(None) => {}
        }
        Ok(a)
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
        let mut a = AcquiringPy::new(gate, costs, 0, timeout_ns);
        Arc::get_mut(&mut a.shared).expect("not shared yet").owner = Some(owner);
        a.on_drop = Some(on_drop);
        a
    }

    /// One step of the wait: the future to wait for, or the end (the permit, or the
    /// error).
    fn step(&self, py: Python<'_>) -> PyResult<Step> {
        let mut w = lock(&self.wait);
        match &*w {
            Wait::Idle => {
                *w = Wait::Starting;
                drop(w);
                let r = self.begin(py);
                if r.is_err() {
                    *lock(&self.wait) = Wait::Done;
                }
                r
            }
            Wait::Starting => Err(misuse("this acquire is already being awaited")),
            Wait::Queued { ticket, side } => {
                if let Some(p) = self.shared.permit.get() {
                    *w = Wait::Done;
                    return Ok(Step::Return(p.clone_ref(py).into_any()));
                }
                // Resumed before its outcome (driven by hand): wait for the same future.
                let fut = lock(&side.futs).get(ticket).map(|f| f.clone_ref(py));
                drop(w);
                match fut {
                    Some(f) => {
                        f.bind(py).setattr(intern!(py, "_asyncio_future_blocking"), true)?;
                        Ok(Step::Yield(f))
                    }
                    None => Err(misuse("this acquire's wait ended without a permit")),
                }
            }
            Wait::Done => match self.shared.permit.get() {
                Some(p) => Ok(Step::Return(p.clone_ref(py).into_any())),
                None => Err(misuse(
                    "this acquire already ended without a permit: call acquire_async() again",
                )),
            },
        }
    }

    /// Submits on the running loop's channel: the permit when granted at once, else the
    /// loop's future registered under the ticket.
    fn begin(&self, py: Python<'_>) -> PyResult<Step> {
        let (event_loop, waiters, plain) = running_waiters(py)?;
        let side = waiters.get().inner.clone();
        if side.chan.is_closed() {
            return Err(channel_closed());
        }
        let fut = if plain {
            let kw = PyDict::new(py);
            kw.set_item(intern!(py, "loop"), &event_loop)?;
            FUTURE.import(py, "asyncio.futures", "Future")?.call((), Some(&kw))?
        } else {
            event_loop.call_method0(intern!(py, "create_future"))?
        };
        let sh = &self.shared;
        let chan = side.chan.clone();
        let q = &sh.gate.queue;
        let submitted = match q.try_submit_dated(&sh.costs, sh.class, sh.timeout_ns, || Wake::Channel(chan.clone())) {
            Some(tail) if tail.is_light() => tail.finish(),
            Some(tail) => py.detach(|| tail.finish()),
            None => py.detach(|| q.submit_dated(&sh.costs, sh.class, sh.timeout_ns, || Wake::Channel(chan))),
        };
        let ticket = match submitted {
            Ok((Submitted::Granted { .. }, now)) => {
                let _ = sh.submitted_ns.set(now);
                *lock(&self.wait) = Wait::Done;
                let p = sh.granted(py, 0, None)?;
                return Ok(Step::Return(p.into_any()));
            }
            Ok((Submitted::Queued(t), now)) => {
                let _ = sh.submitted_ns.set(now);
                t
            }
            Err(e) => return Err(to_py(py, e)),
        };
        lock(&side.native).insert(ticket, sh.clone());
        lock(&side.futs).insert(ticket, fut.clone().unbind());
        *lock(&self.wait) = Wait::Queued { ticket, side };
        fut.setattr(intern!(py, "_asyncio_future_blocking"), true)?;
        Ok(Step::Yield(fut.unbind()))
    }

    /// Ends the wait from outside (an exception thrown in, or close): leaves the queue,
    /// or gives back the grant that raced the exit, exactly once.
    fn end(&self) {
        let w = std::mem::replace(&mut *lock(&self.wait), Wait::Done);
        if let Wait::Queued { ticket, side } = w {
            leave(&self.shared, ticket, &side);
        }
    }
}

/// A queued wait ended without its outcome: leaves the queue, or gives back the grant
/// that raced the exit, exactly once (whoever takes the ticket out of `native` settles
/// it: this, the loop's resolve, or the channel's close).
fn leave(sh: &AcqShared, ticket: u64, side: &LoopSide) {
    let fut = lock(&side.futs).remove(&ticket);
    let queued = lock(&side.native).contains_key(&ticket);
    if queued {
        if unblocked(|| sh.gate.queue.cancel(ticket)) == Cancelled::Removed {
            lock(&side.native).remove(&ticket);
        }
        // Else decided, its outcome in the channel: the resolve (or close) gives a grant
        // back, as the ticket has no future any more.
    } else if let Some(p) = sh.permit.get() {
        // Granted, but the task left before it resumed.
        sh.abandon(p.get());
    }
    drop(fut);
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
    match gate.queue.try_now_token(costs, class) {
        Ok((at_ns, token)) => {
            let permit = Py::new(py, gate.permit(costs, 0).with_grant(GrantRef::new(at_ns, token)))?;
            Ok(Py::new(py, Ready::new(permit.into_any()))?.into_any())
        }
        Err(Some(d)) => Err(to_py(py, gate.queue.error_for(d))),
        Err(None) => Ok(Py::new(py, AcquiringPy::new(gate, costs, class, timeout_ns))?.into_any()),
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
        if let Some(p) = self.shared.permit.get() {
            p.get().release();
        }
        done_false(py)
    }
}

/// The asyncio bridge's calls (`ratequeue.aio`, through [`bridge`]): not Python methods.
impl AcquiringPy {
    /// Queues on `channel` (the caller drains it): returns a Permit if granted at once,
    /// else the ticket. Raises RuntimeError on a closed channel.
    pub(crate) fn submit(&self, py: Python<'_>, channel: &Bound<'_, ChannelPy>) -> PyResult<Py<PyAny>> {
        let chan = channel.get().inner.clone();
        if chan.is_closed() {
            return Err(channel_closed());
        }
        let sh = &self.shared;
        let submitted = py.detach(|| {
            sh.gate
                .queue
                .submit_dated(&sh.costs, sh.class, sh.timeout_ns, || Wake::Channel(chan))
        });
        if let Ok((_, now)) = submitted {
            let _ = sh.submitted_ns.set(now);
        }
        match submitted.map(|(s, _)| s) {
            Ok(Submitted::Granted { .. }) => Ok(sh.granted(py, 0, None)?.into_any()),
            Ok(Submitted::Queued(t)) => Ok(t.into_pyobject(py)?.into_any().unbind()),
            Err(e) => Err(to_py(py, e)),
        }
    }

    /// The permit of a grant after waiting `waited_ns` (`token` identifies the grant,
    /// for an exact give-back if its waiter is cancelled before using it).
    pub(crate) fn granted(&self, py: Python<'_>, waited_ns: u64, token: Option<u64>) -> PyResult<Py<PermitPy>> {
        self.shared.granted(py, waited_ns, token)
    }

    /// The WaitTimeout for a wait that expired after `waited_ns`.
    pub(crate) fn timeout_error(&self, py: Python<'_>, waited_ns: u64) -> PyErr {
        self.shared.timeout_error(py, waited_ns)
    }

    /// Removes the ticket from the queue; False if it was already decided.
    pub(crate) fn cancel(&self, py: Python<'_>, ticket: u64) -> bool {
        py.detach(|| self.shared.gate.queue.cancel(ticket)) == Cancelled::Removed
    }

    /// Gives back, exactly once, a grant whose permit was delivered to a waiter that was
    /// cancelled before it could use it (the permit is marked released).
    pub(crate) fn abandon(&self, permit: &Bound<'_, PermitPy>) {
        self.shared.abandon(permit.get());
    }

    /// Gives back a grant that arrived after its waiter was cancelled (see
    /// Resource::give_back for when a rate keeps it instead).
    pub(crate) fn give_back(&self, token: Option<u64>) {
        self.shared.give_back(token);
    }
}

/// Queued async acquires of one channel, by ticket: settled by whoever takes one out.
type Native = Arc<Mutex<ByTicket<Arc<AcqShared>>>>;
