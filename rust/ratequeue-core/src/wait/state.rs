//! Building a queue and reading its state.

use super::*;

impl WaitQueue {
    /// A queue over `resource` counting `units` cost components, read on `clock`.
    pub fn new(resource: Arc<dyn Resource>, units: usize, clock: AnyClock, config: QueueConfig) -> Arc<WaitQueue> {
        let waits = (0..config.classes.len()).map(|_| Arc::new(Histogram::new())).collect();
        Self::with_histograms(resource, units, clock, config, waits)
    }

    /// A queue that records its waits into `waits` (one per class), e.g. histograms
    /// shared by the per-key queues of a keyed limiter.
    pub fn with_histograms(
        resource: Arc<dyn Resource>,
        units: usize,
        clock: AnyClock,
        config: QueueConfig,
        waits: Vec<Arc<Histogram>>,
    ) -> Arc<WaitQueue> {
        let waits = if waits.len() == config.classes.len() {
            waits
        } else {
            (0..config.classes.len()).map(|_| Arc::new(Histogram::new())).collect()
        };
        let classes = config
            .classes
            .iter()
            .map(|(_, w)| Class {
                weight: *w,
                queued: vec![0; units],
                ..Class::default()
            })
            .collect();
        let q = Arc::new(WaitQueue {
            resource,
            clock,
            waiting: AtomicUsize::new(0),
            inner: Mutex::new(Inner {
                classes,
                vtime: 0.0,
                last_grant_ns: 0,
                where_is: awaiting::ByTicket::default(),
                deadlines: BTreeSet::new(),
                reserved: BTreeSet::new(),
                len: 0,
                others: 0,
                untimed: BTreeSet::new(),
                forgiven: HashMap::new(),
            }),
            counters: Counters::default(),
            waits,
            scheduled: AtomicU64::new(u64::MAX),
            scheduled_pid: std::sync::atomic::AtomicI32::new(0),
            generation: AtomicU64::new(crate::fork::generation()),
            thread_next: AtomicBool::new(false),
            config,
        });
        crate::fork::register_arc(&q);
        q
    }

    /// The current time on the queue's clock.
    pub fn now_ns(&self) -> u64 {
        self.clock.now_ns()
    }

    /// The queue's configuration.
    pub fn config(&self) -> &QueueConfig {
        &self.config
    }

    /// The index of class `name`.
    pub fn class_index(&self, name: &str) -> Option<usize> {
        self.config.classes.iter().position(|(n, _)| n == name)
    }

    /// Waiters now queued (all classes). Never waits for a lock: in a forked child
    /// whose inherited waiters could not be dropped yet (the queue's lock busy) it
    /// counts them, so a fast path stays behind them until a decision under the lock.
    #[inline]
    pub fn waiting(&self) -> usize {
        let n = self.waiting.load(Ordering::Acquire);
        if n != 0 && self.try_drop_inherited() == Some(true) {
            return 0;
        }
        n
    }

    /// True when someone waits or a decision that may queue someone is under way (see
    /// [`WaitQueue::announce`]). A fast path asks it after its take: with the joiner's
    /// fence, either it sees the joiner or the joiner's reads of the resource see the take.
    #[inline]
    pub fn joined(&self) -> bool {
        self.waiting.load(Ordering::SeqCst) != 0
    }

    /// Under the queue's lock, before a decision that may queue someone reads the
    /// resource: until [`WaitQueue::announced`], fast paths count one more waiter, and a
    /// fast take they made without seeing it is visible to every read after the fence.
    pub(super) fn announce(&self, g: &Inner) {
        self.waiting.store(g.len + 1, Ordering::SeqCst);
        std::sync::atomic::fence(Ordering::SeqCst);
    }

    /// Ends [`WaitQueue::announce`]: the count is the queue's own again.
    pub(super) fn announced(&self, g: &Inner) {
        self.waiting.store(g.len, Ordering::Release);
    }

    /// Runs `decide` announced; the count is the queue's own again after it, even when
    /// it panics (else every later fast path would count a waiter that is not there).
    pub(super) fn decide_announced<T>(&self, g: &mut Inner, decide: impl FnOnce(&mut Inner) -> T) -> T {
        self.announce(g);
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| decide(&mut *g)));
        self.announced(g);
        r.unwrap_or_else(|p| std::panic::resume_unwind(p))
    }

    /// Test hook: holds the queue's lock for `d` (as a long decision would).
    #[doc(hidden)]
    pub fn hold_lock_for(&self, d: Duration) {
        let g = lock(&self.inner);
        std::thread::sleep(d);
        drop(g);
    }

    /// Waiters now queued in each class.
    pub fn depths(&self) -> Vec<usize> {
        lock(&self.inner).classes.iter().map(|c| c.waiters.len()).collect()
    }

    /// Counters so far (each read atomically).
    pub fn counts(&self) -> QueueCounts {
        let c = &self.counters;
        let r = |a: &AtomicU64| a.load(Ordering::Relaxed);
        QueueCounts {
            tried_admitted: r(&c.tried_admitted),
            tried_refused: r(&c.tried_refused),
            immediate: r(&c.immediate),
            queued_grants: r(&c.queued_grants),
            refused_full: r(&c.refused_full),
            refused_deadline: r(&c.refused_deadline),
            timed_out: r(&c.timed_out),
            cancelled: r(&c.cancelled),
        }
    }

    /// The queue-wait histogram of class `class` (arrival to grant, schedule time).
    pub fn wait_histogram(&self, class: usize) -> Option<&Arc<Histogram>> {
        self.waits.get(class)
    }

    /// Counts a `try_acquire` decision (those never queue and record no wait). A load
    /// and a store, not a locked add: exact when callers are serialised (Python's GIL
    /// holds on every call from a GIL build); concurrent callers without a GIL may lose
    /// a count now and then, never a decision. Keeps the hot path a few ns shorter.
    #[inline]
    pub fn note_try(&self, admitted: bool) {
        let c = if admitted {
            &self.counters.tried_admitted
        } else {
            &self.counters.tried_refused
        };
        c.store(c.load(Ordering::Relaxed).wrapping_add(1), Ordering::Relaxed);
    }
}
