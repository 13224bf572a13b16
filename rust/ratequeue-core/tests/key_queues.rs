//! The per-key wait queues ([`KeyQueues`]) over random schedules on a manual clock:
//! handles taken and given up, waiters queued, time moved, idle queues swept.
//!
//! After every step: a key's queue that somebody holds or waits in is the map's queue
//! of that key (so a give-back on the key wakes its waiters), and the map holds at most
//! `max_queues` keys. At the end, once every handle is given up and time has moved on,
//! every waiter was granted exactly once and the map is empty.

use std::sync::Arc;

use proptest::prelude::*;
use ratequeue_core::keyed::KeyBucket;
use ratequeue_core::keyed_queue::MakeResource;
use ratequeue_core::wait::{Outcome, Slot, Submitted, Wake};
use ratequeue_core::{AnyClock, KeyQueue, KeyQueues, KeyedLimiter, ManualClock, QueueConfig, Rate};

const SEC: u64 = 1_000_000_000;
const KEYS: u64 = 6;
const MAX_QUEUES: usize = 4;

#[derive(Clone, Debug)]
enum Op {
    /// Take a handle on key k's queue.
    Get(u64),
    /// Queue a waiter of cost 1 in the queue of held handle i (modulo the held ones).
    Submit(usize),
    /// Give up held handle i (then `done`).
    Drop(usize),
    /// Move the clock by this many milliseconds and poll every key.
    Advance(u64),
    /// Take cost 1 on key k outside the queues (another caller's fast path).
    TryNow(u64),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0..KEYS).prop_map(Op::Get),
        (0..16usize).prop_map(Op::Submit),
        (0..16usize).prop_map(Op::Drop),
        (0..1_500u64).prop_map(Op::Advance),
        (0..KEYS).prop_map(Op::TryNow),
    ]
}

fn setup() -> (Arc<KeyQueues>, Arc<ManualClock>) {
    let clock = Arc::new(ManualClock::new(0).unwrap());
    let any = AnyClock::Manual(clock.clone());
    let keyed = Arc::new(KeyedLimiter::new(Rate::new(2.0, 1e9, 1).unwrap(), 1 << 10, any.clone()).unwrap());
    let make: MakeResource = Box::new(move |key| {
        Arc::new(KeyBucket {
            keyed: keyed.clone(),
            key,
        })
    });
    let config = QueueConfig::new(Vec::new(), 1_000, None).unwrap();
    (KeyQueues::new(any, config, MAX_QUEUES, make).unwrap(), clock)
}

/// A queued waiter, holding its key's queue until its outcome arrives (as the bindings'
/// waits and a policy's queued hold do).
struct Waiter {
    key: u64,
    handle: Option<Arc<KeyQueue>>,
    slot: Arc<Slot>,
    outcome: Option<Outcome>,
}

/// Collects the outcomes that arrived: each waiter then gives its queue up.
fn settle(qs: &KeyQueues, waiters: &mut [Waiter]) {
    for w in waiters.iter_mut().filter(|w| w.outcome.is_none()) {
        if let Some(o) = w.slot.take() {
            w.outcome = Some(o);
            drop(w.handle.take());
            qs.done(w.key, 0);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn no_waiter_is_lost_and_the_map_stays_bounded(ops in proptest::collection::vec(op(), 1..80)) {
        let (qs, clock) = setup();
        let mut held: Vec<(u64, Arc<KeyQueue>)> = Vec::new();
        let mut waiters: Vec<Waiter> = Vec::new();
        for op in ops {
            match op {
                Op::Get(k) => {
                    if let Ok(h) = qs.get(k) {
                        held.push((k, h));
                    } else {
                        prop_assert!(qs.len() >= MAX_QUEUES);
                    }
                }
                Op::Submit(i) if !held.is_empty() => {
                    let (k, h) = &held[i % held.len()];
                    let slot = Slot::new();
                    let s = slot.clone();
                    if let Submitted::Queued(_) = h.queue().submit(&[1], 0, None, || Wake::Thread(s)).unwrap() {
                        waiters.push(Waiter { key: *k, handle: Some(h.clone()), slot, outcome: None });
                    }
                }
                Op::Drop(i) if !held.is_empty() => {
                    let (k, h) = held.swap_remove(i % held.len());
                    drop(h);
                    qs.done(k, 0);
                }
                Op::Advance(ms) => {
                    clock.advance(ms * 1_000_000).unwrap();
                    qs.poll_all();
                }
                Op::TryNow(k) => {
                    let _ = qs.try_now(k, &[1]);
                }
                _ => {}
            }
            settle(&qs, &mut waiters);
            prop_assert!(qs.len() <= MAX_QUEUES, "{} queues", qs.len());
            for (k, h) in &held {
                let mapped = qs.existing(*k);
                prop_assert!(mapped.is_some_and(|m| Arc::ptr_eq(&m, h)), "a held queue left the map");
            }
            for w in &waiters {
                if let Some(h) = &w.handle {
                    let mapped = qs.existing(w.key);
                    prop_assert!(mapped.is_some_and(|m| Arc::ptr_eq(&m, h)), "a queue with waiters left the map");
                }
            }
        }
        for (k, h) in held.drain(..) {
            drop(h);
            qs.done(k, 0);
        }
        qs.run_until(&clock, clock.now_ns() + 1_000 * SEC).unwrap();
        settle(&qs, &mut waiters);
        for w in &waiters {
            prop_assert!(matches!(w.outcome, Some(Outcome::Granted { .. })), "a waiter was never granted");
            prop_assert!(w.slot.take().is_none(), "a waiter was woken twice");
        }
        qs.poll_all();
        prop_assert!(qs.is_empty(), "{} idle queues left", qs.len());
    }
}
