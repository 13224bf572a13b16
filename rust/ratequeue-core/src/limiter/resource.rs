//! A limiter as the resource a wait queue hands out: tokens, give-back by the one undo
//! rule, settling, and the predictions of a backlog.

use super::*;
use crate::wait::{GrantRef, Queued, Resource, Sim};

impl Resource for Limiter {
    #[inline]
    fn try_take(&self, now_ns: u64, costs: &[u64]) -> Result<(), Deny> {
        self.try_acquire_at(now_ns, costs)
    }

    fn try_take_token(&self, now_ns: u64, costs: &[u64]) -> Result<Option<u64>, Deny> {
        self.take_token_at(now_ns, costs, false).map(Some)
    }

    #[inline]
    fn try_take_token_nowait(&self, now_ns: u64, costs: &[u64]) -> Option<Result<Option<u64>, Deny>> {
        if self.buckets.len() == 1 {
            return Some(self.try_take_token(now_ns, costs));
        }
        let mut recent = self.try_lock_multi()?;
        Some(
            self.take_all_serial(now_ns, costs, 0, false)
                .map(|r| Some(self.token_of(r, Some(&mut recent)))),
        )
    }

    #[inline]
    fn try_take_token_idle_nowait(
        &self,
        now_ns: u64,
        costs: &[u64],
        joined: &dyn Fn() -> bool,
    ) -> Option<Result<Option<u64>, Deny>> {
        if self.buckets.len() == 1 {
            return Some(self.try_take_one_idle(now_ns, costs, joined).map(Some));
        }
        let mut recent = self.try_lock_multi()?;
        Some(
            self.take_all_idle(now_ns, costs, joined)
                .map(|r| Some(self.token_of(r, Some(&mut recent)))),
        )
    }

    fn ready_at(&self, at_ns: u64, costs: &[u64]) -> Result<Option<u64>, Deny> {
        // Never before capacity given back since: it was not free at an earlier time.
        let at = self.buckets.iter().map(|b| b.given_at()).fold(at_ns, u64::max);
        Ok(Some(at.saturating_add(self.delay_at(at, costs)?)))
    }

    fn take_at(&self, at_ns: u64, costs: &[u64]) -> Result<u64, Deny> {
        self.take_token_at(at_ns, costs, true)
    }

    fn charge_at(&self, at_ns: u64, costs: &[u64]) {
        Limiter::charge_at(self, at_ns, costs);
    }

    fn give_back(&self, costs: &[u64], token: Option<u64>) {
        let now = self.clock.now_ns();
        let Some(token) = token else {
            self.refund(costs);
            return;
        };
        if self.buckets.len() == 1 {
            let mut t = Taken::from_token(token, costs[self.bucket_unit[0]]);
            let ret = t.cost();
            self.note(self.buckets[0].give_back(&mut t, ret, now));
            return;
        }
        let mut recent = self.lock_multi();
        let at = recent.iter().position(|(seq, _)| *seq == token);
        let taken = at.and_then(|k| recent.remove(k)).map(|(_, taken)| taken);
        for (i, b) in self.buckets.iter().enumerate() {
            let c = costs[self.bucket_unit[i]];
            let u = match &taken {
                Some(taken) => {
                    let mut t = taken[i];
                    b.give_back(&mut t, c, now)
                }
                // Forgotten: what it still holds is unknown.
                None if c > 0 => Undo::Dropped,
                None => Undo::Nothing,
            };
            self.note(u);
        }
        self.seq.fetch_add(1, Ordering::AcqRel);
    }

    fn settle(&self, estimated: &[u64], actual: &[u64], grant: GrantRef) -> GrantRef {
        let now = self.clock.now_ns();
        let _serial = self.serial();
        self.settle_serial(now, estimated, actual, grant)
    }

    fn try_settle(&self, estimated: &[u64], actual: &[u64], grant: GrantRef) -> Option<GrantRef> {
        // One rate settles lock-free; several serialise on a lock, taken here only if free.
        let now = self.clock.now_ns();
        let _serial = match self.buckets.len() {
            1 => None,
            _ => Some(self.try_lock_multi()?),
        };
        Some(self.settle_serial(now, estimated, actual, grant))
    }

    fn service_ns(&self, costs: &[u64]) -> f64 {
        self.buckets
            .iter()
            .enumerate()
            .map(|(i, b)| costs[self.bucket_unit[i]] as f64 * b.rate().interval_ns())
            .fold(0.0, f64::max)
    }

    fn error_for(&self, d: Deny) -> Error {
        self.error_for(d, "not admitted")
    }

    fn predict(&self, now_ns: u64, ahead: &[u64], costs: &[u64]) -> Option<u64> {
        let mut t = now_ns;
        for (i, b) in self.buckets.iter().enumerate() {
            let u = self.bucket_unit[i];
            t = t.max(b.predict(now_ns, ahead[u], costs[u]));
        }
        Some(t)
    }

    fn sim(&self, now_ns: u64) -> Option<Sim> {
        Some(Sim::new(
            self.buckets.iter().map(|b| b.sim_at(now_ns)).collect(),
            self.bucket_unit.to_vec(),
        ))
    }

    fn predict_backlog(&self, now_ns: u64, backlog: &[Queued<'_>], costs: &[u64]) -> Option<u64> {
        let mut sims: Vec<_> = self.buckets.iter().map(|b| b.sim_at(now_ns)).collect();
        let mut t = now_ns;
        let last = Queued {
            costs,
            due: None,
            charge: false,
        };
        for Queued { costs: c, due, charge } in backlog.iter().copied().chain(std::iter::once(last)) {
            let from = t.max(due.unwrap_or(0));
            t = from;
            for (i, s) in sims.iter().enumerate().filter(|_| !charge) {
                t = t.max(s.ready(from, c[self.bucket_unit[i]])?);
            }
            for (i, s) in sims.iter_mut().enumerate() {
                s.take(t, c[self.bucket_unit[i]]);
            }
        }
        Some(t)
    }
}

impl Limiter {
    /// [`Resource::settle`]'s body, with the multi-rate lock held (several rates).
    fn settle_serial(&self, now: u64, estimated: &[u64], actual: &[u64], grant: GrantRef) -> GrantRef {
        let exact = match grant.token {
            Some(t) if self.buckets.len() > 1 => self.seq.load(Ordering::Acquire) == t,
            Some(_) => true,
            None => false,
        };
        let mut latest = exact;
        let mut word = 0;
        for (i, b) in self.buckets.iter().enumerate() {
            let u = self.bucket_unit[i];
            let (e, a) = (estimated[u], actual[u]);
            // While exact, the grant's words: the token itself (one rate), or the current
            // words, since nothing changed (several).
            let mut t = match grant.token {
                Some(w) if exact && self.buckets.len() == 1 => Some(Taken::from_token(w, e)),
                Some(_) if exact => Some(Taken::from_token(b.word(), e)),
                _ => None,
            };
            if a < e {
                let u = match &mut t {
                    Some(tk) => match b.give_back(tk, e - a, now) {
                        // The word moved on: a token knows nothing of where its debit sits
                        // now, the grant time does (the same refund as without a token).
                        Undo::Nothing | Undo::Dropped if !tk.is_latest() => b.refund_since(now, e - a, grant.at_ns, e),
                        u => u,
                    },
                    None => b.refund_since(now, e - a, grant.at_ns, e),
                };
                self.note(u);
            } else if a > e {
                match &mut t {
                    Some(t) => b.charge_more(t, a - e, now),
                    None => b.charge(now, a - e),
                }
            }
            latest &= t.is_some_and(|t| t.is_latest());
            word = t.map_or(0, |t| t.after_word());
        }
        let seq = self.seq.fetch_add(1, Ordering::AcqRel) + 1;
        GrantRef {
            at_ns: grant.at_ns,
            token: latest.then_some(if self.buckets.len() == 1 { word } else { seq }),
            owed: None,
        }
    }
}
