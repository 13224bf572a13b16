//! The one undo rule on a bucket ([`Bucket::give_back`]) and the other ways capacity
//! moves outside a decision: undo, refunds, charges and holds.

use super::{Bucket, Params, Taken, Undo, GENS, GEN_SHIFT, TAT_MASK, UNKNOWN};
use crate::sync::Ordering;

impl Bucket {
    /// Undoes `t` if no other debit came after it; true when undone.
    pub fn untake(&self, t: &Taken) -> bool {
        t.before == t.after
            || self
                .word
                .compare_exchange(t.after, t.before, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
    }

    /// Undoes a debit known by the words `before` and `after` it (see
    /// [`Bucket::try_take_words`]) if no other change came after it; true when undone.
    pub fn untake_words(&self, before: u64, after: u64) -> bool {
        before == after
            || self
                .word
                .compare_exchange(after, before, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
    }

    /// The one undo rule: gives back `ret` (at most what `t` still stands for) at
    /// `at_ns`. Exact while `t` is still the bucket's latest change: a CAS from the word
    /// it left back to the word before it (or to `ret` less). Otherwise a refund, only
    /// while no grant is scheduled in the future (TAT ≤ now + tau), capped by what `t`
    /// can still hold and never past full; else nothing ([`Undo::Dropped`]). What `t`
    /// holds ends at the TAT it left, less every refund since it was taken (each moved
    /// it down); nothing after a rate change, or for a debit known only by its token.
    /// `t` is updated, so a later give-back starts from here.
    pub fn give_back(&self, t: &mut Taken, ret: u64, at_ns: u64) -> Undo {
        let ret = ret.min(t.cost);
        if ret == 0 {
            return Undo::Nothing;
        }
        if t.latest && (t.refunded == UNKNOWN || t.refunded == self.refunded.load(Ordering::Acquire)) {
            let (w, _) = self.load_at(at_ns);
            if w == t.after {
                let p = self.params(w);
                let full = ret == t.cost && t.before != UNKNOWN;
                // Until its grant's time, the TAT keeps marking a grant scheduled ahead
                // (see `slot`).
                let lowered = (w & TAT_MASK).saturating_sub(p.cost_ticks(ret));
                let kept = !full && t.slot > p.ticks(at_ns).saturating_add(p.tau) && lowered < t.slot;
                let next = if full {
                    t.before
                } else {
                    (w & !TAT_MASK) | if kept { t.slot } else { lowered }
                };
                if next == w
                    || self
                        .word
                        .compare_exchange(w, next, Ordering::AcqRel, Ordering::Acquire)
                        .is_ok()
                {
                    t.cost -= ret;
                    t.after = next;
                    if next != w {
                        self.given.fetch_max(at_ns, Ordering::AcqRel);
                    }
                    if kept {
                        // The word no longer spans the whole debit that is left.
                        t.before = UNKNOWN;
                        return Undo::Dropped;
                    }
                    return if next == w { Undo::Nothing } else { Undo::Exact };
                }
            }
        }
        t.latest = false;
        self.load_at(at_ns);
        let _guard = self.change_lock();
        let since = match t.refunded {
            UNKNOWN => None,
            r => Some(self.refunded.load(Ordering::Acquire).wrapping_sub(r)),
        };
        let mut w = self.word.load(Ordering::Acquire);
        loop {
            let p = self.params(w);
            let held = match (since, self.held_in(t.after, w, &p)) {
                (Some(since), Some(h)) => h.saturating_sub(since),
                _ => 0,
            };
            let ahead = self.ahead.load(Ordering::Acquire);
            let Some(tat) = p.refund_tat(w & TAT_MASK, at_ns, p.cost_ticks(ret), Some(held), ahead) else {
                t.cost -= ret;
                return Undo::Dropped;
            };
            let next = (w & !TAT_MASK) | tat;
            if next == w {
                t.cost -= ret;
                return Undo::Nothing;
            }
            match self
                .word
                .compare_exchange_weak(w, next, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => {
                    let given = w - next;
                    self.refunded.fetch_add(given, Ordering::Release);
                    self.given.fetch_max(at_ns, Ordering::AcqRel);
                    t.refunded = t.refunded.wrapping_add(given);
                    t.after -= given.min(t.after & TAT_MASK);
                    t.cost -= ret;
                    return Undo::Refunded;
                }
                Err(seen) => w = seen,
            }
        }
    }

    /// The TAT the debit that left word `after` holds, in the ticks of word `w` (params
    /// `p`): exact across rebases (same rate, a later epoch); None after a rate change.
    fn held_in(&self, after: u64, w: u64, p: &Params) -> Option<u64> {
        if (w ^ after) >> GEN_SHIFT == 0 {
            return Some(after & TAT_MASK);
        }
        let old = self.params(after);
        (old.q_ticks == p.q_ticks && old.m == p.m && old.epoch < p.epoch)
            .then(|| (after & TAT_MASK).saturating_sub(old.shift_to(p.epoch)))
    }

    /// Refunds `cost` at `at_ns` by the refund rule of [`Bucket::give_back`], uncapped
    /// (for a debit that is not held, e.g. a permit settled without its grant's token).
    pub fn refund(&self, at_ns: u64, cost: u64) -> Undo {
        self.load_at(at_ns);
        let _guard = self.change_lock();
        self.refund_locked(at_ns, cost, |_| None)
    }

    /// Refunds `ret` at `at_ns` of a debit of `cost` taken at `taken_at_ns` that is not
    /// held as a record: the refund rule, capped by what such a debit can still hold (its
    /// TAT was at least the tick of `taken_at_ns` plus its cost; across rate changes, what
    /// was left of it at each change, converted as the change converted the content).
    pub fn refund_since(&self, at_ns: u64, ret: u64, taken_at_ns: u64, cost: u64) -> Undo {
        self.load_at(at_ns);
        let _guard = self.change_lock();
        self.refund_locked(at_ns, ret, |w| Some(self.held_since(w, taken_at_ns, cost)))
    }

    /// What a debit of `cost` taken at `taken_at_ns` can still hold, as a TAT in the
    /// ticks of the word `w`'s generation (0: nothing known). Called under `change`.
    fn held_since(&self, w: u64, taken_at_ns: u64, cost: u64) -> u64 {
        let cur = (w >> GEN_SHIFT) as usize;
        // The generation current at `taken_at_ns`: walk back while it started later.
        let mut back = 0;
        let mut since = self.slots[cur].since.load(Ordering::Relaxed);
        while since > taken_at_ns {
            back += 1;
            let prev = self.slots[(cur + GENS - back) % GENS].since.load(Ordering::Relaxed);
            if back == GENS || prev > since {
                return 0; // older than every kept generation
            }
            since = prev;
        }
        let mut g = (cur + GENS - back) % GENS;
        let mut p = self.slot_params(g);
        // Less a nanosecond: a scheduled grant may be debited from just before it.
        let mut held = p
            .ticks(taken_at_ns.saturating_sub(1))
            .saturating_add(p.cost_ticks(cost));
        while g != cur {
            g = (g + 1) % GENS;
            let at = self.slots[g].since.load(Ordering::Relaxed);
            let q = self.slot_params(g);
            let left = held.saturating_sub(p.ticks(at)) as u128;
            // Converted as `set_rate` converts the content (rounded up).
            let left = ((left << q.m) + (1u128 << p.m) - 1) >> p.m;
            held = (q.ticks(at) as u128 + left).min(TAT_MASK as u128) as u64;
            p = q;
        }
        held
    }

    /// The refund rule with the cap `held` gives for the word (see [`Params::refund_tat`]);
    /// counts what it gave. Called under `change`.
    fn refund_locked(&self, at_ns: u64, cost: u64, held: impl Fn(u64) -> Option<u64>) -> Undo {
        let mut w = self.word.load(Ordering::Acquire);
        loop {
            let p = self.params(w);
            let ahead = self.ahead.load(Ordering::Acquire);
            let Some(tat) = p.refund_tat(w & TAT_MASK, at_ns, p.cost_ticks(cost), held(w), ahead) else {
                return Undo::Dropped;
            };
            let next = (w & !TAT_MASK) | tat;
            if next == w {
                return Undo::Nothing;
            }
            match self
                .word
                .compare_exchange_weak(w, next, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => {
                    self.refunded.fetch_add(w - next, Ordering::Release);
                    self.given.fetch_max(at_ns, Ordering::AcqRel);
                    return Undo::Refunded;
                }
                Err(seen) => w = seen,
            }
        }
    }

    /// Debits `cost` at `at_ns` unconditionally; the bucket may go into debt, which
    /// delays later admissions until time repays it.
    pub fn charge(&self, at_ns: u64, cost: u64) {
        self.charge_word(at_ns, cost);
    }

    /// Charges `extra` more on the debit `t` (an under-estimate; may go into debt); `t`
    /// stays exactly undoable while it is still the latest change.
    pub fn charge_more(&self, t: &mut Taken, extra: u64, at_ns: u64) {
        let (w, next) = self.charge_word(at_ns, extra);
        if t.latest && w == t.after {
            t.after = next;
        } else {
            t.latest = false;
        }
        t.cost = t.cost.saturating_add(extra);
    }

    /// Admits nothing before `until_ns`, then one unit there: the TAT moves up to
    /// `until + tau - T` (a debt the clock repays by then) and never back, so repeated
    /// holds to the same time do not add up. True when the TAT moved.
    pub fn hold_until(&self, at_ns: u64, until_ns: u64) -> bool {
        let (mut w, _) = self.load_at(at_ns);
        loop {
            let p = self.params(w);
            let target = p.ticks(until_ns).saturating_add(p.tau - (1u64 << p.m)).min(TAT_MASK);
            if w & TAT_MASK >= target {
                return false;
            }
            let next = (w & !TAT_MASK) | target;
            match self
                .word
                .compare_exchange_weak(w, next, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => return true,
                Err(seen) => w = seen,
            }
        }
    }

    fn charge_word(&self, at_ns: u64, cost: u64) -> (u64, u64) {
        let (mut w, _) = self.load_at(at_ns);
        loop {
            let p = self.params(w);
            let add = p.cost_ticks(cost);
            let tat = ((w & TAT_MASK).max(p.ticks(at_ns)) + add).min(TAT_MASK);
            let next = (w & !TAT_MASK) | tat;
            match self
                .word
                .compare_exchange_weak(w, next, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => return (w, next),
                Err(seen) => w = seen,
            }
        }
    }
}
