//! Model check (loom) of the keyed batch's waiter check (`KeyedLimiter::many_in`, the
//! batch branch of `try_acquire_many_idle`) against a joiner on one of its keys.
//!
//! The batch asks "does any key have a queue" under the shard's lock, before its take;
//! a joiner puts its key's queue in the map, counts itself, then reads the key's bucket
//! under that same lock. Whatever the interleaving, the joiner's read sees the batch's
//! take or the batch sees the queue (and decides key by key, behind the waiter): never
//! both miss. The `should_panic` model asks before taking the lock (as the bindings did
//! before residue2) and shows the check fails then. A faithful copy of the protocol: the
//! shard is a loom mutex over the key's used units, the map's emptiness an atomic.
//!
//! Run: `RUSTFLAGS="--cfg loom" cargo test -p ratequeue-core --release --test loom_review15`.
#![cfg(loom)]

use loom::sync::atomic::{fence, AtomicBool, AtomicUsize, Ordering};
use loom::sync::{Arc, Mutex};
use loom::thread;

fn model<F: Fn() + Sync + Send + 'static>(f: F) {
    let mut b = loom::model::Builder::new();
    if b.preemption_bound.is_none() {
        b.preemption_bound = Some(3);
    }
    b.check(f);
}

/// One key of burst 2 with one unit used; the key queues' map and the key's count.
struct Shared {
    shard: Mutex<u64>,
    has_queue: AtomicBool,
    waiting: AtomicUsize,
}

/// The batch's take of one unit on the key: true when kept by the batch itself (no
/// queue seen); `under_lock`: the check is made holding the shard's lock.
fn batch(s: &Shared, under_lock: bool) -> bool {
    if !under_lock && s.has_queue.load(Ordering::Acquire) {
        return false;
    }
    let mut used = s.shard.lock().unwrap();
    if under_lock && s.has_queue.load(Ordering::Acquire) {
        // Key by key from here: refused behind the waiter.
        return false;
    }
    *used += 1;
    true
}

/// A waiter joining the key: its queue in the map, counted, then the bucket read under
/// the shard's lock; true when the read saw the batch's take.
fn join(s: &Shared) -> bool {
    s.has_queue.store(true, Ordering::Release);
    s.waiting.store(1, Ordering::SeqCst);
    fence(Ordering::SeqCst);
    *s.shard.lock().unwrap() == 2
}

fn run(under_lock: bool) {
    model(move || {
        let s = Arc::new(Shared {
            shard: Mutex::new(1),
            has_queue: AtomicBool::new(false),
            waiting: AtomicUsize::new(0),
        });
        let b = {
            let s = s.clone();
            thread::spawn(move || batch(&s, under_lock))
        };
        let saw = join(&s);
        let kept = b.join().unwrap();
        assert!(
            saw || !kept,
            "both missed: the joiner was scheduled without the batch's take, which was kept"
        );
    });
}

#[test]
fn keyed_batch_asked_under_the_shard_lock_never_misses_a_joiner() {
    run(true);
}

#[test]
#[should_panic(expected = "both missed")]
fn keyed_batch_asked_before_the_lock_can_miss_a_joiner() {
    run(false);
}
