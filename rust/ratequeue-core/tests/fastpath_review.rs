//! Review of the fast path's re-check (tests/fastpath_race.rs): interleavings beyond the
//! one the fix was written for, on a manual clock, each run deterministically (threads
//! handed over by channels at the exact points of the race).

mod common;

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc::channel;
use std::sync::Arc;

use common::{check_joiners, check_windows, granted_at, S};
use ratequeue_core::bucket::Deny;
use ratequeue_core::wait::Slot;
use ratequeue_core::{
    AnyClock, Limiter, ManualClock, QueueConfig, QueuedReservation, Rate, Reserved, Resource, Submitted, WaitQueue,
    Wake,
};

/// One unit per second, `burst`, one unit used at 0; a queue in front of it.
fn setup(burst: u64) -> (Arc<ManualClock>, Arc<Limiter>, Arc<WaitQueue>) {
    let clock = Arc::new(ManualClock::new(0).unwrap());
    let rates = vec![("requests".to_string(), Rate::new(1.0, 1e9, burst).unwrap())];
    let lim = Arc::new(Limiter::new(rates, AnyClock::Manual(clock.clone())).unwrap());
    lim.try_acquire(&[1]).unwrap();
    let q = WaitQueue::new(
        lim.clone(),
        1,
        AnyClock::Manual(clock.clone()),
        QueueConfig::new(vec![], 100, None).unwrap(),
    );
    (clock, lim, q)
}

/// Queues a waiter of cost `burst` (it needs the bucket full) and a reservation of cost
/// 1 promised a time behind it.
fn join(q: &Arc<WaitQueue>, lim: &Arc<Limiter>, burst: u64) -> (Arc<Slot>, QueuedReservation) {
    let slot = Slot::new();
    let s = q.submit(&[burst], 0, None, || Wake::Thread(slot.clone())).unwrap();
    assert!(matches!(s, Submitted::Queued(_)), "the waiter must queue");
    let lim2 = lim.clone();
    let r = q.reserve(&[1], 0, None, move |_| lim2.reserve(&[1], None)).unwrap();
    let Reserved::Queued(r) = r else {
        panic!("the reservation must queue behind the waiter")
    };
    (slot, r)
}

/// Two fast paths pass their check, a waiter and a reservation join (reading the bucket
/// before either take), then both take; A re-checks while B's take is the latest change
/// (no exact undo), then B re-checks after A's give-back (no exact undo either). Both
/// must give back all they took: the joiners' promised times hold.
#[test]
fn two_fast_takes_racing_a_joiner_give_back_everything() {
    let burst = 3;
    let (clock, lim, q) = setup(burst);
    assert_eq!(q.waiting(), 0, "both fast paths' checks pass");
    let (waiter, reservation) = join(&q, &lim, burst);
    assert_eq!(reservation.at_ns, 2 * S, "promised behind the waiter (1 s) at 2 s");
    let (a_took, a_took_rx) = channel();
    let (a_go, a_go_rx) = channel::<()>();
    let (b_took, b_took_rx) = channel();
    let (b_go, b_go_rx) = channel::<()>();
    let (a, b) = std::thread::scope(|s| {
        let (lim_a, q_a) = (&lim, &q);
        let a = s.spawn(move || {
            lim_a.try_acquire_idle_nowait(&[1], || {
                a_took.send(()).unwrap();
                a_go_rx.recv().unwrap();
                q_a.joined()
            })
        });
        a_took_rx.recv().unwrap();
        let (lim_b, q_b) = (&lim, &q);
        let b = s.spawn(move || {
            lim_b.try_acquire_idle_nowait(&[1], || {
                b_took.send(()).unwrap();
                b_go_rx.recv().unwrap();
                q_b.joined()
            })
        });
        b_took_rx.recv().unwrap();
        a_go.send(()).unwrap();
        let a = a.join().unwrap();
        b_go.send(()).unwrap();
        (a, b.join().unwrap())
    });
    assert_eq!(a, Some(Err(Deny::Wait(0))), "A saw the joiner");
    assert_eq!(b, Some(Err(Deny::Wait(0))), "B saw the joiner");
    q.run_until(&clock, 10 * S).unwrap();
    let w_at = granted_at(waiter.take());
    let r_at = granted_at(reservation.outcome());
    assert_eq!(w_at, S, "the waiter was moved by takes that were undone");
    assert_eq!(r_at, reservation.at_ns, "the reservation's promised time moved");
    check_windows([(0, 1.0), (w_at, burst as f64), (r_at, 1.0)], 1.0, burst);
}

/// A panic inside a queue's decision (here the caller's `wake`, run while the decision
/// is announced to fast paths) must not leave the queue counting a waiter that is not
/// there: every later fast path would be refused.
#[test]
fn a_panic_inside_a_decision_leaves_no_phantom_waiter() {
    let (clock, lim, q) = setup(1);
    let caught = catch_unwind(AssertUnwindSafe(|| {
        q.submit(&[1], 0, None, || panic!("wake failed")).ok();
    }));
    assert!(caught.is_err(), "the decision would queue, so wake ran");
    assert_eq!(q.depths(), vec![0], "nobody was queued");
    clock.set(5 * S).unwrap();
    assert_eq!(q.waiting(), 0, "a phantom waiter is counted");
    assert!(
        q.try_now(&[1], 0).is_ok(),
        "the fast path is refused for good after the panic"
    );
    assert!(lim.try_acquire_idle_nowait(&[1], || q.joined()).is_some());
}

/// The same through a reservation's `now_path` (run announced, when nobody waits).
#[test]
fn a_panic_in_a_reservations_now_path_leaves_no_phantom_waiter() {
    let (clock, _lim, q) = setup(2);
    let caught = catch_unwind(AssertUnwindSafe(|| {
        let _ = q.reserve(&[1], 0, None, |_| -> Result<(), ratequeue_core::Error> {
            panic!("now_path failed")
        });
    }));
    assert!(caught.is_err());
    clock.set(5 * S).unwrap();
    assert_eq!(q.waiting(), 0, "a phantom waiter is counted");
    assert!(q.try_now(&[1], 0).is_ok(), "the fast path is refused after the panic");
}

/// A keyed limiter's fast path (the bindings' `KeyedLimiter.try_acquire`, and
/// `KeyQueues::try_now`, the keyed acquire's): "nobody waits on the key", then the take.
/// A waiter of cost 2 joining the key's queue in between is scheduled at 1 s; the take
/// must not move it: the re-check after the take sees the joiner and undoes the take.
#[test]
fn keyed_fast_path_racing_a_joiner_keeps_its_schedule() {
    use ratequeue_core::keyed::KeyBucket;
    use ratequeue_core::keyed_queue::MakeResource;
    use ratequeue_core::{KeyQueues, KeyedLimiter};
    let clock = Arc::new(ManualClock::new(0).unwrap());
    let any = AnyClock::Manual(clock.clone());
    let keyed = Arc::new(KeyedLimiter::new(Rate::new(1.0, 1e9, 2).unwrap(), 1 << 10, any.clone()).unwrap());
    let k = 7;
    keyed.try_acquire(k, 1).unwrap();
    let keyed2 = keyed.clone();
    let make: MakeResource = Box::new(move |key| {
        Arc::new(KeyBucket {
            keyed: keyed2.clone(),
            key,
        })
    });
    let kq = KeyQueues::new(any, QueueConfig::new(Vec::new(), 100, None).unwrap(), 16, make).unwrap();
    assert!(!kq.has_waiters(k), "the fast path's check passes");
    let q = kq.get(k).unwrap();
    let slot = Slot::new();
    let s = q.queue().submit(&[2], 0, None, || Wake::Thread(slot.clone())).unwrap();
    assert!(matches!(s, Submitted::Queued(_)));
    let bucket = KeyBucket {
        keyed: keyed.clone(),
        key: k,
    };
    let joined = || kq.joined(k);
    let via_queue = Resource::try_take_token_idle_nowait(&bucket, 0, &[1], &joined);
    assert_eq!(
        via_queue,
        Some(Err(Deny::Wait(0))),
        "the keyed acquire's fast take is undone"
    );
    let fast = keyed.try_acquire_idle(k, 1, joined);
    assert_eq!(
        fast,
        Err(Deny::Wait(0)),
        "refused: a waiter joined the key before the take"
    );
    q.queue().run_until(&clock, 10 * S).unwrap();
    let w_at = granted_at(slot.take());
    let mut grants = vec![(0, 1.0), (w_at, 2.0)];
    if fast.is_ok() {
        grants.push((0, 1.0));
    }
    check_windows(grants, 1.0, 2);
    assert_eq!(w_at, S, "the take moved the waiter that joined before it");
}

/// A policy's fast path (the bindings' `Policy.try_acquire`: "nobody waits on any
/// level", then `Policy::try_acquire`). A waiter and a reservation joining a rate
/// level's queue in between are promised times the take must not move: the re-check
/// after the take sees them and undoes it.
#[test]
fn policy_fast_path_racing_a_joiner_keeps_the_promise() {
    use ratequeue_core::policy::{LevelQueues, QueueRef};
    use ratequeue_core::{Level, LevelArgs, LevelKind, Policy};
    struct Queues(Arc<WaitQueue>);
    impl LevelQueues for Queues {
        fn existing(&self, _key: u64) -> Option<QueueRef> {
            Some(QueueRef::new(self.0.clone()))
        }
    }
    let (clock, lim, q) = setup(2);
    let policy = Policy::new(vec![Level {
        name: "rate".into(),
        kind: LevelKind::Rate(lim.clone()),
        shadow: false,
        wake: None,
        queues: Some(Arc::new(Queues(q.clone()))),
    }])
    .unwrap();
    assert_eq!(q.waiting(), 0, "the policy's check passes");
    let (waiter, reservation) = join(&q, &lim, 2);
    assert_eq!(reservation.at_ns, 2 * S);
    let fast = policy.try_acquire(&[LevelArgs { key: 0, costs: vec![1] }], 0);
    assert!(
        fast.as_ref().is_err_and(|r| r.deny == Deny::Wait(0)),
        "refused: a waiter joined"
    );
    let kept: Vec<_> = fast.iter().map(|_| (0, 1.0)).collect();
    check_joiners(&q, &clock, (&waiter, &reservation), &kept, "the policy");
}
