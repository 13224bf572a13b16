//! Reservations: a promised grant time, debited by the queue at that time.

use super::*;

impl WaitQueue {
    /// Without taking the queue's lock: `Some(now_path(now))` when nobody waits (the
    /// resource reserves by itself, e.g. a GCRA debit at the Lindley time), `None` when
    /// someone does (then call [`WaitQueue::reserve`], which may block on the lock).
    /// A reservation that raced someone joining (see [`WaitQueue::joined`]) is handed to
    /// `undo` and `None` returned.
    #[inline]
    pub fn reserve_if_idle<R>(
        &self,
        now_path: impl FnOnce(u64) -> Result<R, Error>,
        undo: impl FnOnce(R),
    ) -> Option<Result<R, Error>> {
        if self.waiting() != 0 {
            return None;
        }
        match now_path(self.clock.now_ns()) {
            Ok(r) if self.joined() => {
                undo(r);
                None
            }
            other => Some(other),
        }
    }

    /// Reserves `costs` in arrival order without barging, under the queue's lock (see
    /// [`WaitQueue::reserve_if_idle`] for the lock-free try): when nobody waits, returns
    /// what `now_path(now)` reserves; otherwise joins `class` behind the waiters, within
    /// the queue's bounds (`max_queue`, and `timeout_ns` or max_wait: `Overloaded` at once
    /// when the predicted wait exceeds it), and is granted — the resource debited — at
    /// its schedule time like any waiter, its outcome kept in the returned handle. Its
    /// `at_ns` is exact with one class (the FIFO schedule), a prediction with several.
    pub fn reserve<R>(
        self: &Arc<Self>,
        costs: &[u64],
        class: usize,
        timeout_ns: Option<u64>,
        now_path: impl FnOnce(u64) -> Result<R, Error>,
    ) -> Result<Reserved<R>, Error> {
        if class >= self.config.classes.len() {
            return Err(Error::invalid("priority", class, "is not a class of this limiter"));
        }
        let max_wait = timeout_ns.or(self.config.max_wait_ns);
        self.drop_inherited();
        self.join_locked(
            |g, now| {
                if g.len == 0 {
                    now_path(now).map(Reserved::Now)
                } else {
                    self.enqueue_reservation(g, now, costs, class, max_wait)
                        .map(Reserved::Queued)
                }
            },
            |r| matches!(r, Ok(Reserved::Queued(_))),
        )
    }

    /// A join decided under the queue's lock: grants what is due now, then
    /// `decide(g, now)` (the resource's own path when nobody is left queued, else a
    /// place in the queue), announced to the fast paths while it decides, even if it
    /// panics ([`WaitQueue::decide_announced`]); when `queued(result)`, the driver is asked for the next
    /// wake-up once the lock is released. Outcomes are delivered under the lock, grants
    /// of gone waiters given back after it.
    fn join_locked<T>(
        self: &Arc<Self>,
        decide: impl FnOnce(&mut Inner, u64) -> T,
        queued: impl FnOnce(&T) -> bool,
    ) -> T {
        let mut g = lock(&self.inner);
        let now = self.clock.now_ns();
        let mut out = Vec::new();
        self.poll_locked(&mut g, now, &mut out);
        let result = self.decide_announced(&mut g, |g| decide(g, now));
        // A poll that granted a self-timed thread may have made a new head (see `submit_locked`).
        let next = (submit::self_timed_among(&out) || queued(&result))
            .then(|| self.wakes_locked(&g).1)
            .flatten();
        let gone = deliver(out);
        drop(g);
        if let Some(t) = next {
            // Without a driver the wake-up stays pending for the next one that starts.
            let _ = self.schedule(t);
        }
        self.give_back_gone(gone);
        result
    }

    pub(super) fn enqueue_reservation(
        &self,
        g: &mut Inner,
        now: u64,
        costs: &[u64],
        class: usize,
        max_wait: Option<u64>,
    ) -> Result<QueuedReservation, Error> {
        let at = self.backlog_time(g, now, costs)?;
        let wait = at.saturating_sub(now);
        self.has_room(g, wait)?;
        if let Some(mw) = max_wait.filter(|mw| wait > *mw) {
            bump(&self.counters.refused_deadline);
            return Err(Error::Overloaded {
                reason: format!(
                    "the predicted wait of {:.6} s exceeds max_wait={:.6} s",
                    wait as f64 / 1e9,
                    mw as f64 / 1e9
                ),
                retry_after_ns: wait - mw,
            });
        }
        Ok(self.insert_reservation(g, now, costs, class, at))
    }

    /// When `costs` would be granted behind everyone queued now; an error for a cost
    /// the resource can never grant, or for a resource whose grants are not scheduled
    /// in time (permits: nothing to promise).
    fn backlog_time(&self, g: &Inner, now: u64, costs: &[u64]) -> Result<u64, Error> {
        let at = match self.resource.ready_at(now, costs) {
            Err(d) => return Err(self.deny_error(d)),
            Ok(None) => None,
            Ok(Some(_)) => self.predict_all(g, now, costs),
        };
        at.ok_or_else(|| {
            Error::invalid(
                "reserve",
                "a permit resource",
                "needs a resource whose grants are scheduled in time",
            )
        })
    }

    /// `Overloaded` (counted) when the queue holds `max_queue` waiters already.
    fn has_room(&self, g: &Inner, retry_after_ns: u64) -> Result<(), Error> {
        if g.len < self.config.max_queue {
            return Ok(());
        }
        bump(&self.counters.refused_full);
        Err(Error::Overloaded {
            reason: format!(
                "the queue is full ({} waiting, max_queue={})",
                g.len, self.config.max_queue
            ),
            retry_after_ns,
        })
    }

    /// Queues a reservation promised `at_ns`, debited by the queue at that time.
    fn insert_reservation(
        &self,
        g: &mut Inner,
        now: u64,
        costs: &[u64],
        class: usize,
        at_ns: u64,
    ) -> QueuedReservation {
        let slot = Slot::new();
        let ticket = self.insert_locked(g, now, costs, class, None, Some(at_ns), Wake::Thread(slot.clone()));
        QueuedReservation {
            ticket,
            at_ns,
            delay_ns: at_ns.saturating_sub(now),
            slot,
        }
    }

    /// Cancels a queued reservation (once): before its grant it leaves the queue and
    /// the waiters behind it move up; granted before its promised time (waiters ahead
    /// left), the grant goes through [`WaitQueue::give_back`] (the one undo rule); at or
    /// after that time it is kept (conservative: the caller may have used it). True when
    /// it left the queue or its grant was handed back.
    pub fn cancel_reservation(self: &Arc<Self>, r: &QueuedReservation, costs: &[u64]) -> bool {
        if self.cancel(r.ticket) == Cancelled::Removed {
            return true;
        }
        match r.slot.take() {
            Some(Outcome::Granted { token, .. }) if self.clock.now_ns() < r.at_ns => {
                self.give_back(costs, Some(token));
                true
            }
            _ => false,
        }
    }

    /// The earliest time `costs` could be granted behind everyone queued now (None when
    /// nobody waits or it depends on releases), read under the queue's lock.
    pub fn backlog_ready_at(&self, costs: &[u64]) -> Result<Option<u64>, Deny> {
        let now = self.clock.now_ns();
        let g = lock(&self.inner);
        self.resource.ready_at(now, costs)?;
        Ok(if g.len == 0 {
            None
        } else {
            self.predict_all(&g, now, costs)
        })
    }

    /// Joins the queue for a grant at exactly `at_ns` (a policy's common grant time over
    /// several levels), never ahead of anyone queued: when nobody waits, `now_path(at_ns)`
    /// debits for that time under the queue's lock (nobody can queue in between); otherwise a
    /// reservation joins `class` behind the waiters, debited by the queue at `at_ns`.
    /// [`Joined::Later`] (nothing held) when the backlog ahead needs until a later time.
    pub fn reserve_at<R>(
        self: &Arc<Self>,
        costs: &[u64],
        class: usize,
        at_ns: u64,
        now_path: impl FnOnce(u64) -> Result<R, Deny>,
    ) -> Result<Joined<R>, Error> {
        if class >= self.config.classes.len() {
            return Err(Error::invalid("priority", class, "is not a class of this limiter"));
        }
        self.drop_inherited();
        self.join_locked(
            |g, now| {
                if g.len != 0 {
                    return self.join_at_locked(g, now, costs, class, at_ns);
                }
                match now_path(at_ns) {
                    Ok(r) => Ok(Joined::Held(Reserved::Now(r))),
                    Err(Deny::Wait(d)) => Ok(Joined::Later(at_ns.saturating_add(d.max(1)))),
                    Err(d) => Err(self.deny_error(d)),
                }
            },
            |r| matches!(r, Ok(Joined::Held(Reserved::Queued(_)))),
        )
    }

    pub(super) fn join_at_locked<R>(
        &self,
        g: &mut Inner,
        now: u64,
        costs: &[u64],
        class: usize,
        at_ns: u64,
    ) -> Result<Joined<R>, Error> {
        let ready = self.backlog_time(g, now, costs)?;
        if ready > at_ns {
            return Ok(Joined::Later(ready));
        }
        self.has_room(g, ready.saturating_sub(now))?;
        Ok(Joined::Held(Reserved::Queued(
            self.insert_reservation(g, now, costs, class, at_ns),
        )))
    }
}
