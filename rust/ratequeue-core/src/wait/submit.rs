//! Admission at once, or a place in the queue.

use super::*;

/// The rest of a submission decided under the queue's lock: asking the driver for a
/// wake-up and giving back grants of gone waiters.
#[must_use = "finish() completes the submission"]
pub struct SubmitTail {
    queue: Arc<WaitQueue>,
    result: Result<Submitted, Error>,
    next: Option<u64>,
    gone: Gone,
    now: u64,
}

impl SubmitTail {
    fn refused(q: &Arc<WaitQueue>, e: Error) -> SubmitTail {
        SubmitTail {
            queue: q.clone(),
            result: Err(e),
            next: None,
            gone: Vec::new(),
            now: 0,
        }
    }

    /// True when finishing takes no lock (no grant to give back, and a wake-up at the
    /// time asked for is already pending with a running driver): nothing to wait for,
    /// save in a narrow race with the driver's own short lock, which never waits for
    /// anything else.
    pub fn is_light(&self) -> bool {
        self.gone.is_empty() && self.next.is_none_or(|t| self.queue.wake_pending_by(t))
    }

    /// Completes the submission: its outcome, dated by the clock reading it decided at.
    pub fn finish(self) -> Result<(Submitted, u64), Error> {
        let SubmitTail {
            queue,
            result,
            next,
            gone,
            now,
        } = self;
        let mut refused = None;
        if let Some(t) = next {
            if let Err(e) = queue.schedule(t) {
                // Nothing would ever wake this waiter: refuse it instead.
                if let Ok(Submitted::Queued(ticket)) = result {
                    if queue.cancel(ticket) == Cancelled::Removed {
                        refused = Some(e);
                    }
                }
            }
        }
        queue.give_back_gone(gone);
        match refused {
            Some(e) => Err(e),
            None => result.map(|r| (r, now)),
        }
    }
}

/// True when `out` delivers to a self-timed thread (whose grant the driver was not asked for).
pub(super) fn self_timed_among(out: &Deliveries) -> bool {
    out.iter()
        .any(|(w, ..)| matches!(w, Wake::Thread(s) if s.is_self_timed()))
}

impl WaitQueue {
    /// The fast path: grants now if nobody waits and the resource admits. No allocation,
    /// and no wait for a lock. `Err(None)`: must queue (or a lock was busy: `submit`
    /// decides); `Err(Some(e))`: can never be granted.
    #[inline]
    pub fn try_now(self: &Arc<Self>, costs: &[u64], class: usize) -> Result<u64, Option<Deny>> {
        self.try_now_token(costs, class).map(|(now, _)| now)
    }

    /// [`WaitQueue::try_now`], with the grant's token (see [`Resource::try_take_token`]).
    /// A take undone for a joiner asks the driver to look again here, which may wait for
    /// the driver's lock: a caller holding a host lock (Python's GIL) uses
    /// [`WaitQueue::try_now_token_then`].
    #[inline]
    pub fn try_now_token(self: &Arc<Self>, costs: &[u64], class: usize) -> Result<(u64, Option<u64>), Option<Deny>> {
        self.try_now_token_then(costs, class, |q| q.rewake_after_undo())
    }

    /// [`WaitQueue::try_now_token`], calling `undone(self)` (for
    /// [`WaitQueue::rewake_after_undo`], run where it may wait for a lock) when the take
    /// was undone for a joiner in its window.
    #[inline]
    pub fn try_now_token_then(
        self: &Arc<Self>,
        costs: &[u64],
        class: usize,
        undone: impl FnOnce(&Arc<Self>),
    ) -> Result<(u64, Option<u64>), Option<Deny>> {
        if self.waiting() != 0 {
            return Err(None);
        }
        let now = self.clock.now_ns();
        let raced = std::cell::Cell::new(false);
        let joined = || {
            let j = self.joined();
            raced.set(j);
            j
        };
        let Some(taken) = self.resource.try_take_token_idle_nowait(now, costs, &joined) else {
            return Err(None);
        };
        match taken {
            Ok(token) => {
                bump(&self.counters.immediate);
                if let Some(h) = self.waits.get(class) {
                    h.record(0);
                }
                Ok((now, token))
            }
            Err(Deny::Wait(_)) => {
                if raced.get() {
                    // The undone take may let the joiner through earlier than it was told.
                    undone(self);
                }
                Err(None)
            }
            Err(d) => Err(Some(d)),
        }
    }

    /// Admits at once, queues, or refuses. `timeout_ns` overrides the configured
    /// max_wait; `wake` is called only if the request is queued.
    pub fn submit(
        self: &Arc<Self>,
        costs: &[u64],
        class: usize,
        timeout_ns: Option<u64>,
        wake: impl FnOnce() -> Wake,
    ) -> Result<Submitted, Error> {
        self.submit_dated(costs, class, timeout_ns, wake).map(|(s, _)| s)
    }

    /// [`WaitQueue::submit`], with the clock reading it decided at: a queued waiter's
    /// arrival, so its grant's schedule time is exactly that plus its `waited_ns`.
    pub fn submit_dated(
        self: &Arc<Self>,
        costs: &[u64],
        class: usize,
        timeout_ns: Option<u64>,
        wake: impl FnOnce() -> Wake,
    ) -> Result<(Submitted, u64), Error> {
        if class >= self.config.classes.len() {
            return Err(Error::invalid("priority", class, "is not a class of this limiter"));
        }
        self.drop_inherited();
        let g = lock(&self.inner);
        self.submit_locked(g, costs, class, timeout_ns, wake).finish()
    }

    /// [`WaitQueue::submit_dated`] without waiting for the queue's lock: None (nothing
    /// done) when it is busy. The decision is made; what is left ([`SubmitTail::finish`])
    /// may ask the driver for a wake-up or give back grants, which can wait for a lock
    /// unless [`SubmitTail::is_light`].
    pub fn try_submit_dated(
        self: &Arc<Self>,
        costs: &[u64],
        class: usize,
        timeout_ns: Option<u64>,
        wake: impl FnOnce() -> Wake,
    ) -> Option<SubmitTail> {
        if class >= self.config.classes.len() {
            return Some(SubmitTail::refused(
                self,
                Error::invalid("priority", class, "is not a class of this limiter"),
            ));
        }
        if self.generation.load(Ordering::Acquire) != crate::fork::generation() {
            return None;
        }
        let g = match self.inner.try_lock() {
            Ok(g) => g,
            Err(std::sync::TryLockError::Poisoned(e)) => e.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return None,
        };
        Some(self.submit_locked(g, costs, class, timeout_ns, wake))
    }

    pub(super) fn submit_locked(
        self: &Arc<Self>,
        mut g: MutexGuard<'_, Inner>,
        costs: &[u64],
        class: usize,
        timeout_ns: Option<u64>,
        wake: impl FnOnce() -> Wake,
    ) -> SubmitTail {
        // Read under the lock: arrivals are dated in the order they join the queue.
        let now = self.clock.now_ns();
        let max_wait = timeout_ns.or(self.config.max_wait_ns);
        let mut out = Vec::new();
        self.poll_locked(&mut g, now, &mut out);
        let bound = if timeout_ns.is_some() { "timeout" } else { "max_wait" };
        let result = self.decide_announced(&mut g, |g| {
            self.enqueue_locked(g, now, costs, class, (max_wait, bound), wake)
        });
        // A poll that granted or expired a self-timed thread may have made a new head,
        // and no driver wake-up was pending for the old one.
        let next = if self_timed_among(&out) || result.as_ref().is_ok_and(|s| matches!(s, Submitted::Queued(_))) {
            self.wakes_locked(&g).1
        } else {
            None
        };
        // Delivered under the lock: grants reach their waiters in grant order, whichever
        // thread made them (slots and channels are leaf locks; nothing here waits).
        let gone = deliver(out);
        drop(g);
        SubmitTail {
            queue: self.clone(),
            result,
            next,
            gone,
            now,
        }
    }

    pub(super) fn enqueue_locked(
        &self,
        g: &mut Inner,
        now: u64,
        costs: &[u64],
        class: usize,
        (max_wait, bound): (Option<u64>, &str),
        wake: impl FnOnce() -> Wake,
    ) -> Result<Submitted, Error> {
        if g.len == 0 {
            match self.resource.try_take(now, costs) {
                Ok(()) => {
                    bump(&self.counters.immediate);
                    self.waits[class].record(0);
                    g.last_grant_ns = g.last_grant_ns.max(now);
                    return Ok(Submitted::Granted { at_ns: now });
                }
                Err(Deny::Wait(_)) => {}
                Err(d) => return Err(self.deny_error(d)),
            }
        } else if let Err(d @ Deny::TooLarge { .. }) = self.resource.ready_at(now, costs) {
            return Err(self.deny_error(d));
        }
        if g.len >= self.config.max_queue {
            bump(&self.counters.refused_full);
            let retry = self.predict_all(g, now, costs).map_or(0, |t| t.saturating_sub(now));
            return Err(Error::Overloaded {
                reason: format!(
                    "the queue is full ({} waiting, max_queue={})",
                    g.len, self.config.max_queue
                ),
                retry_after_ns: retry,
            });
        }
        if let Some(mw) = max_wait {
            // With one class the FIFO wait is known now; with several, the own class's
            // backlog is a lower bound. Refuse at once what would surely miss its deadline.
            let ahead = saturated(&g.classes[class].queued);
            if let Some(t) = self.resource.predict(now.max(g.last_grant_ns), &ahead, costs) {
                let wait = t.saturating_sub(now);
                if wait > mw {
                    bump(&self.counters.refused_deadline);
                    return Err(Error::Overloaded {
                        reason: format!(
                            "the predicted wait of {:.6} s exceeds {bound}={:.6} s",
                            wait as f64 / 1e9,
                            mw as f64 / 1e9
                        ),
                        retry_after_ns: wait - mw,
                    });
                }
            }
        }
        if max_wait == Some(0) {
            // A deadline that has already passed on this clock: fail now, whichever clock.
            bump(&self.counters.timed_out);
            return Err(Error::WaitTimeout {
                waited_ns: 0,
                retry_after_ns: self.predict_all(g, now, costs).map_or(0, |t| t.saturating_sub(now)),
            });
        }
        let deadline = max_wait.map(|mw| now.saturating_add(mw));
        let wake = wake();
        if let Wake::Thread(s) = &wake {
            if s.self_timed {
                // Its turn behind the backlog of its class (exact for one class; with
                // several an early estimate, corrected once it is the head).
                let ahead = saturated(&g.classes[class].queued);
                if let Some(t) = self.resource.predict(now.max(g.last_grant_ns), &ahead, costs) {
                    s.set_timer(t);
                }
            }
        }
        let ticket = self.insert_locked(g, now, costs, class, deadline, None, wake);
        Ok(Submitted::Queued(ticket))
    }

    /// Queues a waiter at the tail of `class`; returns its ticket.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn insert_locked(
        &self,
        g: &mut Inner,
        now: u64,
        costs: &[u64],
        class: usize,
        deadline: Option<u64>,
        due: Option<u64>,
        wake: Wake,
    ) -> u64 {
        let ticket = NEXT_TICKET.fetch_add(1, Ordering::Relaxed);
        let c = &mut g.classes[class];
        let start = c.last_finish.max(g.vtime);
        c.last_finish = start + self.resource.service_ns(costs) / c.weight;
        for (q, x) in c.queued.iter_mut().zip(costs) {
            *q += *x as u128;
        }
        c.waiters.insert(
            ticket,
            Waiter {
                costs: Costs::new(costs),
                arrival_ns: now,
                deadline_ns: deadline,
                due_ns: due,
                start_tag: start,
                wake,
            },
        );
        g.where_is.insert(ticket, class);
        if let Some(d) = deadline {
            g.deadlines.insert((d, ticket));
        }
        if let Some(d) = due {
            g.reserved.insert((d, ticket));
        }
        g.len += 1;
        g.others += usize::from(!g.classes[class].waiters[&ticket].wake.is_self_timed());
        self.waiting.store(g.len, Ordering::Release);
        ticket
    }
}
