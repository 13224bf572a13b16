//! The real-time driver: one thread per process that sleeps until the earliest due
//! time of any wait queue (a grant or a deadline), polls that queue and sleeps again.
//! Queues ask for a wake-up when their next due time moves earlier; no queue is ever
//! polled on a timer of its own. After `fork` the child gets a driver of its own on
//! first use (the parent's thread does not exist there).

use std::cmp::Ordering as CmpOrdering;
use std::collections::BinaryHeap;
use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::{Condvar, Mutex, Weak};
use std::time::Duration;

use crate::clock::monotonic_ns;
use crate::queue::WaitQueue;

extern "C" {
    fn getpid() -> i32;
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

/// The current process id.
pub fn pid() -> i32 {
    // SAFETY: getpid has no preconditions and cannot fail.
    unsafe { getpid() }
}

/// The driver's time resolution: it sleeps at least this long between wake-ups (grants
/// keep their schedule times; only their delivery is batched).
pub const RESOLUTION_NS: u64 = 100_000;

struct Entry {
    t: u64,
    id: u64,
    queue: Weak<WaitQueue>,
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

#[derive(Default)]
struct State {
    heap: BinaryHeap<Entry>,
    next_id: u64,
    running: bool,
}

/// The process's driver.
pub struct Driver {
    pid: i32,
    state: Mutex<State>,
    cv: Condvar,
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
        }));
        match DRIVER.compare_exchange(p, fresh, Ordering::AcqRel, Ordering::Acquire) {
            // SAFETY: just leaked above.
            Ok(_) => return unsafe { &*fresh },
            // SAFETY: `fresh` was never shared.
            Err(_) => drop(unsafe { Box::from_raw(fresh) }),
        }
    }
}

impl Driver {
    /// Wakes `queue` at `t` (monotonic nanoseconds) or soon after.
    pub fn schedule(&'static self, queue: Weak<WaitQueue>, t: u64) {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let earliest = s.heap.peek().map(|e| e.t);
        let id = s.next_id;
        s.next_id += 1;
        s.heap.push(Entry { t, id, queue });
        if !s.running {
            let spawned = std::thread::Builder::new()
                .name("ratequeue-driver".into())
                .spawn(move || self.run());
            s.running = spawned.is_ok();
        } else if earliest.is_none_or(|e| t < e) {
            self.cv.notify_one();
        }
    }

    fn run(&'static self) {
        precise_timers();
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            let now = monotonic_ns();
            match s.heap.peek().map(|e| e.t) {
                None => s = self.cv.wait(s).unwrap_or_else(|e| e.into_inner()),
                Some(t) if t > now => {
                    // Never sleep less than the resolution: at high rates grants due within
                    // it are handed out together (each still at its own schedule time),
                    // one wake-up of each waiting thread or loop per batch.
                    let d = Duration::from_nanos((t - now).max(RESOLUTION_NS));
                    s = self.cv.wait_timeout(s, d).unwrap_or_else(|e| e.into_inner()).0;
                }
                Some(_) => {
                    let e = s.heap.pop().expect("peeked");
                    drop(s);
                    if let Some(q) = e.queue.upgrade() {
                        q.driver_wake(e.t);
                    }
                    s = self.state.lock().unwrap_or_else(|e| e.into_inner());
                }
            }
        }
    }
}
