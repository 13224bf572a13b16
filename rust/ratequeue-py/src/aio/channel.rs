//! The event-loop channel (a queue's grants delivered to the loop in one batch) and
//! the loop's table of waiting futures, resolved natively.

use super::*;
use crate::errors::panicked;
use ratequeue_core::wait::awaiting::{Begun, Wakeup};
use ratequeue_core::Wake;

/// Where a queue delivers the outcomes of waits submitted with `submit(channel, ...)`:
/// for an event loop other than asyncio (its reader watches `fileno()` and drains), or
/// for virtual time (drained after each step). asyncio's own channel is made by
/// `ratequeue.aio`.
#[pyclass(frozen, name = "Channel", module = "ratequeue")]
pub struct ChannelPy {
    pub(crate) inner: Arc<Channel>,
    /// The awaitables queued natively on this channel (see [`LoopWaitersPy`]).
    pub(super) native: Arc<PyNative>,
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
        Ok(ChannelPy {
            inner,
            native: Arc::default(),
        })
    }

    /// The descriptor to watch for readability (owned by the channel: do not close it).
    fn fileno(&self) -> PyResult<i32> {
        self.inner.fileno().ok_or_else(no_descriptor)
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
    /// back there). Settles the awaitables queued natively on it (a grant delivered to
    /// one is given back, a pending one leaves its queue); returns the other outcomes
    /// delivered but not drained, as drain_tokens: their grants are the caller's to give
    /// back.
    fn close(&self, py: Python<'_>) -> Vec<(u64, bool, u64, u64)> {
        let c = &self.inner;
        let undelivered = c.try_close().unwrap_or_else(|| py.detach(|| c.close()));
        outcome_tuples(self.native.close(&Unblocked, undelivered))
    }

    /// True once closed.
    #[getter]
    fn closed(&self) -> bool {
        self.inner.is_closed()
    }

    /// How many awaitables of `acquire_async` wait on this channel for an outcome.
    #[getter]
    fn pending(&self) -> usize {
        self.native.len()
    }
}

pub(super) fn outcome_tuples(v: Vec<(u64, Outcome)>) -> Vec<(u64, bool, u64, u64)> {
    v.into_iter()
        .map(|(t, o)| match o {
            Outcome::Granted { waited_ns, token, .. } => (t, true, waited_ns, token),
            Outcome::TimedOut { waited_ns } => (t, false, waited_ns, 0),
        })
        .collect()
}

/// The futures an event loop's tasks wait on, by ticket, and the native resolve of a
/// batch of outcomes (owned by the loop's reader; the garbage collector sees the futures).
#[pyclass(frozen, weakref, name = "_LoopWaiters", module = "ratequeue")]
pub struct LoopWaitersPy {
    pub(super) inner: Arc<PyWaits>,
}

#[pymethods]
impl LoopWaitersPy {
    /// The loop's side of `channel`.
    #[new]
    fn new(channel: &Bound<'_, ChannelPy>) -> Self {
        let c = channel.get();
        LoopWaitersPy {
            inner: Arc::new(Waits::new(c.inner.clone(), c.native.clone())),
        }
    }

    /// Drains the channel and resolves the future of every native waiter in it, in
    /// delivery (grant) order: a permit, or WaitTimeout; a grant whose waiter left goes
    /// back. Returns the outcomes of other tickets, as Channel.drain_tokens.
    fn _resolve(&self, py: Python<'_>) -> PyResult<Vec<(u64, bool, u64, u64)>> {
        let w = &self.inner;
        let c = &w.chan;
        let outcomes = c.try_drain().unwrap_or_else(|| py.detach(|| c.drain()));
        let mut host = PyWake { py, err: None };
        let (rest, panic) = w.resolve(&Unblocked, outcomes, &mut host);
        if panic.is_some() {
            return Err(panicked("waking an asyncio task panicked"));
        }
        match host.err {
            Some(e) => Err(e),
            None => Ok(outcome_tuples(rest)),
        }
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        // Never wait for the lock here: a busy table is skipped (its futures then look
        // referenced from outside, which only delays their collection).
        self.inner.visit(|f| visit.call(f)).map(|_| ())
    }

    fn __clear__(&self) {
        self.inner.clear();
    }
}

impl Drop for LoopWaitersPy {
    fn drop(&mut self) {
        // The futures are reported by this object alone: none outlives it in the table.
        self.inner.clear();
    }
}

/// Wakes a task by resolving its future with its grant (kept for it in the core too)
/// or its error; the first failure is kept.
struct PyWake<'py> {
    py: Python<'py>,
    err: Option<PyErr>,
}

impl Wakeup<Py<PyAny>, Py<PyAny>> for PyWake<'_> {
    fn keep(&mut self, grant: &Py<PyAny>) -> Py<PyAny> {
        grant.clone_ref(self.py)
    }

    fn wake(&mut self, fut: Py<PyAny>, r: Result<Option<Py<PyAny>>, ratequeue_core::Error>) {
        let py = self.py;
        let fut = fut.bind(py);
        let set = match r {
            Ok(g) => fut.call_method1(intern!(py, "set_result"), (g,)),
            Err(e) => fut.call_method1(intern!(py, "set_exception"), (to_py(py, e).into_value(py),)),
        };
        let set = match set {
            Ok(_) => Ok(()),
            // Cancelled meanwhile: the task settles the grant when the cancellation
            // reaches it.
            Err(_)
                if fut
                    .call_method0(intern!(py, "done"))
                    .and_then(|d| d.is_truthy())
                    .unwrap_or(false) =>
            {
                Ok(())
            }
            Err(e) => Err(e),
        };
        if let Err(e) = set {
            self.err.get_or_insert(e);
        }
    }
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
    // The driver's lock (after an undone take) is waited for with the GIL released.
    match gate
        .queue
        .try_now_token_then(costs, class, |q| py.detach(|| q.rewake_after_undo()))
    {
        Ok((at_ns, token)) => {
            let p = gate.permit(costs, 0).with_grant(GrantRef::new(at_ns, token));
            return Ok(Py::new(py, p)?.into_any());
        }
        Err(Some(d)) => return Err(to_py(py, gate.queue.error_for(d))),
        Err(None) => {}
    }
    let chan = channel.get().inner.clone();
    if chan.is_closed() {
        return Err(channel_closed());
    }
    let a = LevelAcquire::new(gate, costs, class, timeout_ns);
    match a.submit(&Unblocked, || Wake::Channel(chan)) {
        Ok(Begun::Done(p)) => Ok(Py::new(py, PermitPy::from(p))?.into_any()),
        Ok(Begun::Queued(t)) => Ok(t.into_pyobject(py)?.into_any().unbind()),
        Err(e) => Err(to_py(py, e)),
    }
}
