//! The policy's tests on a ManualClock: levels, undo, queued reservations and the one
//! acquire lifecycle.

use super::*;
use crate::{AnyClock, ManualClock, Rate};

#[test]
fn all_or_nothing_and_shadow() {
    let clock = Arc::new(ManualClock::new(0).unwrap());
    let c = AnyClock::Manual(clock.clone());
    let user = Arc::new(KeyedLimiter::new(Rate::new(1.0, 1e9, 2).unwrap(), 100, c.clone()).unwrap());
    let tenant = Arc::new(KeyedSemaphore::new(1).unwrap());
    let cluster = Arc::new(
        Limiter::new(
            vec![("requests".into(), Rate::new(100.0, 1e9, 100).unwrap())],
            c.clone(),
        )
        .unwrap(),
    );
    let p = Policy::new(vec![
        Level {
            name: "user".into(),
            kind: LevelKind::KeyedRate(user.clone()),
            shadow: false,
            wake: None,
            queues: None,
        },
        Level {
            name: "tenant".into(),
            kind: LevelKind::KeyedConcurrency(tenant.clone()),
            shadow: false,
            wake: None,
            queues: None,
        },
        Level {
            name: "cluster".into(),
            kind: LevelKind::Rate(cluster.clone()),
            shadow: false,
            wake: None,
            queues: None,
        },
    ])
    .unwrap();
    let u = user.hasher().str("alice");
    let t = tenant.hasher().str("acme");
    let args = vec![
        LevelArgs { key: u, costs: vec![1] },
        LevelArgs { key: t, costs: vec![1] },
        LevelArgs { key: 0, costs: vec![1] },
    ];
    let held = p.try_acquire(&args, 0).unwrap();
    // Tenant concurrency is taken: refused, and the user's debit is undone.
    let r = p.try_acquire(&args, 0).unwrap_err();
    assert_eq!(r.level, 1);
    assert_eq!(user.available(u), 1.0);
    assert_eq!(cluster.available(0), 99.0);
    let mut held = held;
    p.release(1, &mut held[1]);
    assert!(p.try_acquire(&args, 0).is_ok());
    assert_eq!(p.counts(1).refused, 1);
}

fn one_level(kind: LevelKind, wake: Option<Waker>) -> Policy {
    Policy::new(vec![Level {
        name: "l".into(),
        kind,
        shadow: false,
        wake,
        queues: None,
    }])
    .unwrap()
}

#[test]
fn cancel_under_a_later_reservation_keeps_the_slot_and_settle_after_it_does_nothing() {
    let clock = Arc::new(ManualClock::new(0).unwrap());
    let lim = Arc::new(
        Limiter::new(
            vec![("requests".into(), Rate::new(1.0, 1e9, 1).unwrap())],
            AnyClock::Manual(clock.clone()),
        )
        .unwrap(),
    );
    let p = one_level(LevelKind::Rate(lim.clone()), None);
    let args = vec![LevelArgs { key: 0, costs: vec![1] }];
    let (d1, mut h1) = p.reserve(&args, 0, u64::MAX, false).unwrap();
    let (d2, _) = p.reserve(&args, 0, u64::MAX, false).unwrap();
    p.undo(0, &mut h1[0], &args[0], 0);
    let (d3, _) = p.reserve(&args, 0, u64::MAX, false).unwrap();
    assert_eq!((d1, d2, d3), (0, 1_000_000_000, 2_000_000_000));
    let zero = vec![LevelArgs { key: 0, costs: vec![0] }];
    p.settle(&mut h1, &args, &zero, 0);
    p.undo(0, &mut h1[0], &args[0], 0);
    assert_eq!(lim.refunds_dropped(), 1);
    assert_eq!(lim.delay_at(0, &[1]).unwrap(), 3_000_000_000);
}

#[test]
fn release_wakes_the_level_queue() {
    use crate::wait::{Outcome, QueueConfig, Slot, Submitted, WaitQueue, Wake};
    let clock = AnyClock::Manual(Arc::new(ManualClock::new(0).unwrap()));
    let sem = Arc::new(Semaphore::new(1).unwrap());
    let q = WaitQueue::new(sem.clone(), 1, clock, QueueConfig::new(vec![], 10, None).unwrap());
    let q2 = q.clone();
    let wake: Waker = Arc::new(move |_| {
        q2.poll_now();
    });
    let p = one_level(LevelKind::Concurrency(sem.clone()), Some(wake));
    let args = vec![LevelArgs { key: 0, costs: vec![1] }];
    let mut held = p.try_acquire(&args, 0).unwrap();
    let slot = Slot::new();
    let s2 = slot.clone();
    let sub = q.submit(&[1], 0, None, || Wake::Thread(s2)).unwrap();
    assert!(matches!(sub, Submitted::Queued(_)));
    p.release(0, &mut held[0]);
    assert!(matches!(slot.take(), Some(Outcome::Granted { .. })));
    assert_eq!(sem.in_use(), 1);
    p.release(0, &mut held[0]); // released once
    assert_eq!(sem.in_use(), 1);
}

// ---------------------------------------------------------------------------------
// a policy's wait joins its rate levels' queues (issue 10)

use crate::wait::{QueueConfig, Slot, Submitted, Wake};

const MS: u64 = 1_000_000;

struct Queues(Arc<WaitQueue>);

impl LevelQueues for Queues {
    fn existing(&self, _key: u64) -> Option<QueueRef> {
        Some(QueueRef::new(self.0.clone()))
    }
}

/// A Limiter of `per_sec` with `burst` and its queue, on `clock`.
fn queued_limiter(clock: &Arc<ManualClock>, per_sec: f64, burst: u64) -> (Arc<Limiter>, Arc<WaitQueue>) {
    let lim = Arc::new(
        Limiter::new(
            vec![("requests".into(), Rate::new(per_sec, 1e9, burst).unwrap())],
            AnyClock::Manual(clock.clone()),
        )
        .unwrap(),
    );
    let q = WaitQueue::new(
        lim.clone(),
        1,
        AnyClock::Manual(clock.clone()),
        QueueConfig::new(vec![], 100, None).unwrap(),
    );
    (lim, q)
}

fn rate_level(name: &str, lim: &Arc<Limiter>, q: &Arc<WaitQueue>) -> Level {
    Level {
        name: name.into(),
        kind: LevelKind::Rate(lim.clone()),
        shadow: false,
        wake: None,
        queues: Some(Arc::new(Queues(q.clone()))),
    }
}

fn waiter(q: &Arc<WaitQueue>) -> Arc<Slot> {
    let s = Slot::new();
    let s2 = s.clone();
    assert!(matches!(
        q.submit(&[1], 0, None, || Wake::Thread(s2)).unwrap(),
        Submitted::Queued(_)
    ));
    s
}

fn granted(s: &Slot) -> Option<u64> {
    match s.take() {
        Some(Outcome::Granted { at_ns, .. }) => Some(at_ns),
        _ => None,
    }
}

/// Rate(10, burst 1) used at 0, a waiter due at 0.1 s and a reservation promised at
/// 0.2 s queued.
fn backlogged() -> (
    Arc<ManualClock>,
    Arc<Limiter>,
    Arc<WaitQueue>,
    Arc<Slot>,
    QueuedReservation,
) {
    let clock = Arc::new(ManualClock::new(0).unwrap());
    let (lim, q) = queued_limiter(&clock, 10.0, 1);
    lim.try_acquire(&[1]).unwrap();
    let w = waiter(&q);
    let l = lim.clone();
    let Ok(Reserved::Queued(r)) = q.reserve(&[1], 0, None, move |_| l.reserve(&[1], None)) else {
        panic!("queued")
    };
    assert_eq!(r.at_ns, 200 * MS);
    (clock, lim, q, w, r)
}

fn one() -> Vec<LevelArgs> {
    vec![LevelArgs { key: 0, costs: vec![1] }]
}

#[test]
fn a_policy_waits_behind_a_levels_waiter_and_promised_reservation() {
    let (clock, lim, q, w, r) = backlogged();
    let p = Policy::new(vec![rate_level("l", &lim, &q)]).unwrap();
    let (delay, held) = p.reserve_queued(&one(), 0, u64::MAX).unwrap();
    assert_eq!(delay, 300 * MS, "behind the waiter (0.1 s) and the reservation (0.2 s)");
    assert!(matches!(held[0], Held::Queued(_)));
    let behind = waiter(&q);
    q.run_until(&clock, 1_000 * MS).unwrap();
    assert_eq!(granted(&w), Some(100 * MS));
    assert!(matches!(r.outcome(), Some(Outcome::Granted { at_ns, .. }) if at_ns == 200 * MS));
    let Held::Queued(h) = &held[0] else { unreachable!() };
    assert_eq!(h.grant().map(|g| g.at_ns), Some(300 * MS));
    assert_eq!(granted(&behind), Some(400 * MS));
}

#[test]
fn an_idle_level_is_debited_at_once_for_the_common_time() {
    let clock = Arc::new(ManualClock::new(0).unwrap());
    let (busy, bq) = queued_limiter(&clock, 10.0, 1);
    let (idle, iq) = queued_limiter(&clock, 1.0, 2);
    busy.try_acquire(&[1]).unwrap();
    let w = waiter(&bq);
    let p = Policy::new(vec![rate_level("idle", &idle, &iq), rate_level("busy", &busy, &bq)]).unwrap();
    let args = vec![
        LevelArgs { key: 0, costs: vec![1] },
        LevelArgs { key: 0, costs: vec![1] },
    ];
    let (delay, held) = p.reserve_queued(&args, 0, u64::MAX).unwrap();
    assert_eq!(delay, 200 * MS);
    assert!(matches!(held[0], Held::Rate(_)), "nobody waits there: debited at once");
    assert!(matches!(held[1], Held::Queued(_)));
    assert_eq!(idle.delay_at(200 * MS, &[1]).unwrap(), 0);
    assert!(idle.delay_at(200 * MS, &[2]).unwrap() > 0, "one unit held for 0.2 s");
    q_run(&bq, &clock, 1_000 * MS);
    assert_eq!(granted(&w), Some(100 * MS));
}

fn q_run(q: &Arc<WaitQueue>, clock: &ManualClock, until: u64) {
    q.run_until(clock, until).unwrap();
}

#[test]
fn a_later_level_moves_the_common_time_and_nothing_is_left_behind() {
    let clock = Arc::new(ManualClock::new(0).unwrap());
    let (busy, bq) = queued_limiter(&clock, 10.0, 1);
    let (slow, sq) = queued_limiter(&clock, 1.0, 1);
    busy.try_acquire(&[1]).unwrap();
    slow.try_acquire(&[1]).unwrap();
    let w = waiter(&bq);
    let p = Policy::new(vec![rate_level("busy", &busy, &bq), rate_level("slow", &slow, &sq)]).unwrap();
    let args = vec![
        LevelArgs { key: 0, costs: vec![1] },
        LevelArgs { key: 0, costs: vec![1] },
    ];
    let (delay, held) = p.reserve_queued(&args, 0, u64::MAX).unwrap();
    assert_eq!(delay, 1_000 * MS, "the slow level's time");
    let Held::Queued(h) = &held[0] else {
        panic!("queued behind the waiter")
    };
    assert_eq!(h.r.at_ns, 1_000 * MS);
    assert_eq!(bq.waiting(), 2);
    q_run(&bq, &clock, 2_000 * MS);
    assert_eq!(granted(&w), Some(100 * MS));
    assert_eq!(h.grant().map(|g| g.at_ns), Some(1_000 * MS));
}

#[test]
fn beyond_max_wait_nothing_is_held() {
    let (clock, lim, q, w, _r) = backlogged();
    let p = Policy::new(vec![rate_level("l", &lim, &q)]).unwrap();
    let Err(Refused::Level(r)) = p.reserve_queued(&one(), 0, 250 * MS) else {
        panic!("refused")
    };
    assert_eq!(r.deny, Deny::Wait(300 * MS));
    assert_eq!(q.waiting(), 2);
    assert_eq!(p.counts(0).refused, 1);
    q_run(&q, &clock, 1_000 * MS);
    assert_eq!(granted(&w), Some(100 * MS));
    assert!(lim.try_acquire(&[1]).is_ok());
}

#[test]
fn undo_before_the_time_leaves_the_queue_and_after_it_keeps_the_slot() {
    let (clock, lim, q, _w, _r) = backlogged();
    let p = Policy::new(vec![rate_level("l", &lim, &q)]).unwrap();
    let (_, mut held) = p.reserve_queued(&one(), 0, u64::MAX).unwrap();
    let behind = waiter(&q);
    p.undo_all(&mut held, &one(), 0);
    p.undo_all(&mut held, &one(), 0); // once
    q_run(&q, &clock, 1_000 * MS);
    assert_eq!(granted(&behind), Some(300 * MS), "moved up into the policy's slot");

    let (delay, mut held) = p.reserve_queued(&one(), clock.now_ns(), u64::MAX).unwrap();
    assert_eq!(delay, 0, "idle: debited at once");
    let now = clock.now_ns();
    p.undo_all(&mut held, &one(), now);
    assert!(lim.try_acquire(&[1]).is_ok(), "exact undo of the latest debit");

    let (clock, lim, q, _w, _r) = backlogged();
    let p = Policy::new(vec![rate_level("l", &lim, &q)]).unwrap();
    let (_, mut held) = p.reserve_queued(&one(), 0, u64::MAX).unwrap();
    q_run(&q, &clock, 300 * MS);
    p.undo_all(&mut held, &one(), 300 * MS);
    assert_eq!(
        lim.delay_at(300 * MS, &[1]).unwrap(),
        100 * MS,
        "kept: granted at its time"
    );
}

#[test]
fn a_settle_before_the_grant_is_what_the_grant_debits_and_is_not_refunded_twice() {
    let clock = Arc::new(ManualClock::new(0).unwrap());
    let (lim, q) = queued_limiter(&clock, 10.0, 5);
    lim.try_acquire(&[5]).unwrap();
    let _w = waiter(&q);
    let p = Policy::new(vec![rate_level("l", &lim, &q)]).unwrap();
    let est = vec![LevelArgs { key: 0, costs: vec![3] }];
    let (delay, mut held) = p.reserve_queued(&est, 0, u64::MAX).unwrap();
    assert_eq!(delay, 400 * MS);
    let less = vec![LevelArgs { key: 0, costs: vec![1] }];
    p.settle(&mut held, &est, &less, 0);
    q_run(&q, &clock, 400 * MS);
    // Five units at 0, the waiter's at 0.1 s, the hold's one (not three) at 0.4 s.
    assert_eq!(
        lim.delay_at(400 * MS, &[3]).unwrap(),
        100 * MS,
        "the grant debits what the hold settled to"
    );
    p.settle(&mut held, &est, &less, 400 * MS);
    assert_eq!(
        lim.delay_at(400 * MS, &[3]).unwrap(),
        100 * MS,
        "nothing refunded twice"
    );
}

// ---------------------------------------------------------------------------------
// the one policy acquire lifecycle (PolicyAcquire)

fn sem_level(clock: &Arc<ManualClock>, limit: u64) -> (Level, Arc<Semaphore>, Arc<WaitQueue>) {
    let sem = Arc::new(Semaphore::new(limit).unwrap());
    let q = WaitQueue::new(
        sem.clone(),
        1,
        AnyClock::Manual(clock.clone()),
        QueueConfig::new(vec![], 100, None).unwrap(),
    );
    let q2 = q.clone();
    let wake: Waker = Arc::new(move |_| {
        q2.poll_now();
    });
    let level = Level {
        name: "slots".into(),
        kind: LevelKind::Concurrency(sem.clone()),
        shadow: false,
        wake: Some(wake),
        queues: Some(Arc::new(Queues(q.clone()))),
    };
    (level, sem, q)
}

fn thread_wake(slot: &Arc<Slot>) -> impl Fn() -> Wake + '_ {
    move || Wake::Thread(slot.clone())
}

#[test]
fn an_acquire_waits_in_the_concurrency_queue_behind_its_waiter_then_holds_the_rate() {
    let (clock, lim, lq, w, _r) = backlogged();
    let (slots, sem, sq) = sem_level(&clock, 1);
    let p = Arc::new(Policy::new(vec![slots, rate_level("api", &lim, &lq)]).unwrap());
    let args = vec![
        LevelArgs { key: 0, costs: vec![1] },
        LevelArgs { key: 0, costs: vec![1] },
    ];
    // A holder and a plain waiter on the semaphore before the policy.
    sq.try_now(&[1], 0).unwrap();
    let first = waiter(&sq);
    let acq = PolicyAcquire::new(p.clone(), args.clone(), AnyClock::Manual(clock.clone()), None);
    let slot = Slot::new();
    let Step::Queued(_) = acq.advance(&thread_wake(&slot)).unwrap() else {
        panic!("the semaphore is taken")
    };
    sq.give_back(&[1], None); // the holder leaves: the plain waiter goes first
    assert_eq!(granted(&first), Some(0));
    assert!(slot.take().is_none(), "FIFO: the policy is behind the waiter");
    clock.advance(50 * MS).unwrap();
    sq.give_back(&[1], None);
    let o = slot.take().expect("granted when the waiter left");
    acq.outcome(o).unwrap();
    let Step::Done {
        delay_ns,
        waited_ns,
        mut held,
    } = acq.advance(&thread_wake(&slot)).unwrap()
    else {
        panic!("every level held")
    };
    assert_eq!((waited_ns, delay_ns), (50 * MS, 250 * MS), "rate level behind its two");
    assert!(matches!(held[0], Held::Permits(1)) && matches!(held[1], Held::Queued(_)));
    assert_eq!(sem.in_use(), 1);
    q_run(&lq, &clock, 1_000 * MS);
    assert_eq!(granted(&w), Some(100 * MS));
    p.release(0, &mut held[0]);
    assert_eq!(sem.in_use(), 0);
}

#[test]
fn a_timeout_in_a_queue_gives_everything_back() {
    let clock = Arc::new(ManualClock::new(0).unwrap());
    let (a, sem_a, _qa) = sem_level(&clock, 1);
    let (b, sem_b, qb) = sem_level(&clock, 1);
    let p = Arc::new(Policy::new(vec![a, b]).unwrap());
    let args = vec![
        LevelArgs { key: 0, costs: vec![1] },
        LevelArgs { key: 0, costs: vec![1] },
    ];
    qb.try_now(&[1], 0).unwrap();
    let acq = PolicyAcquire::new(p, args, AnyClock::Manual(clock.clone()), Some(200 * MS));
    let slot = Slot::new();
    assert!(matches!(acq.advance(&thread_wake(&slot)).unwrap(), Step::Queued(_)));
    assert_eq!(
        sem_a.in_use(),
        1,
        "the first level is held while waiting for the second"
    );
    q_run(&qb, &clock, 200 * MS);
    let e = acq.outcome(slot.take().expect("timed out")).unwrap_err();
    assert!(
        matches!(e, Error::WaitTimeout { waited_ns, .. } if waited_ns == 200 * MS),
        "{e:?}"
    );
    assert_eq!((sem_a.in_use(), sem_b.in_use()), (0, 1));
    assert!(acq.advance(&thread_wake(&slot)).is_err(), "finished");
}

#[test]
fn abandon_leaves_the_queue_or_gives_back_the_grant_that_raced_it_once() {
    let clock = Arc::new(ManualClock::new(0).unwrap());
    let (a, sem_a, _qa) = sem_level(&clock, 1);
    let (b, sem_b, qb) = sem_level(&clock, 1);
    let p = Arc::new(Policy::new(vec![a, b]).unwrap());
    let args = vec![
        LevelArgs { key: 0, costs: vec![1] },
        LevelArgs { key: 0, costs: vec![1] },
    ];
    qb.try_now(&[1], 0).unwrap();

    let acq = PolicyAcquire::new(p.clone(), args.clone(), AnyClock::Manual(clock.clone()), None);
    let slot = Slot::new();
    acq.advance(&thread_wake(&slot)).unwrap();
    let behind = waiter(&qb);
    assert!(acq.abandon(), "left the queue");
    assert!(acq.abandon(), "once");
    assert_eq!(sem_a.in_use(), 0);
    qb.give_back(&[1], None);
    assert_eq!(granted(&behind), Some(0), "the waiter behind moved up");

    // The queue grants the acquire, then the waiter abandons before seeing it.
    let acq = PolicyAcquire::new(p, args, AnyClock::Manual(clock.clone()), None);
    let slot = Slot::new();
    acq.advance(&thread_wake(&slot)).unwrap();
    assert_eq!((sem_a.in_use(), sem_b.in_use()), (1, 1));
    qb.give_back(&[1], None); // released by the waiter that moved up: granted to the acquire
    assert_eq!(sem_b.in_use(), 1);
    acq.abandon_slot(&slot);
    assert_eq!((sem_a.in_use(), sem_b.in_use()), (0, 0));
    acq.abandon_slot(&slot);
    assert_eq!((sem_a.in_use(), sem_b.in_use()), (0, 0));
}

#[test]
fn a_grant_to_a_closed_channel_goes_back_and_abandon_frees_the_rest() {
    let clock = Arc::new(ManualClock::new(0).unwrap());
    let (a, sem_a, _qa) = sem_level(&clock, 1);
    let (b, sem_b, qb) = sem_level(&clock, 1);
    let p = Arc::new(Policy::new(vec![a, b]).unwrap());
    let args = vec![
        LevelArgs { key: 0, costs: vec![1] },
        LevelArgs { key: 0, costs: vec![1] },
    ];
    qb.try_now(&[1], 0).unwrap();
    let acq = PolicyAcquire::new(p, args, AnyClock::Manual(clock), None);
    let ch = crate::wait::Channel::new();
    let c2 = ch.clone();
    let Step::Queued(_) = acq.advance(&move || Wake::Channel(c2.clone())).unwrap() else {
        panic!("queued")
    };
    assert!(ch.close().is_empty());
    qb.give_back(&[1], None); // granted to the closed channel: back to the queue
    assert_eq!(sem_b.in_use(), 0);
    assert!(!acq.abandon(), "the queue decided already");
    assert_eq!((sem_a.in_use(), sem_b.in_use()), (0, 0));
    assert!(qb.try_now(&[1], 0).is_ok());
}

#[test]
fn a_cost_no_level_can_ever_grant_is_refused_before_any_wait() {
    let clock = Arc::new(ManualClock::new(0).unwrap());
    let (a, sem_a, qa) = sem_level(&clock, 1);
    let (lim, lq) = queued_limiter(&clock, 10.0, 1);
    let p = Arc::new(Policy::new(vec![a, rate_level("api", &lim, &lq)]).unwrap());
    qa.try_now(&[1], 0).unwrap();
    let args = vec![
        LevelArgs { key: 0, costs: vec![1] },
        LevelArgs { key: 0, costs: vec![2] },
    ];
    let acq = PolicyAcquire::new(p, args, AnyClock::Manual(clock), None);
    let e = acq.advance(&|| Wake::Thread(Slot::new())).unwrap_err();
    assert!(matches!(e, Error::CostTooLarge { .. }), "{e:?}");
    assert_eq!((qa.waiting(), sem_a.in_use()), (0, 1));
}

// ---------------------------------------------------------------------------------
// review (issue 10): a wait that timed out while its waiter left ends its level's use

/// Counts the waits ended on a level (its `done` calls).
struct Counted(Arc<WaitQueue>, Arc<std::sync::atomic::AtomicUsize>);

impl LevelQueues for Counted {
    fn existing(&self, _key: u64) -> Option<QueueRef> {
        Some(QueueRef::new(self.0.clone()))
    }

    fn done(&self, _key: u64) {
        self.1.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }
}

#[test]
fn a_timeout_racing_an_abandon_ends_the_wait_on_its_level() {
    use crate::concurrency::Semaphore;
    use crate::wait::Outcome;
    use std::sync::atomic::{AtomicUsize, Ordering as O};
    let clock = Arc::new(ManualClock::new(0).unwrap());
    let sem = Arc::new(Semaphore::new(1).unwrap());
    let q = WaitQueue::new(
        sem.clone(),
        1,
        AnyClock::Manual(clock.clone()),
        QueueConfig::new(vec![], 10, None).unwrap(),
    );
    let ended = Arc::new(AtomicUsize::new(0));
    let policy = Arc::new(
        Policy::new(vec![Level {
            name: "slots".into(),
            kind: LevelKind::Concurrency(sem.clone()),
            shadow: false,
            wake: None,
            queues: Some(Arc::new(Counted(q.clone(), ended.clone()))),
        }])
        .unwrap(),
    );
    let args = vec![LevelArgs { key: 0, costs: vec![1] }];
    let mut first = policy.try_acquire(&args, 0).unwrap();
    for blocking in [true, false] {
        let before = ended.load(O::SeqCst);
        let pa = PolicyAcquire::new(
            policy.clone(),
            args.clone(),
            AnyClock::Manual(clock.clone()),
            Some(10 * MS),
        );
        let slot = Slot::new();
        assert!(matches!(
            pa.advance(&|| Wake::Thread(slot.clone())),
            Ok(Step::Queued(_))
        ));
        clock.advance(20 * MS).unwrap();
        q.poll_now(); // the queue times it out: the outcome is on its way
        if blocking {
            // Ctrl-C while the timeout was on its way.
            pa.abandon_slot(&slot);
        } else {
            // A task cancelled while the timeout was on its way, which then arrives.
            assert!(!pa.abandon());
            let o = slot.take().unwrap();
            assert!(matches!(o, Outcome::TimedOut { .. }));
            pa.outcome(o).unwrap();
        }
        assert_eq!(ended.load(O::SeqCst), before + 1, "blocking={blocking}");
        assert_eq!(q.waiting(), 0);
    }
    assert_eq!(sem.in_use(), 1);
    policy.release(0, &mut first[0]);
    assert_eq!(sem.in_use(), 0);
}

// ---------------------------------------------------------------------------------
// review of issue 10's owed overages (c5000b4, b7026bc)

fn two() -> Vec<LevelArgs> {
    vec![LevelArgs { key: 0, costs: vec![2] }]
}

fn zero() -> Vec<LevelArgs> {
    vec![LevelArgs { key: 0, costs: vec![0] }]
}

#[test]
fn a_queued_hold_settled_up_before_its_grant_is_not_charged_again_after_it() {
    // Rate(10, burst 1): one unit per 0.1 s. Used at 0, a waiter due at 0.1 s.
    let clock = Arc::new(ManualClock::new(0).unwrap());
    let (lim, q) = queued_limiter(&clock, 10.0, 1);
    lim.try_acquire(&[1]).unwrap();
    let w = waiter(&q);
    let p = Policy::new(vec![rate_level("l", &lim, &q)]).unwrap();
    let (delay, mut held) = p.reserve_queued(&one(), 0, u64::MAX).unwrap();
    assert_eq!(delay, 200 * MS);
    // Settled to 2 before the grant: one unit owed, debited behind the hold.
    p.settle(&mut held, &one(), &two(), 0);
    q_run(&q, &clock, 250 * MS);
    assert_eq!(granted(&w), Some(100 * MS));
    // The same settle again (the permit already holds 2): nothing more to charge.
    p.settle(&mut held, &two(), &two(), 250 * MS);
    // Held: the waiter's unit to 0.2 s, the hold's to 0.3 s, its overage to 0.4 s.
    assert_eq!(
        lim.delay_at(250 * MS, &[1]).unwrap(),
        150 * MS,
        "the overage was charged twice"
    );
}

#[test]
fn a_queued_hold_settled_down_after_its_grant_cancels_what_it_owes() {
    let clock = Arc::new(ManualClock::new(0).unwrap());
    let (lim, q) = queued_limiter(&clock, 10.0, 1);
    lim.try_acquire(&[1]).unwrap();
    let w = waiter(&q); // due 0.1 s
    let p = Policy::new(vec![rate_level("l", &lim, &q)]).unwrap();
    let (delay, mut held) = p.reserve_queued(&one(), 0, u64::MAX).unwrap();
    assert_eq!(delay, 200 * MS);
    let l = lim.clone();
    let Ok(Reserved::Queued(r)) = q.reserve(&[1], 0, None, move |_| l.reserve(&[1], None)) else {
        panic!("queued")
    };
    assert_eq!(r.at_ns, 300 * MS);
    // Settled to 2 before the grant: one unit owed, behind the reservation (0.3 s).
    p.settle(&mut held, &one(), &two(), 0);
    q_run(&q, &clock, 250 * MS);
    assert_eq!(granted(&w), Some(100 * MS));
    // Nothing used after all, while the overage is still owed: it is cancelled first.
    p.settle(&mut held, &two(), &zero(), 250 * MS);
    q_run(&q, &clock, 350 * MS);
    assert!(matches!(r.outcome(), Some(Outcome::Granted { at_ns, .. }) if at_ns == 300 * MS));
    assert_eq!(q.waiting(), 0);
    // The reservation's unit ends at 0.4 s; the cancelled overage must not follow it.
    assert_eq!(
        lim.delay_at(350 * MS, &[1]).unwrap(),
        50 * MS,
        "the owed overage was kept"
    );
}

#[test]
fn a_rate_hold_settled_back_down_cancels_the_overage_it_queued() {
    // Rate(10, burst 1). A policy debit at 0 (nobody waits), then a waiter (due 0.1 s)
    // and a reservation (promised 0.2 s) queue on the level.
    let clock = Arc::new(ManualClock::new(0).unwrap());
    let (lim, q) = queued_limiter(&clock, 10.0, 1);
    let p = Policy::new(vec![rate_level("l", &lim, &q)]).unwrap();
    let mut held = p.try_acquire(&one(), 0).unwrap();
    assert!(matches!(held[0], Held::Rate(_)));
    let w = waiter(&q);
    let l = lim.clone();
    let Ok(Reserved::Queued(r)) = q.reserve(&[1], 0, None, move |_| l.reserve(&[1], None)) else {
        panic!("queued")
    };
    assert_eq!(r.at_ns, 200 * MS);
    // Settled up: the overage is owed in the queue, behind the reservation.
    p.settle(&mut held, &one(), &two(), 0);
    assert_eq!(q.waiting(), 3);
    // Settled back to the estimate: what it owes is cancelled (as a Limiter permit's
    // is), not the unit it used at 0 refunded while the overage stays owed for later.
    p.settle(&mut held, &two(), &one(), 0);
    let owed = q.waiting() - 2;
    q_run(&q, &clock, 250 * MS);
    // One unit per 0.1 s at burst 1: the policy's unit at 0, the waiter's at 0.1 s (not
    // at 0 on the policy's slot: two units in one slot), the reservation's at 0.2 s.
    assert_eq!(
        (owed, granted(&w)),
        (0, Some(100 * MS)),
        "(charges still owed, the waiter's grant time)"
    );
    assert!(matches!(r.outcome(), Some(Outcome::Granted { at_ns, .. }) if at_ns == 200 * MS));
    assert_eq!(lim.delay_at(250 * MS, &[1]).unwrap(), 50 * MS);
}

#[test]
fn an_undo_gives_back_what_a_rate_hold_still_owes_too() {
    let clock = Arc::new(ManualClock::new(0).unwrap());
    let (lim, q) = queued_limiter(&clock, 10.0, 1);
    let p = Policy::new(vec![rate_level("l", &lim, &q)]).unwrap();
    let mut held = p.try_acquire(&one(), 0).unwrap();
    let w = waiter(&q); // due 0.1 s
    let l = lim.clone();
    let Ok(Reserved::Queued(r)) = q.reserve(&[1], 0, None, move |_| l.reserve(&[1], None)) else {
        panic!("queued")
    };
    p.settle(&mut held, &one(), &two(), 0); // one unit owed behind the reservation
    assert_eq!(q.waiting(), 3);
    // Cancelled: everything it took comes back, the owed unit included.
    p.undo_all(&mut held, &two(), 0);
    assert_eq!(q.waiting(), 2, "the owed overage outlived the undo");
    q_run(&q, &clock, 250 * MS);
    assert_eq!(granted(&w), Some(0));
    assert!(matches!(r.outcome(), Some(Outcome::Granted { at_ns, .. }) if at_ns == 200 * MS));
}
