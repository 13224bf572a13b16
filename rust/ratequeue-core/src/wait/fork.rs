//! Fork: the queue's lock held across fork(2), and the waiters a child inherited.

use super::*;

struct QueueHold<'a> {
    queue: &'a WaitQueue,
    inner: MutexGuard<'a, Inner>,
}

impl crate::fork::Held for QueueHold<'_> {
    fn in_child(&mut self) {
        self.queue.forget_inherited(&mut self.inner);
    }
}

impl crate::fork::ForkLocks for WaitQueue {
    fn rank(&self) -> crate::fork::Rank {
        crate::fork::Rank::Queue
    }

    fn lock_for_fork<'a>(&'a self, held: &mut Vec<Box<dyn crate::fork::Held + 'a>>) {
        held.push(Box::new(QueueHold {
            queue: self,
            inner: lock(&self.inner),
        }));
    }
}

impl WaitQueue {
    /// In a forked child, drops the waiters queued in the parent (once); true if the
    /// queue is now empty because of that.
    #[cold]
    pub(super) fn drop_inherited(&self) -> bool {
        if self.generation.load(Ordering::Acquire) == crate::fork::generation() {
            return false;
        }
        let mut g = lock(&self.inner);
        self.forget_inherited(&mut g);
        g.len == 0
    }

    /// [`WaitQueue::drop_inherited`] without waiting for the queue's lock (its callers
    /// may hold the GIL): None, nothing dropped, when the lock is busy.
    #[cold]
    pub(super) fn try_drop_inherited(&self) -> Option<bool> {
        if self.generation.load(Ordering::Acquire) == crate::fork::generation() {
            return Some(false);
        }
        let mut g = match self.inner.try_lock() {
            Ok(g) => g,
            Err(std::sync::TryLockError::Poisoned(e)) => e.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return None,
        };
        self.forget_inherited(&mut g);
        Some(g.len == 0)
    }

    /// Test hook: this queue leaves the fork handlers (as if it had been made behind
    /// their back), so a child inherits its waiters and its lock as they were.
    #[doc(hidden)]
    pub fn skip_fork_handlers(self: &Arc<Self>) {
        crate::fork::unregister(Arc::as_ptr(self) as *const ());
    }

    /// Drops the waiters queued before the last fork (their threads and loops are not
    /// in this process), once. The overage charges queued then go too: the parent
    /// debits them, this child's buckets never held them. Each is kept as forgiven
    /// (bounded by the queue at the fork), so that the grant that owed it, settled in the
    /// child, settles from what the child's bucket holds of it: its estimate less what
    /// it owed ([`WaitQueue::settle_by`]), never giving back what was never debited here.
    pub(super) fn forget_inherited(&self, g: &mut Inner) {
        let now_gen = crate::fork::generation();
        if self.generation.swap(now_gen, Ordering::AcqRel) != now_gen {
            let Inner { classes, forgiven, .. } = g;
            for c in classes.iter_mut() {
                for (t, w) in std::mem::take(&mut c.waiters) {
                    if matches!(w.wake, Wake::Nobody) {
                        forgiven.insert(t, w.costs);
                    }
                }
                c.queued.iter_mut().for_each(|q| *q = 0);
                c.last_finish = 0.0;
            }
            g.where_is.clear();
            g.deadlines.clear();
            g.reserved.clear();
            g.len = 0;
            g.others = 0;
            g.untimed.clear();
            g.vtime = 0.0;
            self.waiting.store(0, Ordering::Release);
            self.scheduled.store(u64::MAX, Ordering::Release);
        }
    }
}
