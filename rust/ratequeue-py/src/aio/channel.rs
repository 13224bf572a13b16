//! The event-loop channel (a queue's grants delivered to the loop in one batch) and
//! the loop's table of waiting futures, resolved natively.

use super::*;

/// Where a queue delivers the outcomes of waits submitted with `submit(channel, ...)`:
/// for an event loop other than asyncio (its reader watches `fileno()` and drains), or
/// for virtual time (drained after each step). asyncio's own channel is made by
/// `ratequeue.aio`.
#[pyclass(frozen, name = "Channel", module = "ratequeue")]
pub struct ChannelPy {
    pub(crate) inner: Arc<Channel>,
    /// The awaitables queued natively on this channel (see [`LoopWaitersPy`]).
    pub(super) native: Native,
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
            native: Native::default(),
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
        let mut native = std::mem::take(&mut *lock(&self.native));
        let mut rest = Vec::new();
        for (t, o) in undelivered {
            match native.remove(&t) {
                Some(sh) => {
                    if let Outcome::Granted { token, .. } = o {
                        sh.give_back(Some(token));
                    }
                }
                None => rest.push((t, o)),
            }
        }
        for (t, sh) in native {
            // Not queued any more: decided after the close, and given back in the core.
            unblocked(|| sh.gate.queue.cancel(t));
        }
        outcome_tuples(rest)
    }

    /// True once closed.
    #[getter]
    fn closed(&self) -> bool {
        self.inner.is_closed()
    }

    /// How many awaitables of `acquire_async` wait on this channel for an outcome.
    #[getter]
    fn pending(&self) -> usize {
        lock(&self.native).len()
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

/// The loop's side of a channel: the future of each natively queued awaitable.
pub(crate) struct LoopSide {
    pub(super) chan: Arc<Channel>,
    pub(super) native: Native,
    pub(super) futs: Mutex<ByTicket<Py<PyAny>>>,
}

/// The futures an event loop's tasks wait on, by ticket, and the native resolve of a
/// batch of outcomes (owned by the loop's reader; the garbage collector sees the futures).
#[pyclass(frozen, weakref, name = "_LoopWaiters", module = "ratequeue")]
pub struct LoopWaitersPy {
    pub(super) inner: Arc<LoopSide>,
}

#[pymethods]
impl LoopWaitersPy {
    /// The loop's side of `channel`.
    #[new]
    fn new(channel: &Bound<'_, ChannelPy>) -> Self {
        let c = channel.get();
        LoopWaitersPy {
            inner: Arc::new(LoopSide {
                chan: c.inner.clone(),
                native: c.native.clone(),
                futs: Mutex::new(ByTicket::default()),
            }),
        }
    }

    /// Drains the channel and resolves the future of every native waiter in it, in
    /// delivery (grant) order: a permit, or WaitTimeout; a grant whose waiter left goes
    /// back. Returns the outcomes of other tickets, as Channel.drain_tokens.
    fn _resolve(&self, py: Python<'_>) -> PyResult<Vec<(u64, bool, u64, u64)>> {
        let side = &self.inner;
        let c = &side.chan;
        let outcomes = c.try_drain().unwrap_or_else(|| py.detach(|| c.drain()));
        let mut rest = Vec::new();
        let mut first_err = None;
        for (t, o) in outcomes {
            let Some(sh) = lock(&side.native).remove(&t) else {
                rest.push((t, o));
                continue;
            };
            let fut = lock(&side.futs).remove(&t);
            if let Err(e) = resolve(py, &sh, fut, o) {
                first_err.get_or_insert(e);
            }
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(outcome_tuples(rest)),
        }
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        // Never wait for the lock here: a busy table is skipped (its futures then look
        // referenced from outside, which only delays their collection).
        if let Ok(futs) = self.inner.futs.try_lock() {
            for f in futs.values() {
                visit.call(f)?;
            }
        }
        Ok(())
    }

    fn __clear__(&self) {
        let futs = std::mem::take(&mut *lock(&self.inner.futs));
        drop(futs);
    }
}

impl Drop for LoopWaitersPy {
    fn drop(&mut self) {
        // The futures are reported by this object alone: none outlives it in the table.
        let futs = std::mem::take(&mut *lock(&self.inner.futs));
        drop(futs);
    }
}

/// Resolves one native waiter's future with its outcome. A grant whose waiter left (its
/// future gone) goes back to its queue; one whose future was cancelled but whose task has
/// not resumed yet is kept as the permit, which the task gives back when the cancellation
/// reaches it (see [`leave`]).
pub(super) fn resolve(py: Python<'_>, sh: &AcqShared, fut: Option<Py<PyAny>>, o: Outcome) -> PyResult<()> {
    let Some(fut) = fut else {
        if let Outcome::Granted { token, .. } = o {
            sh.give_back(Some(token));
        }
        return Ok(());
    };
    let fut = fut.bind(py);
    let set = match o {
        Outcome::Granted { waited_ns, token, .. } => {
            let p = sh.granted(py, waited_ns, Some(token))?;
            fut.call_method1(intern!(py, "set_result"), (p,))
        }
        Outcome::TimedOut { waited_ns } => {
            let e = sh.timeout_error(py, waited_ns);
            fut.call_method1(intern!(py, "set_exception"), (e.into_value(py),))
        }
    };
    match set {
        Ok(_) => Ok(()),
        // Cancelled meanwhile: the task settles it when it resumes.
        Err(_) if fut.call_method0(intern!(py, "done"))?.is_truthy()? => Ok(()),
        Err(e) => Err(e),
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
    let a = AcquiringPy::start(py, gate, costs, class, timeout_ns)?;
    if let Some(p) = a.permit() {
        return Ok(p.clone_ref(py).into_any());
    }
    a.submit(py, channel)
}
