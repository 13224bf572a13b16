//! One key of a keyed limit as the resource a wait queue hands out (waiting per key).

use super::*;

/// One key of a [`KeyedLimiter`] as a queue resource (waiting per key).
pub struct KeyBucket {
    /// The map.
    pub keyed: std::sync::Arc<KeyedLimiter>,
    /// The hashed key.
    pub key: u64,
}

impl crate::wait::Resource for KeyBucket {
    fn try_take(&self, now_ns: u64, costs: &[u64]) -> Result<(), Deny> {
        self.keyed.take(self.key, now_ns, costs[0], 0).map(|_| ())
    }

    fn ready_at(&self, at_ns: u64, costs: &[u64]) -> Result<Option<u64>, Deny> {
        // Never before capacity given back since: it was not free at an earlier time.
        let at = at_ns.max(self.keyed.given_at());
        Ok(Some(at.saturating_add(self.keyed.delay_for(self.key, at, costs[0])?)))
    }

    fn take_at(&self, at_ns: u64, costs: &[u64]) -> Result<u64, Deny> {
        self.keyed
            .take_with(self.key, at_ns, costs[0], 0, true)
            .map(|t| t.token())
    }

    fn charge_at(&self, at_ns: u64, costs: &[u64]) {
        self.keyed.charge_at(self.key, at_ns, costs[0]);
    }

    fn give_back(&self, costs: &[u64], token: Option<u64>) {
        match token {
            Some(token) => {
                let mut t = KeyTaken::from_token(self.key, token, costs[0]);
                self.keyed.give_back(&mut t, costs[0], self.keyed.clock.now_ns());
            }
            None => {
                self.keyed.refund(self.key, costs[0]);
            }
        }
    }

    fn try_take_token(&self, now_ns: u64, costs: &[u64]) -> Result<Option<u64>, Deny> {
        self.keyed.take(self.key, now_ns, costs[0], 0).map(|t| Some(t.token()))
    }

    fn try_take_token_nowait(&self, now_ns: u64, costs: &[u64]) -> Option<Result<Option<u64>, Deny>> {
        self.keyed
            .take_nowait(self.key, now_ns, costs[0], 0)
            .map(|r| r.map(|t| Some(t.token())))
    }

    fn try_take_token_idle_nowait(
        &self,
        now_ns: u64,
        costs: &[u64],
        joined: &dyn Fn() -> bool,
    ) -> Option<Result<Option<u64>, Deny>> {
        self.keyed
            .take_idle_nowait(self.key, now_ns, costs[0], joined)
            .map(|r| r.map(|t| Some(t.token())))
    }

    fn settle(&self, estimated: &[u64], actual: &[u64], grant: GrantRef) -> GrantRef {
        let (e, a) = (estimated[0], actual[0]);
        let now = self.keyed.clock.now_ns();
        // Without a token: capped by what a debit of `e` taken at `grant.at_ns` holds.
        let held = self.keyed.held_token(self.key, grant.at_ns.saturating_sub(1), e);
        let mut t = KeyTaken::from_token(self.key, grant.token.unwrap_or(held), e).bound_by(held);
        if grant.token.is_none() {
            t.latest = false;
            t.evictions = UNKNOWN_EVICTIONS;
        }
        if a < e {
            self.keyed.give_back(&mut t, e - a, now);
        } else if a > e {
            self.keyed.charge_more(&mut t, a - e, now);
        }
        GrantRef {
            at_ns: grant.at_ns,
            token: t.latest.then_some(t.token()),
            owed: None,
        }
    }

    fn service_ns(&self, costs: &[u64]) -> f64 {
        costs[0] as f64 * self.keyed.rate().interval_ns()
    }

    fn error_for(&self, d: Deny) -> Error {
        match d {
            Deny::TooLarge { cost, burst, .. } => Error::CostTooLarge {
                unit: "per key".into(),
                cost,
                burst,
            },
            Deny::Wait(ns) => Error::Overloaded {
                reason: "not admitted".into(),
                retry_after_ns: ns,
            },
        }
    }

    fn predict(&self, now_ns: u64, ahead: &[u64], costs: &[u64]) -> Option<u64> {
        Some(self.keyed.predict(self.key, now_ns, ahead[0].saturating_add(costs[0])))
    }

    /// The FIFO schedule played forward on a copy of the key's bucket, each queued
    /// reservation debited no earlier than its promised time (a summed prediction would
    /// count the capacity a bucket cannot keep while it waits for that time).
    fn predict_backlog(&self, now_ns: u64, backlog: &[crate::wait::Queued<'_>], costs: &[u64]) -> Option<u64> {
        let mut sim = self.keyed.sim_at(self.key, now_ns);
        let mut t = now_ns;
        let me = crate::wait::Queued {
            costs,
            due: None,
            charge: false,
        };
        for q in backlog.iter().copied().chain(std::iter::once(me)) {
            let from = t.max(q.due.unwrap_or(0));
            // An overage charge is debited in turn without waiting for conformance.
            t = if q.charge { from } else { sim.ready(from, q.costs[0])? };
            sim.take(t, q.costs[0]);
        }
        Some(t)
    }
}

/// One key of a [`KeyedSemaphore`] as a queue resource.
pub struct KeyPermits {
    /// The map.
    pub sem: std::sync::Arc<KeyedSemaphore>,
    /// The hashed key.
    pub key: u64,
}

impl crate::wait::Resource for KeyPermits {
    fn try_take(&self, _now_ns: u64, costs: &[u64]) -> Result<(), Deny> {
        self.sem.try_take(self.key, costs[0])
    }

    fn try_take_token_nowait(&self, _now_ns: u64, costs: &[u64]) -> Option<Result<Option<u64>, Deny>> {
        self.sem.try_take_nowait(self.key, costs[0]).map(|r| r.map(|_| None))
    }

    fn ready_at(&self, at_ns: u64, costs: &[u64]) -> Result<Option<u64>, Deny> {
        if costs[0] > self.sem.limit() {
            return Err(Deny::TooLarge {
                cost: costs[0],
                burst: self.sem.limit(),
                unit: 0,
            });
        }
        Ok(crate::concurrency::fits(self.sem.in_use(self.key), costs[0], self.sem.limit()).then_some(at_ns))
    }

    fn take_at(&self, at_ns: u64, costs: &[u64]) -> Result<u64, Deny> {
        self.try_take(at_ns, costs).map(|_| 0)
    }

    fn schedules_in_time(&self) -> bool {
        false
    }

    fn give_back(&self, costs: &[u64], _token: Option<u64>) {
        self.sem.release(self.key, costs[0]);
    }

    fn service_ns(&self, costs: &[u64]) -> f64 {
        costs[0] as f64
    }

    fn error_for(&self, d: Deny) -> Error {
        crate::concurrency::permits_error(d)
    }

    fn predict(&self, _now_ns: u64, _ahead: &[u64], _costs: &[u64]) -> Option<u64> {
        None
    }
}
