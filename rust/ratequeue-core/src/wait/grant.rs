//! Polling: grants in schedule time and expired deadlines.

use super::*;

impl WaitQueue {
    /// Grants and expires everything due at `now`; returns the next wake-up time.
    pub fn poll(self: &Arc<Self>, now: u64) -> Option<u64> {
        self.drop_inherited();
        match self.poll_and_unlock(lock(&self.inner), now) {
            (next, false) => next,
            // Grants handed back by gone waiters may have moved the next due time.
            (_, true) => self.next_wake(),
        }
    }

    /// Grants and expires what is due at `now` with the lock held, delivers the outcomes
    /// in grant order, releases the lock, asks the driver for the next due time and gives
    /// back the grants of waiters that are gone. Returns the next due time and whether
    /// any grant was given back.
    pub(super) fn poll_and_unlock(self: &Arc<Self>, g: MutexGuard<'_, Inner>, now: u64) -> (Option<u64>, bool) {
        self.poll_and_unlock_then(g, now, |_| {})
    }

    /// [`WaitQueue::poll_and_unlock`], running `then` under the lock after the poll,
    /// before the head is timed and the driver's next wake-up chosen.
    pub(super) fn poll_and_unlock_then(
        self: &Arc<Self>,
        mut g: MutexGuard<'_, Inner>,
        now: u64,
        then: impl FnOnce(&mut Inner),
    ) -> (Option<u64>, bool) {
        let mut out = Vec::new();
        self.poll_locked(&mut g, now, &mut out);
        then(&mut g);
        let (next, driver) = self.wakes_locked(&g);
        let gone = deliver(out);
        drop(g);
        if let Some(t) = driver {
            let _ = self.schedule(t);
        }
        let any_gone = !gone.is_empty();
        self.give_back_gone(gone);
        (next, any_gone)
    }

    /// Polls at the clock's current time.
    pub fn poll_now(self: &Arc<Self>) -> Option<u64> {
        self.poll(self.clock.now_ns())
    }

    /// When something will next be due (a grant or a deadline), if anything waits.
    pub fn next_wake(&self) -> Option<u64> {
        self.next_wake_locked(&lock(&self.inner))
    }

    pub(super) fn head(&self, g: &Inner) -> Option<(usize, u64)> {
        let mut best: Option<(f64, usize, u64)> = None;
        for (i, c) in g.classes.iter().enumerate() {
            if let Some((t, w)) = c.waiters.first_key_value() {
                if best.is_none_or(|(s, _, bt)| w.start_tag < s || (w.start_tag == s && *t < bt)) {
                    best = Some((w.start_tag, i, *t));
                }
            }
        }
        best.map(|(_, i, t)| (i, t))
    }

    /// The waiter to grant next and when. With several classes, while reservations hold
    /// promised times, the class of the first one goes first (its head, in FIFO order)
    /// when that promised time has come, or when granting the fair-share head of another
    /// class would leave some promised time unreachable: a reservation was promised the
    /// drain time of the backlog ahead of it, and later arrivals of other classes must
    /// not make it, or the waiters ahead of it in its class, late.
    pub(super) fn head_time(&self, g: &Inner) -> Option<(usize, u64, Option<u64>)> {
        let (ci, t) = self.head(g)?;
        let at = self.ready_time(g, ci, t);
        if let Some(&(due, rt)) = g.reserved.first() {
            let rci = g.where_is[&rt];
            if g.classes.len() > 1
                && rci != ci
                && (at.is_none_or(|a| due <= a) || at.is_some_and(|a| !self.keeps_promises(g, ci, t, a)))
            {
                let (&ht, _) = g.classes[rci].waiters.first_key_value()?;
                return Some((rci, ht, self.ready_time(g, rci, ht)));
            }
        }
        Some((ci, t, at))
    }

    /// True when the waiter `t` of class `ci`, granted at `at_ns`, leaves every queued
    /// reservation its promised time, with the waiters ahead of it in its class served
    /// first in FIFO order.
    pub(super) fn keeps_promises(&self, g: &Inner, ci: usize, t: u64, at_ns: u64) -> bool {
        let Some(sim) = self.resource.sim(at_ns) else {
            return true;
        };
        let rest = g
            .classes
            .iter()
            .map(|c| c.waiters.iter().map(|(t, w)| (*t, w.queued())));
        sim.keeps(at_ns, &g.classes[ci].waiters[&t].costs, &promised(rest, (ci, t)))
    }

    pub(super) fn ready_time(&self, g: &Inner, ci: usize, t: u64) -> Option<u64> {
        let w = &g.classes[ci].waiters[&t];
        // A queued reservation is debited at its promised time, never earlier: its holder
        // uses it then, and an earlier debit would let a later grant share its slot.
        let from = w.arrival_ns.max(g.last_grant_ns).max(w.due_ns.unwrap_or(0));
        if matches!(w.wake, Wake::Nobody) {
            return Some(from); // a charge needs no conformance
        }
        self.resource.ready_at(from, &w.costs).ok().flatten()
    }

    pub(super) fn next_wake_locked(&self, g: &Inner) -> Option<u64> {
        self.wakes_locked(g).0
    }

    /// When something will next be due (a grant or a deadline), and when the driver must
    /// look: at that time, unless it is the grant of a self-timed thread at the head,
    /// whose timer is set here to its grant time (it wakes and polls by itself, see
    /// [`WaitQueue::wait_slot`]; deadlines stay the driver's).
    pub(super) fn wakes_locked(&self, g: &Inner) -> (Option<u64>, Option<u64>) {
        let head = self.head_time(g);
        let grant = head.and_then(|(_, _, at)| at);
        let deadline = g.deadlines.first().map(|(d, _)| *d);
        let mut timed = false;
        let mut thread_next = false;
        if let Some((ci, t, Some(at))) = head {
            if let Wake::Thread(s) = &g.classes[ci].waiters[&t].wake {
                if s.self_timed {
                    if s.timer.load(Ordering::Acquire) != at {
                        s.set_timer(at);
                    }
                    timed = s.present.load(Ordering::Acquire);
                }
                if !timed {
                    // A blocked thread granted next is woken precisely (see Driver::schedule).
                    thread_next = deadline.is_none_or(|d| at <= d);
                }
            }
        }
        self.thread_next.store(thread_next, Ordering::Relaxed);
        let next = match (grant, deadline) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        // A timed head's thread may be runnable and not running: when waiters behind it
        // count on its poll (not self-timed, or self-timed but woken before their turn and
        // waiting untimed: another class served first, a pause, a slower rate), the driver
        // polls in its place past TAKEOVER_NS of lateness. Self-timed threads behind it
        // that are still timed poll at their own times: no driver for them.
        let takeover = g.others > 0 || !g.untimed.is_empty();
        let driver_grant = if timed {
            grant.filter(|_| takeover).map(|a| a.saturating_add(TAKEOVER_NS))
        } else {
            grant
        };
        let driver = match (driver_grant, deadline) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        (next, driver)
    }

    pub(super) fn poll_locked(&self, g: &mut Inner, now: u64, out: &mut Deliveries) {
        let mut raced = 0;
        loop {
            let grant = self.head_time(g);
            let deadline = g.deadlines.first().copied();
            // A grant of permits happens at the poll that finds them free: that is its time.
            let in_time = self.resource.schedules_in_time();
            let grant_due = grant.and_then(|(ci, t, at)| {
                at.filter(|a| *a <= now)
                    .map(|a| (ci, t, if in_time { a } else { now.max(a) }))
            });
            match (grant_due, deadline) {
                (Some((ci, t, at)), d) if d.is_none_or(|(dl, dt)| at <= dl || dt == t) => {
                    let w = &g.classes[ci].waiters[&t];
                    if w.deadline_ns.is_some_and(|dl| at > dl) {
                        self.expire(g, ci, t, out);
                        continue;
                    }
                    if matches!(w.wake, Wake::Nobody) {
                        self.resource.charge_at(at, &w.costs);
                        self.remove(g, ci, t);
                        g.last_grant_ns = g.last_grant_ns.max(at);
                        continue;
                    }
                    let Ok(token) = self.resource.take_at(at, &w.costs) else {
                        // A fast-path caller took the capacity first: look again, and
                        // leave it to the next wake-up if that keeps happening.
                        raced += 1;
                        if raced > 8 {
                            return;
                        }
                        continue;
                    };
                    let in_turn = self.head(g).is_some_and(|(_, h)| h == t);
                    let w = self.remove(g, ci, t);
                    if in_turn {
                        g.vtime = w.start_tag;
                    }
                    g.last_grant_ns = g.last_grant_ns.max(at);
                    bump(&self.counters.queued_grants);
                    let waited = at.saturating_sub(w.arrival_ns);
                    self.waits[ci].record(waited);
                    out.push((
                        w.wake,
                        t,
                        Outcome::Granted {
                            at_ns: at,
                            waited_ns: waited,
                            token,
                        },
                        w.costs,
                    ));
                }
                (_, Some((dl, t))) if dl <= now => {
                    let ci = g.where_is[&t];
                    self.expire(g, ci, t, out);
                }
                _ => return,
            }
        }
    }

    pub(super) fn expire(&self, g: &mut Inner, ci: usize, t: u64, out: &mut Deliveries) {
        let w = self.remove(g, ci, t);
        bump(&self.counters.timed_out);
        let waited = w.deadline_ns.unwrap_or(w.arrival_ns).saturating_sub(w.arrival_ns);
        out.push((w.wake, t, Outcome::TimedOut { waited_ns: waited }, w.costs));
    }

    pub(super) fn remove(&self, g: &mut Inner, ci: usize, t: u64) -> Waiter {
        let c = &mut g.classes[ci];
        let w = c.waiters.remove(&t).expect("ticket is queued in its class");
        for (q, x) in c.queued.iter_mut().zip(w.costs.iter()) {
            *q -= *x as u128;
        }
        if c.waiters.is_empty() {
            // An idle class restarts from the current virtual time, not from its past.
            c.last_finish = g.vtime;
        }
        g.where_is.remove(&t);
        if let Some(d) = w.deadline_ns {
            g.deadlines.remove(&(d, t));
        }
        if let Some(d) = w.due_ns {
            g.reserved.remove(&(d, t));
            if !matches!(w.wake, Wake::Nobody) {
                Self::retime_charges(g);
            }
        }
        g.len -= 1;
        g.others -= usize::from(!w.wake.is_self_timed());
        if !g.untimed.is_empty() {
            g.untimed.remove(&t);
        }
        self.waiting.store(g.len, Ordering::Release);
        w
    }

    /// Overage charges wait only for the promises still held: after a reservation left,
    /// none waits past the last promised time that is left (with none left, a charge is
    /// an ordinary waiter that needs no conformance).
    pub(super) fn retime_charges(g: &mut Inner) {
        let (last, late) = charges_to_retime(&g.reserved, |t| {
            matches!(g.classes[g.where_is[&t]].waiters[&t].wake, Wake::Nobody)
        });
        for (d, t) in late {
            g.reserved.remove(&(d, t));
            if let Some(last) = last {
                g.reserved.insert((last, t));
            }
            let ci = g.where_is[&t];
            if let Some(w) = g.classes[ci].waiters.get_mut(&t) {
                w.due_ns = last;
            }
        }
    }
}
