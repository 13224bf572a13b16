//! What a grant owes (issue 10's residue): an overage decided under a lock on a keyed
//! limit whose key map is full and a settle down before a queued hold's grant (a
//! parent's owed charge in a forked child: `forked.rs`). Each on a ManualClock; the race
//! on a full key map is made deterministic by a resource that pauses inside its settle.

use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;

use ratequeue_core::bucket::Deny;
use ratequeue_core::keyed::KeyBucket;
use ratequeue_core::keyed_queue::MakeResource;
use ratequeue_core::policy::{LevelQueues, QueueRef};
use ratequeue_core::wait::{GrantRef, Outcome, Queued, Reserved, Sim, Slot, Submitted, WaitQueue, Wake};
use ratequeue_core::{
    AnyClock, Error, KeyQueues, KeyedLimiter, Level, LevelArgs, LevelKind, Limiter, ManualClock, Policy, QueueConfig,
    Rate, Resource,
};

mod common;
use common::waiter;

const MS: u64 = 1_000_000;

/// A key's bucket whose `settle` tells `entered` when it starts, then waits (at most
/// `pause`) for a word on `go` before it settles: another thread acts in between.
struct Paused {
    inner: KeyBucket,
    entered: mpsc::SyncSender<()>,
    go: Arc<std::sync::Mutex<mpsc::Receiver<()>>>,
    pause: Duration,
}

impl Resource for Paused {
    fn try_take(&self, now_ns: u64, costs: &[u64]) -> Result<(), Deny> {
        self.inner.try_take(now_ns, costs)
    }
    fn try_take_token(&self, now_ns: u64, costs: &[u64]) -> Result<Option<u64>, Deny> {
        self.inner.try_take_token(now_ns, costs)
    }
    fn ready_at(&self, at_ns: u64, costs: &[u64]) -> Result<Option<u64>, Deny> {
        self.inner.ready_at(at_ns, costs)
    }
    fn take_at(&self, at_ns: u64, costs: &[u64]) -> Result<u64, Deny> {
        self.inner.take_at(at_ns, costs)
    }
    fn charge_at(&self, at_ns: u64, costs: &[u64]) {
        self.inner.charge_at(at_ns, costs)
    }
    fn give_back(&self, costs: &[u64], token: Option<u64>) {
        self.inner.give_back(costs, token)
    }
    fn settle(&self, estimated: &[u64], actual: &[u64], grant: GrantRef) -> GrantRef {
        let _ = self.entered.try_send(());
        let _ = self.go.lock().unwrap().recv_timeout(self.pause);
        self.inner.settle(estimated, actual, grant)
    }
    fn service_ns(&self, costs: &[u64]) -> f64 {
        self.inner.service_ns(costs)
    }
    fn error_for(&self, d: Deny) -> Error {
        self.inner.error_for(d)
    }
    fn predict(&self, now_ns: u64, ahead: &[u64], costs: &[u64]) -> Option<u64> {
        self.inner.predict(now_ns, ahead, costs)
    }
    fn sim(&self, now_ns: u64) -> Option<Sim> {
        self.inner.sim(now_ns)
    }
    fn predict_backlog(&self, now_ns: u64, backlog: &[Queued<'_>], costs: &[u64]) -> Option<u64> {
        self.inner.predict_backlog(now_ns, backlog, costs)
    }
}

fn granted_at(o: Option<Outcome>) -> Option<u64> {
    match o {
        Some(Outcome::Granted { at_ns, .. }) => Some(at_ns),
        _ => None,
    }
}

#[test]
fn a_keyed_overage_on_a_full_key_map_is_decided_under_a_lock() {
    // One unit per 0.1 s per key, burst 1; one key at a time may have a queue.
    let clock = Arc::new(ManualClock::new(0).unwrap());
    let any = AnyClock::Manual(clock.clone());
    let keyed = Arc::new(KeyedLimiter::new(Rate::new(10.0, 1e9, 1).unwrap(), 1 << 10, any.clone()).unwrap());
    let (entered_tx, entered) = mpsc::sync_channel(8);
    let (go, go_rx) = mpsc::channel();
    let go_rx = Arc::new(std::sync::Mutex::new(go_rx));
    let k2 = keyed.clone();
    let make: MakeResource = Box::new(move |key| {
        Arc::new(Paused {
            inner: KeyBucket { keyed: k2.clone(), key },
            entered: entered_tx.clone(),
            go: go_rx.clone(),
            pause: Duration::from_secs(1),
        })
    });
    let qs = KeyQueues::new(any, QueueConfig::new(Vec::new(), 100, None).unwrap(), 1, make).unwrap();
    let (a, b) = (1u64, 2u64);
    // Key a has a waiter: the map is full.
    qs.try_now(a, &[1]).unwrap();
    let qa = qs.get(a).unwrap();
    let Submitted::Queued(wa) = qa.queue().submit(&[1], 0, None, || Wake::Thread(Slot::new())).unwrap() else {
        panic!("queued on a")
    };
    assert!(qs.get(b).is_err(), "the map is full");
    // A permit on key b, granted at 0, settles up by one unit on another thread.
    let (at, token) = qs.try_now(b, &[1]).unwrap();
    let settler = {
        let qs = qs.clone();
        std::thread::spawn(move || qs.settle(b, &[1], &[2], GrantRef::new(at, token)))
    };
    entered.recv_timeout(Duration::from_secs(30)).unwrap();
    // Meanwhile key a's waiter leaves, key b gets its queue, a waiter and a reservation.
    qa.queue().cancel(wa);
    drop(qa);
    qs.done(a, 0);
    let qb = qs.get(b).unwrap();
    let wb = Slot::new();
    let w2 = wb.clone();
    assert!(matches!(
        qb.queue().submit(&[1], 0, None, || Wake::Thread(w2)).unwrap(),
        Submitted::Queued(_)
    ));
    let Reserved::Queued(r) = qb.queue().reserve(&[1], 0, None, |_| Ok(())).unwrap() else {
        panic!("queued behind b's waiter")
    };
    let _ = go.send(());
    settler.join().unwrap();
    qb.queue().run_until(&clock, 1000 * MS).unwrap();
    // Whichever came first, the reservation is granted at the time it was promised, and
    // key b never admits more than one unit per 0.1 s.
    let w_at = granted_at(wb.take()).expect("b's waiter is granted");
    let r_at = granted_at(r.outcome());
    assert_eq!(r_at, Some(r.at_ns), "promised {} ms", r.at_ns / MS);
    assert!(
        w_at >= 200 * MS && r.at_ns >= w_at + 100 * MS,
        "waiter {w_at}, reservation {}",
        r.at_ns
    );
}

// ---------------------------------------------------------------------------------
// a settle down before a queued hold's grant

/// A Limiter of 10 per second with `burst` and its queue; a policy over it whose wait
/// joins that queue.
fn queued_policy(clock: &Arc<ManualClock>, burst: u64) -> (Arc<Limiter>, Arc<WaitQueue>, Policy) {
    let any = AnyClock::Manual(clock.clone());
    let lim = Arc::new(
        Limiter::new(
            vec![("requests".into(), Rate::new(10.0, 1e9, burst).unwrap())],
            any.clone(),
        )
        .unwrap(),
    );
    let q = WaitQueue::new(lim.clone(), 1, any, QueueConfig::new(vec![], 100, None).unwrap());
    let p = Policy::new(vec![Level {
        name: "l".into(),
        kind: LevelKind::Rate(lim.clone()),
        shadow: false,
        wake: None,
        queues: Some(Arc::new(One(q.clone()))),
    }])
    .unwrap();
    (lim, q, p)
}

struct One(Arc<WaitQueue>);

impl LevelQueues for One {
    fn existing(&self, _key: u64) -> Option<QueueRef> {
        Some(QueueRef::new(self.0.clone()))
    }
}

fn cost(c: u64) -> Vec<LevelArgs> {
    vec![LevelArgs { key: 0, costs: vec![c] }]
}

/// Queues a waiter of `c` on `q`; its slot.
#[test]
fn a_settle_down_before_a_queued_holds_grant_cancels_what_it_owes() {
    // One unit per 0.1 s, burst 1. Used at 0, a waiter due at 0.1 s, the hold at 0.2 s.
    let clock = Arc::new(ManualClock::new(0).unwrap());
    let (lim, q, p) = queued_policy(&clock, 1);
    lim.try_acquire(&[1]).unwrap();
    let w = waiter(&q, 1);
    let (delay, mut held) = p.reserve_queued(&cost(1), 0, u64::MAX).unwrap();
    assert_eq!(delay, 200 * MS);
    // Settled up before the grant: one unit owed behind the hold; then back down to the
    // estimate, still before the grant: nothing is owed any more.
    p.settle(&mut held, &cost(1), &cost(2), 0);
    assert_eq!(q.waiting(), 3);
    p.settle(&mut held, &cost(2), &cost(1), 0);
    assert_eq!(q.waiting(), 2, "the owed unit is still queued");
    q.run_until(&clock, 250 * MS).unwrap();
    assert_eq!(granted_at(w.take()), Some(100 * MS));
    // The hold's unit ends at 0.3 s: free at 0.3 s, not at 0.4 s.
    assert_eq!(
        lim.delay_at(250 * MS, &[1]).unwrap(),
        50 * MS,
        "the owed unit was charged"
    );
}

#[test]
fn a_settle_below_the_estimate_before_a_queued_holds_grant_is_debited_as_settled() {
    // One unit per 0.1 s, burst 2. Two used at 0, a waiter due at 0.1 s, the hold of two
    // at 0.3 s; settled to one before its grant, its grant debits one unit.
    let clock = Arc::new(ManualClock::new(0).unwrap());
    let (lim, q, p) = queued_policy(&clock, 2);
    lim.try_acquire(&[2]).unwrap();
    let w = waiter(&q, 1);
    let (delay, mut held) = p.reserve_queued(&cost(2), 0, u64::MAX).unwrap();
    assert_eq!(delay, 300 * MS);
    p.settle(&mut held, &cost(2), &cost(1), 0);
    q.run_until(&clock, 350 * MS).unwrap();
    assert_eq!(granted_at(w.take()), Some(100 * MS));
    // Two units at 0, the waiter's at 0.1 s, the hold's one at 0.3 s: the bucket is full
    // again at 0.4 s, and two units conform from 0.4 s (not 0.5 s).
    assert_eq!(
        lim.delay_at(350 * MS, &[2]).unwrap(),
        50 * MS,
        "the hold was debited its estimate"
    );
    // Settled back to zero after the grant: the one unit it holds comes back.
    p.settle(&mut held, &cost(1), &cost(0), 350 * MS);
    assert_eq!(lim.delay_at(350 * MS, &[2]).unwrap(), 0);
}

#[test]
fn a_keyed_overage_owed_behind_a_promise_is_debited_in_turn() {
    // One unit per 0.1 s per key, burst 1. A permit on the key at 0; a waiter (due 0.1 s)
    // and a reservation (promised 0.2 s) queue there; the permit settles up by two: owed
    // behind the reservation, debited at 0.2 s after it.
    let clock = Arc::new(ManualClock::new(0).unwrap());
    let any = AnyClock::Manual(clock.clone());
    let keyed = Arc::new(KeyedLimiter::new(Rate::new(10.0, 1e9, 1).unwrap(), 1 << 10, any.clone()).unwrap());
    let k2 = keyed.clone();
    let make: MakeResource = Box::new(move |key| Arc::new(KeyBucket { keyed: k2.clone(), key }));
    let qs = KeyQueues::new(any, QueueConfig::new(Vec::new(), 100, None).unwrap(), 16, make).unwrap();
    let k = 7u64;
    let (at, token) = qs.try_now(k, &[1]).unwrap();
    let h = qs.get(k).unwrap();
    let w = waiter(h.queue(), 1);
    let Reserved::Queued(r) = h.queue().reserve(&[1], 0, None, |_| Ok(())).unwrap() else {
        panic!("queued behind the waiter")
    };
    assert_eq!(r.at_ns, 200 * MS);
    let g = qs.settle(k, &[1], &[3], GrantRef::new(at, token));
    assert!(g.owed.is_some(), "owed behind the promise");
    h.queue().run_until(&clock, 250 * MS).unwrap();
    assert_eq!(granted_at(w.take()), Some(100 * MS));
    assert_eq!(granted_at(r.outcome()), Some(200 * MS));
    // Units at 0, 0.1 s and 0.2 s, then the two owed: the key is busy until 0.5 s.
    assert_eq!(
        keyed.delay_for(k, 250 * MS, 1).unwrap(),
        250 * MS,
        "the owed overage was never debited"
    );
}
