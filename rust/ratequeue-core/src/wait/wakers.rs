//! How a waiter learns its outcome: a blocked thread's slot or an event-loop channel.

use std::sync::atomic::AtomicU32;

use super::*;

/// A one-shot mailbox for a blocked thread.
pub struct Slot {
    pub(super) state: Mutex<Option<Outcome>>,
    pub(super) cv: Condvar,
    /// Its thread wakes itself at its grant time (see [`WaitQueue::wait_slot`]).
    pub(super) self_timed: bool,
    /// A self-timed slot's timer: when its thread next wakes to poll the queue (`NONE`:
    /// not before it is told). Changed only under `state`'s lock.
    pub(super) timer: AtomicU64,
    /// A self-timed slot's thread is in [`WaitQueue::wait_slot`] (or about to enter it):
    /// its timer, not the driver, times its grant.
    pub(super) present: AtomicBool,
    /// Threads asleep on `cv`: a change made while none sleeps (the outcome a self-timed
    /// thread's own poll puts, the timer set at submission) needs no wake-up call, since
    /// the thread reads both under `state`'s lock before it sleeps. Changed only under
    /// that lock.
    pub(super) sleepers: AtomicU32,
}

impl Default for Slot {
    fn default() -> Slot {
        Slot {
            state: Mutex::new(None),
            cv: Condvar::new(),
            self_timed: false,
            timer: AtomicU64::new(NONE),
            present: AtomicBool::new(false),
            sleepers: AtomicU32::new(0),
        }
    }
}

/// No timer set.
pub(super) const NONE: u64 = u64::MAX;

impl Slot {
    /// A new empty slot, filled by whichever thread polls the queue (its driver's).
    pub fn new() -> Arc<Slot> {
        Arc::new(Slot::default())
    }

    /// A new empty slot whose thread waits in [`WaitQueue::wait_slot`]: it sleeps until its
    /// grant time and polls the queue itself, so the driver is never asked to wake for it.
    pub fn self_timed() -> Arc<Slot> {
        Arc::new(Slot {
            self_timed: true,
            present: AtomicBool::new(true),
            ..Slot::default()
        })
    }

    /// True for a slot made by [`Slot::self_timed`].
    pub fn is_self_timed(&self) -> bool {
        self.self_timed
    }

    /// When the slot's thread next wakes by itself to poll the queue, if it does.
    pub fn timer(&self) -> Option<u64> {
        Some(self.timer.load(Ordering::Acquire)).filter(|t| *t != NONE)
    }

    /// Sets the timer to `t`, waking the thread to sleep again when it moves earlier.
    pub(super) fn set_timer(&self, t: u64) {
        let _g = lock(&self.state);
        if self.timer.swap(t, Ordering::AcqRel) > t {
            self.notify_locked();
        }
    }

    pub(super) fn put(&self, o: Outcome) {
        let mut g = lock(&self.state);
        *g = Some(o);
        self.notify_locked();
    }

    /// Wakes the slot's thread if it sleeps on `cv` (call with `state` locked).
    fn notify_locked(&self) {
        if self.sleepers.load(Ordering::Relaxed) > 0 {
            self.cv.notify_one();
        }
    }

    /// Sleeps on `cv` until notified or `d` (None: no limit) has passed; `g` is the guard
    /// of `state`. True when `d` passed.
    pub(super) fn sleep<'a>(
        &self,
        g: MutexGuard<'a, Option<Outcome>>,
        d: Option<Duration>,
    ) -> (MutexGuard<'a, Option<Outcome>>, bool) {
        self.sleepers.fetch_add(1, Ordering::Relaxed);
        let (g, timed_out) = match d {
            None => (self.cv.wait(g).unwrap_or_else(|e| e.into_inner()), false),
            Some(d) => {
                let (g, to) = self.cv.wait_timeout(g, d).unwrap_or_else(|e| e.into_inner());
                (g, to.timed_out())
            }
        };
        self.sleepers.fetch_sub(1, Ordering::Relaxed);
        (g, timed_out)
    }

    /// Waits up to `slice` for the outcome; None if still waiting.
    pub fn wait(&self, slice: Option<Duration>) -> Option<Outcome> {
        let mut g = lock(&self.state);
        loop {
            if let Some(o) = *g {
                return Some(o);
            }
            let (g2, timed_out) = self.sleep(g, slice);
            g = g2;
            if timed_out {
                return *g;
            }
        }
    }

    /// Takes the outcome if one has arrived.
    pub fn take(&self) -> Option<Outcome> {
        lock(&self.state).take()
    }
}

impl Wake {
    /// True for a thread that times its own grant ([`Slot::self_timed`]).
    pub(super) fn is_self_timed(&self) -> bool {
        matches!(self, Wake::Thread(s) if s.self_timed)
    }

    fn deliver(&self, ticket: u64, o: Outcome) -> Result<(), Outcome> {
        match self {
            Wake::Thread(s) => {
                s.put(o);
                Ok(())
            }
            Wake::Channel(c) => c.put(ticket, o),
            Wake::Nobody => Ok(()),
        }
    }
}

/// Delivers each outcome; returns the grants a closed channel handed back.
pub(super) fn deliver(out: Deliveries) -> Gone {
    let mut gone = Vec::new();
    for (wake, t, o, costs) in out {
        if let Err(Outcome::Granted { token, .. }) = wake.deliver(t, o) {
            gone.push((costs, token));
        }
    }
    gone
}
