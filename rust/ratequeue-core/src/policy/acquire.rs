//! One policy acquire under way: the lifecycle that blocking and asyncio
//! `Policy.acquire` share (concurrency queues in turn, then every rate level held for one
//! common time behind its queue), driven by whoever waits.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard, Once};

use super::{Held, LevelArgs, LevelKind, Policy, QueueRef, Refusal, Refused};
use crate::bucket::Deny;
use crate::clock::AnyClock;
use crate::error::Error;
use crate::wait::{Cancelled, Outcome, Slot, Submitted, Wake};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// What [`PolicyAcquire::advance`] reached.
#[derive(Debug)]
pub enum Step {
    /// Waiting in a concurrency level's queue under this ticket; the outcome arrives
    /// through the [`Wake`] given, and goes to [`PolicyAcquire::outcome`].
    Queued(u64),
    /// Every level held: concurrency permits taken, rate levels held for the common
    /// time `delay_ns` from now (see [`Policy::reserve_queued`]).
    Done {
        /// From now until the common grant time of the rate levels.
        delay_ns: u64,
        /// From the start of the acquire until now.
        waited_ns: u64,
        /// What is held, per level (the caller's to release, settle or undo).
        held: Vec<Held>,
    },
}

struct Waiting {
    level: usize,
    queue: QueueRef,
    ticket: u64,
}

/// The state of an acquire behind its lock, registered for the fork protocol: the lock
/// is held while a level's key map, queue or resource is asked, and an asyncio acquire
/// is still reachable (and given back) in a forked child.
struct StateLock(Mutex<AcquireState>);

impl crate::fork::ForkLocks for StateLock {
    fn rank(&self) -> crate::fork::Rank {
        crate::fork::Rank::Acquire
    }

    fn lock_for_fork<'a>(&'a self, held: &mut Vec<Box<dyn crate::fork::Held + 'a>>) {
        held.push(Box::new(lock(&self.0)));
    }
}

impl std::ops::Deref for StateLock {
    type Target = Mutex<AcquireState>;

    fn deref(&self) -> &Mutex<AcquireState> {
        &self.0
    }
}

struct AcquireState {
    next: usize,
    held: Vec<Held>,
    waiting: Option<Waiting>,
    /// A wait abandoned after its queue decided: its grant, when it arrives, goes back.
    raced: Option<Waiting>,
    done: bool,
}

/// One policy acquire under way: the one lifecycle of a blocking and an asyncio
/// `Policy.acquire`. It waits in the queue of each enforced concurrency level in one
/// order shared by every policy (see `order`; in the level's first class, behind its waiters, like any of them), then holds every
/// rate level for one common time without passing anyone ([`Policy::reserve_queued`]).
/// Whoever waits drives it: [`PolicyAcquire::advance`] starts the next wait or finishes,
/// [`PolicyAcquire::outcome`] takes the outcome of the wait under way, and
/// [`PolicyAcquire::abandon`] gives back everything held, exactly once, when the wait ends
/// any other way (cancellation, interruption, a closed event loop). A refusal or a
/// timeout gives everything back before it is returned.
pub struct PolicyAcquire {
    policy: Arc<Policy>,
    args: Vec<LevelArgs>,
    clock: AnyClock,
    start_ns: u64,
    deadline_ns: Option<u64>,
    /// The enforced concurrency levels in the order they are waited for: one order for
    /// every policy (by the limit's serial number, then key), so two policies over the same
    /// limits never each hold one while waiting for the other's.
    order: Vec<usize>,
    st: Arc<StateLock>,
    /// Registers `st` for the fork handlers before its first step takes it (an acquire
    /// decided by the caller's fast path never steps: it costs no registration).
    registered: Once,
}

impl PolicyAcquire {
    /// An acquire of `args` on `policy` starting now on `clock`, within `timeout_ns`.
    pub fn new(policy: Arc<Policy>, args: Vec<LevelArgs>, clock: AnyClock, timeout_ns: Option<u64>) -> PolicyAcquire {
        let start_ns = clock.now_ns();
        Self::started_at(policy, args, clock, timeout_ns, start_ns)
    }

    /// [`PolicyAcquire::new`] for a call that read the clock at `start_ns` (its
    /// timeout and its delay count from there).
    pub fn started_at(
        policy: Arc<Policy>,
        args: Vec<LevelArgs>,
        clock: AnyClock,
        timeout_ns: Option<u64>,
        start_ns: u64,
    ) -> PolicyAcquire {
        let n = policy.levels.len();
        let st = Arc::new(StateLock(Mutex::new(AcquireState {
            next: 0,
            held: (0..n).map(|_| Held::Nothing).collect(),
            waiting: None,
            raced: None,
            done: false,
        })));
        let mut order: Vec<(u64, u64, usize)> = policy
            .levels
            .iter()
            .enumerate()
            .filter_map(|(i, l)| {
                let key = args.get(i).map_or(0, |a| a.key);
                match &l.kind {
                    _ if l.shadow => None,
                    LevelKind::Concurrency(s) => Some((s.serial(), 0, i)),
                    LevelKind::KeyedConcurrency(s) => Some((s.serial(), key, i)),
                    _ => None,
                }
            })
            .collect();
        order.sort_unstable();
        PolicyAcquire {
            order: order.into_iter().map(|(_, _, i)| i).collect(),
            registered: Once::new(),
            policy,
            args,
            clock,
            start_ns,
            deadline_ns: timeout_ns.map(|t| start_ns.saturating_add(t)),
            st,
        }
    }

    /// Test hook: holds the acquire's lock for `d` on this thread, as a long step would.
    #[doc(hidden)]
    pub fn hold_lock_for(&self, d: std::time::Duration) {
        self.register();
        let g = lock(&self.st);
        std::thread::sleep(d);
        drop(g);
    }

    /// Registers its lock for the fork handlers, once, before anything takes it there
    /// (takes their registry's lock: steps, outcomes and abandons run without the GIL).
    fn register(&self) {
        self.registered.call_once(|| crate::fork::register_arc(&self.st));
    }

    /// When the acquire started, on its clock.
    pub fn start_ns(&self) -> u64 {
        self.start_ns
    }

    /// The costs and keys it asks for, per level.
    pub fn args(&self) -> &[LevelArgs] {
        &self.args
    }

    fn permits(&self, i: usize) -> Held {
        let a = &self.args[i];
        match self.policy.levels[i].kind {
            LevelKind::KeyedConcurrency(_) => Held::KeyedPermits(a.key, a.costs[0]),
            _ => Held::Permits(a.costs[0]),
        }
    }

    fn level_error(&self, r: Refusal, max_wait_ns: u64) -> Error {
        let name = &self.policy.levels[r.level].name;
        match r.deny {
            Deny::TooLarge { cost, burst, .. } => Error::CostTooLarge {
                unit: format!("(level {name:?})"),
                cost,
                burst,
            },
            Deny::Wait(ns) => Error::Overloaded {
                reason: format!("refused by level {name:?}"),
                retry_after_ns: if ns == u64::MAX {
                    0
                } else {
                    ns.saturating_sub(max_wait_ns)
                },
            },
        }
    }

    /// Ends the wait under way (its queue ref dropped, the level told).
    fn end_wait(&self, w: Waiting) {
        let Waiting { level, queue, .. } = w;
        drop(queue);
        if let Some(qs) = &self.policy.levels[level].queues {
            qs.done(self.args[level].key);
        }
    }

    fn give_back_locked(&self, st: &mut AcquireState) {
        st.done = true;
        self.policy.undo_all(&mut st.held, &self.args, self.clock.now_ns());
    }

    /// Goes as far as it can without waiting (the first step registers the acquire
    /// for the fork handlers: call it without the GIL): queues in the next enforced concurrency
    /// level that cannot grant at once (`wake` says how its outcome is delivered), or
    /// holds the rate levels and finishes. An error (refused, queue full, timed out)
    /// gives back everything first.
    pub fn advance(&self, wake: &dyn Fn() -> Wake) -> Result<Step, Error> {
        self.register();
        let mut st = lock(&self.st);
        if st.done || st.waiting.is_some() {
            return Err(Error::invalid("acquire", "advance", "is finished or waiting already"));
        }
        if st.next == 0 {
            if let Err(r) = self.policy.check_costs(&self.args, self.start_ns) {
                st.done = true;
                return Err(self.level_error(r, 0));
            }
        }
        let levels = &self.policy.levels;
        while let Some(&i) = self.order.get(st.next) {
            let l = &levels[i];
            let a = &self.args[i];
            let now = self.clock.now_ns();
            let q = match l.queues.as_ref() {
                Some(qs) => match qs.existing(a.key) {
                    Some(q) => Some(q),
                    // A key nobody waits on: taken now without making it a queue.
                    None => match self.policy.take_level(i, a, now) {
                        Ok(h) => {
                            st.held[i] = h;
                            st.next += 1;
                            continue;
                        }
                        Err(_) => qs.queue(a.key),
                    },
                },
                None => None,
            };
            let Some(q) = q else {
                // A level nobody waits on: taken now or refused.
                match self.policy.take_level(i, a, now) {
                    Ok(h) => {
                        st.held[i] = h;
                        st.next += 1;
                        continue;
                    }
                    Err(deny) => {
                        self.policy.refused[i].fetch_add(1, Ordering::Relaxed);
                        self.give_back_locked(&mut st);
                        return Err(self.level_error(Refusal { level: i, deny }, 0));
                    }
                }
            };
            let timeout = self.deadline_ns.map(|d| d.saturating_sub(now));
            let submitted = q.queue.submit(&a.costs, 0, timeout, wake);
            match submitted {
                Ok(Submitted::Granted { .. }) => {
                    st.held[i] = self.permits(i);
                    st.next += 1;
                    self.end_wait(Waiting {
                        level: i,
                        queue: q,
                        ticket: 0,
                    });
                }
                Ok(Submitted::Queued(ticket)) => {
                    st.waiting = Some(Waiting {
                        level: i,
                        queue: q,
                        ticket,
                    });
                    return Ok(Step::Queued(ticket));
                }
                Err(e) => {
                    self.end_wait(Waiting {
                        level: i,
                        queue: q,
                        ticket: 0,
                    });
                    self.policy.refused[i].fetch_add(1, Ordering::Relaxed);
                    self.give_back_locked(&mut st);
                    return Err(match e {
                        Error::WaitTimeout { retry_after_ns, .. } => Error::WaitTimeout {
                            waited_ns: now.saturating_sub(self.start_ns),
                            retry_after_ns,
                        },
                        e => e,
                    });
                }
            }
        }
        let now = self.clock.now_ns();
        let max_wait = self.deadline_ns.map_or(u64::MAX, |d| d.saturating_sub(now));
        match self.policy.reserve_queued(&self.args, now, max_wait) {
            Ok((delay_ns, rates)) => {
                for (h, r) in st.held.iter_mut().zip(rates) {
                    if !matches!(r, Held::Nothing) {
                        *h = r;
                    }
                }
                st.done = true;
                Ok(Step::Done {
                    delay_ns,
                    waited_ns: now.saturating_sub(self.start_ns),
                    held: std::mem::take(&mut st.held),
                })
            }
            Err(r) => {
                self.give_back_locked(&mut st);
                Err(match r {
                    Refused::Level(r) => self.level_error(r, max_wait),
                    Refused::Queue { error, .. } => error,
                })
            }
        }
    }

    /// The ticket of the wait under way, if any.
    pub fn waiting_ticket(&self) -> Option<u64> {
        lock(&self.st).waiting.as_ref().map(|w| w.ticket)
    }

    /// The outcome of the wait under way: granted, the permits are held and
    /// [`PolicyAcquire::advance`] goes on; timed out, everything is given back and the
    /// error returned. After [`PolicyAcquire::abandon`], a grant is given back and a
    /// timeout ends the wait on its level.
    pub fn outcome(&self, o: Outcome) -> Result<(), Error> {
        self.register();
        let mut st = lock(&self.st);
        let Some(w) = st.waiting.take() else {
            drop(st);
            match o {
                Outcome::Granted { token, .. } => self.give_back_late(token),
                Outcome::TimedOut { .. } => {
                    // Timed out while its waiter left: the wait ends on its level.
                    let raced = lock(&self.st).raced.take();
                    if let Some(w) = raced {
                        self.end_wait(w);
                    }
                }
            }
            return Ok(());
        };
        let level = w.level;
        self.end_wait(w);
        match o {
            Outcome::Granted { .. } => {
                st.held[level] = self.permits(level);
                st.next = self
                    .order
                    .iter()
                    .position(|&i| i == level)
                    .map_or(self.order.len(), |p| p + 1);
                Ok(())
            }
            Outcome::TimedOut { .. } => {
                self.give_back_locked(&mut st);
                let now = self.clock.now_ns();
                Err(Error::WaitTimeout {
                    waited_ns: now.saturating_sub(self.start_ns),
                    retry_after_ns: 0,
                })
            }
        }
    }

    /// Gives back everything held, once: the wait under way leaves its queue (true), or
    /// — its queue decided already (false) — a grant it got goes back through
    /// [`PolicyAcquire::give_back_late`] when it arrives.
    pub fn abandon(&self) -> bool {
        self.register();
        let mut st = lock(&self.st);
        if st.done && st.waiting.is_none() {
            return true;
        }
        let removed = match st.waiting.take() {
            Some(w) if w.queue.queue.cancel(w.ticket) == Cancelled::Removed => {
                self.end_wait(w);
                true
            }
            Some(w) => {
                st.raced = Some(w);
                false
            }
            None => true,
        };
        self.give_back_locked(&mut st);
        removed
    }

    /// Abandons (see [`PolicyAcquire::abandon`]) and gives back the grant `token` of
    /// the wait that was under way, which arrived after its waiter left (once).
    pub fn give_back_late(&self, token: u64) {
        self.abandon();
        let raced = lock(&self.st).raced.take();
        if let Some(w) = raced {
            w.queue.queue.give_back(&self.args[w.level].costs, Some(token));
            self.end_wait(w);
        }
    }

    /// [`PolicyAcquire::abandon`] for a blocked thread whose outcomes go to `slot`: an
    /// outcome that raced the abandon is settled at once (a grant given back).
    pub fn abandon_slot(&self, slot: &Slot) {
        if !self.abandon() {
            if let Some(o) = slot.take() {
                let _ = self.outcome(o);
            }
        }
    }
}
