//! The real-time driver: one thread per process that sleeps until the earliest due
//! time of any wait queue (a grant or a deadline), polls that queue and sleeps again.
//! Queues ask for a wake-up when their next due time moves earlier; no queue is ever
//! polled on a timer of its own. After `fork` the child gets a driver of its own on
//! first use (the parent's thread does not exist there).
//!
//! Recovery: a panic in a wake is caught (the queue is looked at again shortly after);
//! if the thread ends anyway, it starts its successor when wake-ups are pending, and
//! otherwise the next `schedule` does; a driver that cannot start is reported to the
//! caller (a waiter is then refused with a clear error instead of waiting forever).

use std::cmp::Ordering as CmpOrdering;
use std::collections::BinaryHeap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU32, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::time::Duration;

use crate::clock::monotonic_ns;
use crate::error::Error;
use crate::fork::{pid, Held};

/// What the driver wakes: anything with due times (a wait queue). The driver knows only
/// this, so the queue depends on the driver and not the other way round.
pub trait Due: Send + Sync {
    /// Called at a due time `t` this asked for, or soon after.
    fn wake(self: Arc<Self>, t: u64);
    /// Called after a wake of this panicked: its next request must reach the driver
    /// whatever it believed was pending.
    fn rearm(&self);
}

#[cfg(target_os = "linux")]
extern "C" {
    fn prctl(option: i32, arg2: u64, arg3: u64, arg4: u64, arg5: u64) -> i32;
}

/// Asks Linux for precise timed waits on this thread (the default 50 µs timer slack,
/// inherited from whichever thread started the driver, would add to every wake-up).
fn precise_timers() {
    #[cfg(target_os = "linux")]
    // SAFETY: PR_SET_TIMERSLACK (29) takes a value and touches only this thread.
    unsafe {
        prctl(29, 1, 0, 0, 0);
    }
}

/// After a wake panicked, its queue is looked at again this much later.
const RETRY_AFTER_PANIC_NS: u64 = 10_000_000;

/// Faults a test can inject into the driver.
#[doc(hidden)]
#[derive(Clone, Copy, Debug)]
pub enum Fault {
    /// The next spawns of a driver thread fail.
    FailSpawn,
    /// The next wakes panic (before polling their queue).
    PanicWake,
    /// The driver thread ends at its next wake.
    Exit,
}

static FAIL_SPAWNS: AtomicU32 = AtomicU32::new(0);
static PANIC_WAKES: AtomicU32 = AtomicU32::new(0);
static EXITS: AtomicU32 = AtomicU32::new(0);

/// Test hook: injects `fault` the next `n` times it can happen.
#[doc(hidden)]
pub fn inject_fault(fault: Fault, n: u32) {
    let c = match fault {
        Fault::FailSpawn => &FAIL_SPAWNS,
        Fault::PanicWake => &PANIC_WAKES,
        Fault::Exit => &EXITS,
    };
    c.store(n, Ordering::Release);
}

fn take_fault(c: &AtomicU32) -> bool {
    c.load(Ordering::Relaxed) != 0
        && c.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1))
            .is_ok()
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The driver's time resolution for wake-ups that deliver to event loops: it sleeps at
/// least this long before one (grants keep their schedule times; only their delivery is
/// batched, one loop wake-up per batch). A precise wake-up (a blocked thread is next) is
/// kept to the nanosecond asked for.
///
/// Each wake-up of the driver costs ~25 µs of CPU on a virtual machine (its timer and
/// context switch, then the loop's): at 100 µs, 50,000 grants/s cost 5 µs of CPU each
/// (issue 13); at 500 µs, 1 µs. Half a millisecond is still below asyncio's own timer
/// resolution (its selectors wait in whole milliseconds).
pub const RESOLUTION_NS: u64 = 500_000;

struct Entry {
    t: u64,
    id: u64,
    queue: Weak<dyn Due>,
    precise: bool,
}

impl PartialEq for Entry {
    fn eq(&self, o: &Self) -> bool {
        (self.t, self.id) == (o.t, o.id)
    }
}
impl Eq for Entry {}
impl PartialOrd for Entry {
    fn partial_cmp(&self, o: &Self) -> Option<CmpOrdering> {
        Some(self.cmp(o))
    }
}
impl Ord for Entry {
    fn cmp(&self, o: &Self) -> CmpOrdering {
        // A min-heap on (t, id).
        (o.t, o.id).cmp(&(self.t, self.id))
    }
}

/// When to wake for the heap's earliest entry `first` (> `now`): not before the
/// resolution has passed, unless a precise entry is due earlier (`precise`: how many
/// entries are; none, and the heap is not looked through).
fn wake_at(heap: &BinaryHeap<Entry>, precise: usize, first: u64, now: u64) -> u64 {
    let floor = now.saturating_add(RESOLUTION_NS);
    if precise == 0 {
        return first.max(floor);
    }
    heap.iter()
        .filter(|e| e.precise && e.t < floor)
        .map(|e| e.t)
        .min()
        .unwrap_or(first.max(floor))
}

#[derive(Default)]
struct State {
    heap: BinaryHeap<Entry>,
    /// How many entries of the heap are precise.
    precise: usize,
    next_id: u64,
}

impl State {
    fn pop(&mut self) -> Option<Entry> {
        let e = self.heap.pop()?;
        self.precise -= usize::from(e.precise);
        Some(e)
    }

    fn push(&mut self, e: Entry) {
        self.precise += usize::from(e.precise);
        self.heap.push(e);
    }
}

thread_local! {
    /// True on the driver thread.
    static ON_DRIVER: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// The process's driver.
pub struct Driver {
    pid: i32,
    state: Mutex<State>,
    cv: Condvar,
    /// A driver thread runs (changed only under `state`'s lock).
    running: AtomicBool,
}

static DRIVER: AtomicPtr<Driver> = AtomicPtr::new(std::ptr::null_mut());

/// This process's driver (created on first use, and again in a forked child).
pub fn driver() -> &'static Driver {
    let me = pid();
    loop {
        let p = DRIVER.load(Ordering::Acquire);
        // SAFETY: drivers are leaked, never freed: a non-null pointer stays valid.
        if let Some(d) = unsafe { p.as_ref() } {
            if d.pid == me {
                return d;
            }
        }
        let fresh = Box::into_raw(Box::new(Driver {
            pid: me,
            state: Mutex::default(),
            cv: Condvar::new(),
            running: AtomicBool::new(false),
        }));
        match DRIVER.compare_exchange(p, fresh, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => {
                crate::fork::hold_last(lock_for_fork);
                // SAFETY: just leaked above.
                return unsafe { &*fresh };
            }
            // SAFETY: `fresh` was never shared.
            Err(_) => drop(unsafe { Box::from_raw(fresh) }),
        }
    }
}

/// Takes this process's driver state for a fork (see [`crate::fork`]).
fn lock_for_fork() -> Option<Box<dyn Held>> {
    // SAFETY: drivers are leaked, never freed.
    let d = unsafe { DRIVER.load(Ordering::Acquire).as_ref() }?;
    (d.pid == pid()).then(|| Box::new(lock(&d.state)) as Box<dyn Held>)
}

/// Ends the driver thread's turn: whatever way it ends, `running` is cleared, and a
/// successor starts at once if wake-ups are pending.
struct Exit(&'static Driver);

impl Drop for Exit {
    fn drop(&mut self) {
        let mut s = lock(&self.0.state);
        self.0.running.store(false, Ordering::Release);
        if !s.heap.is_empty() {
            let _ = self.0.start(&mut s);
        }
    }
}

impl Driver {
    /// Wakes `queue` at `t` (monotonic nanoseconds) or soon after: as close to `t` as
    /// the system's timers allow when `precise`, else within [`RESOLUTION_NS`]. Err when
    /// no driver thread runs and none can be started (the wake-up stays pending for the
    /// next one).
    pub fn schedule(&'static self, queue: Weak<dyn Due>, t: u64, precise: bool) -> Result<(), Error> {
        let mut s = lock(&self.state);
        let earliest = s.heap.peek().map(|e| e.t);
        let id = s.next_id;
        s.next_id += 1;
        s.push(Entry { t, id, queue, precise });
        if !self.running.load(Ordering::Acquire) {
            self.start(&mut s)
        } else {
            // The driver thread itself (asking from a wake) looks at the heap again before
            // it sleeps: no futex call to wake a thread that is awake.
            if earliest.is_none_or(|e| t < e) && !ON_DRIVER.get() {
                self.cv.notify_one();
            }
            Ok(())
        }
    }

    /// True while a driver thread runs.
    pub fn is_running(&self) -> bool {
        self.running.load(Ordering::Acquire)
    }

    fn start(&'static self, _s: &mut State) -> Result<(), Error> {
        let spawned = if take_fault(&FAIL_SPAWNS) {
            Err(std::io::Error::other("injected by a test"))
        } else {
            std::thread::Builder::new()
                .name("ratequeue-driver".into())
                .spawn(move || self.run())
        };
        match spawned {
            Ok(_) => {
                self.running.store(true, Ordering::Release);
                Ok(())
            }
            Err(e) => Err(Error::Overloaded {
                reason: format!("the ratequeue driver thread could not start ({e}), so nothing can wait"),
                retry_after_ns: 0,
            }),
        }
    }

    fn run(&'static self) {
        let _exit = Exit(self);
        precise_timers();
        ON_DRIVER.set(true);
        let mut s = lock(&self.state);
        loop {
            let now = monotonic_ns();
            match s.heap.peek().map(|e| e.t) {
                None => s = self.cv.wait(s).unwrap_or_else(|e| e.into_inner()),
                Some(t) if t > now => {
                    // Never sleep less than the resolution before a batched wake-up: at
                    // high rates grants due within it are handed out together (each still
                    // at its own schedule time), one wake-up of each loop per batch. A
                    // precise wake-up due earlier cuts the sleep short.
                    let at = wake_at(&s.heap, s.precise, t, now);
                    let d = Duration::from_nanos(at.saturating_sub(now).max(1));
                    s = self.cv.wait_timeout(s, d).unwrap_or_else(|e| e.into_inner()).0;
                }
                Some(_) => {
                    let e = s.pop().expect("peeked");
                    if take_fault(&EXITS) {
                        s.push(e);
                        return;
                    }
                    drop(s);
                    if let Some(q) = e.queue.upgrade() {
                        let woke = catch_unwind(AssertUnwindSafe(|| {
                            if take_fault(&PANIC_WAKES) {
                                panic!("ratequeue driver: a panic injected into a wake by a test");
                            }
                            q.clone().wake(e.t);
                        }));
                        if woke.is_err() {
                            // The queue may have stopped half-way: look at it again soon.
                            q.rearm();
                            let mut s = lock(&self.state);
                            let id = s.next_id;
                            s.next_id += 1;
                            s.push(Entry {
                                t: monotonic_ns().saturating_add(RETRY_AFTER_PANIC_NS),
                                id,
                                queue: e.queue,
                                precise: false,
                            });
                        }
                    }
                    s = lock(&self.state);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wait::{Outcome, Slot, WaitQueue};
    use crate::{AnyClock, Limiter, QueueConfig, Rate, Submitted, Wake};
    use std::sync::Arc;

    const LONG: Duration = Duration::from_secs(10);

    #[test]
    fn batched_wake_ups_wait_for_the_resolution_precise_ones_do_not() {
        let entry = |t: u64, precise: bool| Entry {
            t,
            id: t,
            queue: Weak::<WaitQueue>::new() as Weak<dyn Due>,
            precise,
        };
        let now = 1_000_000;
        let at = |s: &State| wake_at(&s.heap, s.precise, s.heap.peek().unwrap().t, now);
        let mut s = State::default();
        s.push(entry(now + 10_000, false));
        assert_eq!(at(&s), now + RESOLUTION_NS);
        s.push(entry(now + 30_000, true));
        assert_eq!(at(&s), now + 30_000);
        s.push(entry(now + 20_000, true));
        assert_eq!(at(&s), now + 20_000);
        assert_eq!(s.precise, 2);
        let mut far = State::default();
        far.push(entry(now + 5 * RESOLUTION_NS, false));
        far.push(entry(now + 6 * RESOLUTION_NS, true));
        assert_eq!(at(&far), now + 5 * RESOLUTION_NS);
    }

    #[test]
    fn the_count_of_precise_entries_follows_pushes_and_pops() {
        let entry = |t: u64, precise: bool| Entry {
            t,
            id: t,
            queue: Weak::<WaitQueue>::new() as Weak<dyn Due>,
            precise,
        };
        let now = 1_000_000;
        let mut s = State::default();
        s.push(entry(now + 10, true));
        s.push(entry(now + 20, false));
        s.push(entry(now + 30, true));
        assert_eq!(s.precise, 2);
        assert!(s.pop().unwrap().precise);
        assert_eq!(s.precise, 1);
        assert!(!s.pop().unwrap().precise);
        assert_eq!(s.precise, 1);
        assert_eq!(wake_at(&s.heap, s.precise, now + 30, now), now + 30);
        assert!(s.pop().unwrap().precise);
        assert_eq!(s.precise, 0);
        assert!(s.pop().is_none());
        s.push(entry(now + 10, false));
        assert_eq!(wake_at(&s.heap, s.precise, now + 10, now), now + RESOLUTION_NS);
    }

    fn real_time_queue() -> Arc<WaitQueue> {
        let lim = Limiter::new(
            vec![("requests".into(), Rate::new(50.0, 1e9, 1).unwrap())],
            AnyClock::Monotonic,
        )
        .unwrap();
        WaitQueue::new(
            Arc::new(lim),
            1,
            AnyClock::Monotonic,
            QueueConfig::new(vec![], 1000, None).unwrap(),
        )
    }

    /// Submits one request behind a used-up bucket: its slot, or the refusal.
    fn submit(q: &Arc<WaitQueue>) -> Result<Arc<Slot>, Error> {
        loop {
            let s = Slot::new();
            let s2 = s.clone();
            if let Submitted::Queued(_) = q.submit(&[1], 0, None, || Wake::Thread(s2))? {
                return Ok(s);
            }
        }
    }

    fn granted(s: &Slot, within: Duration) -> bool {
        matches!(s.wait(Some(within)), Some(Outcome::Granted { .. }))
    }

    #[test]
    fn recovers_from_a_panicking_wake_its_death_and_failed_spawns() {
        // One test: the faults are process-wide.
        let q = real_time_queue();
        inject_fault(Fault::PanicWake, 1);
        assert!(granted(&submit(&q).unwrap(), LONG), "served after a panicking wake");

        inject_fault(Fault::Exit, 1);
        assert!(granted(&submit(&q).unwrap(), LONG), "served by a successor");

        // The thread ends and its successor cannot start: the pending wait-up is served
        // by the driver the next `schedule` starts; a waiter that finds no driver and
        // cannot start one is refused with a clear error.
        inject_fault(Fault::Exit, 1);
        inject_fault(Fault::FailSpawn, 1);
        let first = submit(&q).unwrap();
        assert!(!granted(&first, Duration::from_millis(300)));
        inject_fault(Fault::FailSpawn, 1);
        match submit(&q) {
            Err(Error::Overloaded { reason, .. }) => assert!(reason.contains("driver"), "{reason}"),
            other => panic!("{:?}", other.map(|_| ())),
        }
        let last = submit(&q).unwrap();
        assert!(granted(&first, LONG) && granted(&last, LONG));
    }
}
