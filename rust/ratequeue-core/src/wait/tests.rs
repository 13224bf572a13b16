use super::*;
use crate::{Limiter, ManualClock, Rate};

fn setup(per_sec: f64, burst: u64, classes: Vec<(String, f64)>) -> (Arc<WaitQueue>, Arc<ManualClock>) {
    let clock = Arc::new(ManualClock::new(0).unwrap());
    let lim = Limiter::new(
        vec![("requests".into(), Rate::new(per_sec, 1e9, burst).unwrap())],
        AnyClock::Manual(clock.clone()),
    )
    .unwrap();
    let q = WaitQueue::new(
        Arc::new(lim),
        1,
        AnyClock::Manual(clock.clone()),
        QueueConfig::new(classes, 1_000_000, None).unwrap(),
    );
    (q, clock)
}

fn granted(slot: &Slot) -> Option<u64> {
    match slot.take() {
        Some(Outcome::Granted { at_ns, .. }) => Some(at_ns),
        _ => None,
    }
}

#[test]
fn prediction_per_class_is_the_fair_queue_wait() {
    let (q, clock) = setup(1.0, 1, vec![("hi".into(), 9.0), ("lo".into(), 1.0)]);
    let slots: Vec<_> = (0..12).map(|_| Slot::new()).collect();
    let mut tickets = vec![];
    for s in &slots[..11] {
        let s2 = s.clone();
        tickets.push(q.submit(&[1], 1, None, || Wake::Thread(s2)).unwrap());
    }
    assert!(matches!(tickets[0], Submitted::Granted { .. }));
    let hi = q.predict_delay_in(&[1], 0).unwrap().unwrap().1;
    let lo = q.predict_delay_in(&[1], 1).unwrap().unwrap().1;
    assert_eq!((hi, lo), (2_000_000_000, 11_000_000_000));
    let s = slots[11].clone();
    q.submit(&[1], 0, None, || Wake::Thread(s)).unwrap();
    q.run_until(&clock, 30_000_000_000).unwrap();
    assert_eq!(granted(&slots[11]), Some(hi));
    assert_eq!(granted(&slots[10]), Some(11_000_000_000));
}

#[test]
fn a_passed_deadline_fails_at_once() {
    let sem = Arc::new(crate::Semaphore::new(1).unwrap());
    let clock = Arc::new(ManualClock::new(0).unwrap());
    let q = WaitQueue::new(
        sem,
        1,
        AnyClock::Manual(clock),
        QueueConfig::new(vec![], 10, None).unwrap(),
    );
    assert!(matches!(
        q.submit(&[1], 0, None, || Wake::Thread(Slot::new())),
        Ok(Submitted::Granted { .. })
    ));
    let r = q.submit(&[1], 0, Some(0), || Wake::Thread(Slot::new()));
    assert!(matches!(r, Err(Error::WaitTimeout { waited_ns: 0, .. })), "{r:?}");
    assert_eq!(q.waiting(), 0);
    let r = q.submit(&[1], 0, Some(1), || Wake::Thread(Slot::new()));
    assert!(matches!(r, Ok(Submitted::Queued(_))));
}

#[test]
fn one_class_grants_follow_lindley() {
    let (q, clock) = setup(100.0, 2, vec![]);
    let slots: Vec<_> = (0..6).map(|_| Slot::new()).collect();
    let mut tickets = vec![];
    for s in &slots {
        let s2 = s.clone();
        tickets.push(q.submit(&[1], 0, None, || Wake::Thread(s2)).unwrap());
    }
    assert!(matches!(tickets[0], Submitted::Granted { .. }));
    assert!(matches!(tickets[2], Submitted::Queued(_)));
    q.run_until(&clock, 1_000_000_000).unwrap();
    for (k, s) in slots[2..].iter().enumerate() {
        let at = granted(s).unwrap();
        assert!(at.abs_diff(10_000_000 * (k as u64 + 1)) <= 1, "{at}");
    }
}

#[test]
fn no_barging_and_fast_path_blocked_while_waiting() {
    let (q, _clock) = setup(1.0, 1, vec![]);
    assert!(q.try_now(&[1], 0).is_ok());
    let s = Slot::new();
    let s2 = s.clone();
    assert!(matches!(
        q.submit(&[1], 0, None, || Wake::Thread(s2)).unwrap(),
        Submitted::Queued(_)
    ));
    assert_eq!(q.try_now(&[1], 0), Err(None));
}

#[test]
fn weighted_shares_when_backlogged() {
    let (q, clock) = setup(1000.0, 1, vec![("a".into(), 8.0), ("b".into(), 1.0)]);
    let mut slots = vec![];
    for i in 0..9000 {
        let class = i % 2;
        let s = Slot::new();
        let s2 = s.clone();
        q.submit(&[1], class, None, || Wake::Thread(s2)).unwrap();
        slots.push((class, s));
    }
    q.run_until(&clock, 900_000_000).unwrap();
    let mut got = [0usize; 2];
    for (c, s) in &slots {
        if granted(s).is_some() {
            got[*c] += 1;
        }
    }
    let share = got[0] as f64 / (got[0] + got[1]) as f64;
    assert!((share - 8.0 / 9.0).abs() < 0.01, "{got:?}");
}

#[test]
fn deadline_expires_and_predicted_refusal() {
    let (q, clock) = setup(1.0, 1, vec![]);
    q.try_now(&[1], 0).unwrap();
    // FIFO wait of 1 s is known: a 0.5 s deadline is refused at once.
    assert!(matches!(
        q.submit(&[1], 0, Some(500_000_000), || unreachable!()),
        Err(Error::Overloaded { .. })
    ));
    let s = Slot::new();
    let s2 = s.clone();
    q.submit(&[1], 0, Some(2_000_000_000), || Wake::Thread(s2)).unwrap();
    q.run_until(&clock, 3_000_000_000).unwrap();
    assert!(matches!(
        s.take(),
        Some(Outcome::Granted {
            at_ns: 1_000_000_000,
            waited_ns: 1_000_000_000,
            ..
        })
    ));
}

/// Says it is ready now but never lets a take through.
struct Stuck;

impl Resource for Stuck {
    fn try_take(&self, _: u64, _: &[u64]) -> Result<(), Deny> {
        Err(Deny::Wait(0))
    }
    fn ready_at(&self, at_ns: u64, _: &[u64]) -> Result<Option<u64>, Deny> {
        Ok(Some(at_ns))
    }
    fn take_at(&self, _: u64, _: &[u64]) -> Result<u64, Deny> {
        Err(Deny::Wait(0))
    }
    fn give_back(&self, _: &[u64], _: Option<u64>) {}
    fn service_ns(&self, _: &[u64]) -> f64 {
        1.0
    }
    fn error_for(&self, d: Deny) -> Error {
        Error::Overloaded {
            reason: format!("{d:?}"),
            retry_after_ns: 0,
        }
    }
    fn predict(&self, _: u64, _: &[u64], _: &[u64]) -> Option<u64> {
        None
    }
}

#[test]
fn run_until_never_spins() {
    let clock = Arc::new(ManualClock::new(1 << 62).unwrap());
    let cfg = QueueConfig::new(vec![], 10, None).unwrap();
    let q = WaitQueue::new(Arc::new(Stuck), 1, AnyClock::Manual(clock.clone()), cfg);
    assert!(matches!(
        q.submit(&[1], 0, None, || Wake::Thread(Slot::new())),
        Ok(Submitted::Queued(_))
    ));
    // A waiter due now that can be neither granted nor expired: an error, not a spin.
    let e = q.run_until(&clock, (1 << 62) + 1_000).unwrap_err();
    assert!(e.to_string().contains("cannot be reached"), "{e}");
    // A time beyond the clock's range: refused before the clock moves.
    let e = q.run_until(&clock, u64::MAX).unwrap_err();
    assert!(e.to_string().starts_with("until="), "{e}");
    assert_eq!(clock.now_ns(), 1 << 62);
}

#[test]
fn run_until_far_from_zero_grants_like_at_zero() {
    for start in [1u64 << 62, 1_764_000_000_123_456_789] {
        let clock = Arc::new(ManualClock::new(start).unwrap());
        let lim = Limiter::new(
            vec![("requests".into(), Rate::new(100.0, 1e9, 2).unwrap())],
            AnyClock::Manual(clock.clone()),
        )
        .unwrap();
        let cfg = QueueConfig::new(vec![], 100, None).unwrap();
        let q = WaitQueue::new(Arc::new(lim), 1, AnyClock::Manual(clock.clone()), cfg);
        let slots: Vec<_> = (0..6).map(|_| Slot::new()).collect();
        for s in &slots {
            let s2 = s.clone();
            q.submit(&[1], 0, None, || Wake::Thread(s2)).unwrap();
        }
        assert_eq!(q.run_until(&clock, start + 1_000_000_000).unwrap(), 4);
        for (k, s) in slots[2..].iter().enumerate() {
            let at = granted(s).unwrap() - start;
            assert!(at.abs_diff(10_000_000 * (k as u64 + 1)) <= 1, "{at}");
        }
    }
}

#[test]
fn queued_cost_totals_never_wrap() {
    let big = 1u64 << 56;
    let (q, _clock) = setup(1e9, big, vec![]);
    q.try_now(&[big], 0).unwrap();
    let mut last = q.predict(&[big]).unwrap();
    for i in 0..300 {
        assert!(matches!(
            q.submit(&[big], 0, None, || Wake::Thread(Slot::new())).unwrap(),
            Submitted::Queued(_)
        ));
        let t = q.predict(&[big]).unwrap();
        assert!(t >= last, "after {} waiters: {t} < {last}", i + 1);
        last = t;
    }
    assert!(matches!(
        q.submit(&[big], 0, Some(1 << 50), || unreachable!()),
        Err(Error::Overloaded { .. })
    ));
}

#[test]
fn cancel_restores_capacity() {
    let (q, clock) = setup(10.0, 1, vec![]);
    q.try_now(&[1], 0).unwrap();
    let mut tickets = vec![];
    for _ in 0..100 {
        if let Submitted::Queued(t) = q.submit(&[1], 0, None, || Wake::Thread(Slot::new())).unwrap() {
            tickets.push(t);
        }
    }
    for t in &tickets {
        assert_eq!(q.cancel(*t), Cancelled::Removed);
    }
    assert_eq!(q.waiting(), 0);
    clock.advance(100_000_000).unwrap();
    assert!(q.try_now(&[1], 0).is_ok());
}

fn rate_queue(per_sec: f64, burst: u64, max_queue: usize) -> (Arc<WaitQueue>, Arc<Limiter>, Arc<ManualClock>) {
    let clock = Arc::new(ManualClock::new(0).unwrap());
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
        QueueConfig::new(vec![], max_queue, None).unwrap(),
    );
    (q, lim, clock)
}

fn reserve(
    q: &Arc<WaitQueue>,
    lim: &Arc<Limiter>,
    max_wait: Option<u64>,
) -> Result<Reserved<crate::Reservation>, Error> {
    let l = lim.clone();
    q.reserve(&[1], 0, max_wait, move |_| l.reserve(&[1], max_wait))
}

fn queued_waiter(q: &Arc<WaitQueue>) -> (u64, Arc<Slot>) {
    let s = Slot::new();
    let s2 = s.clone();
    match q.submit(&[1], 0, None, || Wake::Thread(s2)).unwrap() {
        Submitted::Queued(t) => (t, s),
        other => panic!("not queued: {other:?}"),
    }
}

#[test]
fn reserve_queues_behind_a_waiter_and_moves_nobody() {
    let (q, lim, clock) = rate_queue(10.0, 1, 100);
    let Reserved::Now(first) = reserve(&q, &lim, None).unwrap() else {
        panic!("an idle queue reserves at once")
    };
    assert_eq!(first.delay_ns, 0);
    let (_, waiter) = queued_waiter(&q);
    let Reserved::Queued(r) = reserve(&q, &lim, None).unwrap() else {
        panic!("a reservation must queue behind the waiter")
    };
    assert_eq!((r.at_ns, r.delay_ns), (200_000_000, 200_000_000));
    let (_, behind) = queued_waiter(&q);
    q.run_until(&clock, 1_000_000_000).unwrap();
    assert_eq!(granted(&waiter), Some(100_000_000));
    assert!(matches!(r.outcome(), Some(Outcome::Granted { at_ns: 200_000_000, .. })));
    assert_eq!(granted(&behind), Some(300_000_000));
}

#[test]
fn reserve_respects_max_queue_and_the_predicted_deadline() {
    let (q, lim, _clock) = rate_queue(10.0, 1, 2);
    lim.try_acquire(&[1]).unwrap();
    queued_waiter(&q);
    // 0.2 s predicted: refused at once against 0.15 s, retry 0.05 s later.
    match reserve(&q, &lim, Some(150_000_000)) {
        Err(Error::Overloaded { retry_after_ns, .. }) => assert_eq!(retry_after_ns, 50_000_000),
        other => panic!("{other:?}"),
    }
    assert!(matches!(reserve(&q, &lim, Some(200_000_000)), Ok(Reserved::Queued(_))));
    match reserve(&q, &lim, None) {
        Err(Error::Overloaded { retry_after_ns, .. }) => assert_eq!(retry_after_ns, 300_000_000),
        other => panic!("{other:?}"),
    }
    assert_eq!(q.waiting(), 2);
    assert_eq!(q.counts().refused_full, 1);
    assert_eq!(q.counts().refused_deadline, 1);
}

#[test]
fn cancelling_a_queued_reservation_moves_the_next_waiter_up() {
    let (q, lim, clock) = rate_queue(10.0, 1, 100);
    lim.try_acquire(&[1]).unwrap();
    let (_, a) = queued_waiter(&q);
    let Ok(Reserved::Queued(r)) = reserve(&q, &lim, None) else {
        panic!("queued")
    };
    let (_, b) = queued_waiter(&q);
    assert!(q.cancel_reservation(&r, &[1]));
    assert!(!q.cancel_reservation(&r, &[1]));
    q.run_until(&clock, 1_000_000_000).unwrap();
    assert_eq!(granted(&a), Some(100_000_000));
    assert_eq!(granted(&b), Some(200_000_000));
    assert!(r.outcome().is_none());
}

#[test]
fn a_granted_reservation_cancelled_at_its_time_keeps_its_slot() {
    let (q, lim, clock) = rate_queue(10.0, 1, 100);
    lim.try_acquire(&[1]).unwrap();
    queued_waiter(&q);
    let Ok(Reserved::Queued(r)) = reserve(&q, &lim, None) else {
        panic!("queued")
    };
    q.run_until(&clock, r.at_ns).unwrap();
    assert!(r.outcome().is_some());
    assert!(!q.cancel_reservation(&r, &[1]));
    assert_eq!(lim.delay_for(&[1]).unwrap(), 100_000_000);
}

#[test]
fn with_several_classes_a_reservation_is_granted_by_its_promised_time() {
    let (q, clock) = setup(10.0, 1, vec![("a".into(), 1.0), ("b".into(), 8.0)]);
    q.try_now(&[1], 0).unwrap();
    let a: Vec<_> = (0..3).map(|_| queued_waiter(&q).1).collect();
    let l = q.resource.clone();
    let Ok(Reserved::Queued(r)) = q.reserve(&[1], 0, None, move |_| l.try_take(0, &[1]).map_err(|d| l.error_for(d)))
    else {
        panic!("queued")
    };
    assert_eq!(r.at_ns, 400_000_000);
    // Later arrivals of a heavier class have earlier fair-share tags than the
    // reservation; it is still granted at its promised time.
    let b: Vec<_> = (0..30)
        .map(|_| {
            let s = Slot::new();
            let s2 = s.clone();
            q.submit(&[1], 1, None, || Wake::Thread(s2)).unwrap();
            s
        })
        .collect();
    q.run_until(&clock, 10_000_000_000).unwrap();
    let Some(Outcome::Granted { at_ns, .. }) = r.outcome() else {
        panic!("not granted")
    };
    assert!(at_ns <= r.at_ns, "{at_ns}");
    let mut times: Vec<u64> = a.iter().chain(&b).filter_map(|s| granted(s)).collect();
    times.push(at_ns);
    times.sort_unstable();
    assert_eq!(times.len(), 34);
    for w in times.windows(2) {
        assert!(w[1] - w[0] >= 99_999_999, "{times:?}");
    }
}

#[test]
fn grants_to_a_closed_channel_go_back_to_the_resource_without_recursion() {
    let clock = Arc::new(ManualClock::new(0).unwrap());
    let sem = Arc::new(crate::Semaphore::new(1).unwrap());
    let q = WaitQueue::new(
        sem.clone(),
        1,
        AnyClock::Manual(clock),
        QueueConfig::new(vec![], 1_000_000, None).unwrap(),
    );
    q.try_now(&[1], 0).unwrap();
    let ch = Channel::new();
    for _ in 0..20_000 {
        let c = ch.clone();
        assert!(matches!(
            q.submit(&[1], 0, None, || Wake::Channel(c)).unwrap(),
            Submitted::Queued(_)
        ));
    }
    assert!(ch.close().is_empty());
    // The holder releases: each waiter in turn is granted, handed back by the closed
    // channel and its permit given back, in a loop (20,000 nested give-backs would
    // overflow the stack).
    q.give_back(&[1], None);
    assert_eq!(q.waiting(), 0);
    assert_eq!(sem.in_use(), 0);
    assert_eq!(q.counts().queued_grants, 20_000);
    assert!(ch.drain().is_empty());
}

#[test]
fn a_rate_grant_to_a_closed_channel_is_refunded() {
    let (q, clock) = setup(10.0, 1, vec![]);
    q.try_now(&[1], 0).unwrap();
    let ch = Channel::new();
    let c = ch.clone();
    q.submit(&[1], 0, None, || Wake::Channel(c)).unwrap();
    ch.close();
    q.run_until(&clock, 100_000_000).unwrap();
    assert_eq!(q.waiting(), 0);
    assert!(q.try_now(&[1], 0).is_ok(), "the slot at 0.1 s is free again");
    assert!(q.try_now(&[1], 0).is_err());
}

#[test]
fn an_overage_settled_under_a_queued_reservation_is_debited_behind_it() {
    let (q, clock) = setup(10.0, 1, vec![]); // one unit per 0.1 s
    let ms = 1_000_000;
    let Submitted::Granted { at_ns } = q.submit(&[1], 0, None, || unreachable!()).unwrap() else {
        panic!("granted at once")
    };
    let grant = GrantRef::new(at_ns, None);
    let slot = Slot::new();
    let s2 = slot.clone();
    q.submit(&[1], 0, None, || Wake::Thread(s2)).unwrap(); // due 0.1 s
    let Reserved::Queued(r) = q.reserve(&[1], 0, None, |_| Ok(())).unwrap() else {
        panic!("queued behind the waiter")
    };
    assert_eq!(r.at_ns, 200 * ms);
    q.settle(&[1], &[2], grant); // one more unit, owed
    q.run_until(&clock, 250 * ms).unwrap();
    // Neither the waiter nor the reservation moved; the overage follows them.
    assert_eq!(granted(&slot), Some(100 * ms));
    assert!(matches!(r.outcome(), Some(Outcome::Granted { at_ns, .. }) if at_ns == 200 * ms));
    assert_eq!(q.waiting(), 0);
    assert_eq!(q.predict(&[1]), Some(400 * ms));
}

#[test]
fn a_refund_cancels_an_overage_still_queued_first() {
    let (q, clock) = setup(10.0, 1, vec![]);
    let ms = 1_000_000;
    q.submit(&[1], 0, None, || unreachable!()).unwrap();
    let grant = GrantRef::new(0, None);
    let s = Slot::new();
    let s2 = s.clone();
    q.submit(&[1], 0, None, || Wake::Thread(s2)).unwrap();
    let Reserved::Queued(_r) = q.reserve(&[1], 0, None, |_| Ok(())).unwrap() else {
        panic!("queued")
    };
    let g = q.settle(&[1], &[3], grant);
    assert_eq!(q.waiting(), 3); // the waiter, the reservation, the overage
    q.settle(&[3], &[1], g); // back to the estimate: the overage is cancelled
    assert_eq!(q.waiting(), 2);
    q.run_until(&clock, 250 * ms).unwrap();
    assert_eq!(q.predict(&[1]), Some(300 * ms));
}

#[test]
fn a_second_overage_never_lands_ahead_of_a_reservation_promised_after_the_first() {
    // A grant owing an overage (a queued charge) settles up again after a later
    // reservation was promised a time behind that charge: the new overage must follow
    // the reservation, not grow the charge queued ahead of it.
    let (q, clock) = setup(10.0, 1, vec![]); // one unit per 0.1 s, burst 1
    let ms = 1_000_000;
    let Submitted::Granted { at_ns } = q.submit(&[1], 0, None, || unreachable!()).unwrap() else {
        panic!("granted at once")
    };
    let p = GrantRef::new(at_ns, None);
    let slot = Slot::new();
    let s2 = slot.clone();
    q.submit(&[1], 0, None, || Wake::Thread(s2)).unwrap(); // due 0.1 s
    let Reserved::Queued(r1) = q.reserve(&[1], 0, None, |_| Ok(())).unwrap() else {
        panic!("queued")
    };
    assert_eq!(r1.at_ns, 200 * ms);
    let p = q.settle(&[1], &[2], p); // owes one unit behind r1
    assert!(p.owed.is_some());
    let Reserved::Queued(r2) = q.reserve(&[1], 0, None, |_| Ok(())).unwrap() else {
        panic!("queued")
    };
    assert_eq!(r2.at_ns, 400 * ms); // behind r1 (0.2 s) and the owed unit (0.3 s)
    q.settle(&[2], &[3], p); // one more unit: must not move r2
    q.run_until(&clock, 1000 * ms).unwrap();
    assert_eq!(granted(&slot), Some(100 * ms));
    assert!(matches!(r1.outcome(), Some(Outcome::Granted { at_ns, .. }) if at_ns == 200 * ms));
    let o = r2.outcome();
    assert!(
        matches!(o, Some(Outcome::Granted { at_ns, .. }) if at_ns == 400 * ms),
        "r2 was promised 0.4 s: {o:?}"
    );
}

#[test]
fn a_refund_after_its_owed_overage_is_cancelled_gives_back_only_what_the_bucket_holds() {
    // Found by the threaded history checker (seed 60000): a permit settled up while a
    // reservation held a promise owes the overage in the queue; settled down later, it
    // cancels what it owes, and only the rest is refunded, capped by where its own debit
    // (not the owed part, never debited) sits in the bucket.
    let (q, clock) = setup(5.0, 3, vec![]); // one unit per 0.2 s, burst 3
    let ms = 1_000_000;
    let Submitted::Granted { at_ns } = q.submit(&[3], 0, None, || unreachable!()).unwrap() else {
        panic!("granted at once")
    };
    let p = GrantRef::new(at_ns, None);
    let slot = Slot::new();
    let s2 = slot.clone();
    q.submit(&[3], 0, None, || Wake::Thread(s2)).unwrap(); // due 0.6 s
    let Reserved::Queued(r) = q.reserve(&[1], 0, None, |_| Ok(())).unwrap() else {
        panic!("queued behind the waiter")
    };
    assert_eq!(r.at_ns, 800 * ms);
    let p = q.settle(&[3], &[4], p); // one more unit, owed behind the promise
    q.run_until(&clock, 650 * ms).unwrap();
    assert_eq!(granted(&slot), Some(600 * ms));
    // Nothing used after all: the owed unit is cancelled, and the three units taken at
    // 0 lie before now (0.65 s), behind the waiter's: nothing to give back.
    q.settle(&[4], &[0], p);
    q.run_until(&clock, 850 * ms).unwrap();
    assert!(matches!(r.outcome(), Some(Outcome::Granted { at_ns, .. }) if at_ns == 800 * ms));
    assert_eq!(q.waiting(), 0);
    // The waiter's three units end at 1.2 s, the reservation's at 1.4 s.
    assert_eq!(q.predict(&[3]), Some(1400 * ms));
}

#[test]
fn with_several_classes_a_reservation_keeps_its_time_and_its_place_in_its_class() {
    let (q, clock) = setup(1.0, 1, vec![("hi".into(), 1.0), ("lo".into(), 1.0)]);
    let s = 1_000_000_000;
    q.submit(&[1], 0, None, || unreachable!()).unwrap(); // at 0: the next unit at 1 s
    let hi: Vec<_> = (0..3).map(|_| Slot::new()).collect();
    for slot in &hi {
        let s2 = slot.clone();
        q.submit(&[1], 0, None, || Wake::Thread(s2)).unwrap();
    }
    let Reserved::Queued(r) = q.reserve(&[1], 0, None, |_| Ok(())).unwrap() else {
        panic!("queued behind the waiters")
    };
    assert_eq!(r.at_ns, 4 * s);
    // A later arrival of the other class has the smallest start tag.
    let lo = Slot::new();
    let l2 = lo.clone();
    q.submit(&[1], 1, None, || Wake::Thread(l2)).unwrap();
    q.run_until(&clock, 10 * s).unwrap();
    let hi: Vec<u64> = hi.iter().map(|x| granted(x).unwrap()).collect();
    let Some(Outcome::Granted { at_ns: r_at, .. }) = r.outcome() else {
        panic!("the reservation is granted")
    };
    // FIFO in its class, at its promised time, one unit per second throughout.
    assert_eq!(r_at, 4 * s);
    assert!(hi.iter().all(|h| *h < r_at), "{hi:?}");
    let mut all = vec![0, r_at, granted(&lo).unwrap()];
    all.extend(&hi);
    all.sort();
    assert!(all.windows(2).all(|w| w[1] - w[0] >= s), "{all:?}");
}

fn two_rate_queue() -> (Arc<WaitQueue>, Arc<Limiter>, Arc<ManualClock>) {
    let clock = Arc::new(ManualClock::new(0).unwrap());
    let lim = Arc::new(
        Limiter::new(
            vec![
                ("requests".into(), Rate::new(5.0, 2e9, 1).unwrap()),
                ("tokens".into(), Rate::new(100.0, 1e9, 100).unwrap()),
            ],
            AnyClock::Manual(clock.clone()),
        )
        .unwrap(),
    );
    let q = WaitQueue::new(
        lim.clone(),
        2,
        AnyClock::Manual(clock.clone()),
        QueueConfig::new(vec![], 1000, None).unwrap(),
    );
    (q, lim, clock)
}

fn reserve_costs(q: &Arc<WaitQueue>, lim: &Arc<Limiter>, costs: &[u64]) -> QueuedReservation {
    let l = lim.clone();
    let c = costs.to_vec();
    match q.reserve(costs, 0, None, move |_| l.reserve(&c, None)).unwrap() {
        Reserved::Queued(r) => r,
        Reserved::Now(_) => panic!("a reservation behind waiters must queue"),
    }
}

fn near(a: u64, b: u64) -> bool {
    a.abs_diff(b) <= 2
}

#[test]
fn two_rate_reservations_are_promised_the_joint_fifo_schedule() {
    let (q, lim, clock) = two_rate_queue();
    lim.try_acquire(&[1, 80]).unwrap();
    let a = Slot::new();
    let b = Slot::new();
    let (a2, b2) = (a.clone(), b.clone());
    q.submit(&[1, 63], 0, None, || Wake::Thread(a2)).unwrap();
    q.submit(&[1, 26], 0, Some(1_000_000_000), || Wake::Thread(b2)).unwrap();
    let r1 = reserve_costs(&q, &lim, &[1, 68]);
    clock.advance(12_000_000).unwrap();
    let r2 = reserve_costs(&q, &lim, &[1, 8]);
    assert!(near(r1.at_ns, 1_370_000_000), "{}", r1.at_ns);
    assert!(near(r2.at_ns, 1_770_000_000), "{}", r2.at_ns);
    q.run_until(&clock, 3_000_000_000).unwrap();
    let at = |r: &QueuedReservation| match r.outcome() {
        Some(Outcome::Granted { at_ns, .. }) => at_ns,
        o => panic!("{o:?}"),
    };
    assert_eq!((at(&r1), at(&r2)), (r1.at_ns, r2.at_ns));
    assert!(granted(&a).is_some() && granted(&b).is_some());
}

#[test]
fn two_rate_retry_after_counts_the_joint_schedule_of_the_waiters() {
    let (q, lim, clock) = two_rate_queue();
    lim.try_acquire(&[1, 25]).unwrap();
    let a = Slot::new();
    let a2 = a.clone();
    q.submit(&[1, 87], 0, None, || Wake::Thread(a2)).unwrap();
    let retry = q.retry_after_ns(&[1, 96]);
    assert!(near(retry, 1_230_000_000), "{retry}");
    assert_eq!(q.predict(&[1, 96]), Some(retry));
    q.run_until(&clock, retry).unwrap();
    assert!(granted(&a).is_some());
    assert!(
        q.try_now(&[1, 96], 0).is_ok(),
        "refused after the retry_after it was told"
    );
}

/// History checker seed 29: an overage charge queued behind a reservation is
/// re-timed to an ordinary waiter once the reservation is granted (it then goes in
/// fair-share order, after a lower-tagged waiter of another class); the prediction
/// must play that forward too, or `retry_after` is short.
#[test]
fn retry_after_follows_a_charge_retimed_after_its_reservation() {
    let clock = Arc::new(ManualClock::new(0).unwrap());
    let lim = Arc::new(
        Limiter::new(
            vec![
                ("requests".into(), Rate::new(10.0, 1e9, 2).unwrap()),
                ("tokens".into(), Rate::new(250.0, 1e9, 100).unwrap()),
            ],
            AnyClock::Manual(clock.clone()),
        )
        .unwrap(),
    );
    let classes = vec![("hi".into(), 1.0), ("lo".into(), 1.0)];
    let q = WaitQueue::new(
        lim.clone(),
        2,
        AnyClock::Manual(clock.clone()),
        QueueConfig::new(classes, 1000, None).unwrap(),
    );
    lim.try_acquire(&[1, 48]).unwrap();
    lim.try_acquire(&[1, 0]).unwrap();
    let w0 = Slot::new();
    let w0c = w0.clone();
    let Submitted::Queued(t0) = q.submit(&[1, 80], 0, None, || Wake::Thread(w0c)).unwrap() else {
        panic!("queued")
    };
    let r = reserve_costs(&q, &lim, &[1, 80]);
    assert_eq!(q.cancel(t0), Cancelled::Removed);
    let w = Slot::new();
    let wc = w.clone();
    q.submit(&[1, 84], 1, None, || Wake::Thread(wc)).unwrap();
    q.settle(&[1, 48], &[2, 48], GrantRef::default());
    let retry = q.retry_after_ns(&[1, 21]);
    q.run_until(&clock, retry).unwrap();
    assert!(matches!(r.outcome(), Some(Outcome::Granted { .. })));
    assert!(granted(&w).is_some());
    assert_eq!(q.waiting(), 0);
    assert!(
        q.try_now(&[1, 21], 0).is_ok(),
        "refused after the retry_after it was told ({retry} ns)"
    );
}

#[test]
fn a_reservation_is_debited_at_its_promised_time_when_a_waiter_ahead_leaves() {
    let (q, lim, clock) = rate_queue(10.0, 1, 100);
    lim.try_acquire(&[1]).unwrap();
    let (a, _) = queued_waiter(&q);
    let Ok(Reserved::Queued(r)) = reserve(&q, &lim, None) else {
        panic!("queued")
    };
    assert_eq!(r.at_ns, 200_000_000);
    assert_eq!(q.cancel(a), Cancelled::Removed);
    q.run_until(&clock, 150_000_000).unwrap();
    assert!(r.outcome().is_none(), "granted before its promised time");
    q.run_until(&clock, 200_000_000).unwrap();
    assert!(matches!(r.outcome(), Some(Outcome::Granted { at_ns: 200_000_000, .. })));
    assert_eq!(lim.delay_for(&[1]).unwrap(), 100_000_000);
}

fn permit_queue(limit: u64) -> (Arc<WaitQueue>, Arc<ManualClock>) {
    let clock = Arc::new(ManualClock::new(0).unwrap());
    let sem = Arc::new(crate::Semaphore::new(limit).unwrap());
    let q = WaitQueue::new(
        sem,
        1,
        AnyClock::Manual(clock.clone()),
        QueueConfig::new(vec![], 1000, None).unwrap(),
    );
    (q, clock)
}

#[test]
fn cancelling_the_head_grants_the_next_waiter_a_free_permit() {
    let (q, _clock) = permit_queue(2);
    q.try_now(&[1], 0).unwrap();
    let Submitted::Queued(a) = q.submit(&[2], 0, None, || Wake::Thread(Slot::new())).unwrap() else {
        panic!("queued")
    };
    let b = Slot::new();
    let b2 = b.clone();
    assert!(matches!(
        q.submit(&[1], 0, None, || Wake::Thread(b2)).unwrap(),
        Submitted::Queued(_)
    ));
    assert_eq!(q.cancel(a), Cancelled::Removed);
    assert_eq!(
        granted(&b),
        Some(0),
        "a permit is free: the next waiter is granted at once"
    );
    assert_eq!(q.waiting(), 0);
}

#[test]
fn a_permit_freed_after_a_deadline_times_the_waiter_out() {
    let (q, clock) = permit_queue(1);
    q.try_now(&[1], 0).unwrap();
    let a = Slot::new();
    let a2 = a.clone();
    q.submit(&[1], 0, Some(1_000_000_000), || Wake::Thread(a2)).unwrap();
    clock.set(1_500_000_000).unwrap(); // nobody polled at the deadline
    q.give_back(&[1], None);
    assert_eq!(
        a.take(),
        Some(Outcome::TimedOut {
            waited_ns: 1_000_000_000
        })
    );
    assert_eq!(q.waiting(), 0);
}

#[test]
fn a_timed_out_head_grants_the_next_waiter_a_free_permit() {
    let (q, clock) = permit_queue(2);
    q.try_now(&[1], 0).unwrap();
    q.submit(&[2], 0, Some(1_000_000_000), || Wake::Thread(Slot::new()))
        .unwrap();
    let b = Slot::new();
    let b2 = b.clone();
    q.submit(&[1], 0, None, || Wake::Thread(b2)).unwrap();
    q.run_until(&clock, 1_000_000_000).unwrap();
    assert_eq!(granted(&b), Some(1_000_000_000));
    assert_eq!(q.waiting(), 0);
}

/// Grant times (ms) of three waiters of three units, costs [1, 2, 3], [3, 3, 3] and
/// [1, 1, 1], at 10/s per unit with burst 3 behind an emptied bucket; the second one's
/// channel closed when `second_gone`.
fn three_unit_grants(second_gone: bool) -> Vec<(u64, u64)> {
    let clock = Arc::new(ManualClock::new(0).unwrap());
    let rates = ["a", "b", "c"]
        .iter()
        .map(|u| (u.to_string(), Rate::new(10.0, 1e9, 3).unwrap()))
        .collect();
    let lim = Limiter::new(rates, AnyClock::Manual(clock.clone())).unwrap();
    let q = WaitQueue::new(
        Arc::new(lim),
        3,
        AnyClock::Manual(clock.clone()),
        QueueConfig::new(vec![], 100, None).unwrap(),
    );
    q.try_now(&[3, 3, 3], 0).unwrap();
    let (open, other) = (Channel::new(), Channel::new());
    if second_gone {
        other.close();
    }
    let mut tickets = vec![];
    for (costs, chan) in [(&[1, 2, 3], &open), (&[3, 3, 3], &other), (&[1, 1, 1], &open)] {
        let c = chan.clone();
        match q.submit(costs, 0, None, || Wake::Channel(c)).unwrap() {
            Submitted::Queued(t) => tickets.push(t),
            s => panic!("not queued: {s:?}"),
        }
    }
    q.run_until(&clock, 2_000_000_000).unwrap();
    let mut got: Vec<_> = open.drain().into_iter().chain(other.drain()).collect();
    got.sort_by_key(|(t, _)| *t);
    got.iter()
        .map(|(t, o)| match o {
            Outcome::Granted { at_ns, .. } => (tickets.iter().position(|x| x == t).unwrap() as u64, at_ns / 1_000_000),
            o => panic!("{o:?}"),
        })
        .collect()
}

#[test]
fn waiters_of_one_to_three_units_are_granted_in_order_and_a_gone_ones_costs_go_back_whole() {
    // Costs of up to two units are kept inline, more on the heap: both through a grant,
    // a delivery to a closed channel and the give-back of that grant (whose three units
    // let the next waiter through 100 ms earlier).
    assert_eq!(three_unit_grants(false), vec![(0, 300), (1, 600), (2, 700)]);
    assert_eq!(three_unit_grants(true), vec![(0, 300), (2, 600)]);
}

#[test]
fn a_slot_wakes_its_sleeping_thread_and_keeps_an_outcome_put_before_it_sleeps() {
    let o = Outcome::Granted {
        at_ns: 7,
        waited_ns: 3,
        token: 1,
    };
    // Put while nobody sleeps (as a self-timed thread's own poll puts its grant): no
    // wake-up is needed, and the outcome is there when its thread looks.
    let s = Slot::new();
    s.put(o);
    assert_eq!(s.wait(Some(Duration::ZERO)), Some(o));
    // Put while its thread sleeps without a limit: the thread is woken.
    for _ in 0..200 {
        let s = Slot::new();
        let s2 = s.clone();
        let waiter = std::thread::spawn(move || s2.wait(None));
        while s.sleepers.load(Ordering::Relaxed) == 0 && !waiter.is_finished() {
            std::thread::yield_now();
        }
        s.put(o);
        assert_eq!(waiter.join().unwrap(), Some(o));
    }
    // Put racing the thread's way into its sleep: never lost.
    for _ in 0..200 {
        let s = Slot::new();
        let s2 = s.clone();
        let waiter = std::thread::spawn(move || s2.wait(None));
        s.put(o);
        assert_eq!(waiter.join().unwrap(), Some(o));
    }
}
