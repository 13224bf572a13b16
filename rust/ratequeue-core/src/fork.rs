//! Fork safety: the core's locks are taken in a `pthread_atfork` prepare handler and
//! released in the parent and child handlers, so no lock is copied into a child in the
//! middle of a change by a thread that does not exist there, and no other code (Python
//! included) runs while they are held for a fork.
//!
//! # The one lock order
//!
//! Every path that holds two core locks takes them in this order, and `prepare` takes
//! them all in it:
//!
//! 1. the registry below (only `register` and `prepare` take it, holding nothing else);
//! 2. [`Rank::Acquire`]: a policy acquire under way (its state is held while it asks a
//!    level's key map, queue or resource; nothing takes it while holding those);
//! 3. [`Rank::KeyMap`]: the per-key queue maps, [`crate::KeyQueues`] (they look at a
//!    queue's state);
//! 4. [`Rank::Queue`]: each wait queue (its decisions call its resource and deliver);
//! 5. [`Rank::Resource`]: a limiter's multi-rate and rate-change locks, keyed shards;
//! 6. [`Rank::Leaf`]: event-loop channels (a delivery writes to them);
//! 7. the driver's state (a queue asks for a wake-up only after releasing its lock; the
//!    driver wakes a queue only after releasing its state).
//!
//! Within a rank no path holds two locks at once. A thread slot's lock is a leaf taken
//! only by its waiting thread and by a delivery under the queue's lock (held by
//! `prepare`); the waiting thread does not exist in a child, so slots need no hold.
//! No core lock is held while waiting for the GIL or calling Python, so `prepare`
//! (which runs with the forking thread holding the GIL) always gets every lock.

use std::cell::RefCell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Once, OnceLock, Weak};

/// Where an object's locks sit in the lock order (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Rank {
    /// Policy acquires under way.
    Acquire,
    /// Maps of per-key queues.
    KeyMap,
    /// Wait queues.
    Queue,
    /// What queues hand out: limiters, keyed maps, semaphores.
    Resource,
    /// Event-loop channels.
    Leaf,
}

/// A lock held across a fork, or a change a child makes before its locks are released.
pub trait Held {
    /// Runs in the child, on its only thread, before the locks are released.
    fn in_child(&mut self) {}
}

impl<T: ?Sized> Held for MutexGuard<'_, T> {}

#[cfg(loom)]
impl<T: ?Sized> Held for loom::sync::MutexGuard<'_, T> {}

impl<H: Held> Held for Vec<H> {
    fn in_child(&mut self) {
        self.iter_mut().for_each(H::in_child);
    }
}

/// Something shared between threads whose locks must not be copied into a child
/// mid-change; register it with [`register`] when it is created.
pub trait ForkLocks: Send + Sync {
    /// Its place in the lock order.
    fn rank(&self) -> Rank;
    /// Takes each of its locks (in its own order), pushing what holds them to `held`.
    fn lock_for_fork<'a>(&'a self, held: &mut Vec<Box<dyn Held + 'a>>);
}

struct Registry {
    live: Vec<Weak<dyn ForkLocks>>,
    prune_at: usize,
}

static REGISTRY: Mutex<Registry> = Mutex::new(Registry {
    live: Vec::new(),
    prune_at: 64,
});

/// This process's id with the fork generation it was read in (see [`pid()`]).
static PID: AtomicU64 = AtomicU64::new(u64::MAX);

/// The current process id (read once per fork generation: no system call on hot paths).
pub fn pid() -> i32 {
    let gen = crate::fork::generation() & 0xffff_ffff;
    let cached = PID.load(Ordering::Acquire);
    if cached != u64::MAX && cached >> 32 == gen {
        return cached as u32 as i32;
    }
    // SAFETY: getpid has no preconditions and cannot fail.
    let p = unsafe { getpid() };
    PID.store((gen << 32) | u64::from(p as u32), Ordering::Release);
    p
}

/// What [`hold_last`] asked `prepare` to take after every registered object.
static LAST: OnceLock<TakeLast> = OnceLock::new();

/// Takes a lock for a fork, if there is one to take now.
pub type TakeLast = fn() -> Option<Box<dyn Held>>;

/// Makes `prepare` take the lock `take` returns after every registered object's (the
/// driver's state, last in the lock order). Set once per process; later calls do nothing.
pub fn hold_last(take: TakeLast) {
    let _ = LAST.set(take);
}

/// Incremented in each forked child, before its locks are released.
static GENERATION: AtomicU64 = AtomicU64::new(0);

/// How many forks this process descends from (0 in the original process).
#[inline]
pub fn generation() -> u64 {
    GENERATION.load(Ordering::Acquire)
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Registers `obj` for the fork protocol (held weakly: dropping it unregisters it; the
/// registry stays within twice the live objects).
pub fn register(obj: Weak<dyn ForkLocks>) {
    install();
    let mut r = lock(&REGISTRY);
    if r.live.len() >= r.prune_at {
        r.live.retain(|w| w.strong_count() > 0);
        r.prune_at = (r.live.len() * 2).max(64);
    }
    r.live.push(obj);
}

/// [`register`] for an `Arc`.
pub fn register_arc<T: ForkLocks + 'static>(obj: &Arc<T>) {
    let w: Weak<dyn ForkLocks> = Arc::downgrade(obj) as Weak<dyn ForkLocks>;
    register(w);
}

/// Test hook: the object at `ptr` leaves the fork protocol (its locks are no longer
/// taken for a fork, its child handler no longer runs).
#[doc(hidden)]
pub fn unregister(ptr: *const ()) {
    lock(&REGISTRY).live.retain(|w| w.as_ptr() as *const () != ptr);
}

/// Objects registered now (tests).
#[doc(hidden)]
pub fn registered() -> usize {
    lock(&REGISTRY).live.len()
}

extern "C" {
    fn getpid() -> i32;
    fn pthread_atfork(
        prepare: Option<extern "C" fn()>,
        parent: Option<extern "C" fn()>,
        child: Option<extern "C" fn()>,
    ) -> i32;
}

/// Installs the fork handlers (once per process; registering an object does it too).
pub fn install() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // SAFETY: the handlers are plain functions that never unwind.
        unsafe {
            pthread_atfork(Some(prepare), Some(after_in_parent), Some(after_in_child));
        }
    });
}

/// What the forking thread holds between `prepare` and the parent or child handler.
struct Hold {
    held: Vec<Box<dyn Held>>,
    registry: Option<MutexGuard<'static, Registry>>,
    /// Keeps alive what the guards borrow.
    _objects: Vec<Arc<dyn ForkLocks>>,
}

thread_local! {
    static HOLD: RefCell<Option<Hold>> = const { RefCell::new(None) };
}

extern "C" fn prepare() {
    let registry = lock(&REGISTRY);
    let mut objects: Vec<Arc<dyn ForkLocks>> = registry.live.iter().filter_map(Weak::upgrade).collect();
    objects.sort_by_key(|o| o.rank());
    let mut held: Vec<Box<dyn Held + '_>> = Vec::with_capacity(objects.len() + 1);
    for o in &objects {
        o.lock_for_fork(&mut held);
    }
    if let Some(g) = LAST.get().and_then(|take| take()) {
        held.push(g);
    }
    // SAFETY: each guard borrows an object kept alive in `objects` (moving the Vec does
    // not move the objects), or a static; all are dropped before `objects`, on this
    // thread, in `release`.
    let held: Vec<Box<dyn Held + 'static>> = unsafe { std::mem::transmute(held) };
    let hold = Hold {
        held,
        registry: Some(registry),
        _objects: objects,
    };
    let _ = HOLD.try_with(|h| *h.borrow_mut() = Some(hold));
}

fn release(in_child: bool) {
    let Ok(Some(mut hold)) = HOLD.try_with(|h| h.borrow_mut().take()) else {
        return;
    };
    if in_child {
        GENERATION.fetch_add(1, Ordering::AcqRel);
        for h in hold.held.iter_mut() {
            h.in_child();
        }
    }
    // Guards first, then the registry (an object's drop may register), then the objects.
    hold.held.clear();
    drop(hold.registry.take());
    drop(hold);
}

extern "C" fn after_in_parent() {
    release(false);
}

/// Test hook: runs `between` as a fork would run in this process, between the prepare
/// handler (every registered object's locks and the registry held) and the parent's (all
/// released, also when `between` panics). Every registered object of the process is held
/// meanwhile, so a test using it belongs with the fork tests, in a test binary of their
/// own. As around a real fork, `between` must not take a registered lock, register an
/// object (make a queue, a channel, a key map) or fork: each waits for good; nor may the
/// caller hold a registered lock.
#[doc(hidden)]
pub fn while_held_for_fork<T>(between: impl FnOnce() -> T) -> T {
    struct Release;
    impl Drop for Release {
        fn drop(&mut self) {
            after_in_parent();
        }
    }
    prepare();
    let _release = Release;
    between()
}

extern "C" fn after_in_child() {
    release(true);
}
