use std::sync::atomic::AtomicBool;
use std::time::Duration;

use super::*;
use crate::keyed::{KeyBucket, KeyPermits};
use crate::wait::{Outcome, Slot, Submitted, Wake};
use crate::{KeyedLimiter, KeyedSemaphore, Rate};

const SEC: u64 = 1_000_000_000;

fn config() -> QueueConfig {
    QueueConfig::new(Vec::new(), 1_000, None).unwrap()
}

/// Queues over a keyed limiter of `per_sec` with `burst` per key, on a manual clock.
fn rate_queues(per_sec: f64, burst: u64, max_queues: usize) -> (Arc<KeyQueues>, Arc<KeyedLimiter>, Arc<ManualClock>) {
    let clock = Arc::new(ManualClock::new(0).unwrap());
    let any = AnyClock::Manual(clock.clone());
    let keyed = Arc::new(KeyedLimiter::new(Rate::new(per_sec, 1e9, burst).unwrap(), 1 << 16, any.clone()).unwrap());
    let k2 = keyed.clone();
    let make: MakeResource = Box::new(move |key| Arc::new(KeyBucket { keyed: k2.clone(), key }));
    (KeyQueues::new(any, config(), max_queues, make).unwrap(), keyed, clock)
}

/// Queues over a keyed semaphore of `limit` per key.
fn permit_queues(limit: u64) -> (Arc<KeyQueues>, Arc<KeyedSemaphore>) {
    let sem = Arc::new(KeyedSemaphore::new(limit).unwrap());
    let s2 = sem.clone();
    let make: MakeResource = Box::new(move |key| Arc::new(KeyPermits { sem: s2.clone(), key }));
    let clock = AnyClock::Manual(Arc::new(ManualClock::new(0).unwrap()));
    (KeyQueues::new(clock, config(), 1 << 10, make).unwrap(), sem)
}

/// Queues a waiter for `cost` on `q`; its slot.
fn enqueue(q: &Arc<WaitQueue>, cost: u64) -> Arc<Slot> {
    let slot = Slot::new();
    let s = slot.clone();
    match q.submit(&[cost], 0, None, || Wake::Thread(s)).unwrap() {
        Submitted::Queued(_) => slot,
        Submitted::Granted { .. } => panic!("granted at once"),
    }
}

fn granted_at(slot: &Slot) -> Option<u64> {
    match slot.take() {
        Some(Outcome::Granted { at_ns, .. }) => Some(at_ns),
        _ => None,
    }
}

#[test]
fn a_key_queue_is_made_on_demand_reused_and_dropped_when_idle() {
    let (qs, _, _) = rate_queues(1.0, 1, 16);
    assert!(qs.is_empty() && qs.existing(7).is_none());
    let a = qs.get(7).unwrap();
    let b = qs.get(7).unwrap();
    assert!(Arc::ptr_eq(&a, &b), "one queue per key");
    assert_eq!(qs.len(), 1);
    assert!(Arc::ptr_eq(&qs.existing(7).unwrap(), &a));
    qs.done(7, 1);
    assert_eq!(qs.len(), 1, "still held by a");
    drop(b);
    qs.done(7, 0);
    assert_eq!(qs.len(), 1, "still held by a");
    drop(a);
    qs.done(7, 0);
    assert!(qs.is_empty() && qs.existing(7).is_none());
    // The queue's own references (the driver's) are not handles: they keep nothing.
    let a = qs.get(9).unwrap();
    let raw = a.queue().clone();
    drop(a);
    qs.done(9, 0);
    assert!(qs.existing(9).is_none());
    drop(raw);
    // A queue left without its done is swept by the next poll of every key.
    drop(qs.get(8).unwrap());
    assert_eq!(qs.len(), 1);
    assert_eq!(qs.poll_all(), None);
    assert!(qs.is_empty());
}

#[test]
fn a_queue_with_a_waiter_survives_done_and_sweeps_until_granted() {
    let (qs, _, clock) = rate_queues(1.0, 1, 16);
    assert!(qs.try_now(1, &[1]).is_ok(), "the burst");
    assert_eq!(qs.try_now(1, &[1]), Err(None));
    let q = qs.get(1).unwrap();
    let slot = enqueue(q.queue(), 1);
    drop(q);
    qs.done(1, 0);
    qs.poll_all();
    assert_eq!(qs.len(), 1, "a queue with a waiter stays");
    assert!(qs.has_waiters(1) && qs.try_has_waiters(1) == Some(true));
    assert_eq!(qs.try_now_nowait(1, &[1]), Some(Err(None)), "no overtaking");
    assert_eq!(qs.backlog_delay_ns(1, &[1]), Ok(Some(2 * SEC)));
    assert_eq!(qs.run_until(&clock, SEC).unwrap(), 1);
    assert_eq!(granted_at(&slot), Some(SEC));
    assert!(qs.is_empty(), "swept once idle");
    assert!(!qs.has_waiters(1));
    assert_eq!(qs.backlog_delay_ns(1, &[1]), Ok(None));
}

#[test]
fn run_until_drives_every_keys_queue_in_virtual_time() {
    let (qs, _, clock) = rate_queues(2.0, 1, 16);
    let mut slots = Vec::new();
    for key in 0..3u64 {
        qs.try_now(key, &[1]).unwrap();
        let q = qs.get(key).unwrap();
        slots.push((enqueue(q.queue(), 1), enqueue(q.queue(), 1)));
    }
    assert_eq!(qs.len(), 3);
    qs.run_until(&clock, 2 * SEC).unwrap();
    for (a, b) in &slots {
        assert_eq!(granted_at(a), Some(SEC / 2));
        assert_eq!(granted_at(b), Some(SEC));
    }
    // Each key's waits: 0.5 s and 1 s, plus the three immediate grants (0).
    let snap = qs.wait_histogram().snapshot();
    assert_eq!(snap.count(), 9);
}

#[test]
fn the_number_of_key_queues_is_bounded() {
    let (qs, _, _) = rate_queues(1.0, 1, 2);
    let a = qs.get(1).unwrap();
    let _b = qs.get(2).unwrap();
    assert!(matches!(qs.get(3), Err(Error::Overloaded { .. })));
    assert!(qs.get(1).is_ok(), "a key with a queue still gets it");
    qs.done(1, 1);
    drop(a);
    assert!(qs.get(3).is_ok(), "room again once a queue is idle");
    // Idle queues nobody said done for are swept to make room.
    let (qs, _, _) = rate_queues(1.0, 1, 2);
    for key in 0..100 {
        drop(qs.get(key).unwrap());
    }
    assert!(qs.len() <= 2);
    assert!(KeyQueues::new(AnyClock::default(), config(), 0, Box::new(|_| unreachable!())).is_err());
}

#[test]
fn a_sweep_racing_an_enqueue_loses_no_waiter() {
    let (qs, sem) = permit_queues(1);
    let stop = Arc::new(AtomicBool::new(false));
    let sweeper = {
        let (qs, stop) = (qs.clone(), stop.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Acquire) {
                qs.poll_all();
                std::thread::yield_now();
            }
        })
    };
    let workers: Vec<_> = (0..6)
        .map(|w| {
            let qs = qs.clone();
            std::thread::spawn(move || {
                for i in 0..1_000u64 {
                    let key = (w + i) % 2;
                    if qs.try_now(key, &[1]).is_err() {
                        let q = qs.get(key).unwrap();
                        // A preemption here is the window a sweep must not use.
                        std::thread::yield_now();
                        let slot = Slot::new();
                        let s = slot.clone();
                        if let Submitted::Queued(_) = q.queue().submit(&[1], 0, None, || Wake::Thread(s)).unwrap() {
                            // Only a release can grant it: a waiter lost by the sweep hangs here.
                            match slot.wait(Some(Duration::from_secs(10))) {
                                Some(Outcome::Granted { .. }) => {}
                                o => panic!("waiter lost on key {key}: {o:?}"),
                            }
                        }
                        drop(q);
                        qs.done(key, 0);
                    }
                    std::thread::sleep(Duration::from_micros(20));
                    qs.resource(key).give_back(&[1], None);
                    qs.poll(key);
                }
            })
        })
        .collect();
    for w in workers {
        w.join().unwrap();
    }
    stop.store(true, Ordering::Release);
    sweeper.join().unwrap();
    qs.poll_all();
    assert!(qs.is_empty());
    assert!((0..3).all(|k| sem.in_use(k) == 0));
}

#[test]
fn tries_are_counted() {
    let (qs, _, _) = rate_queues(1.0, 1, 4);
    qs.note_try(true);
    qs.note_try(false);
    qs.note_tries(3, 2);
    assert_eq!(qs.tries(), (4, 3));
}

#[test]
fn the_fork_handlers_hold_the_key_map() {
    use crate::fork::ForkLocks;
    let (qs, _, _) = rate_queues(1.0, 1, 4);
    let _q = qs.get(1).unwrap();
    assert_eq!(qs.rank(), crate::fork::Rank::KeyMap);
    let mut held: Vec<Box<dyn crate::fork::Held + '_>> = Vec::new();
    qs.lock_for_fork(&mut held);
    assert_eq!(qs.try_existing(1).map(|q| q.is_some()), None, "busy while held");
    assert_eq!(qs.try_now_nowait(1, &[1]), None, "changes nothing while held");
    drop(held);
    assert!(qs.try_existing(1).unwrap().is_some());
}
