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
    /// the reservation past it): it joins the queue as a charge debited in turn, no
    /// earlier than the last promised time, behind every waiter already queued. A later
    /// refund of any grant first cancels such pending charges (giving back later is
    /// never less strict than giving back now).
    pub fn settle(self: &Arc<Self>, estimated: &[u64], actual: &[u64], grant: GrantRef) -> GrantRef {
        if self.waiting() == 0 {
            let grant = self.resource.settle(estimated, actual, grant);
            if actual.iter().zip(estimated).any(|(a, e)| a < e) {
                self.poll_now();
            }
            return grant;
        }
        let mut g = lock(&self.inner);
        let now = self.clock.now_ns();
        let mut actual = actual.to_vec();
        for (u, (a, e)) in actual.iter_mut().zip(estimated).enumerate() {
            if *a < *e {
                *a += self.absorb_charges(&mut g, u, *e - *a);
            }
        }
        let last_due = g.reserved.last().map(|(d, _)| *d);
        let over: Vec<u64> = actual
            .iter()
            .zip(estimated)
            .map(|(a, e)| a.saturating_sub(*e))
            .collect();
        let deferred = last_due.filter(|_| self.resource.schedules_in_time() && over.iter().any(|x| *x > 0));
        if deferred.is_some() {
            for (a, e) in actual.iter_mut().zip(estimated) {
                *a = (*a).min(*e);
            }
        }
        let mut grant = self.resource.settle(estimated, &actual, grant);
        if let Some(due) = deferred {
            self.insert_locked(&mut g, now, &over, 0, None, Some(due), Wake::Nobody);
            // The permit's costs now include an overage not debited yet: no exact undo.
            grant.token = None;
        }
        self.poll_and_unlock(g, now);
        grant
    }

    /// Cancels up to `ret` units of unit `u` from the overage charges still queued;
    /// returns how many.
    pub(super) fn absorb_charges(&self, g: &mut Inner, u: usize, ret: u64) -> u64 {
        let mut left = ret;
        let charges: Vec<(usize, u64)> = g
            .classes
            .iter()
            .enumerate()
            .flat_map(|(ci, c)| {
                c.waiters
                    .iter()
                    .filter(|(_, w)| matches!(w.wake, Wake::Nobody))
                    .map(move |(t, _)| (ci, *t))
            })
            .collect();
        for (ci, t) in charges {
            if left == 0 {
                break;
            }
            let c = &mut g.classes[ci];
            let w = c.waiters.get_mut(&t).expect("a charge is queued in its class");
            let take = w.costs[u].min(left);
            w.costs[u] -= take;
            c.queued[u] -= take as u128;
            left -= take;
            if w.costs.iter().all(|x| *x == 0) {
                self.remove(g, ci, t);
            }
        }
        ret - left
    }

    /// [`WaitQueue::settle`] without waiting for a lock: None (nothing changed) when the
    /// queue's lock or one the resource needs is busy, or when waiters are queued (an
    /// overage may then have to join the queue: settle through the waiting call).
    pub fn try_settle(self: &Arc<Self>, estimated: &[u64], actual: &[u64], grant: GrantRef) -> Option<GrantRef> {
        if self.waiting() != 0 {
            return None;
        }
        if !actual.iter().zip(estimated).any(|(a, e)| a < e) {
            return self.resource.try_settle(estimated, actual, grant);
        }
        // A refund may let a waiter through: the queue is polled under the lock held here.
        let mut g = match self.inner.try_lock() {
            Ok(g) => g,
            Err(std::sync::TryLockError::Poisoned(e)) => e.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return None,
        };
        self.forget_inherited(&mut g);
        if g.len != 0 {
            return None;
        }
        let grant = self.resource.try_settle(estimated, actual, grant)?;
        self.poll_and_unlock(g, self.clock.now_ns());
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
type GivingBack = (bool, Vec<(Arc<WaitQueue>, Box<[u64]>, u64)>);

thread_local! {
    pub(super) static GIVING_BACK: std::cell::RefCell<GivingBack> = const { std::cell::RefCell::new((false, Vec::new())) };
}
