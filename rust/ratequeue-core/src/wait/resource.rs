//! The interface a queue waits on (rate capacity or permits) and the private schedule
//! copy a prediction plays forward.

use super::*;

/// What a queue hands out: rate capacity (a [`crate::Limiter`]) or permits (a semaphore).
pub trait Resource: Send + Sync {
    /// Takes `costs` now if possible, without looking at the queue.
    fn try_take(&self, now_ns: u64, costs: &[u64]) -> Result<(), Deny>;
    /// [`Resource::try_take`], with a token of the grant when the resource can give
    /// capacity back exactly (see [`Resource::take_at`]).
    fn try_take_token(&self, now_ns: u64, costs: &[u64]) -> Result<Option<u64>, Deny> {
        self.try_take(now_ns, costs).map(|_| None)
    }
    /// [`Resource::try_take_token`] without waiting for a lock: None (nothing changed)
    /// when one it needs is busy.
    #[inline]
    fn try_take_token_nowait(&self, now_ns: u64, costs: &[u64]) -> Option<Result<Option<u64>, Deny>> {
        Some(self.try_take_token(now_ns, costs))
    }
    /// [`Resource::try_take_token_nowait`] for a fast path that checked that nobody
    /// waits: after the take, `joined()` is asked once more and, when someone joined
    /// meanwhile, the take is undone (exactly while it is the latest change, else by the
    /// one undo rule) and refused with `Deny::Wait(0)`, so no time promised to a joiner
    /// moves. By default (resources that promise no time) the take is not re-checked.
    #[inline]
    fn try_take_token_idle_nowait(
        &self,
        now_ns: u64,
        costs: &[u64],
        _joined: &dyn Fn() -> bool,
    ) -> Option<Result<Option<u64>, Deny>> {
        self.try_take_token_nowait(now_ns, costs)
    }
    /// The earliest time ≥ `at_ns` at which `costs` could be taken, or `None` when it
    /// depends on a release rather than on time.
    fn ready_at(&self, at_ns: u64, costs: &[u64]) -> Result<Option<u64>, Deny>;
    /// Takes `costs` at `at_ns` (a schedule time, possibly in the past); Err if not
    /// possible. Ok carries a token that identifies the state right after the grant.
    fn take_at(&self, at_ns: u64, costs: &[u64]) -> Result<u64, Deny>;
    /// Debits `costs` at `at_ns` whatever the conformance (an overage settled after its
    /// grant, possibly into debt). Only resources that schedule in time are charged;
    /// others ignore it.
    fn charge_at(&self, _at_ns: u64, _costs: &[u64]) {}
    /// Gives back what a grant took and was never used, by the one undo rule
    /// ([`crate::Bucket::give_back`]): with the grant's `token`, exactly while nothing
    /// came after it on any rate; otherwise refunded only while no grant is scheduled in
    /// the future (returning it under a later one would let a newcomer reuse a slot
    /// already used), else kept and counted; permits always come back.
    fn give_back(&self, costs: &[u64], token: Option<u64>);
    /// False when readiness depends on releases rather than on time (semaphores): a
    /// grant then happens at the time of the poll that finds the resource free.
    fn schedules_in_time(&self) -> bool {
        true
    }
    /// Corrects a grant's `estimated` costs to the `actual` ones: refunds the difference
    /// by the one undo rule (exact while the grant's token says nothing came after it,
    /// else capped by what a debit taken at `grant.at_ns` can still hold) or charges the
    /// overage (possibly debt). Returns the grant as it stands for a later settle.
    fn settle(&self, _estimated: &[u64], _actual: &[u64], grant: GrantRef) -> GrantRef {
        grant
    }
    /// [`Resource::settle`] without waiting for a lock: None (nothing changed) when it
    /// would have to wait for one (by default always: a resource opts in).
    fn try_settle(&self, _estimated: &[u64], _actual: &[u64], _grant: GrantRef) -> Option<GrantRef> {
        None
    }
    /// Service time of `costs` in nanoseconds, for fair shares across classes.
    fn service_ns(&self, costs: &[u64]) -> f64;
    /// The error a denial stands for.
    fn error_for(&self, d: Deny) -> Error;
    /// Earliest time at which `ahead` (queued costs) and then `costs` could all be taken,
    /// if predictable from time alone.
    fn predict(&self, now_ns: u64, ahead: &[u64], costs: &[u64]) -> Option<u64>;
    /// A private copy of the schedule as it stands at `now_ns`, to play a backlog
    /// forward; None when grants depend on releases, not on time (the default).
    fn sim(&self, _now_ns: u64) -> Option<Sim> {
        None
    }
    /// Grant time of `costs` once `backlog` has been served by the joint FIFO schedule:
    /// each waiter at the latest conformance time over the rates and every rate debited
    /// at that time (a charge debited without waiting for conformance). By default
    /// [`Resource::predict`] of the summed backlog (exact for one rate without promised
    /// times).
    fn predict_backlog(&self, now_ns: u64, backlog: &[Queued<'_>], costs: &[u64]) -> Option<u64> {
        let mut ahead = vec![0u128; costs.len()];
        let mut due = now_ns;
        for Queued { costs: c, due: d, .. } in backlog {
            for (a, x) in ahead.iter_mut().zip(c.iter()) {
                *a += *x as u128;
            }
            due = due.max(d.unwrap_or(0));
        }
        self.predict(now_ns, &saturated(&ahead), costs).map(|t| t.max(due))
    }
}

/// One queued waiter as a prediction sees it.
#[derive(Clone, Copy, Debug)]
pub struct Queued<'a> {
    /// Its cost per unit.
    pub costs: &'a [u64],
    /// A reservation's promised time (or a charge's earliest time): debited no earlier.
    pub due: Option<u64>,
    /// An overage charge: debited in turn without waiting for conformance.
    pub charge: bool,
}

/// A private copy of a rate resource's schedule (one bucket per rate), to play a queue
/// forward without touching it.
#[derive(Clone, Debug)]
pub struct Sim {
    buckets: Vec<crate::bucket::SimBucket>,
    unit: Vec<usize>,
}

impl Sim {
    pub(crate) fn new(buckets: Vec<crate::bucket::SimBucket>, unit: Vec<usize>) -> Sim {
        Sim { buckets, unit }
    }

    /// When `q`, considered from `from` (no earlier than its promised time), would be
    /// granted: every rate conforming, or at once for a charge. None: never.
    pub(super) fn ready(&self, from: u64, q: &Queued<'_>) -> Option<u64> {
        let from = from.max(q.due.unwrap_or(0));
        if q.charge {
            return Some(from);
        }
        let mut at = from;
        for (b, u) in self.buckets.iter().zip(&self.unit) {
            at = at.max(b.ready(from, q.costs[*u])?);
        }
        Some(at)
    }

    /// Debits `costs` at `at_ns` on every rate.
    pub(super) fn take(&mut self, at_ns: u64, costs: &[u64]) {
        for (b, u) in self.buckets.iter_mut().zip(&self.unit) {
            b.take(at_ns, costs[*u]);
        }
    }

    /// True when `costs` debited at `at_ns`, then `promised` served in order (each at
    /// its earliest time, no earlier than its promised one), leaves every promised time
    /// reachable.
    pub(super) fn keeps(mut self, at_ns: u64, costs: &[u64], promised: &[Queued<'_>]) -> bool {
        self.take(at_ns, costs);
        let mut t = at_ns;
        for q in promised {
            let Some(at) = self.ready(t, q) else { return false };
            // A charge promised nobody anything: it may be debited later.
            if !q.charge && q.due.is_some_and(|d| at > d) {
                return false;
            }
            self.take(at, q.costs);
            t = at;
        }
        true
    }
}

/// Cost totals as a resource reads them: past u64::MAX they can never be served anyway.
pub(super) fn saturated(totals: &[u128]) -> Vec<u64> {
    totals.iter().map(|t| u64::try_from(*t).unwrap_or(u64::MAX)).collect()
}
