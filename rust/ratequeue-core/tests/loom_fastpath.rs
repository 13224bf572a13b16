//! Model check (loom) of the fast path's re-check against a joiner (see
//! tests/fastpath_race.rs): the store-buffer (Dekker) pattern "the joiner counts itself,
//! then reads the bucket" against "the fast path takes, then reads the count". Whatever
//! the interleaving, the joiner's read sees the take or the fast path sees the joiner
//! (and gives the take back): never both miss.
//!
//! The bucket is the real one (its atomics are loom's under `cfg(loom)`); the queue's
//! count lives beside process-wide statics loom cannot build, so it is a faithful copy
//! (`WaitQueue::announce`, `WaitQueue::joined`, `Limiter::try_take_one_idle`). Loom models
//! a `SeqCst` load, store or read-modify-write as `AcqRel` (a known gap of loom, which
//! makes it report store buffering that `SeqCst` forbids); it does model `fence(SeqCst)`.
//! So the fast path's `SeqCst` compare-and-swap followed by its `SeqCst` load is modelled
//! as the take, `fence(SeqCst)`, the load: the same guarantee in C++20's model, where if
//! the joiner's read missed the take (fence X before it, [atomics.order] p4.3: X precedes
//! the CAS in S) and the load missed the joiner's store (p4.1: load precedes the store
//! in S), S would hold the cycle store < X < CAS < load < store. The `should_panic`
//! models show the check fails when a side of the protocol is missing.
//!
//! Run with the other models: `make test-loom`.
#![cfg(loom)]

use loom::sync::atomic::{fence, AtomicUsize, Ordering};
use loom::sync::Arc;
use loom::thread;
use ratequeue_core::{Bucket, Rate};

mod loom_common;
use loom_common::model;

/// A bucket of burst 2 (nothing refills: time stands at 0) and the queue's count.
struct Shared {
    bucket: Bucket,
    waiting: AtomicUsize,
}

fn shared() -> Arc<Shared> {
    Arc::new(Shared {
        bucket: Bucket::new(Rate::new(1.0, 1e9, 2).unwrap()),
        waiting: AtomicUsize::new(0),
    })
}

/// Which sides of the protocol a model keeps.
#[derive(Clone, Copy)]
struct Sides {
    /// The joiner's fence after it counts itself (`WaitQueue::announce`).
    joiner_fence: bool,
    /// The fast path's re-check after its take (`Limiter::try_take_one_idle`).
    recheck: bool,
}

const BOTH: Sides = Sides {
    joiner_fence: true,
    recheck: true,
};

/// The fast path: "nobody waits", the take, the re-check (the SeqCst pair, see the
/// module's note) and the exact undo; true when it kept its take.
fn fast(s: &Shared, sides: Sides) -> bool {
    if s.waiting.load(Ordering::Acquire) != 0 {
        return false;
    }
    let Ok((before, after)) = s.bucket.try_take_words(0, 1) else {
        return false;
    };
    if !sides.recheck {
        return true;
    }
    fence(Ordering::SeqCst);
    if s.waiting.load(Ordering::SeqCst) != 0 {
        if !s.bucket.untake_words(before, after) {
            s.bucket.refund_since(0, 1, 0, 1);
        }
        return false;
    }
    true
}

/// A decision that may queue someone, under the queue's lock: it counts itself, then
/// reads the bucket to promise a time; true when that read saw the fast path's take.
fn join(s: &Shared, sides: Sides) -> bool {
    s.waiting.store(1, Ordering::SeqCst);
    if sides.joiner_fence {
        fence(Ordering::SeqCst);
    }
    s.bucket.available(0) < 2.0
}

fn run(sides: Sides) {
    model(move || {
        let s = shared();
        let f = {
            let s = s.clone();
            thread::spawn(move || fast(&s, sides))
        };
        let saw = join(&s, sides);
        let kept = f.join().unwrap();
        assert!(
            saw || !kept,
            "both missed: the joiner promised a time without the take, and the take was kept"
        );
        let left = if kept { 1.0 } else { 2.0 };
        assert_eq!(s.bucket.available(0), left, "the undo was not exact");
    });
}

/// Two fast paths and a joiner: neither take survives unseen, and both undo exactly
/// (or by the refund rule when the other's take came after) to a full bucket.
#[test]
fn two_fast_paths_and_a_joiner_never_both_miss() {
    model(|| {
        let s = shared();
        let fs: Vec<_> = (0..2)
            .map(|_| {
                let s = s.clone();
                thread::spawn(move || fast(&s, BOTH))
            })
            .collect();
        let saw_all = {
            s.waiting.store(1, Ordering::SeqCst);
            fence(Ordering::SeqCst);
            s.bucket.available(0)
        };
        let kept = fs.into_iter().map(|f| f.join().unwrap()).filter(|k| *k).count();
        assert!(
            2.0 - saw_all >= kept as f64,
            "a kept take the joiner's read did not see ({kept} kept, read {saw_all})"
        );
        assert_eq!(
            s.bucket.available(0),
            2.0 - kept as f64,
            "an undo gave back too little or too much"
        );
    });
}

#[test]
fn fast_path_and_joiner_never_both_miss() {
    run(BOTH);
}

#[test]
#[should_panic(expected = "both missed")]
fn without_the_joiners_fence_both_can_miss() {
    run(Sides {
        joiner_fence: false,
        recheck: true,
    });
}

#[test]
#[should_panic(expected = "both missed")]
fn without_the_recheck_both_can_miss() {
    run(Sides {
        joiner_fence: true,
        recheck: false,
    });
}
