//! The event-loop channel: outcomes of queued waits for one asyncio loop, signalled
//! through a wake-up descriptor the channel owns (an eventfd on Linux, a pipe
//! elsewhere). The loop watches [`Channel::fileno`] and drains; it never closes it.
//!
//! Lifecycle: [`Channel::close`] (the loop went away) makes every later delivery come
//! back to the queue, which gives a grant back to its resource; the descriptor is closed
//! when the last reference goes, so no writer can ever reach a closed (and possibly
//! reused) descriptor number.

use std::io;
use std::os::fd::RawFd;
use std::sync::Arc;

use crate::sync::{AtomicBool, Mutex, MutexGuard, Ordering};
use crate::wait::Outcome;

/// The descriptor(s) a channel signals through, owned by the process that made them.
struct WakeFd {
    read: RawFd,
    write: RawFd,
    pid: i32,
}

impl WakeFd {
    #[cfg(target_os = "linux")]
    fn new() -> io::Result<WakeFd> {
        // SAFETY: eventfd has no memory preconditions; the result is checked.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(WakeFd {
            read: fd,
            write: fd,
            pid: crate::fork::pid(),
        })
    }

    #[cfg(not(target_os = "linux"))]
    fn new() -> io::Result<WakeFd> {
        let mut fds = [0 as RawFd; 2];
        // SAFETY: `fds` is a valid buffer of two descriptors; the result is checked.
        if unsafe { libc::pipe(fds.as_mut_ptr()) } != 0 {
            return Err(io::Error::last_os_error());
        }
        let w = WakeFd {
            read: fds[0],
            write: fds[1],
            pid: crate::fork::pid(),
        };
        for fd in fds {
            // SAFETY: fcntl on descriptors this function just opened.
            unsafe {
                let fl = libc::fcntl(fd, libc::F_GETFL);
                if fl < 0 || libc::fcntl(fd, libc::F_SETFL, fl | libc::O_NONBLOCK) < 0 {
                    return Err(io::Error::last_os_error());
                }
                let fdf = libc::fcntl(fd, libc::F_GETFD);
                if fdf < 0 || libc::fcntl(fd, libc::F_SETFD, fdf | libc::FD_CLOEXEC) < 0 {
                    return Err(io::Error::last_os_error());
                }
            }
        }
        Ok(w)
    }

    fn signal(&self) {
        #[cfg(target_os = "linux")]
        let (buf, n) = (1u64.to_ne_bytes(), 8);
        #[cfg(not(target_os = "linux"))]
        let (buf, n) = ([1u8], 1);
        // SAFETY: a valid buffer of `n` bytes to a descriptor open while `self` lives. A
        // full counter or pipe (EAGAIN) already holds a pending wake-up.
        unsafe {
            libc::write(self.write, buf.as_ptr().cast(), n);
        }
    }

    fn clear(&self) {
        let mut buf = [0u8; 64];
        // SAFETY: reads into a valid buffer from a descriptor open while `self` lives;
        // non-blocking, so this stops at EAGAIN.
        while unsafe { libc::read(self.read, buf.as_mut_ptr().cast(), buf.len()) } > 0 {
            if cfg!(target_os = "linux") {
                break;
            }
        }
    }
}

impl Drop for WakeFd {
    fn drop(&mut self) {
        // In a forked child the numbers may since have been closed and reused by the
        // child: leave them alone rather than close someone else's file.
        if self.pid != crate::fork::pid() {
            return;
        }
        // SAFETY: closing descriptors this object opened, once.
        unsafe {
            libc::close(self.read);
            if self.write != self.read {
                libc::close(self.write);
            }
        }
    }
}

/// Outcomes for one event loop, signalled at most once per drain.
pub struct Channel {
    ready: Mutex<Vec<(u64, Outcome)>>,
    /// Set under the `ready` lock (so no put lands after a close); read without it.
    closed: AtomicBool,
    signalled: AtomicBool,
    fd: Option<WakeFd>,
}

impl Channel {
    /// A channel that never signals: its owner drains it after each step (virtual time).
    pub fn new() -> Arc<Channel> {
        let c = Arc::new(Channel {
            ready: Mutex::new(Vec::new()),
            closed: AtomicBool::new(false),
            signalled: AtomicBool::new(false),
            fd: None,
        });
        crate::fork::register_arc(&c);
        c
    }

    /// A channel with a wake-up descriptor of its own (close-on-exec, non-blocking),
    /// readable at [`Channel::fileno`] until the last reference goes.
    pub fn with_wakeup() -> io::Result<Arc<Channel>> {
        let c = Arc::new(Channel {
            ready: Mutex::new(Vec::new()),
            closed: AtomicBool::new(false),
            signalled: AtomicBool::new(false),
            fd: Some(WakeFd::new()?),
        });
        crate::fork::register_arc(&c);
        Ok(c)
    }

    /// The descriptor that becomes readable when outcomes arrive (None: never signals).
    pub fn fileno(&self) -> Option<RawFd> {
        self.fd.as_ref().map(|f| f.read)
    }

    /// Delivers an outcome, signalling the descriptor once per drain; hands the outcome
    /// back when the channel is closed (or inherited across fork), so the caller can
    /// give a grant back to its resource.
    pub(crate) fn put(&self, ticket: u64, o: Outcome) -> Result<(), Outcome> {
        let mut ready = lock(&self.ready);
        if self.closed.load(Ordering::Acquire) {
            return Err(o);
        }
        if let Some(fd) = &self.fd {
            if !self.signalled.swap(true, Ordering::AcqRel) {
                if fd.pid != crate::fork::pid() {
                    self.closed.store(true, Ordering::Release);
                    return Err(o);
                }
                fd.signal();
            }
        }
        ready.push((ticket, o));
        Ok(())
    }

    /// [`Channel::put`] for the loom model checks (tests/loom.rs).
    #[cfg(loom)]
    #[doc(hidden)]
    pub fn put_for_model(&self, ticket: u64, o: Outcome) -> Result<(), Outcome> {
        self.put(ticket, o)
    }

    /// Takes every outcome delivered so far and re-arms the signal.
    pub fn drain(&self) -> Vec<(u64, Outcome)> {
        self.rearm();
        std::mem::take(&mut *lock(&self.ready))
    }

    /// [`Channel::drain`] without waiting: None when the lock is busy (call `drain`
    /// then, e.g. after releasing the GIL).
    pub fn try_drain(&self) -> Option<Vec<(u64, Outcome)>> {
        self.rearm();
        try_lock(&self.ready).map(|mut r| std::mem::take(&mut *r))
    }

    fn rearm(&self) {
        if let Some(fd) = &self.fd {
            fd.clear();
        }
        self.signalled.store(false, Ordering::Release);
    }

    /// Closes the channel: nothing is delivered or signalled after this (later outcomes
    /// go back to their queue). Returns the outcomes delivered but not yet drained, for
    /// the caller to settle (a grant among them must be given back).
    pub fn close(&self) -> Vec<(u64, Outcome)> {
        Self::close_locked(&self.closed, lock(&self.ready))
    }

    /// [`Channel::close`] without waiting: None when the lock is busy.
    pub fn try_close(&self) -> Option<Vec<(u64, Outcome)>> {
        try_lock(&self.ready).map(|r| Self::close_locked(&self.closed, r))
    }

    fn close_locked(closed: &AtomicBool, mut ready: MutexGuard<'_, Vec<(u64, Outcome)>>) -> Vec<(u64, Outcome)> {
        closed.store(true, Ordering::Release);
        std::mem::take(&mut *ready)
    }

    /// True once closed.
    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }
}

impl crate::fork::ForkLocks for Channel {
    fn rank(&self) -> crate::fork::Rank {
        crate::fork::Rank::Leaf
    }

    fn lock_for_fork<'a>(&'a self, held: &mut Vec<Box<dyn crate::fork::Held + 'a>>) {
        held.push(Box::new(lock(&self.ready)));
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn try_lock<T>(m: &Mutex<T>) -> Option<MutexGuard<'_, T>> {
    match m.try_lock() {
        Ok(g) => Some(g),
        Err(std::sync::TryLockError::Poisoned(e)) => Some(e.into_inner()),
        Err(std::sync::TryLockError::WouldBlock) => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Tests that open descriptors run one at a time, so a closed number is not reused
    /// by another test before it is checked.
    static FDS: Mutex<()> = Mutex::new(());

    fn granted(token: u64) -> Outcome {
        Outcome::Granted {
            at_ns: 0,
            waited_ns: 0,
            token,
        }
    }

    fn is_open(fd: RawFd) -> bool {
        // SAFETY: F_GETFD only queries the descriptor table.
        unsafe { libc::fcntl(fd, libc::F_GETFD) >= 0 }
    }

    fn readable(fd: RawFd) -> bool {
        let mut p = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd, no wait.
        unsafe { libc::poll(&mut p, 1, 0) == 1 }
    }

    #[test]
    fn signals_once_per_drain_and_drain_clears() {
        let _one = lock(&FDS);
        let c = Channel::with_wakeup().unwrap();
        let fd = c.fileno().unwrap();
        assert!(!readable(fd));
        c.put(1, granted(7)).unwrap();
        c.put(2, Outcome::TimedOut { waited_ns: 3 }).unwrap();
        assert!(readable(fd));
        assert_eq!(c.drain().len(), 2);
        assert!(!readable(fd));
        c.put(3, granted(8)).unwrap();
        assert!(readable(fd));
        assert_eq!(c.drain(), vec![(3, granted(8))]);
        c.put(4, granted(9)).unwrap();
        let busy = c.ready.lock().unwrap();
        assert_eq!(c.try_drain(), None);
        assert_eq!(c.try_close(), None);
        drop(busy);
        assert_eq!(c.try_drain(), Some(vec![(4, granted(9))]));
        assert_eq!(c.try_close(), Some(vec![]));
    }

    #[test]
    fn put_after_close_hands_the_outcome_back_and_writes_nothing() {
        let _one = lock(&FDS);
        let c = Channel::with_wakeup().unwrap();
        let fd = c.fileno().unwrap();
        c.put(1, granted(1)).unwrap();
        assert_eq!(c.close(), vec![(1, granted(1))]);
        assert!(c.is_closed());
        c.drain();
        assert_eq!(c.put(2, granted(2)), Err(granted(2)));
        assert!(!readable(fd));
        assert!(c.drain().is_empty());
    }

    #[test]
    fn the_descriptor_closes_with_the_last_reference() {
        let _one = lock(&FDS);
        let c = Channel::with_wakeup().unwrap();
        let fd = c.fileno().unwrap();
        let writer = c.clone();
        c.close();
        drop(c);
        assert!(is_open(fd), "a writer still holds the channel");
        drop(writer);
        assert!(!is_open(fd));
    }

    #[test]
    fn a_channel_without_descriptor_never_signals() {
        let c = Channel::new();
        assert_eq!(c.fileno(), None);
        c.put(1, granted(1)).unwrap();
        assert_eq!(c.drain().len(), 1);
    }
}
