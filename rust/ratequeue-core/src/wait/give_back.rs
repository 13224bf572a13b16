//! Cancel, settle and give-back: what a waiter or a grant returns, exactly once.

use super::*;

impl WaitQueue {
    /// Removes a queued waiter; `NotQueued` when it was already granted or expired
    /// (its outcome is in its wake; a grant must then be given back by the caller
    /// through [`WaitQueue::give_back`]).
    pub fn cancel(self: &Arc<Self>, ticket: u64) -> Cancelled {
        let mut g = lock(&self.inner);
        let Some(ci) = g.where_is.get(&ticket).copied() else {
            return Cancelled::NotQueued;
        };
        self.remove(&mut g, ci, ticket);
        bump(&self.counters.cancelled);
        // The head may have changed: whoever behind it can be granted now is.
        self.poll_and_unlock(g, self.clock.now_ns());
        Cancelled::Removed
    }

    /// Settles a grant's estimated costs to the actual ones (see [`Resource::settle`]),
    /// then grants whoever a refund lets through; returns the grant as it now stands.
    ///
    /// While queued reservations hold promised times, an overage is not charged at once
    /// (that would push the waiters ahead of a reservation onto its promised time, or
    /// the reservation past it): it joins the queue as this grant's charge, debited in
    /// turn no earlier than the last promised time, behind every waiter already queued
    /// (`owed` in the returned grant). Settled down later, the grant first cancels what it
    /// still owes; only the rest is refunded, by the one undo rule on what the resource
    /// holds of it (its estimate less what it owes, which was never debited).
    pub fn settle(self: &Arc<Self>, estimated: &[u64], actual: &[u64], grant: GrantRef) -> GrantRef {
        let (mut out, owed) = self.settle_by(estimated, actual, grant.owed, |held, keep| {
            self.resource.settle(held, keep, GrantRef { owed: None, ..grant })
        });
        if owed.is_some() {
            // The grant's costs include what it owes, not debited yet: no exact undo.
            out.token = None;
        }
        out.owed = owed;
        out
    }

    /// [`WaitQueue::settle`] of a debit held elsewhere (a policy's): `owed` is the ticket
    /// of what it still owes in this queue; `debit(held, keep)` settles the debit itself
    /// from what it holds to what it should hold (under the queue's lock, but for a
    /// refund while nobody is queued). Returns what `debit` returned and the ticket of
    /// what the debit owes now.
    pub fn settle_by<R>(
        self: &Arc<Self>,
        estimated: &[u64],
        actual: &[u64],
        owed: Option<u64>,
        debit: impl FnOnce(&[u64], &[u64]) -> R,
    ) -> (R, Option<u64>) {
        // Without the lock only a refund (it never moves a promised time later): an
        // overage is decided under it, or a reservation joining meanwhile could be
        // promised a time the charge then takes. Nothing queued and nothing owed: a
        // charge leaves the queue only once debited.
        if self.waiting() == 0 && owed.is_none() && actual.iter().zip(estimated).all(|(a, e)| a <= e) {
            let r = debit(estimated, actual);
            if actual.iter().zip(estimated).any(|(a, e)| a < e) {
                self.poll_now();
            }
            return (r, None);
        }
        let mut g = lock(&self.inner);
        let now = self.clock.now_ns();
        let out = self.settle_locked(&mut g, now, estimated, actual, owed, |_, held, keep| debit(held, keep));
        self.poll_and_unlock(g, now);
        out
    }

    /// Settles the queued reservation `ticket` before its grant, from `estimated` (what
    /// it holds: its queued costs and what it owes, `owed`) to `actual`, as
    /// [`WaitQueue::settle_by`] settles a debit: a settle down cancels what it owes
    /// first, then lowers what its grant will debit; an overage is owed behind the
    /// waiters queued now. Returns the ticket of what it owes now, or None (nothing
    /// changed) when it is no longer queued: granted (its outcome is in its slot: settle
    /// the grant) or gone.
    pub fn settle_queued(
        self: &Arc<Self>,
        ticket: u64,
        estimated: &[u64],
        actual: &[u64],
        owed: Option<u64>,
    ) -> Option<Option<u64>> {
        self.drop_inherited();
        let mut g = lock(&self.inner);
        if !g.where_is.contains_key(&ticket) {
            return None;
        }
        let now = self.clock.now_ns();
        let ((), owes) = self.settle_locked(&mut g, now, estimated, actual, owed, |g, _, keep| {
            Self::set_costs(g, ticket, keep)
        });
        self.poll_and_unlock(g, now);
        Some(owes)
    }

    /// The locked part of a settle: cancels what `owed` still owes of a refund, then
    /// `debit(g, held, keep)` settles what the debit holds (its estimate less what it
    /// owes) to what it should hold (with the overage, unless that is owed behind the
    /// promised reservations). Returns what `debit` returned and the ticket of what the
    /// debit owes now.
    fn settle_locked<R>(
        &self,
        g: &mut Inner,
        now: u64,
        estimated: &[u64],
        actual: &[u64],
        owed: Option<u64>,
        debit: impl FnOnce(&mut Inner, &[u64], &[u64]) -> R,
    ) -> (R, Option<u64>) {
        // In a forked child, what the debit owed at the fork was dropped with the queue:
        // it holds its estimate less that, and settles from there.
        let in_child: Vec<u64>;
        let estimated = match owed.and_then(|t| g.forgiven.remove(&t)) {
            Some(f) => {
                in_child = estimated
                    .iter()
                    .zip(f.iter())
                    .map(|(e, f)| e.saturating_sub(*f))
                    .collect();
                &in_child[..]
            }
            None => estimated,
        };
        let owed_ticket = owed.filter(|t| g.where_is.contains_key(t));
        let owed: Vec<u64> = match owed_ticket {
            Some(t) => g.classes[g.where_is[&t]].waiters[&t].costs.to_vec(),
            None => vec![0; estimated.len()],
        };
        // What the resource holds of the grant, and what it should hold.
        let held: Vec<u64> = estimated.iter().zip(&owed).map(|(e, o)| e.saturating_sub(*o)).collect();
        let mut keep: Vec<u64> = held.iter().zip(actual).map(|(h, a)| (*h).min(*a)).collect();
        let cancel: Vec<u64> = (0..estimated.len())
            .map(|u| estimated[u].saturating_sub(actual[u]).min(owed[u]))
            .collect();
        let over: Vec<u64> = actual
            .iter()
            .zip(estimated)
            .map(|(a, e)| a.saturating_sub(*e))
            .collect();
        let mut owed_ticket = owed_ticket;
        if let Some(t) = owed_ticket.filter(|_| cancel.iter().any(|c| *c > 0)) {
            if self.reduce_charge(g, t, &cancel) {
                owed_ticket = None;
            }
        }
        let last_due = g.reserved.last().map(|(d, _)| *d);
        let deferred = last_due.filter(|_| self.resource.schedules_in_time() && over.iter().any(|x| *x > 0));
        if deferred.is_none() {
            for (k, o) in keep.iter_mut().zip(&over) {
                *k = k.saturating_add(*o);
            }
        }
        let out = debit(g, &held, &keep);
        if let Some(due) = deferred {
            // What the grant still owes moves behind every waiter queued now, with the new
            // overage: grown in place, it would land ahead of reservations promised a time
            // since it joined.
            let mut owes = over;
            if let Some(t) = owed_ticket {
                let ci = g.where_is[&t];
                let w = self.remove(g, ci, t);
                for (o, x) in owes.iter_mut().zip(w.costs.iter()) {
                    *o = o.saturating_add(*x);
                }
            }
            owed_ticket = Some(self.insert_locked(g, now, &owes, 0, None, Some(due), Wake::Nobody));
        }
        (out, owed_ticket)
    }

    /// Sets what the queued waiter `t` will be debited at its grant to `costs`.
    fn set_costs(g: &mut Inner, t: u64, costs: &[u64]) {
        let ci = g.where_is[&t];
        let c = &mut g.classes[ci];
        let w = c.waiters.get_mut(&t).expect("a waiter is queued in its class");
        for (u, x) in costs.iter().enumerate() {
            c.queued[u] = c.queued[u] - w.costs[u] as u128 + *x as u128;
            w.costs[u] = *x;
        }
    }

    /// Cancels what a grant still owes here (its queued charge `owed`, if still queued):
    /// an undo gives back everything the grant took, its overage too.
    pub fn cancel_owed(self: &Arc<Self>, owed: u64) {
        let mut g = lock(&self.inner);
        let Some(ci) = g.where_is.get(&owed).copied() else {
            g.forgiven.remove(&owed);
            return;
        };
        if matches!(g.classes[ci].waiters[&owed].wake, Wake::Nobody) {
            self.remove(&mut g, ci, owed);
            self.poll_and_unlock(g, self.clock.now_ns());
        }
    }

    /// Cancels `costs` of the queued charge `t`; true when nothing of it is left.
    pub(super) fn reduce_charge(&self, g: &mut Inner, t: u64, costs: &[u64]) -> bool {
        let ci = g.where_is[&t];
        let c = &mut g.classes[ci];
        let w = c.waiters.get_mut(&t).expect("a charge is queued in its class");
        for (u, x) in costs.iter().enumerate() {
            let x = (*x).min(w.costs[u]);
            w.costs[u] -= x;
            c.queued[u] -= x as u128;
        }
        if w.costs.iter().all(|x| *x == 0) {
            self.remove(g, ci, t);
            return true;
        }
        false
    }

    /// [`WaitQueue::settle`] without waiting for a lock: None (nothing changed) when the
    /// queue's lock or one the resource needs is busy, when the grant owed a charge, or
    /// when anyone is queued (the grant may owe a charge there, or an overage may have
    /// to join it: settle through the waiting call then).
    pub fn try_settle(self: &Arc<Self>, estimated: &[u64], actual: &[u64], grant: GrantRef) -> Option<GrantRef> {
        if self.waiting() != 0 || grant.owed.is_some() {
            return None;
        }
        // Decided under the queue's lock, as a settle is: ordered with any waiter or
        // reservation that joins after it.
        let mut g = match self.inner.try_lock() {
            Ok(g) => g,
            Err(std::sync::TryLockError::Poisoned(e)) => e.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return None,
        };
        self.forget_inherited(&mut g);
        if g.len != 0 {
            return None;
        }
        // Nothing queued, so nothing owed: a charge leaves the queue only once debited.
        let grant = self
            .resource
            .try_settle(estimated, actual, GrantRef { owed: None, ..grant })?;
        if actual.iter().zip(estimated).any(|(a, e)| a < e) {
            // A refund may let a waiter through, but nobody is queued (`len`, read under
            // this lock, held since, is 0): a poll would find nothing due and nothing to
            // time, and only reset the driver's hint, as done here without the poll's code.
            self.thread_next.store(false, Ordering::Relaxed);
        }
        drop(g);
        Some(grant)
    }

    /// Returns what a grant took (a cancelled or unused grant), then grants whoever can
    /// now be granted.
    pub fn give_back(self: &Arc<Self>, costs: &[u64], token: Option<u64>) {
        self.resource.give_back(costs, token);
        self.poll_now();
    }

    /// [`WaitQueue::give_back`] without waiting for the queue's lock: false (nothing
    /// done) when it is busy.
    pub fn try_give_back(self: &Arc<Self>, costs: &[u64], token: Option<u64>) -> bool {
        let mut g = match self.inner.try_lock() {
            Ok(g) => g,
            Err(std::sync::TryLockError::Poisoned(e)) => e.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return false,
        };
        self.forget_inherited(&mut g);
        self.resource.give_back(costs, token);
        self.poll_and_unlock(g, self.clock.now_ns());
        true
    }

    /// Gives back the grants of waiters that are gone (see [`Channel::close`]). The
    /// give-back may grant further gone waiters: they are handled by the outermost call on
    /// this thread, in a loop rather than by recursion.
    pub(super) fn give_back_gone(self: &Arc<Self>, gone: Gone) {
        if gone.is_empty() {
            return;
        }
        let outermost = GIVING_BACK.with(|g| {
            let mut g = g.borrow_mut();
            g.1.extend(gone.into_iter().map(|(c, t)| (self.clone(), c, t)));
            !std::mem::replace(&mut g.0, true)
        });
        if !outermost {
            return;
        }
        struct Done;
        impl Drop for Done {
            fn drop(&mut self) {
                GIVING_BACK.with(|g| g.borrow_mut().0 = false);
            }
        }
        let _done = Done;
        while let Some((q, costs, token)) = GIVING_BACK.with(|g| g.borrow_mut().1.pop()) {
            q.give_back(&costs, Some(token));
        }
    }
}

/// Grants of gone waiters still to give back on this thread, and whether a loop below
/// on the stack is already giving them back.
type GivingBack = (bool, Vec<(Arc<WaitQueue>, Costs, u64)>);

thread_local! {
    pub(super) static GIVING_BACK: std::cell::RefCell<GivingBack> = const { std::cell::RefCell::new((false, Vec::new())) };
}
