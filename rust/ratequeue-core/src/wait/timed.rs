//! Self-timed blocked waiters: a thread whose grant time is known sleeps until that time
//! and polls the queue itself, one wake-up (its own timer), where being woken by the
//! driver takes two (the driver's timer, then its futex wake of the waiter, each a
//! scheduling delay: ~25 µs apiece on a virtual machine whose idle CPUs halt).
//!
//! The queue keeps the timer of a self-timed thread at the head equal to its grant time
//! whenever it chooses the driver's next wake-up (`wakes_locked`), and then does not ask
//! the driver for that grant; a timer moved earlier (a waiter ahead left, capacity came
//! back) wakes the thread to sleep again until the new time. A waiter further back
//! sleeps until the time predicted at its submission (exact for one class); one that
//! wakes before its turn polls, finds itself not granted and waits untimed until it is
//! the head. Deadlines stay the driver's. The grant itself is the queue's ordinary poll,
//! in FIFO order at schedule time, whichever thread runs it.

use std::time::Instant;

use super::wakers::NONE;
use super::*;

/// How late a self-timed head's thread may be before the driver polls in its place, when
/// waiters behind it count on that poll (see [`WaitQueue::wakes_locked`]): a thread that
/// is runnable but not running (a busy or starved CPU) then holds up no one else for
/// longer. Twice the driver's event-loop resolution: a thread on time is rarely later.
pub(super) const TAKEOVER_NS: u64 = 2 * super::driver::RESOLUTION_NS;

#[cfg(target_os = "linux")]
extern "C" {
    fn prctl(option: i32, arg2: u64, arg3: u64, arg4: u64, arg5: u64) -> i32;
}

thread_local! {
    /// This thread's timer slack is already 1 ns (set by [`precise_timers`]).
    static PRECISE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Sets this thread's timer slack to 1 ns (Linux adds the default 50 µs to every timed
/// wait otherwise), once per thread: the slack stays at 1 ns after the wait, so a
/// thread that waits again makes no system call for it, and none runs between its
/// timer and its return (setting it back after each wait cost a `prctl` on the wake
/// path, ~1-2 µs on a virtual machine). A slack the thread sets itself afterwards is
/// left as it is.
fn precise_timers() {
    #[cfg(target_os = "linux")]
    PRECISE.with(|done| {
        if !done.get() {
            // SAFETY: PR_GET_TIMERSLACK (30) and PR_SET_TIMERSLACK (29) touch only this
            // thread.
            unsafe {
                if prctl(30, 0, 0, 0, 0) > 1 {
                    prctl(29, 1, 0, 0, 0);
                }
            }
            done.set(true);
        }
    });
}

/// True when this thread's timed waits already run with 1 ns timer slack.
#[cfg(test)]
pub(super) fn timers_precise() -> bool {
    PRECISE.with(|done| done.get())
}

impl WaitQueue {
    /// True when blocked threads of this queue may time themselves ([`Slot::self_timed`]):
    /// on the real-time clock (on a manual clock only its driver, `run_until`, moves time).
    pub fn self_timing(&self) -> bool {
        !self.clock.is_manual()
    }

    /// Waits up to `slice` (None: no limit) for the outcome of the queued `ticket`, whose
    /// wake is `slot`; None when the slice ended first (the waiter is still queued). A
    /// self-timed slot's thread sleeps until its timer and then polls the queue itself,
    /// as the driver would; any other slot waits to be filled. Between slices (e.g. while
    /// its host runs signal handlers) the driver times the grant instead. May wait for
    /// the queue's lock: run it detached from any host lock.
    pub fn wait_slot(self: &Arc<Self>, ticket: u64, slot: &Slot, slice: Option<Duration>) -> Option<Outcome> {
        if !slot.self_timed {
            return slot.wait(slice);
        }
        let end = slice.map(|d| Instant::now() + d);
        loop {
            let mut g = lock(&slot.state);
            slot.present.store(true, Ordering::Release);
            let sliced = loop {
                if let Some(o) = *g {
                    return Some(o);
                }
                let timer = slot.timer.load(Ordering::Acquire);
                let now = self.clock.now_ns();
                if timer <= now {
                    break false;
                }
                let mut d = (timer != NONE).then(|| Duration::from_nanos(timer - now));
                if let Some(end) = end {
                    let left = end.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        break true;
                    }
                    d = Some(d.map_or(left, |d| d.min(left)));
                }
                if timer != NONE {
                    precise_timers();
                }
                g = slot.sleep(g, d).0;
            };
            if sliced {
                // Away from the wait: the driver must not count on this thread's timer.
                slot.present.store(false, Ordering::Release);
                drop(g);
                let (_, driver) = self.wakes_locked(&lock(&self.inner));
                if let Some(t) = driver {
                    let _ = self.schedule(t);
                }
                return None;
            }
            drop(g);
            self.poll_for(ticket, slot);
        }
    }

    /// The poll a self-timed thread runs when its timer is due: grants and expires what is
    /// due (its own grant in its turn); still queued and not re-timed as the head, it
    /// waits untimed until the queue times it again.
    pub(super) fn poll_for(self: &Arc<Self>, ticket: u64, slot: &Slot) {
        self.drop_inherited();
        let g = lock(&self.inner);
        let now = self.clock.now_ns();
        self.poll_and_unlock_then(g, now, |g| {
            if g.where_is.contains_key(&ticket) && slot.timer.load(Ordering::Acquire) <= now {
                slot.set_timer(NONE);
                // Timed again only by the poll that makes it the head (see `wakes_locked`).
                g.untimed.insert(ticket);
            }
        });
    }
}
