//! Running the queue: the real-time driver's wake-ups and virtual-time runs.

use super::*;

impl WaitQueue {
    /// Runs the queue on a manual clock: moves the clock to each due time up to `until_ns`
    /// and polls there. Returns the number of wake-ups processed. Never spins: an
    /// `until_ns` beyond the clock's range is refused before anything moves, and a
    /// waiter that stays due without being granted or expired ends the run with an error.
    pub fn run_until(self: &Arc<Self>, clock: &crate::ManualClock, until_ns: u64) -> Result<usize, Error> {
        crate::clock::check_time("until", until_ns)?;
        let mut n = 0;
        let mut stalled = Stalled::default();
        while let Some(t) = self.next_wake() {
            if t > until_ns {
                break;
            }
            let before = (clock.now_ns(), self.progress());
            let now = clock.set(t.max(before.0))?;
            // The wake-up the driver would have served (see `take_wake_asked`).
            self.scheduled.store(u64::MAX, Ordering::Release);
            self.poll(now);
            n += 1;
            stalled.check(before != (now, self.progress()), until_ns, now)?;
        }
        clock.set(until_ns.max(clock.now_ns()))?;
        self.poll(clock.now_ns());
        Ok(n)
    }

    /// Grants, expiries and cancellations so far: it moves whenever a poll changed the queue.
    pub fn progress(&self) -> u64 {
        let c = &self.counters;
        [&c.queued_grants, &c.timed_out, &c.cancelled]
            .iter()
            .fold(0u64, |a, x| a.wrapping_add(x.load(Ordering::Relaxed)))
    }

    /// True when a wake-up at or before `t` is pending with a running driver of this
    /// process (or the queue runs on a manual clock): asking for `t` changes nothing.
    pub(super) fn wake_pending_by(&self, t: u64) -> bool {
        self.clock.is_manual()
            || (self.scheduled_pid.load(Ordering::Acquire) == crate::fork::pid()
                && self.scheduled.load(Ordering::Acquire) <= t
                && crate::wait::driver::driver().is_running())
    }

    /// Asks the driver for a poll now (a fast take was undone, see
    /// [`WaitQueue::try_now_token`]); on a manual clock the next run finds it anyway.
    #[cold]
    #[inline(never)]
    pub(super) fn rewake(self: &Arc<Self>, now: u64) {
        let _ = self.schedule(now);
    }

    /// Test hook, on a manual clock: the earliest wake-up asked of the driver since the
    /// last call (or `run_until` poll), taken as the driver takes it; a test that polls
    /// only at these times sees the queue as the real-time driver would serve it.
    #[doc(hidden)]
    pub fn take_wake_asked(&self) -> Option<u64> {
        Some(self.scheduled.swap(u64::MAX, Ordering::AcqRel)).filter(|t| *t != u64::MAX)
    }

    /// A fast path's take guarded by this queue: `take(joined)` is a take that checked
    /// nobody waits and asks `joined` once after it (see [`WaitQueue::joined`]), undoing
    /// itself when true. Returns what `take` returned, and after a take undone that way
    /// the wake-up owed to the joiner ([`Rewake::send`]): it read the take and was
    /// scheduled behind it, and without a wake-up now would be granted at that time.
    #[inline]
    pub fn fast_take<T>(self: &Arc<Self>, take: impl FnOnce(&(dyn Fn() -> bool + Sync)) -> T) -> (T, Option<Rewake>) {
        let raced = AtomicBool::new(false);
        let joined = || {
            let j = self.joined();
            if j {
                raced.store(true, Ordering::Relaxed);
            }
            j
        };
        let out = take(&joined);
        let owed = raced.load(Ordering::Relaxed).then(|| Rewake {
            queue: self.clone(),
            now: self.clock.now_ns(),
        });
        (out, owed)
    }

    /// Asks the driver for a wake-up at `t` unless one is already due by then; Err when
    /// no driver thread can run (the wake-up stays pending for the next one that starts).
    pub(super) fn schedule(self: &Arc<Self>, t: u64) -> Result<(), Error> {
        if self.clock.is_manual() {
            // No driver: kept only for a test to play the driver (`take_wake_asked`).
            self.scheduled.fetch_min(t, Ordering::AcqRel);
            return Ok(());
        }
        let pid = crate::fork::pid();
        if self.scheduled_pid.swap(pid, Ordering::AcqRel) != pid {
            // First use, or a forked child: the parent's wake-ups are not ours.
            self.scheduled.store(u64::MAX, Ordering::Release);
        }
        let driver = crate::wait::driver::driver();
        // A wake-up already pending counts only while a driver runs to serve it.
        if t < self.scheduled.fetch_min(t, Ordering::AcqRel) || !driver.is_running() {
            let me: Weak<dyn crate::wait::driver::Due> = Arc::downgrade(self) as Weak<dyn crate::wait::driver::Due>;
            let asked = driver.schedule(me, t, self.thread_next.load(Ordering::Relaxed));
            if asked.is_err() {
                // Not pending with any running driver: the next call asks again.
                self.scheduled.store(u64::MAX, Ordering::Release);
            }
            return asked;
        }
        Ok(())
    }
}

impl crate::wait::driver::Due for WaitQueue {
    fn wake(self: Arc<Self>, t: u64) {
        let _ = self
            .scheduled
            .compare_exchange(t, u64::MAX, Ordering::AcqRel, Ordering::Acquire);
        self.poll_now();
    }

    fn rearm(&self) {
        self.scheduled.store(u64::MAX, Ordering::Release);
    }
}

/// Counts the rounds of a virtual-time run in which neither the clock nor the queue moved.
#[derive(Default)]
pub struct Stalled(u32);

impl Stalled {
    /// Rounds without progress tolerated (another thread may take the capacity a due
    /// waiter was about to get; the next round then finds a later due time).
    const LIMIT: u32 = 64;

    /// Notes one round; an error once virtual time has stood still too long at `now_ns`.
    pub fn check(&mut self, moved: bool, until_ns: u64, now_ns: u64) -> Result<(), Error> {
        if moved {
            self.0 = 0;
            return Ok(());
        }
        self.0 += 1;
        if self.0 < Self::LIMIT {
            std::thread::yield_now();
            return Ok(());
        }
        Err(Error::invalid(
            "until",
            until_ns as f64 / 1e9,
            &format!(
                "cannot be reached: at {:.9} s a waiter is due but can be neither granted nor expired",
                now_ns as f64 / 1e9
            ),
        ))
    }
}

/// The wake-up a fast take owes the queue it raced (see [`WaitQueue::fast_take`]).
#[must_use = "send() asks the driver to look at the queue again"]
pub struct Rewake {
    queue: Arc<WaitQueue>,
    now: u64,
}

impl Rewake {
    /// Asks the driver to look at the queue now (may wait for the driver's lock: run it
    /// detached from Python).
    pub fn send(self) {
        self.queue.rewake(self.now);
    }
}
