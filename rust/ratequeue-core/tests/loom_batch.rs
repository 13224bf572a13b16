//! Model check (loom) of the keyed batch's check against a joiner (see
//! tests/fastpath_residue.rs): the batch asks "does any key have a queue" under a
//! shard's lock, before that shard's takes; a joiner makes its key's queue (the map's
//! count), then reads the key under the same lock. Whatever the interleaving, the
//! joiner's read sees the batch's take or the batch sees the queue and takes nothing
//! (it then decides key by key, each take re-checked). The `should_panic` model shows
//! that a check made only before the lock, as the batch did, lets both miss.
//!
//! The shard and the count are faithful copies (`KeyedLimiter::many_in`,
//! `KeyQueues::get`/`is_empty`): the argument rests on the lock, not on the buckets.
//!
//! Run with the other models: `make test-loom`.
#![cfg(loom)]

use loom::sync::atomic::{AtomicUsize, Ordering};
use loom::sync::{Arc, Mutex};
use loom::thread;

mod loom_common;
use loom_common::model;

/// A shard holding one key's TAT (0: full) and the key map's count of queues.
struct Shared {
    shard: Mutex<u64>,
    queues: AtomicUsize,
}

/// The batch over one shard; true when it took. `under_lock`: its check is made again
/// under the shard's lock (the fix), else only before (as before the fix).
fn batch(s: &Shared, under_lock: bool) -> bool {
    if s.queues.load(Ordering::Acquire) != 0 {
        return false;
    }
    let mut tat = s.shard.lock().unwrap();
    if under_lock && s.queues.load(Ordering::Acquire) != 0 {
        return false;
    }
    *tat += 1;
    true
}

/// A joiner: makes its key's queue, then reads the key under the shard's lock to
/// schedule itself; true when that read saw the batch's take.
fn join(s: &Shared) -> bool {
    s.queues.store(1, Ordering::Release);
    *s.shard.lock().unwrap() != 0
}

fn run(under_lock: bool) {
    model(move || {
        let s = Arc::new(Shared {
            shard: Mutex::new(0),
            queues: AtomicUsize::new(0),
        });
        let b = {
            let s = s.clone();
            thread::spawn(move || batch(&s, under_lock))
        };
        let saw = join(&s);
        let took = b.join().unwrap();
        assert!(
            saw || !took,
            "both missed: the joiner was scheduled without the batch's take, and the take stands"
        );
    });
}

#[test]
fn batch_checked_under_the_shard_lock_never_misses_a_joiner() {
    run(true);
}

#[test]
#[should_panic(expected = "both missed")]
fn batch_checked_only_before_the_lock_can_miss_a_joiner() {
    run(false);
}
