//! The fast paths not covered by tests/fastpath_race.rs and fastpath_review.rs, each
//! against a waiter joining in its window (deterministic: a hook runs the join at the
//! exact point of the race): the batch branch of a keyed `try_acquire_many`, a policy
//! acquire's own fast path, a semaphore's fast path (which promises no time), and the
//! wake-up owed to a joiner after a fast take was undone.

mod common;

use std::sync::{Arc, Mutex};

use common::{check_joiners, check_windows, granted_at, S};
use ratequeue_core::bucket::Deny;
use ratequeue_core::keyed::{KeyBucket, KeyWaiters};
use ratequeue_core::keyed_queue::MakeResource;
use ratequeue_core::policy::{LevelQueues, QueueRef};
use ratequeue_core::wait::Slot;
use ratequeue_core::{
    AnyClock, KeyQueues, KeyedLimiter, Level, LevelArgs, LevelKind, Limiter, ManualClock, Policy, QueueConfig,
    QueuedReservation, Rate, Reserved, Resource, Semaphore, Submitted, WaitQueue, Wake,
};

type Hook = Box<dyn FnOnce() + Send>;

/// A waiter on a key: the queue's handle (keeping it in the map) and its slot.
type KeyJoiner = (Arc<ratequeue_core::KeyQueue>, Arc<Slot>);

fn config() -> QueueConfig {
    QueueConfig::new(Vec::new(), 100, None).unwrap()
}

/// A keyed limiter of one unit per second, burst 2, with key 7 one unit used at 0, and
/// its key queues.
fn keyed_setup() -> (Arc<ManualClock>, Arc<KeyedLimiter>, Arc<KeyQueues>) {
    let clock = Arc::new(ManualClock::new(0).unwrap());
    let any = AnyClock::Manual(clock.clone());
    let keyed = Arc::new(KeyedLimiter::new(Rate::new(1.0, 1e9, 2).unwrap(), 1 << 10, any.clone()).unwrap());
    keyed.try_acquire(7, 1).unwrap();
    let keyed2 = keyed.clone();
    let make: MakeResource = Box::new(move |key| {
        Arc::new(KeyBucket {
            keyed: keyed2.clone(),
            key,
        })
    });
    let kq = KeyQueues::new(any, config(), 16, make).unwrap();
    (clock, keyed, kq)
}

/// Key queues whose "nobody waits anywhere" check runs `hook` right after it answered
/// (the window between a batch's check and its takes).
struct HookedWaiters {
    inner: Arc<KeyQueues>,
    hook: Mutex<Option<Hook>>,
}

impl KeyWaiters for HookedWaiters {
    fn none(&self) -> bool {
        let none = KeyWaiters::none(&*self.inner);
        let hook = self.hook.lock().unwrap().take();
        if let Some(h) = hook {
            h();
        }
        none
    }
    fn has_waiters(&self, key: u64) -> bool {
        KeyWaiters::has_waiters(&*self.inner, key)
    }
    fn joined(&self, key: u64) -> bool {
        KeyWaiters::joined(&*self.inner, key)
    }
}

/// The batch branch of `KeyedLimiter.try_acquire_many` (no key had a queue at its
/// check): a waiter of cost 2 joining key 7 in the window is scheduled at 1 s; the batch
/// must not take the unit it stands on, and the other keys are still decided.
#[test]
fn keyed_batch_racing_a_joiner_keeps_its_schedule() {
    let (clock, keyed, kq) = keyed_setup();
    let joined: Arc<Mutex<Option<KeyJoiner>>> = Arc::default();
    let (kq2, j2) = (kq.clone(), joined.clone());
    let waiters = HookedWaiters {
        inner: kq.clone(),
        hook: Mutex::new(Some(Box::new(move || {
            let handle = kq2.get(7).unwrap();
            let slot = Slot::new();
            let s = handle
                .queue()
                .submit(&[2], 0, None, || Wake::Thread(slot.clone()))
                .unwrap();
            assert!(matches!(s, Submitted::Queued(_)), "the waiter must queue");
            *j2.lock().unwrap() = Some((handle, slot));
        }))),
    };
    let keys = [7u64, 8, 7, 8];
    let mut out = [false; 4];
    keyed.try_acquire_many_idle(&keys, None, &mut out, &waiters).unwrap();
    let (handle, slot) = joined.lock().unwrap().take().unwrap();
    handle.queue().run_until(&clock, 10 * S).unwrap();
    let w_at = granted_at(slot.take());
    let mut grants = vec![(0, 1.0), (w_at, 2.0)];
    grants.extend(out.iter().zip(keys).filter(|(ok, k)| **ok && *k == 7).map(|_| (0, 1.0)));
    check_windows(grants, 1.0, 2);
    assert_eq!(
        out,
        [false, true, false, true],
        "key 7 refused behind its waiter, key 8 decided"
    );
    assert_eq!(w_at, S, "the batch's take moved the waiter that joined before it");
}

/// The batch with a queue on a key from the start decides key by key: refused where
/// someone waits, decided elsewhere (as the loop of single calls would).
#[test]
fn keyed_batch_with_waiters_refuses_only_their_keys() {
    let (_clock, keyed, kq) = keyed_setup();
    let handle = kq.get(7).unwrap();
    let slot = Slot::new();
    let s = handle
        .queue()
        .submit(&[2], 0, None, || Wake::Thread(slot.clone()))
        .unwrap();
    assert!(matches!(s, Submitted::Queued(_)));
    let mut out = [false; 4];
    keyed
        .try_acquire_many_idle(&[7, 9, 9, 9], None, &mut out, &*kq)
        .unwrap();
    assert_eq!(out, [false, true, true, false]);
}

/// One unit per second, burst 2, one unit used at 0; a queue in front of it.
fn limiter_setup() -> (Arc<ManualClock>, Arc<Limiter>, Arc<WaitQueue>) {
    let clock = Arc::new(ManualClock::new(0).unwrap());
    let rates = vec![("requests".to_string(), Rate::new(1.0, 1e9, 2).unwrap())];
    let lim = Arc::new(Limiter::new(rates, AnyClock::Manual(clock.clone())).unwrap());
    lim.try_acquire(&[1]).unwrap();
    let q = WaitQueue::new(lim.clone(), 1, AnyClock::Manual(clock.clone()), config());
    (clock, lim, q)
}

/// Queues a waiter of cost 2 and a reservation of cost 1 promised a time behind it.
fn join(q: &Arc<WaitQueue>, lim: &Arc<Limiter>) -> (Arc<Slot>, QueuedReservation) {
    let slot = Slot::new();
    let s = q.submit(&[2], 0, None, || Wake::Thread(slot.clone())).unwrap();
    assert!(matches!(s, Submitted::Queued(_)), "the waiter must queue");
    let lim2 = lim.clone();
    let r = q.reserve(&[1], 0, None, move |_| lim2.reserve(&[1], None)).unwrap();
    let Reserved::Queued(r) = r else {
        panic!("the reservation must queue behind the waiter")
    };
    (slot, r)
}

/// A policy acquire's own fast path (`Policy::try_now`, the bindings' `Policy.acquire`
/// and `acquire_async` before they queue): "nobody waits on any level", then the take. A
/// waiter and a reservation joining in between are promised times the take must not
/// move: it is undone, and the acquire queues behind them.
#[test]
fn policy_acquire_fast_path_racing_a_joiner_keeps_the_promise() {
    struct Queues(Arc<WaitQueue>);
    impl LevelQueues for Queues {
        fn existing(&self, _key: u64) -> Option<QueueRef> {
            Some(QueueRef::new(self.0.clone()))
        }
    }
    let (clock, lim, q) = limiter_setup();
    let policy = Policy::new(vec![Level {
        name: "rate".into(),
        kind: LevelKind::Rate(lim.clone()),
        shadow: false,
        wake: None,
        queues: Some(Arc::new(Queues(q.clone()))),
    }])
    .unwrap();
    assert_eq!(q.waiting(), 0, "the acquire's check passes");
    let (waiter, reservation) = join(&q, &lim);
    assert_eq!(reservation.at_ns, 2 * S, "promised behind the waiter (1 s) at 2 s");
    let fast = policy.try_now(&[LevelArgs { key: 0, costs: vec![1] }], 0);
    let kept: Vec<_> = fast.iter().map(|_| (0, 1.0)).collect();
    check_joiners(&q, &clock, (&waiter, &reservation), &kept, "the acquire");
    assert!(
        fast.is_none(),
        "the acquire overtook the waiter that joined in its window"
    );
}

/// A semaphore's fast path promises no time, and is ordered at its check ("nobody
/// waits"): a waiter queued before that check is never passed, even when a permit is
/// free and the queue has not granted it yet; a waiter joining between the check and
/// the take may be passed (the two calls overlap, the fast path came first) and gets the
/// next permit. The permits in use never exceed the limit.
#[test]
fn semaphore_fast_path_is_ordered_at_its_check() {
    let clock = Arc::new(ManualClock::new(0).unwrap());
    let sem = Arc::new(Semaphore::new(1).unwrap());
    let q = WaitQueue::new(sem.clone(), 1, AnyClock::Manual(clock.clone()), config());
    q.try_now(&[1], 0).unwrap();
    // Queued before the check: a release that has not reached the queue yet frees a
    // permit, and the fast path still does not take it.
    let first = Slot::new();
    let s = q.submit(&[1], 0, None, || Wake::Thread(first.clone())).unwrap();
    assert!(matches!(s, Submitted::Queued(_)));
    sem.give_back(&[1], None);
    assert_eq!(q.try_now(&[1], 0), Err(None), "passed a waiter queued before its check");
    assert!(q.waiting() != 0, "the bindings' own check refuses too");
    q.poll_now();
    assert!(first.take().is_some(), "the waiter got the permit");
    // Joining in the window: the check passed, a waiter queues (no permit), a release
    // frees one before the take; the fast path takes it, the waiter gets the next one.
    assert_eq!(sem.in_use(), 1);
    let check_passed = true;
    let second = Slot::new();
    let s = q.submit(&[1], 0, None, || Wake::Thread(second.clone())).unwrap();
    assert!(matches!(s, Submitted::Queued(_)));
    sem.give_back(&[1], None);
    assert!(
        check_passed && Resource::try_take(&*sem, 0, &[1]).is_ok(),
        "the overlapping call is served"
    );
    assert_eq!(sem.in_use(), 1, "never above the limit");
    q.poll_now();
    assert!(second.take().is_none(), "no permit free: the waiter keeps its place");
    sem.give_back(&[1], None);
    q.poll_now();
    assert!(second.take().is_some(), "the waiter got the next permit");
    assert_eq!(sem.in_use(), 1);
}

/// Plays the real-time driver on a manual clock: polls only at the wake-ups the queue
/// asked for; returns the clock time at which `slot` was granted, and its grant time.
fn drive_until_granted(q: &Arc<WaitQueue>, clock: &ManualClock, slot: &Slot, until: u64) -> (u64, u64) {
    loop {
        let t = q
            .take_wake_asked()
            .expect("a waiter is queued, yet the driver was not asked");
        assert!(t <= until, "the driver was asked for {t} only");
        let now = clock.set(t.max(clock.now_ns())).unwrap();
        q.poll(now);
        if let Some(o) = slot.take() {
            return (now, granted_at(Some(o)));
        }
    }
}

/// `Limiter.try_acquire`'s fast path (a take, then the re-check): a waiter of cost 2
/// joins after the take, reads it and is scheduled at 2 s; the re-check sees it and
/// undoes the take, so the waiter can go at 1 s. The driver must be asked to look again,
/// or it sleeps until 2 s (the grant dated 1 s, but the waiter woken a second late).
#[test]
fn an_undone_fast_take_wakes_the_driver_for_the_joiner() {
    let (clock, lim, q) = limiter_setup();
    assert_eq!(q.waiting(), 0, "the caller's own check passes");
    let slot = Slot::new();
    let decided = lim.try_acquire_idle_nowait(&[1], || {
        let s = q.submit(&[2], 0, None, || Wake::Thread(slot.clone())).unwrap();
        assert!(matches!(s, Submitted::Queued(_)), "the waiter must queue");
        q.joined()
    });
    assert_eq!(
        decided,
        Some(Err(Deny::Wait(0))),
        "refused: a waiter joined before the re-check"
    );
    // What the bindings' try_acquire does after a take undone that way.
    q.rewake_after_undo();
    let (woken, at) = drive_until_granted(&q, &clock, &slot, 10 * S);
    assert_eq!(at, S, "granted at its time");
    assert_eq!(
        woken, S,
        "the driver slept past the joiner's time after the undone take"
    );
}
