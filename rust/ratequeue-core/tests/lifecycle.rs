//! The blocking acquire lifecycle ([`Gate::acquire_blocking`], [`Permit`]) on a manual
//! clock: granted at once or after queueing, refused, timed out, cancelled, interrupted
//! after its grant, released and settled exactly once. The host counts its detaches: a
//! path that never waits must not detach. (Worth nothing in a forked child: `forked.rs`,
//! a binary of its own, since a fork holds every queue's lock of the process.)

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use ratequeue_core::wait::{Detach, Gate, Host, Inline, Permit, Stopped};
use ratequeue_core::{AnyClock, Error, Limiter, ManualClock, QueueConfig, Rate, Semaphore, WaitQueue};

const MS: u64 = 1_000_000;

/// A host that, between slices, moves the clock by `step_ns` and polls the queue, and
/// stops the wait at check number `stop_at` (after that check's poll when `poll_first`).
struct TestHost {
    clock: Arc<ManualClock>,
    queue: Arc<WaitQueue>,
    step_ns: u64,
    checks: u32,
    stop_at: Option<u32>,
    poll_first: bool,
    detaches: Cell<u32>,
}

impl TestHost {
    fn new(gate: &Gate, clock: &Arc<ManualClock>, step_ns: u64) -> TestHost {
        TestHost {
            clock: clock.clone(),
            queue: gate.queue.clone(),
            step_ns,
            checks: 0,
            stop_at: None,
            poll_first: false,
            detaches: Cell::new(0),
        }
    }

    fn advance(&self) {
        let now = self.clock.now_ns() + self.step_ns;
        self.clock.set(now).unwrap();
        self.queue.poll(now);
    }
}

impl Detach for TestHost {
    fn detached<T: Send, F: FnOnce() -> T + Send>(&self, f: F) -> T {
        self.detaches.set(self.detaches.get() + 1);
        f()
    }
}

impl Host for TestHost {
    type Interrupt = &'static str;

    fn slice(&mut self) -> Result<Option<Duration>, &'static str> {
        Ok(Some(Duration::from_millis(1)))
    }

    fn check(&mut self) -> Result<(), &'static str> {
        self.checks += 1;
        if self.stop_at == Some(self.checks) {
            if self.poll_first {
                self.advance();
            }
            return Err("interrupted");
        }
        self.advance();
        Ok(())
    }
}

fn manual() -> Arc<ManualClock> {
    Arc::new(ManualClock::new(0).unwrap())
}

/// A gate over one rate of `per_sec` per second with `burst`, in unit "tokens".
fn rate_gate(per_sec: f64, burst: u64) -> (Arc<Gate>, Arc<ManualClock>) {
    let clock = manual();
    let lim = Limiter::new(
        vec![("tokens".into(), Rate::new(per_sec, 1e9, burst).unwrap())],
        AnyClock::Manual(clock.clone()),
    )
    .unwrap();
    let q = WaitQueue::new(
        Arc::new(lim),
        1,
        AnyClock::Manual(clock.clone()),
        QueueConfig::new(Vec::new(), 1_000, None).unwrap(),
    );
    (Gate::new(q, vec!["tokens".into()], false), clock)
}

/// A gate over a semaphore of `limit` permits (returned on exit).
fn sem_gate(limit: u64) -> (Arc<Gate>, Arc<ManualClock>, Arc<Semaphore>) {
    let clock = manual();
    let sem = Arc::new(Semaphore::new(limit).unwrap());
    ratequeue_core::fork::register_arc(&sem);
    let q = WaitQueue::new(
        sem.clone(),
        1,
        AnyClock::Manual(clock.clone()),
        QueueConfig::new(Vec::new(), 1_000, None).unwrap(),
    );
    (Gate::new(q, Vec::new(), true), clock, sem)
}

fn grant_of(p: &Permit) -> ratequeue_core::GrantRef {
    p.held(&Inline).1
}

#[test]
fn granted_at_once_never_detaches() {
    let (gate, clock) = rate_gate(10.0, 1);
    let mut host = TestHost::new(&gate, &clock, 100 * MS);
    let p = gate.acquire_blocking(&mut host, &[1], 0, None).unwrap();
    assert_eq!(p.waited_ns(), 0);
    assert_eq!(grant_of(&p).at_ns, 0);
    assert!(grant_of(&p).token.is_some());
    assert_eq!(host.detaches.get(), 0, "the fast path waits for nothing");
    assert_eq!(gate.queue.counts().immediate, 1);
}

#[test]
fn granted_after_queueing_at_its_schedule_time() {
    let (gate, clock) = rate_gate(10.0, 1);
    assert!(gate.try_now(&[1], 0).unwrap().is_some());
    let mut host = TestHost::new(&gate, &clock, 30 * MS);
    let p = gate.acquire_blocking(&mut host, &[1], 0, None).unwrap();
    // Due at 100 ms; polled at 120 ms: granted in schedule time, not at the wake-up.
    assert_eq!(p.waited_ns(), 100 * MS);
    assert_eq!(grant_of(&p).at_ns, 100 * MS);
    assert!(grant_of(&p).token.is_some());
    assert_eq!(gate.queue.waiting(), 0);
    assert_eq!(gate.queue.counts().queued_grants, 1);
}

#[test]
fn refused_at_once_consumes_nothing() {
    let (gate, clock) = rate_gate(1.0, 1);
    let mut host = TestHost::new(&gate, &clock, 100 * MS);
    match gate.acquire_blocking(&mut host, &[2], 0, None) {
        Err(Stopped::Failed(Error::CostTooLarge { cost: 2, burst: 1, .. })) => {}
        other => panic!("{other:?}"),
    }
    assert!(gate.try_now(&[1], 0).unwrap().is_some());
    // The next token comes in 1 s: a 100 ms deadline is refused at arrival.
    match gate.acquire_blocking(&mut host, &[1], 0, Some(100 * MS)) {
        Err(Stopped::Failed(Error::Overloaded { retry_after_ns, .. })) => assert!(retry_after_ns > 0),
        other => panic!("{other:?}"),
    }
    assert_eq!(gate.queue.waiting(), 0);
    assert_eq!(host.checks, 0);
}

#[test]
fn timed_out_leaves_the_queue_at_its_deadline() {
    let (gate, clock, sem) = sem_gate(1);
    let held = gate.try_now(&[1], 0).unwrap().unwrap();
    let mut host = TestHost::new(&gate, &clock, 100 * MS);
    match gate.acquire_blocking(&mut host, &[1], 0, Some(500 * MS)) {
        Err(Stopped::Failed(Error::WaitTimeout { waited_ns, .. })) => assert_eq!(waited_ns, 500 * MS),
        other => panic!("{other:?}"),
    }
    assert_eq!(gate.queue.waiting(), 0);
    assert_eq!(gate.queue.counts().timed_out, 1);
    assert!(held.release(&Inline));
    assert_eq!(sem.in_use(), 0);
}

#[test]
fn cancelled_while_queued_takes_nothing() {
    let (gate, clock) = rate_gate(10.0, 1);
    assert!(gate.try_now(&[1], 0).unwrap().is_some());
    let mut host = TestHost::new(&gate, &clock, 0);
    host.stop_at = Some(1);
    assert_eq!(
        gate.acquire_blocking(&mut host, &[1], 0, None).unwrap_err(),
        Stopped::Interrupted("interrupted")
    );
    assert_eq!(gate.queue.waiting(), 0);
    assert_eq!(gate.queue.counts().cancelled, 1);
    // The token due at 100 ms is still there, for exactly one taker.
    clock.set(100 * MS).unwrap();
    assert!(gate.try_now(&[1], 0).unwrap().is_some());
    assert!(gate.try_now(&[1], 0).unwrap().is_none());
}

#[test]
fn interrupted_after_its_grant_gives_the_grant_back() {
    let (gate, clock) = rate_gate(10.0, 1);
    assert!(gate.try_now(&[1], 0).unwrap().is_some());
    let mut host = TestHost::new(&gate, &clock, 100 * MS);
    host.stop_at = Some(1);
    host.poll_first = true;
    assert_eq!(
        gate.acquire_blocking(&mut host, &[1], 0, None).unwrap_err(),
        Stopped::Interrupted("interrupted")
    );
    assert_eq!(gate.queue.counts().queued_grants, 1, "the grant won the race");
    assert_eq!(gate.queue.waiting(), 0);
    // Given back exactly (nothing came after it): the token is free again at 100 ms.
    assert_eq!(clock.now_ns(), 100 * MS);
    assert!(gate.try_now(&[1], 0).unwrap().is_some());
    assert!(gate.try_now(&[1], 0).unwrap().is_none());
}

/// A host where the interrupt comes while the wait asks for its slice (as a Python
/// signal handler runs, and raises, inside the binding's "which thread is main" check),
/// after the queue has granted the waiter (the clock moved and the queue polled).
struct InterruptedInSlice {
    clock: Arc<ManualClock>,
    queue: Arc<WaitQueue>,
    step_ns: u64,
}

impl Detach for InterruptedInSlice {
    fn detached<T: Send, F: FnOnce() -> T + Send>(&self, f: F) -> T {
        f()
    }
}

impl Host for InterruptedInSlice {
    type Interrupt = &'static str;

    fn slice(&mut self) -> Result<Option<Duration>, &'static str> {
        let now = self.clock.now_ns() + self.step_ns;
        self.clock.set(now).unwrap();
        self.queue.poll(now);
        Err("interrupted")
    }

    fn check(&mut self) -> Result<(), &'static str> {
        Ok(())
    }
}

#[test]
fn interrupted_while_asking_for_its_slice_gives_the_grant_back() {
    let (gate, clock) = rate_gate(10.0, 1);
    assert!(gate.try_now(&[1], 0).unwrap().is_some());
    let mut host = InterruptedInSlice {
        clock: clock.clone(),
        queue: gate.queue.clone(),
        step_ns: 100 * MS,
    };
    assert_eq!(
        gate.acquire_blocking(&mut host, &[1], 0, None).unwrap_err(),
        Stopped::Interrupted("interrupted"),
        "the interrupt is raised, never dropped for the grant that came first"
    );
    assert_eq!(gate.queue.counts().queued_grants, 1, "the grant won the race");
    assert_eq!(gate.queue.waiting(), 0);
    assert_eq!(clock.now_ns(), 100 * MS);
    assert!(gate.try_now(&[1], 0).unwrap().is_some());
    assert!(gate.try_now(&[1], 0).unwrap().is_none());
}

#[test]
fn a_semaphore_permit_is_released_once() {
    let (gate, clock, sem) = sem_gate(1);
    let mut host = TestHost::new(&gate, &clock, MS);
    let p = gate.acquire_blocking(&mut host, &[1], 0, None).unwrap();
    assert_eq!(sem.in_use(), 1);
    assert!(p.release(&host));
    assert!(!p.release(&host));
    assert!(p.released());
    assert_eq!(sem.in_use(), 0);
    assert_eq!(host.detaches.get(), 0, "an idle queue gives back without waiting");
    // A release wakes the next waiter.
    let held = gate.try_now(&[1], 0).unwrap().unwrap();
    let g2 = gate.clone();
    let waiter = std::thread::spawn(move || {
        let p = g2.acquire_blocking(&mut Blocking, &[1], 0, None).unwrap();
        p.release(&Inline)
    });
    while gate.queue.waiting() == 0 {
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(held.release(&Inline));
    assert!(waiter.join().unwrap());
    assert_eq!(sem.in_use(), 0);
}

#[test]
fn settle_refunds_without_waiting_when_no_lock_is_busy() {
    let (gate, clock) = rate_gate(100.0, 100);
    let mut host = TestHost::new(&gate, &clock, MS);
    let p = gate.acquire_blocking(&mut host, &[100], 0, None).unwrap();
    p.settle(&[(0, 40)], &host);
    assert_eq!(host.detaches.get(), 0);
    assert_eq!(p.held(&Inline).0, vec![40]);
    assert!(gate.try_now(&[60], 0).unwrap().is_some());
    assert!(gate.try_now(&[1], 0).unwrap().is_none());
}

#[test]
fn settle_waits_detached_only_while_the_queue_lock_is_busy() {
    let (gate, clock) = rate_gate(100.0, 100);
    let host = TestHost::new(&gate, &clock, MS);
    let p = gate.try_now(&[100], 0).unwrap().unwrap();
    let q = gate.queue.clone();
    let holder = std::thread::spawn(move || q.hold_lock_for(Duration::from_millis(1_500)));
    // The holder takes the lock well within this (a loaded machine included).
    std::thread::sleep(Duration::from_millis(300));
    p.settle(&[(0, 40)], &host);
    assert_eq!(host.detaches.get(), 1);
    holder.join().unwrap();
    assert!(gate.try_now(&[60], 0).unwrap().is_some());
    assert!(gate.try_now(&[1], 0).unwrap().is_none());
}

/// A host whose waits are plain blocking waits (a Rust thread).
struct Blocking;

impl Detach for Blocking {
    fn detached<T: Send, F: FnOnce() -> T + Send>(&self, f: F) -> T {
        f()
    }
}

impl Host for Blocking {
    type Interrupt = ();

    fn slice(&mut self) -> Result<Option<Duration>, ()> {
        Ok(None)
    }

    fn check(&mut self) -> Result<(), ()> {
        Ok(())
    }
}

#[test]
fn contended_threads_never_exceed_the_limit_and_return_every_permit() {
    let (gate, _clock, sem) = sem_gate(2);
    let peak = Arc::new(AtomicU64::new(0));
    let threads: Vec<_> = (0..8)
        .map(|_| {
            let (gate, sem, peak) = (gate.clone(), sem.clone(), peak.clone());
            std::thread::spawn(move || {
                for _ in 0..200 {
                    let p = gate.acquire_blocking(&mut Blocking, &[1], 0, None).unwrap();
                    peak.fetch_max(sem.in_use(), Ordering::Relaxed);
                    assert!(p.release(&Inline));
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    assert!(peak.load(Ordering::Relaxed) <= 2);
    assert_eq!(sem.in_use(), 0);
    assert_eq!(gate.queue.waiting(), 0);
}
