//! A keyed debit given back or added to: the one undo rule under the shard's lock,
//! refunds and charges (overages) on a key, and the token a refund is capped by.

use std::sync::atomic::Ordering;

use super::{KeyTaken, KeyedLimiter, ERA_MASK, ERA_SHIFT, TOKEN_EVICTIONS, UNKNOWN_EVICTIONS};
use crate::bucket::Undo;

impl KeyedLimiter {
    /// The one undo rule on `t`'s key (as [`crate::Bucket::give_back`], under the
    /// shard's lock): gives back `ret` at `at_ns`, exactly while `t` is the key's latest
    /// change, else by the refund rule capped by what `t` can still hold, else kept and
    /// counted. `t` is updated, so a later give-back starts from here.
    pub fn give_back(&self, t: &mut KeyTaken, ret: u64, at_ns: u64) -> Undo {
        let ret = ret.min(t.cost);
        if ret == 0 {
            return Undo::Nothing;
        }
        let mut g = self.shard(t.key);
        let p = self.params_at(&mut g, at_ns);
        g.align(t);
        let evictions = if t.token {
            g.evicted_live & TOKEN_EVICTIONS
        } else {
            g.evicted_live
        };
        let found = g
            .find(t.key)
            .filter(|_| t.evictions == UNKNOWN_EVICTIONS || evictions == t.evictions);
        let Some(i) = found else {
            // Dropped as full (nothing is held on the key any more), or a live key was
            // dropped since (the key's bucket may be a new one, holding others' debits).
            t.latest = false;
            t.cost -= ret;
            return Undo::Nothing;
        };
        let tat = g.slots[i].tat;
        let exact = t.latest && tat == t.after;
        let (new, how) = if exact {
            let new = match t.before {
                Some(b) if ret == t.cost => b,
                _ => tat.saturating_sub(self.params.cost_ticks(ret)),
            };
            t.after = new;
            t.held = t.held.saturating_sub(self.params.cost_ticks(ret)).min(new);
            (new, Undo::Exact)
        } else {
            t.latest = false;
            let ahead = Self::ahead_of(&mut g, t.key, at_ns);
            match p.refund_tat(
                tat,
                at_ns,
                self.params.cost_ticks(ret),
                Some(t.after.min(t.held)),
                ahead,
            ) {
                Some(new) => {
                    t.after -= (tat - new).min(t.after);
                    t.held -= (tat - new).min(t.held);
                    (new, Undo::Refunded)
                }
                None => {
                    t.cost -= ret;
                    self.refunds_dropped.fetch_add(1, Ordering::Relaxed);
                    return Undo::Dropped;
                }
            }
        };
        t.cost -= ret;
        if new == tat {
            return Undo::Nothing;
        }
        g.slots[i].tat = new;
        g.next_full = g.next_full.min(new);
        self.given.fetch_max(at_ns, Ordering::AcqRel);
        how
    }

    /// The latest clock time at which an undo or refund gave capacity back on any key: a
    /// key's grant scheduled in the past is never dated before it.
    pub fn given_at(&self) -> u64 {
        self.given.load(Ordering::Acquire)
    }

    /// Refunds `cost` to `key` at `at_ns` by the refund rule (for a debit not held, e.g.
    /// a permit settled without its grant's token).
    pub fn refund(&self, key: u64, cost: u64) -> Undo {
        let now = self.clock.now_ns();
        let mut t = self.shard(key);
        let p = self.params_at(&mut t, now);
        let Some(i) = t.find(key) else {
            return Undo::Nothing;
        };
        let tat = t.slots[i].tat;
        let ahead = Self::ahead_of(&mut t, key, now);
        let Some(new) = p.refund_tat(tat, now, self.params.cost_ticks(cost), None, ahead) else {
            self.refunds_dropped.fetch_add(1, Ordering::Relaxed);
            return Undo::Dropped;
        };
        if new == tat {
            return Undo::Nothing;
        }
        t.slots[i].tat = new;
        t.next_full = t.next_full.min(new);
        self.given.fetch_max(now, Ordering::AcqRel);
        Undo::Refunded
    }

    /// Charges `cost` to `key` now regardless of conformance (it may go into debt).
    pub fn charge(&self, key: u64, cost: u64) {
        self.charge_tat(key, self.clock.now_ns(), cost, None);
    }

    /// Charges `cost` to `key` at `at_ns` regardless of conformance (an overage owed in
    /// the key's queue, debited in turn; it may go into debt).
    pub fn charge_at(&self, key: u64, at_ns: u64, cost: u64) {
        self.charge_tat(key, at_ns, cost, None);
    }

    /// Charges `extra` more on the debit `t` at `at_ns` (may go into debt); `t` stays
    /// exactly undoable while it is still its key's latest change.
    pub fn charge_more(&self, t: &mut KeyTaken, extra: u64, at_ns: u64) {
        let (old, new) = self.charge_tat(t.key, at_ns, extra, Some(t));
        t.held = t.held.saturating_add(self.params.cost_ticks(extra));
        if t.latest && old == Some(t.after) {
            t.after = new;
        } else {
            t.latest = false;
        }
        t.cost = t.cost.saturating_add(extra);
    }

    /// Returns the key's TAT before (None: not held) and after the charge, with `held`
    /// brought to the shard's epoch.
    fn charge_tat(&self, key: u64, at_ns: u64, cost: u64, held: Option<&mut KeyTaken>) -> (Option<u64>, u64) {
        let mut t = self.shard(key);
        let now_ticks = self.params_at(&mut t, at_ns).ticks(at_ns);
        if let Some(h) = held {
            t.align(h);
        }
        let add = self.params.cost_ticks(cost);
        match t.find(key) {
            Some(i) => {
                let old = t.slots[i].tat;
                let new = (old.max(now_ticks) + add).min(crate::bucket::TAT_LIMIT);
                t.slots[i].tat = new;
                (Some(old), new)
            }
            None => {
                self.make_room(&mut t, now_ticks);
                let new = (now_ticks + add).min(crate::bucket::TAT_LIMIT);
                t.insert_new(key, new);
                (None, new)
            }
        }
    }

    /// The token of the least TAT a debit of `cost` on `key` taken at `at_ns` left.
    pub(super) fn held_token(&self, key: u64, at_ns: u64, cost: u64) -> u64 {
        let mut t = self.shard(key);
        let p = self.params_at(&mut t, at_ns);
        let tat = p
            .ticks(at_ns)
            .saturating_add(p.cost_ticks(cost))
            .min(crate::bucket::TAT_LIMIT);
        ((t.rebases & ERA_MASK) << ERA_SHIFT) | tat
    }
}
