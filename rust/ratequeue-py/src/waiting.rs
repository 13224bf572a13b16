//! Waiting from Python: blocking acquire with the GIL released, the awaitable of
//! acquire_async (fast path in Rust, queued path in ratequeue.aio), permits, and the
//! event-loop channel. Shared by Limiter and Concurrency.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use pyo3::exceptions::PyStopIteration;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTuple};
use ratequeue_core::queue::{Cancelled, Channel, Slot};
use ratequeue_core::{Error, GrantRef, Outcome, Submitted, WaitQueue, Wake};

use crate::args::seconds_ns;
use crate::blocking::{copy_unblocked, try_or_unblocked, unblocked};
use crate::errors::to_py;
use crate::histogram::HistogramPy;

/// Interval at which a main-thread wait looks for signals (Ctrl-C); other threads
/// sleep until their wake-up.
const SIGNAL_SLICE: Duration = Duration::from_millis(50);

/// What a permit returns to when released or settled.
pub trait PermitOwner: Send + Sync {
    /// Unit names, indexed as the costs (empty: nothing to settle).
    fn units(&self) -> &[String];
    /// True when the permit is returned on exit (concurrency).
    fn returns_on_exit(&self) -> bool;
    /// Returns the permits of a grant.
    fn give_back(&self, costs: &[u64]);
    /// Settles estimated costs to actual ones by the one undo rule; returns the grant
    /// as it now stands, for the next settle.
    fn settle(&self, estimated: &[u64], actual: &[u64], grant: GrantRef) -> GrantRef;
}

impl PermitOwner for Gate {
    fn units(&self) -> &[String] {
        &self.units
    }

    fn returns_on_exit(&self) -> bool {
        self.returns_on_exit
    }

    fn give_back(&self, costs: &[u64]) {
        let q = &self.queue;
        try_or_unblocked(
            || q.try_give_back(costs, None).then_some(()),
            || q.give_back(costs, None),
        );
    }

    fn settle(&self, estimated: &[u64], actual: &[u64], grant: GrantRef) -> GrantRef {
        unblocked(|| self.queue.settle(estimated, actual, grant))
    }
}

/// A queue plus how its permits behave on exit.
pub struct Gate {
    pub queue: Arc<WaitQueue>,
    /// Unit names, indexed as the costs (empty for a semaphore: nothing to settle).
    pub units: Vec<String>,
    /// True for a semaphore: the permit is returned when the holder is done.
    pub returns_on_exit: bool,
}

impl Gate {
    /// The class index for `priority` (None: the first class).
    pub fn class(&self, priority: Option<&Bound<'_, PyAny>>) -> PyResult<usize> {
        match crate::args::opt_text("priority", priority)?.as_deref() {
            None => Ok(0),
            Some(p) => self.queue.class_index(p).ok_or_else(|| {
                let names: Vec<&str> = self.queue.config().classes.iter().map(|(n, _)| n.as_str()).collect();
                pyo3::exceptions::PyValueError::new_err(format!("priority={p:?} is not one of the classes {names:?}"))
            }),
        }
    }

    /// The class names, in order.
    pub fn class_names(&self) -> Vec<String> {
        self.queue.config().classes.iter().map(|(n, _)| n.clone()).collect()
    }

    pub fn timeout(&self, timeout: Option<&Bound<'_, PyAny>>) -> PyResult<Option<u64>> {
        timeout.map(|t| seconds_ns("timeout", t)).transpose()
    }

    pub(crate) fn permit(self: &Arc<Self>, costs: &[u64], waited_ns: u64) -> PermitPy {
        PermitPy::new(self.clone(), costs, waited_ns)
    }

    /// Blocks until granted (GIL released), raising Overloaded, WaitTimeout, or
    /// KeyboardInterrupt (leaving the queue clean).
    pub fn acquire_blocking(
        self: &Arc<Self>,
        py: Python<'_>,
        costs: &[u64],
        class: usize,
        timeout_ns: Option<u64>,
    ) -> PyResult<PermitPy> {
        match self.queue.try_now_token(costs, class) {
            Ok((at_ns, token)) => return Ok(self.permit(costs, 0).with_grant(GrantRef { at_ns, token })),
            Err(Some(d)) => return Err(to_py(py, self.queue_error(d))),
            Err(None) => {}
        }
        let slot = Slot::new();
        let submitted = py.detach(|| {
            self.queue
                .submit(costs, class, timeout_ns, || Wake::Thread(slot.clone()))
        });
        let ticket = match submitted {
            Ok(Submitted::Granted { at_ns }) => {
                return Ok(self.permit(costs, 0).with_grant(GrantRef { at_ns, token: None }))
            }
            Ok(Submitted::Queued(t)) => t,
            Err(e) => return Err(to_py(py, e)),
        };
        let slice = is_main_thread(py).then_some(SIGNAL_SLICE);
        loop {
            let s = slot.clone();
            if let Some(o) = py.detach(move || s.wait(slice)) {
                return self.outcome(py, costs, o);
            }
            if let Err(e) = py.check_signals() {
                py.detach(|| self.abandon(ticket, &slot, costs));
                return Err(e);
            }
        }
    }

    fn queue_error(&self, d: ratequeue_core::Deny) -> Error {
        self.queue.error_for(d)
    }

    fn outcome(self: &Arc<Self>, py: Python<'_>, costs: &[u64], o: Outcome) -> PyResult<PermitPy> {
        match o {
            Outcome::Granted {
                at_ns,
                waited_ns,
                token,
            } => Ok(self.permit(costs, waited_ns).with_grant(GrantRef {
                at_ns,
                token: Some(token),
            })),
            Outcome::TimedOut { waited_ns } => Err(to_py(
                py,
                Error::WaitTimeout {
                    waited_ns,
                    retry_after_ns: py.detach(|| self.queue.retry_after_ns(costs)),
                },
            )),
        }
    }

    /// Leaves the queue after an interruption: removed, or the grant that won the race
    /// is given back. Exactly once either way.
    fn abandon(&self, ticket: u64, slot: &Slot, costs: &[u64]) {
        if self.queue.cancel(ticket) == Cancelled::NotQueued {
            if let Some(Outcome::Granted { token, .. }) = slot.take() {
                self.queue.give_back(costs, Some(token));
            }
        }
    }
}

/// True on the interpreter's main thread, asked each time: a child forked from another
/// thread has that thread as its main thread (and its signal handlers run there).
pub(crate) fn is_main_thread(py: Python<'_>) -> bool {
    let Ok(threading) = py.import("threading") else {
        return true;
    };
    match (
        threading.call_method0("main_thread"),
        threading.call_method0("current_thread"),
    ) {
        (Ok(main), Ok(current)) => current.is(&main),
        _ => true,
    }
}

/// What a grant gave: context manager; a Concurrency permit is returned on exit.
#[pyclass(frozen, name = "Permit", module = "ratequeue")]
pub struct PermitPy {
    owner: Arc<dyn PermitOwner>,
    costs: Mutex<Vec<u64>>,
    waited_ns: u64,
    released: AtomicBool,
    /// The grant, for settling by the one undo rule (locked after `costs`).
    grant: Mutex<GrantRef>,
    /// The fork generation it was granted in: in a forked child every permit starts
    /// free, so one from before the fork gives nothing back there.
    fork_gen: u64,
}

impl PermitPy {
    /// A permit of `owner` holding `costs`, granted after `waited_ns` in the queue.
    pub fn new(owner: Arc<dyn PermitOwner>, costs: &[u64], waited_ns: u64) -> PermitPy {
        PermitPy {
            owner,
            costs: Mutex::new(costs.to_vec()),
            waited_ns,
            released: AtomicBool::new(false),
            grant: Mutex::new(GrantRef::default()),
            fork_gen: ratequeue_core::fork::generation(),
        }
    }

    /// True when granted in this process (not inherited across a fork).
    pub fn granted_here(&self) -> bool {
        self.fork_gen == ratequeue_core::fork::generation()
    }

    /// The same permit, knowing its grant (when it was taken, and its token).
    pub fn with_grant(self, grant: GrantRef) -> PermitPy {
        *self.grant.lock().unwrap_or_else(|e| e.into_inner()) = grant;
        self
    }

    /// The same grant, owned by `owner` instead (e.g. a key rather than its queue).
    pub fn rehome(&self, owner: Arc<dyn PermitOwner>) -> PermitPy {
        let costs = copy_unblocked(&self.costs);
        let grant = copy_unblocked(&self.grant);
        PermitPy::new(owner, &costs, self.waited_ns).with_grant(grant)
    }
}

#[pymethods]
impl PermitPy {
    /// Seconds spent in the queue (arrival to grant, in schedule time).
    #[getter]
    fn waited(&self) -> f64 {
        self.waited_ns as f64 / 1e9
    }

    /// The grant's schedule time, in nanoseconds of the limiter's clock (its
    /// `now_ns()`): when the capacity was taken, whenever the holder woke up.
    #[getter]
    fn granted_at_ns(&self) -> u64 {
        copy_unblocked(&self.grant).at_ns
    }

    /// True once released.
    #[getter]
    fn released(&self) -> bool {
        self.released.load(Ordering::Acquire)
    }

    /// Returns a Concurrency permit now (a rate grant has nothing to return); only the
    /// first call has an effect. Returns True if this call released it.
    pub(crate) fn release(&self) -> bool {
        if self.released.swap(true, Ordering::AcqRel) {
            return false;
        }
        if self.owner.returns_on_exit() && self.granted_here() {
            let costs = copy_unblocked(&self.costs);
            self.owner.give_back(&costs);
        }
        true
    }

    /// Corrects the costs this grant was admitted with (an estimate, e.g. prompt +
    /// max_tokens) to the actual ones: the difference is refunded (never past the
    /// burst) or the overage charged (the bucket may go into debt and delay later
    /// requests until time repays it). Units not named keep their estimate. May be
    /// called again; each call settles against the previous one.
    #[pyo3(signature = (**costs))]
    fn settle(&self, costs: Option<&Bound<'_, PyDict>>) -> PyResult<()> {
        let units = self.owner.units();
        if units.is_empty() {
            return Err(pyo3::exceptions::PyTypeError::new_err(
                "a Concurrency permit has no costs to settle",
            ));
        }
        let mut named = Vec::new();
        if let Some(kw) = costs {
            for (k, v) in kw.iter() {
                let name: String = k.extract()?;
                let i = units.iter().position(|u| *u == name).ok_or_else(|| {
                    pyo3::exceptions::PyTypeError::new_err(format!(
                        "unexpected keyword {name:?}: this limiter counts units {:?}",
                        units
                    ))
                })?;
                named.push((i, crate::args::cost(&name, &v)?));
            }
        }
        // This permit's locks are held across the core call: taken without the GIL.
        unblocked(|| {
            let mut cur = self.costs.lock().unwrap_or_else(|e| e.into_inner());
            let mut actual = cur.clone();
            for &(i, c) in &named {
                actual[i] = c;
            }
            let mut grant = self.grant.lock().unwrap_or_else(|e| e.into_inner());
            *grant = self.owner.settle(&cur, &actual, *grant);
            *cur = actual;
        });
        Ok(())
    }

    /// The costs this permit holds, by unit.
    #[getter]
    fn costs(&self) -> std::collections::HashMap<String, u64> {
        let c = copy_unblocked(&self.costs);
        self.owner.units().iter().cloned().zip(c).collect()
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_exc))]
    fn __exit__(&self, _exc: &Bound<'_, PyTuple>) -> bool {
        self.release();
        false
    }

    fn __repr__(&self) -> String {
        format!("Permit(waited={}, released={})", self.waited(), self.released())
    }
}

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
        Err(PyStopIteration::new_err((self.value.clone_ref(py),)))
    }

    /// Coroutine protocol (so `asyncio.create_task` accepts it): done at once.
    fn send(&self, py: Python<'_>, _value: &Bound<'_, PyAny>) -> PyResult<()> {
        self.__next__(py)
    }

    /// Coroutine protocol: raises what is thrown in (nothing runs inside).
    #[pyo3(signature = (typ, val = None, _tb = None))]
    fn throw(&self, typ: &Bound<'_, PyAny>, val: Option<&Bound<'_, PyAny>>, _tb: Option<&Bound<'_, PyAny>>) -> PyErr {
        thrown(typ, val)
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

/// The result of acquire_async: await it for a Permit, or use `async with`.
#[pyclass(frozen, name = "Acquiring", module = "ratequeue")]
pub struct AcquiringPy {
    gate: Arc<Gate>,
    costs: Vec<u64>,
    class: usize,
    timeout_ns: Option<u64>,
    pub(crate) permit: OnceLock<Py<PermitPy>>,
    token: OnceLock<u64>,
    /// The queue's clock reading at the submit (the arrival): grant time = this + wait.
    submitted_ns: OnceLock<u64>,
    /// Who the permit belongs to, when not the queue (e.g. a key of a keyed limiter).
    owner: Option<Arc<dyn PermitOwner>>,
    /// Run when this object goes away (e.g. drop a per-key queue nobody uses).
    on_drop: Option<Box<dyn Fn() + Send + Sync>>,
    /// The wait driven through the coroutine protocol (send/throw/close), once started.
    running: OnceLock<Py<PyAny>>,
}

impl Drop for AcquiringPy {
    fn drop(&mut self) {
        if let Some(f) = self.on_drop.take() {
            f();
        }
    }
}

impl AcquiringPy {
    /// Not started yet: queues when awaited.
    fn new(gate: &Arc<Gate>, costs: &[u64], class: usize, timeout_ns: Option<u64>) -> AcquiringPy {
        AcquiringPy {
            gate: gate.clone(),
            costs: costs.to_vec(),
            class,
            timeout_ns,
            permit: OnceLock::new(),
            token: OnceLock::new(),
            submitted_ns: OnceLock::new(),
            owner: None,
            on_drop: None,
            running: OnceLock::new(),
        }
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
                let _ = a.permit.set(Py::new(
                    py,
                    gate.permit(costs, 0).with_grant(GrantRef { at_ns, token }),
                )?);
            }
            Err(Some(d)) => return Err(to_py(py, gate.queue_error(d))),
            Err(None) => {}
        }
        Ok(a)
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
    match gate.queue.try_now_token(costs, class) {
        Ok((at_ns, token)) => {
            let permit = Py::new(py, gate.permit(costs, 0).with_grant(GrantRef { at_ns, token }))?;
            Ok(Py::new(py, Ready::new(permit.into_any()))?.into_any())
        }
        Err(Some(d)) => Err(to_py(py, gate.queue_error(d))),
        Err(None) => Ok(Py::new(py, AcquiringPy::new(gate, costs, class, timeout_ns))?.into_any()),
    }
}

impl AcquiringPy {
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
        a.owner = Some(owner);
        a.on_drop = Some(on_drop);
        a
    }

    fn make_permit(&self, waited_ns: u64) -> PermitPy {
        let p = match &self.owner {
            Some(o) => PermitPy::new(o.clone(), &self.costs, waited_ns),
            None => self.gate.permit(&self.costs, waited_ns),
        };
        let at_ns = self.submitted_ns.get().map_or(0, |s| s.saturating_add(waited_ns));
        p.with_grant(GrantRef {
            at_ns,
            token: self.token.get().copied(),
        })
    }
}

static AIO_WAIT: PyOnceLock<Py<PyAny>> = PyOnceLock::new();

#[pymethods]
impl AcquiringPy {
    fn __await__(slf: &Bound<'_, Self>) -> PyResult<Py<PyAny>> {
        let py = slf.py();
        if let Some(p) = slf.get().permit.get() {
            return Ok(Py::new(py, Ready::new(p.clone_ref(py).into_any()))?.into_any());
        }
        let wait = AIO_WAIT.import(py, "ratequeue.aio", "_wait")?;
        Ok(wait.call1((slf,))?.call_method0("__await__")?.unbind())
    }

    /// Coroutine protocol (so `asyncio.create_task` accepts it): the first send starts
    /// the wait that `await` would run; later calls drive it.
    #[pyo3(signature = (value, /))]
    fn send(slf: &Bound<'_, Self>, value: &Bound<'_, PyAny>) -> PyResult<Py<PyAny>> {
        Ok(Self::running(slf)?
            .bind(slf.py())
            .call_method1("send", (value,))?
            .unbind())
    }

    /// Coroutine protocol: throws into the wait (a cancel leaves the queue cleanly).
    #[pyo3(signature = (typ, val = None, tb = None, /))]
    fn throw(
        slf: &Bound<'_, Self>,
        typ: &Bound<'_, PyAny>,
        val: Option<&Bound<'_, PyAny>>,
        tb: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Py<PyAny>> {
        let Some(r) = slf.get().running.get() else {
            return Err(thrown(typ, val));
        };
        let args = (typ, val, tb);
        Ok(r.bind(slf.py()).call_method1("throw", args)?.unbind())
    }

    /// Coroutine protocol: closes the wait if it started.
    fn close(slf: &Bound<'_, Self>) -> PyResult<()> {
        if let Some(r) = slf.get().running.get() {
            r.bind(slf.py()).call_method0("close")?;
        }
        Ok(())
    }

    fn __aenter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_exc))]
    fn __aexit__(&self, py: Python<'_>, _exc: &Bound<'_, PyTuple>) -> PyResult<Py<Ready>> {
        if let Some(p) = self.permit.get() {
            p.get().release();
        }
        done_false(py)
    }

    /// Queues on `channel`: returns a Permit if granted at once, else the ticket.
    /// Raises RuntimeError on a closed channel (its outcomes would never be seen).
    fn _submit(&self, py: Python<'_>, channel: &Bound<'_, ChannelPy>) -> PyResult<Py<PyAny>> {
        let chan = channel.get().inner.clone();
        if chan.is_closed() {
            return Err(pyo3::exceptions::PyRuntimeError::new_err("the channel is closed"));
        }
        let submitted = py.detach(|| {
            self.gate
                .queue
                .submit_dated(&self.costs, self.class, self.timeout_ns, || Wake::Channel(chan))
        });
        if let Ok((_, now)) = submitted {
            let _ = self.submitted_ns.set(now);
        }
        match submitted.map(|(s, _)| s) {
            Ok(Submitted::Granted { .. }) => Ok(self._granted(py, 0, None)?.into_any()),
            Ok(Submitted::Queued(t)) => Ok(t.into_pyobject(py)?.into_any().unbind()),
            Err(e) => Err(to_py(py, e)),
        }
    }

    /// The permit of a grant after waiting `waited_ns` (`token` identifies the grant,
    /// for an exact give-back if its waiter is cancelled before using it).
    #[pyo3(signature = (waited_ns, token = None))]
    fn _granted(&self, py: Python<'_>, waited_ns: u64, token: Option<u64>) -> PyResult<Py<PermitPy>> {
        if let Some(t) = token {
            let _ = self.token.set(t);
        }
        let p = Py::new(py, self.make_permit(waited_ns))?;
        let _ = self.permit.set(p.clone_ref(py));
        Ok(p)
    }

    /// The WaitTimeout for a wait that expired after `waited_ns`.
    fn _timeout_error(&self, py: Python<'_>, waited_ns: u64) -> PyErr {
        to_py(
            py,
            Error::WaitTimeout {
                waited_ns,
                retry_after_ns: py.detach(|| self.gate.queue.retry_after_ns(&self.costs)),
            },
        )
    }

    /// Removes the ticket from the queue; False if it was already decided.
    fn _cancel(&self, py: Python<'_>, ticket: u64) -> bool {
        py.detach(|| self.gate.queue.cancel(ticket)) == Cancelled::Removed
    }

    /// Gives back, exactly once, a grant whose permit was delivered to a waiter that was
    /// cancelled before it could use it (the permit is marked released).
    fn _abandon(&self, permit: &Bound<'_, PermitPy>) {
        if !permit.get().released.swap(true, Ordering::AcqRel) && permit.get().granted_here() {
            let token = self.token.get().copied();
            unblocked(|| self.gate.queue.give_back(&self.costs, token));
        }
    }

    /// Gives back a grant that arrived after its waiter was cancelled (see
    /// Resource::give_back for when a rate keeps it instead).
    #[pyo3(signature = (token = None))]
    fn _give_back(&self, token: Option<u64>) {
        let token = token.or_else(|| self.token.get().copied());
        unblocked(|| self.gate.queue.give_back(&self.costs, token));
    }
}

impl AcquiringPy {
    /// The iterator `await` runs, made once (for the coroutine protocol).
    fn running(slf: &Bound<'_, Self>) -> PyResult<Py<PyAny>> {
        let py = slf.py();
        if let Some(r) = slf.get().running.get() {
            return Ok(r.clone_ref(py));
        }
        let it = Self::__await__(slf)?;
        Ok(slf.get().running.get_or_init(|| it).clone_ref(py))
    }
}

/// Outcomes for one event loop, signalled through a wake-up descriptor the channel
/// owns (the loop reads it, never closes it).
#[pyclass(frozen, name = "Channel", module = "ratequeue")]
pub struct ChannelPy {
    pub(crate) inner: Arc<Channel>,
}

#[pymethods]
impl ChannelPy {
    /// With `wakeup`, a channel whose descriptor (`fileno()`) becomes readable when
    /// outcomes arrive; without, it never signals and the owner drains it after each
    /// step (virtual time).
    #[new]
    #[pyo3(signature = (*, wakeup = false))]
    fn new(wakeup: bool) -> PyResult<Self> {
        // A new channel registers for fork safety: without the GIL.
        let inner = unblocked(|| {
            if wakeup {
                Channel::with_wakeup()
            } else {
                Ok(Channel::new())
            }
        })
        .map_err(PyErr::from)?;
        Ok(ChannelPy { inner })
    }

    /// The descriptor to watch for readability (owned by the channel: do not close it).
    fn fileno(&self) -> PyResult<i32> {
        self.inner
            .fileno()
            .ok_or_else(|| pyo3::exceptions::PyValueError::new_err("this channel has no wake-up descriptor"))
    }

    /// Outcomes since the last drain: (ticket, granted, waited_ns).
    fn drain(&self, py: Python<'_>) -> Vec<(u64, bool, u64)> {
        self.drain_tokens(py)
            .into_iter()
            .map(|(t, g, w, _)| (t, g, w))
            .collect()
    }

    /// Outcomes since the last drain with each grant's token: (ticket, granted,
    /// waited_ns, token); clears the descriptor's signal.
    fn drain_tokens(&self, py: Python<'_>) -> Vec<(u64, bool, u64, u64)> {
        let c = &self.inner;
        outcome_tuples(c.try_drain().unwrap_or_else(|| py.detach(|| c.drain())))
    }

    /// Closes the channel: later outcomes go back to their queues (a grant is given
    /// back there). Returns the outcomes delivered but not drained, as drain_tokens;
    /// their grants are the caller's to give back.
    fn close(&self, py: Python<'_>) -> Vec<(u64, bool, u64, u64)> {
        let c = &self.inner;
        outcome_tuples(c.try_close().unwrap_or_else(|| py.detach(|| c.close())))
    }

    /// True once closed.
    #[getter]
    fn closed(&self) -> bool {
        self.inner.is_closed()
    }
}

fn outcome_tuples(v: Vec<(u64, Outcome)>) -> Vec<(u64, bool, u64, u64)> {
    v.into_iter()
        .map(|(t, o)| match o {
            Outcome::Granted { waited_ns, token, .. } => (t, true, waited_ns, token),
            Outcome::TimedOut { waited_ns } => (t, false, waited_ns, 0),
        })
        .collect()
}

/// The live queue-wait histogram of a class (None: the first class).
pub fn wait_histogram(gate: &Gate, priority: Option<&Bound<'_, PyAny>>) -> PyResult<HistogramPy> {
    let class = gate.class(priority)?;
    let h = gate.queue.wait_histogram(class).expect("class index checked");
    Ok(HistogramPy { inner: h.clone() })
}

/// Submits without blocking: a Permit when granted at once, else the ticket whose
/// outcome arrives in `channel` (drain it); raises like acquire when refused.
pub fn submit(
    py: Python<'_>,
    gate: &Arc<Gate>,
    channel: &Bound<'_, ChannelPy>,
    costs: &[u64],
    class: usize,
    timeout_ns: Option<u64>,
) -> PyResult<Py<PyAny>> {
    let a = AcquiringPy::start(py, gate, costs, class, timeout_ns)?;
    if let Some(p) = a.permit.get() {
        return Ok(p.clone_ref(py).into_any());
    }
    a._submit(py, channel)
}

/// Shared stats of queue owners (Limiter, Concurrency): counters, depths and a copy of
/// each class's wait histogram, in one snapshot.
pub fn queue_stats<'py>(py: Python<'py>, q: &WaitQueue) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    let c = q.counts();
    let depths_now = py.detach(|| q.depths());
    d.set_item("waiting", q.waiting())?;
    d.set_item("tried_admitted", c.tried_admitted)?;
    d.set_item("tried_refused", c.tried_refused)?;
    d.set_item("immediate", c.immediate)?;
    d.set_item("queued_grants", c.queued_grants)?;
    d.set_item("refused_full", c.refused_full)?;
    d.set_item("refused_deadline", c.refused_deadline)?;
    d.set_item("timed_out", c.timed_out)?;
    d.set_item("cancelled", c.cancelled)?;
    let depths = PyDict::new(py);
    for ((name, _), n) in q.config().classes.iter().zip(depths_now) {
        depths.set_item(name, n)?;
    }
    d.set_item("depths", depths)?;
    let waits = PyDict::new(py);
    for (i, (name, _)) in q.config().classes.iter().enumerate() {
        if let Some(h) = q.wait_histogram(i) {
            let copy = ratequeue_core::Histogram::new();
            copy.add_snapshot(&h.snapshot());
            waits.set_item(name, HistogramPy { inner: Arc::new(copy) })?;
        }
    }
    d.set_item("wait", waits)?;
    Ok(d)
}
