//! Predicting a newcomer's grant time from the backlog.

use super::*;

impl WaitQueue {
    /// The predicted grant time of `costs` if submitted now behind everyone queued
    /// (exact for one class on a rate; None when it depends on releases).
    pub fn predict(&self, costs: &[u64]) -> Option<u64> {
        self.predict_delay(costs)
            .ok()
            .flatten()
            .map(|(now, d)| now.saturating_add(d))
    }

    /// The wait `costs` would have if submitted now behind everyone queued, with the
    /// time it was read at: `Ok(None)` when it depends on releases, `Err` when the cost
    /// can never be granted.
    pub fn predict_delay(&self, costs: &[u64]) -> Result<Option<(u64, u64)>, Deny> {
        let now = self.clock.now_ns();
        let g = lock(&self.inner);
        let ready = self.resource.ready_at(now, costs)?;
        let at = if g.len == 0 {
            ready
        } else {
            self.predict_all(&g, now, costs)
        };
        Ok(at.map(|t| (now, t.saturating_sub(now))))
    }

    /// The wait `costs` would have if submitted now in `class`, with the time it was read
    /// at: the fair queue serves first every waiter whose start tag is at or before the
    /// new request's (and every reservation with a promised time, which may go first),
    /// then it. Exact when nothing else arrives (with one class: FIFO behind everyone);
    /// later arrivals of other classes can only add their fair share. `Ok(None)` when
    /// it depends on releases, `Err` when the cost can never be granted.
    pub fn predict_delay_in(&self, costs: &[u64], class: usize) -> Result<Option<(u64, u64)>, Deny> {
        let now = self.clock.now_ns();
        let g = lock(&self.inner);
        let ready = self.resource.ready_at(now, costs)?;
        if g.len == 0 {
            return Ok(ready.map(|t| (now, t.saturating_sub(now))));
        }
        let Some(c) = g.classes.get(class) else {
            return Ok(self.predict_all(&g, now, costs).map(|t| (now, t.saturating_sub(now))));
        };
        let start = c.last_finish.max(g.vtime);
        let mut ahead: Vec<(f64, u64, &Waiter)> = g
            .classes
            .iter()
            .flat_map(|c| c.waiters.iter().map(|(t, w)| (w.start_tag, *t, w)))
            .filter(|(tag, _, w)| *tag <= start || w.due_ns.is_some())
            .collect();
        ahead.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
        let ahead: Vec<Queued<'_>> = ahead.iter().map(|(_, _, w)| w.queued()).collect();
        let at = self.resource.predict_backlog(now.max(g.last_grant_ns), &ahead, costs);
        Ok(at.map(|t| (now, t.saturating_sub(now))))
    }

    /// The grant time of `costs` behind everyone queued: exact with one class (the FIFO
    /// schedule played forward); with several, the backlog in start-tag order, a
    /// prediction that arrivals of other classes can move.
    pub(super) fn predict_all(&self, g: &Inner, now: u64, costs: &[u64]) -> Option<u64> {
        if g.classes.len() > 1 && !g.reserved.is_empty() && g.len <= SIMULATED_BACKLOG {
            if let Some(sim) = self.resource.sim(now.max(g.last_grant_ns)) {
                return self.play_forward(g, sim, now, costs);
            }
        }
        let mut backlog: Vec<(f64, u64, &Waiter)> = g
            .classes
            .iter()
            .flat_map(|c| c.waiters.iter().map(|(t, w)| (w.start_tag, *t, w)))
            .collect();
        if g.classes.len() > 1 {
            backlog.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
        }
        let backlog: Vec<Queued<'_>> = backlog.iter().map(|(_, _, w)| w.queued()).collect();
        self.resource.predict_backlog(now.max(g.last_grant_ns), &backlog, costs)
    }

    /// [`WaitQueue::predict_all`] by playing the queue's own order forward on `sim`: the
    /// fair-share head, or the head of the reservations' class where [`Self::head_time`]
    /// would choose it; then `costs`, behind everyone.
    pub(super) fn play_forward(&self, g: &Inner, mut sim: Sim, now: u64, costs: &[u64]) -> Option<u64> {
        // Per class in FIFO order: (ticket, start tag, arrival, what the resource sees).
        let mut rest: Vec<std::collections::VecDeque<(u64, f64, u64, Queued<'_>)>> = g
            .classes
            .iter()
            .map(|c| {
                c.waiters
                    .iter()
                    .map(|(t, w)| (*t, w.start_tag, w.arrival_ns, w.queued()))
                    .collect()
            })
            .collect();
        let mut reserved = g.reserved.clone();
        let charges: std::collections::HashSet<u64> = rest
            .iter()
            .flatten()
            .filter(|(_, _, _, q)| q.charge)
            .map(|(t, ..)| *t)
            .collect();
        let mut last = now.max(g.last_grant_ns);
        loop {
            let head = rest
                .iter()
                .enumerate()
                .filter_map(|(i, c)| c.front().map(|(t, tag, ..)| (*tag, *t, i)))
                .min_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
            let Some((_, t, mut ci)) = head else { break };
            if let Some(&(due, rt)) = reserved.first() {
                let rci = g.where_is[&rt];
                if rci != ci {
                    let (_, _, arrival, q) = rest[ci].front().copied().expect("a head");
                    let at = sim.ready(arrival.max(last), &q);
                    let later = rest.iter().map(|c| c.iter().map(|(t, _, _, q)| (*t, *q)));
                    if at.is_none_or(|a| due <= a || !sim.clone().keeps(a, q.costs, &promised(later, (ci, t)))) {
                        ci = rci;
                    }
                }
            }
            let (t, _, arrival, q) = rest[ci].pop_front().expect("a head");
            let at = sim.ready(arrival.max(last), &q)?;
            sim.take(at, q.costs);
            last = last.max(at);
            if let Some(d) = q.due {
                reserved.remove(&(d, t));
                if !q.charge {
                    // As the queue does when a reservation leaves (see `retime_charges`).
                    let (due, late) = charges_to_retime(&reserved, |t| charges.contains(&t));
                    for (d, t) in late {
                        reserved.remove(&(d, t));
                        if let Some(due) = due {
                            reserved.insert((due, t));
                        }
                        if let Some(w) = rest.iter_mut().flatten().find(|(rt, ..)| *rt == t) {
                            w.3.due = due;
                        }
                    }
                }
            }
        }
        let new = Queued {
            costs,
            due: None,
            charge: false,
        };
        sim.ready(last, &new)
    }

    pub(super) fn deny_error(&self, d: Deny) -> Error {
        self.resource.error_for(d)
    }

    /// The error a denial of the resource stands for.
    pub fn error_for(&self, d: Deny) -> Error {
        self.resource.error_for(d)
    }

    /// Nanoseconds after which `costs` is admitted once everyone queued now has been
    /// served (exact for a rate with no new arrivals, whatever the classes); 0 when that
    /// depends on releases (permits) or can never happen.
    pub fn retry_after_ns(&self, costs: &[u64]) -> u64 {
        self.predict_delay(costs).ok().flatten().map_or(0, |(_, d)| d)
    }

    /// Nanoseconds until the queue's next due time (0 when nothing is due).
    pub fn next_wake_delay(&self) -> u64 {
        self.next_wake().map_or(0, |t| t.saturating_sub(self.clock.now_ns()))
    }
}

/// Queues longer than this are predicted from their start-tag order alone (playing the
/// queue's choices forward costs a pass over the reservations per waiter).
pub(super) const SIMULATED_BACKLOG: usize = 256;

/// Each class's waiters (from `classes`, in FIFO order) up to its last one with a promised
/// time, merged in order of the promised time of the next such waiter at or behind each,
/// leaving out `skip` (class, ticket): the order in which promises must be kept.
pub(super) fn promised<'a, C, I>(classes: C, skip: (usize, u64)) -> Vec<Queued<'a>>
where
    C: Iterator<Item = I>,
    I: DoubleEndedIterator<Item = (u64, Queued<'a>)>,
{
    let mut out: Vec<(u64, usize, u64, Queued<'a>)> = Vec::new();
    for (k, c) in classes.enumerate() {
        let mut key = None;
        let at = out.len();
        for (t, q) in c.rev() {
            if q.due.is_some() {
                key = q.due;
            }
            if let Some(key) = key.filter(|_| (k, t) != skip) {
                out.push((key, k, t, q));
            }
        }
        out[at..].reverse();
    }
    out.sort_by_key(|(key, k, t, _)| (*key, *k, *t));
    out.into_iter().map(|(_, _, _, q)| q).collect()
}

/// The overage charges to re-time when a reservation leaves the promised set
/// `reserved`: those promised after the last reservation left (returned first; None
/// when none is left), which then wait only until it (or, with none, not at all).
pub(super) fn charges_to_retime(
    reserved: &BTreeSet<(u64, u64)>,
    is_charge: impl Fn(u64) -> bool,
) -> (Option<u64>, Vec<(u64, u64)>) {
    let last = reserved.iter().rev().find(|(_, t)| !is_charge(*t)).map(|(d, _)| *d);
    let from = last.map_or(0, |d| d.saturating_add(1));
    (last, reserved.range((from, 0)..).copied().collect())
}
