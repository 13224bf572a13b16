//! The await lifecycle on a ManualClock: every transition of [`Awaiting`] with a loop
//! whose futures are numbers, for one level and for a policy's levels.

use super::*;
use crate::policy::{Finished, Held, Level, LevelArgs, LevelKind, LevelQueues, Policy, PolicyAcquire, QueueRef};
use crate::{Limiter, ManualClock, Rate, Semaphore};

const MS: u64 = 1_000_000;

/// An event loop in a test: one channel, futures numbered in order, the ones woken and
/// the errors they were woken with.
struct TestLoop<G> {
    waits: Arc<Waits<u64, G>>,
    next: u64,
    woken: Vec<u64>,
    errors: Vec<(u64, Error)>,
    /// A future whose wake panics.
    panic_on: Option<u64>,
    /// `running` panics.
    panic_running: bool,
    /// `running` fails (no running loop, Ctrl-C in the host's lookup).
    fail_running: bool,
}

impl<G: Clone> TestLoop<G> {
    fn new() -> TestLoop<G> {
        TestLoop {
            waits: Arc::new(Waits::new(Channel::new(), Arc::new(Native::default()))),
            next: 0,
            woken: Vec::new(),
            errors: Vec::new(),
            panic_on: None,
            panic_running: false,
            fail_running: false,
        }
    }

    /// The loop's reader: drains the channel and wakes the tasks; returns the panic of a
    /// wake, if any.
    fn drain(&mut self) -> Option<Box<dyn std::any::Any + Send>> {
        let waits = self.waits.clone();
        let outcomes = waits.chan.drain();
        let (rest, panicked) = waits.resolve(&Inline, outcomes, self);
        assert!(rest.is_empty(), "every ticket is an await's");
        panicked
    }
}

impl<G: Clone> Loop for TestLoop<G> {
    type Future = u64;
    type Grant = G;
    type Error = &'static str;

    fn running(&mut self) -> Result<(Arc<Waits<u64, G>>, u64), &'static str> {
        assert!(!self.panic_running, "the host's loop lookup panicked");
        if self.fail_running {
            return Err("no running event loop");
        }
        self.next += 1;
        Ok((self.waits.clone(), self.next))
    }

    fn share(&mut self, fut: &u64) -> u64 {
        *fut
    }
}

impl<G: Clone> Wakeup<u64, G> for TestLoop<G> {
    fn keep(&mut self, grant: &G) -> G {
        grant.clone()
    }

    fn wake(&mut self, fut: u64, r: Result<Option<G>, Error>) {
        assert_ne!(Some(fut), self.panic_on, "the host's wake panicked");
        self.woken.push(fut);
        if let Err(e) = r {
            self.errors.push((fut, e));
        }
    }
}

/// `A` with its grants shared, so that the loop keeps a copy as a host does.
struct Kept<A>(A);

impl<A: Acquire> Acquire for Kept<A>
where
    A::Grant: Sync,
{
    type Grant = Arc<A::Grant>;

    fn begin(&self, d: &dyn Unlock, wake: &(dyn Fn() -> Wake + Sync)) -> Result<Begun<Self::Grant>, Error> {
        Ok(match self.0.begin(d, wake)? {
            Begun::Done(g) => Begun::Done(Arc::new(g)),
            Begun::Queued(t) => Begun::Queued(t),
        })
    }

    fn finish(&self, d: &dyn Unlock, ticket: u64, o: Outcome) -> Result<Option<Self::Grant>, Error> {
        Ok(self.0.finish(d, ticket, o)?.map(Arc::new))
    }

    fn leave(&self, d: &dyn Unlock, ticket: u64) -> bool {
        self.0.leave(d, ticket)
    }

    fn give_back(&self, d: &dyn Unlock, ticket: u64, o: Outcome) {
        self.0.give_back(d, ticket, o);
    }

    fn undo(&self, d: &dyn Unlock, grant: Option<Self::Grant>) {
        self.0
            .undo(d, grant.map(|g| Arc::into_inner(g).expect("the task's copy is gone")));
    }
}

type LevelAwait = Awaiting<Kept<LevelAcquire>, u64>;
type LevelLoop = TestLoop<Arc<Permit>>;

/// A limiter of 10/s, burst 1, on a ManualClock at 0, its queue and gate.
fn rate() -> (Arc<ManualClock>, Arc<Limiter>, Arc<Gate>) {
    let clock = Arc::new(ManualClock::new(0).unwrap());
    let lim = Arc::new(
        Limiter::new(
            vec![("requests".into(), Rate::new(10.0, 1e9, 1).unwrap())],
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
    (clock, lim, Gate::new(q, vec!["requests".into()], false))
}

/// A semaphore of `n` on a ManualClock at 0, its queue and gate.
fn semaphore(n: u64) -> (Arc<ManualClock>, Arc<Semaphore>, Arc<Gate>) {
    let clock = Arc::new(ManualClock::new(0).unwrap());
    let sem = Arc::new(Semaphore::new(n).unwrap());
    let q = WaitQueue::new(
        sem.clone(),
        1,
        AnyClock::Manual(clock.clone()),
        QueueConfig::new(vec![], 100, None).unwrap(),
    );
    (clock, sem, Gate::new(q, vec![], true))
}

fn awaiting(gate: &Arc<Gate>, timeout_ns: Option<u64>) -> LevelAwait {
    Awaiting::new(Kept(LevelAcquire::new(gate, &[1], 0, timeout_ns)))
}

fn waits_for(a: &LevelAwait, l: &mut LevelLoop) -> u64 {
    match a.step(l, &Inline) {
        Ok(Next::Wait(f)) => f,
        other => panic!("expected a wait, got {other:?}"),
    }
}

fn permit_of(a: &LevelAwait, l: &mut LevelLoop) -> Arc<Permit> {
    match a.step(l, &Inline) {
        Ok(Next::Granted(p)) => p,
        other => panic!("expected a grant, got {other:?}"),
    }
}

/// True when the limiter admits one more now (nothing given back would leave it empty).
fn admits_now(gate: &Arc<Gate>) -> bool {
    gate.queue.try_now(&[1], 0).is_ok()
}

#[test]
fn granted_at_once_and_over_after() {
    let (_c, _lim, gate) = rate();
    let mut l = LevelLoop::new();
    let a = awaiting(&gate, None);
    let p = permit_of(&a, &mut l);
    assert_eq!(p.waited_ns(), 0);
    assert!(matches!(a.step(&mut l, &Inline), Ok(Next::Over)));
    assert_eq!(l.waits.native.len(), 0);
    assert!(!admits_now(&gate), "the grant holds the burst");
}

#[test]
fn queued_then_granted_with_one_wake() {
    let (clock, _lim, gate) = rate();
    let mut l = LevelLoop::new();
    gate.queue.try_now(&[1], 0).unwrap();
    let a = awaiting(&gate, None);
    let f = waits_for(&a, &mut l);
    assert_eq!(l.waits.native.len(), 1);
    // Resumed by hand before its outcome: the same future again.
    assert!(matches!(a.step(&mut l, &Inline), Ok(Next::Wait(g)) if g == f));
    gate.queue.run_until(&clock, 100 * MS).unwrap();
    assert!(l.drain().is_none());
    assert_eq!(l.woken, vec![f], "one wake");
    let p = permit_of(&a, &mut l);
    assert_eq!(p.waited_ns(), 100 * MS);
    assert_eq!(p.held(&Inline).1.at_ns, 100 * MS, "granted in schedule time");
    assert_eq!((gate.queue.waiting(), l.waits.native.len()), (0, 0));
    assert!(matches!(a.step(&mut l, &Inline), Ok(Next::Over)));
}

#[test]
fn fifo_across_awaits_each_woken_once() {
    let (clock, _lim, gate) = rate();
    let mut l = LevelLoop::new();
    gate.queue.try_now(&[1], 0).unwrap();
    let awaits: Vec<_> = (0..5).map(|_| awaiting(&gate, None)).collect();
    let futs: Vec<_> = awaits.iter().map(|a| waits_for(a, &mut l)).collect();
    gate.queue.run_until(&clock, 500 * MS).unwrap();
    l.drain();
    assert_eq!(l.woken, futs, "woken in arrival order, once each");
    for (k, a) in awaits.iter().enumerate() {
        assert_eq!(permit_of(a, &mut l).waited_ns(), (k as u64 + 1) * 100 * MS);
    }
}

#[test]
fn cancelled_while_queued_leaves_and_the_next_moves_up() {
    let (clock, _lim, gate) = rate();
    let mut l = LevelLoop::new();
    gate.queue.try_now(&[1], 0).unwrap();
    let (a, b) = (awaiting(&gate, None), awaiting(&gate, None));
    waits_for(&a, &mut l);
    let fb = waits_for(&b, &mut l);
    a.end(&Inline);
    assert_eq!((gate.queue.waiting(), l.waits.native.len()), (1, 1));
    gate.queue.run_until(&clock, 100 * MS).unwrap();
    l.drain();
    assert_eq!(l.woken, vec![fb]);
    assert_eq!(permit_of(&b, &mut l).waited_ns(), 100 * MS, "b took a's place");
    assert!(matches!(a.step(&mut l, &Inline), Ok(Next::Over)));
    assert_eq!(gate.queue.counts().cancelled, 1);
}

#[test]
fn cancelled_after_its_grant_before_resuming_gives_the_grant_back_once() {
    let (clock, _lim, gate) = rate();
    let mut l = LevelLoop::new();
    gate.queue.try_now(&[1], 0).unwrap();
    let a = awaiting(&gate, None);
    waits_for(&a, &mut l);
    gate.queue.run_until(&clock, 100 * MS).unwrap();
    l.drain();
    a.end(&Inline);
    a.end(&Inline);
    assert!(admits_now(&gate), "the grant went back");
    assert!(!admits_now(&gate), "once");
    assert!(matches!(a.step(&mut l, &Inline), Ok(Next::Over)));
}

#[test]
fn cancelled_while_its_grant_is_in_the_channel_gives_it_back_at_the_resolve() {
    let (clock, _lim, gate) = rate();
    let mut l = LevelLoop::new();
    gate.queue.try_now(&[1], 0).unwrap();
    let a = awaiting(&gate, None);
    waits_for(&a, &mut l);
    gate.queue.run_until(&clock, 100 * MS).unwrap();
    a.end(&Inline);
    assert_eq!(l.waits.native.len(), 1, "decided: the resolve settles it");
    l.drain();
    assert!(l.woken.is_empty(), "nobody to wake");
    assert_eq!(l.waits.native.len(), 0);
    assert!(admits_now(&gate), "the grant went back");
    assert!(!admits_now(&gate), "once");
}

#[test]
fn timed_out_raises_with_nothing_held() {
    let (clock, sem, gate) = semaphore(1);
    let mut l = LevelLoop::new();
    gate.queue.try_now(&[1], 0).unwrap();
    let a = awaiting(&gate, Some(50 * MS));
    let f = waits_for(&a, &mut l);
    gate.queue.run_until(&clock, 50 * MS).unwrap();
    l.drain();
    assert_eq!(l.woken, vec![f]);
    let [(g, Error::WaitTimeout { waited_ns, .. })] = &l.errors[..] else {
        panic!("woken with its timeout: {:?}", l.errors)
    };
    assert_eq!((*g, *waited_ns), (f, 50 * MS));
    // The task is thrown the error; resumed instead, it has nothing to resume with.
    assert!(matches!(a.step(&mut l, &Inline), Err(Failed::Lost)));
    assert_eq!((sem.in_use(), gate.queue.waiting()), (1, 0));
    assert!(matches!(a.step(&mut l, &Inline), Ok(Next::Over)));
}

#[test]
fn refused_at_once_holds_nothing() {
    let (_c, _lim, gate) = rate();
    let mut l = LevelLoop::new();
    gate.queue.try_now(&[1], 0).unwrap();
    // 100 ms to wait, 10 ms allowed: refused at arrival.
    let a = awaiting(&gate, Some(10 * MS));
    let e = a.step(&mut l, &Inline).unwrap_err();
    assert!(matches!(e, Failed::Refused(Error::Overloaded { .. })), "{e:?}");
    assert_eq!((gate.queue.waiting(), l.waits.native.len()), (0, 0));
}

#[test]
fn the_loop_closed_settles_pending_and_undelivered_waits() {
    let (clock, sem, gate) = semaphore(1);
    let mut l = LevelLoop::new();
    gate.queue.try_now(&[1], 0).unwrap();
    let (a, b) = (awaiting(&gate, None), awaiting(&gate, None));
    waits_for(&a, &mut l);
    waits_for(&b, &mut l);
    gate.queue.give_back(&[1], None); // a is granted, its outcome in the channel
    let _ = clock;
    let rest = l.waits.native.close(&Inline, l.waits.chan.close());
    assert!(rest.is_empty());
    assert_eq!(sem.in_use(), 0, "a's grant went back");
    assert_eq!(gate.queue.waiting(), 0, "b left the queue");
    // The tasks go later: nothing more is given back.
    a.end(&Inline);
    b.end(&Inline);
    assert_eq!(sem.in_use(), 0);
    gate.queue.try_now(&[1], 0).unwrap();
    assert!(gate.queue.try_now(&[1], 0).is_err(), "one permit, not two");
    // A new await on the closed loop is refused before it queues.
    let c = awaiting(&gate, None);
    assert!(matches!(c.step(&mut l, &Inline), Err(Failed::Closed)));
}

#[test]
fn a_grant_decided_after_the_close_goes_back_in_the_queue() {
    let (_clock, sem, gate) = semaphore(1);
    let mut l = LevelLoop::new();
    gate.queue.try_now(&[1], 0).unwrap();
    let a = awaiting(&gate, None);
    waits_for(&a, &mut l);
    let undelivered = l.waits.chan.close();
    gate.queue.give_back(&[1], None); // decided for a: its channel hands it back
    l.waits.native.close(&Inline, undelivered);
    assert_eq!((sem.in_use(), gate.queue.waiting()), (0, 0));
}

#[test]
fn dropped_in_each_state_holds_nothing() {
    let (clock, _lim, gate) = rate();
    let mut l = LevelLoop::new();
    // Idle: nothing to do.
    drop(awaiting(&gate, None));
    gate.queue.try_now(&[1], 0).unwrap();
    // Queued: leaves the queue.
    let a = awaiting(&gate, None);
    waits_for(&a, &mut l);
    drop(a);
    assert_eq!((gate.queue.waiting(), l.waits.native.len()), (0, 0));
    // Delivered, never resumed: the grant goes back.
    let b = awaiting(&gate, None);
    waits_for(&b, &mut l);
    gate.queue.run_until(&clock, 100 * MS).unwrap();
    l.drain();
    drop(b);
    assert!(admits_now(&gate), "b's grant went back");
    // Decided, not delivered: the resolve gives it back.
    let c = awaiting(&gate, None);
    waits_for(&c, &mut l);
    gate.queue.run_until(&clock, 200 * MS).unwrap();
    drop(c);
    l.drain();
    assert!(admits_now(&gate), "c's grant went back");
    // Done: the permit is the task's.
    let d = awaiting(&gate, None);
    waits_for(&d, &mut l);
    gate.queue.run_until(&clock, 300 * MS).unwrap();
    l.drain();
    let p = permit_of(&d, &mut l);
    drop(d);
    assert!(!admits_now(&gate), "the permit's grant stays taken");
    drop(p);
}

#[test]
fn stepped_while_starting_is_busy_and_a_lost_wait_says_so() {
    let (clock, _lim, gate) = rate();
    let mut l = LevelLoop::new();
    let a = awaiting(&gate, None);
    *lock(&a.state) = State::Starting;
    assert!(matches!(a.step(&mut l, &Inline), Err(Failed::Busy)));
    *lock(&a.state) = State::Idle;
    gate.queue.try_now(&[1], 0).unwrap();
    let b = awaiting(&gate, None);
    waits_for(&b, &mut l);
    gate.queue.run_until(&clock, 100 * MS).unwrap();
    // The ticket settled by a close while the task still runs: nothing to resume with.
    l.waits.native.close(&Inline, l.waits.chan.close());
    assert!(matches!(b.step(&mut l, &Inline), Err(Failed::Lost)));
    assert!(admits_now(&gate), "the close gave the grant back");
}

#[test]
fn a_panicking_wake_leaves_the_batch_delivered_and_nothing_held() {
    let (_clock, sem, gate) = semaphore(2);
    let mut l = LevelLoop::new();
    gate.queue.try_now(&[1], 0).unwrap();
    gate.queue.try_now(&[1], 0).unwrap();
    let (a, b) = (awaiting(&gate, None), awaiting(&gate, None));
    let fa = waits_for(&a, &mut l);
    let fb = waits_for(&b, &mut l);
    gate.queue.give_back(&[1], None);
    gate.queue.give_back(&[1], None);
    l.panic_on = Some(fa);
    assert!(l.drain().is_some(), "the panic is handed back");
    assert_eq!(l.woken, vec![fb], "the rest of the batch is woken");
    let pb = permit_of(&b, &mut l);
    // a's task never wakes; when it goes, its grant goes back.
    drop(a);
    assert_eq!(sem.in_use(), 1, "b's permit only");
    pb.release(&Inline);
    assert_eq!(sem.in_use(), 0);
}

#[test]
fn a_panicking_host_at_the_start_queues_nothing_and_ends_the_await() {
    let (_c, _lim, gate) = rate();
    let mut l = LevelLoop::new();
    gate.queue.try_now(&[1], 0).unwrap();
    let a = awaiting(&gate, None);
    l.panic_running = true;
    let r = std::panic::catch_unwind(AssertUnwindSafe(|| a.step(&mut l, &Inline)));
    assert!(r.is_err());
    assert_eq!((gate.queue.waiting(), l.waits.native.len()), (0, 0));
    l.panic_running = false;
    assert!(
        matches!(a.step(&mut l, &Inline), Ok(Next::Over)),
        "ended, not stuck starting"
    );
}

// ---------------------------------------------------------------------------------
// the policy variant: several levels, all or nothing

struct Queues(Arc<WaitQueue>);

impl LevelQueues for Queues {
    fn existing(&self, _key: u64) -> Option<QueueRef> {
        Some(QueueRef::new(self.0.clone()))
    }
}

/// A semaphore level of one permit with its queue, on `clock`.
fn sem_level(clock: &Arc<ManualClock>, name: &str) -> (Level, Arc<Semaphore>, Arc<WaitQueue>) {
    let sem = Arc::new(Semaphore::new(1).unwrap());
    let q = WaitQueue::new(
        sem.clone(),
        1,
        AnyClock::Manual(clock.clone()),
        QueueConfig::new(vec![], 100, None).unwrap(),
    );
    let q2 = q.clone();
    let level = Level {
        name: name.into(),
        kind: LevelKind::Concurrency(sem.clone()),
        shadow: false,
        wake: Some(Arc::new(move |_| {
            q2.poll_now();
        })),
        queues: Some(Arc::new(Queues(q.clone()))),
    };
    (level, sem, q)
}

type PolicyAwait = Awaiting<Kept<Arc<PolicyAcquire>>, u64>;
type PolicyLoop = TestLoop<Arc<Finished>>;

/// Two one-permit semaphore levels `a` and `b`, an await of both.
#[allow(clippy::type_complexity)]
fn two_levels(
    timeout_ns: Option<u64>,
) -> (
    PolicyAwait,
    (Arc<Semaphore>, Arc<WaitQueue>),
    (Arc<Semaphore>, Arc<WaitQueue>),
    Arc<ManualClock>,
) {
    let clock = Arc::new(ManualClock::new(0).unwrap());
    let (a, sem_a, qa) = sem_level(&clock, "a");
    let (b, sem_b, qb) = sem_level(&clock, "b");
    let p = Arc::new(Policy::new(vec![a, b]).unwrap());
    let args = vec![
        LevelArgs { key: 0, costs: vec![1] },
        LevelArgs { key: 0, costs: vec![1] },
    ];
    let acq = Arc::new(PolicyAcquire::new(p, args, AnyClock::Manual(clock.clone()), timeout_ns));
    (Awaiting::new(Kept(acq)), (sem_a, qa), (sem_b, qb), clock)
}

/// A loop on which `a`'s first step queued, each queue of `held` having had its one
/// permit taken first.
fn first_step_queued(a: &PolicyAwait, held: &[&Arc<WaitQueue>]) -> PolicyLoop {
    let mut l = PolicyLoop::new();
    for q in held {
        q.try_now(&[1], 0).unwrap();
    }
    assert!(matches!(a.step(&mut l, &Inline), Ok(Next::Wait(_))));
    l
}

fn finished(a: &PolicyAwait, l: &mut PolicyLoop) -> Arc<Finished> {
    match a.step(l, &Inline) {
        Ok(Next::Granted(f)) => f,
        other => panic!("expected every level, got {other:?}"),
    }
}

#[test]
fn policy_every_level_at_once() {
    let (a, (sem_a, _), (sem_b, _), _c) = two_levels(None);
    let mut l = PolicyLoop::new();
    let f = finished(&a, &mut l);
    assert!(matches!(f.held[..], [Held::Permits(1), Held::Permits(1)]));
    assert_eq!((sem_a.in_use(), sem_b.in_use()), (1, 1));
}

#[test]
fn policy_waits_level_by_level_one_wake_each() {
    let (a, (sem_a, qa), (sem_b, qb), _c) = two_levels(None);
    let mut l = PolicyLoop::new();
    qa.try_now(&[1], 0).unwrap();
    qb.try_now(&[1], 0).unwrap();
    let f1 = match a.step(&mut l, &Inline) {
        Ok(Next::Wait(f)) => f,
        other => panic!("{other:?}"),
    };
    qa.give_back(&[1], None);
    l.drain();
    assert_eq!(l.woken, vec![f1]);
    // Level a granted: the next step queues on b, with a new future.
    let f2 = match a.step(&mut l, &Inline) {
        Ok(Next::Wait(f)) => f,
        other => panic!("{other:?}"),
    };
    assert_ne!(f1, f2);
    assert_eq!((sem_a.in_use(), qb.waiting()), (1, 1));
    qb.give_back(&[1], None);
    l.drain();
    assert_eq!(l.woken, vec![f1, f2]);
    let f = finished(&a, &mut l);
    assert!(matches!(f.held[..], [Held::Permits(1), Held::Permits(1)]));
    assert_eq!((sem_a.in_use(), sem_b.in_use()), (1, 1));
}

#[test]
fn policy_cancelled_while_queued_gives_back_the_levels_it_held() {
    let (a, (sem_a, _qa), (sem_b, qb), _c) = two_levels(None);
    let _l = first_step_queued(&a, &[&qb]);
    assert_eq!(sem_a.in_use(), 1, "a held while waiting for b");
    a.end(&Inline);
    assert_eq!((sem_a.in_use(), sem_b.in_use(), qb.waiting()), (0, 1, 0));
}

#[test]
fn policy_cancelled_after_a_levels_grant_before_resuming_gives_everything_back() {
    let (a, (sem_a, qa), (sem_b, qb), _c) = two_levels(None);
    let mut l = first_step_queued(&a, &[&qa, &qb]);
    qa.give_back(&[1], None);
    l.drain();
    assert_eq!(sem_a.in_use(), 1, "granted to the await");
    a.end(&Inline);
    a.end(&Inline);
    assert_eq!(
        (sem_a.in_use(), sem_b.in_use()),
        (0, 1),
        "a given back once, b untouched"
    );
}

#[test]
fn policy_timed_out_on_a_later_level_gives_the_earlier_back() {
    let (a, (sem_a, _qa), (sem_b, qb), clock) = two_levels(Some(200 * MS));
    let mut l = first_step_queued(&a, &[&qb]);
    qb.run_until(&clock, 200 * MS).unwrap();
    l.drain();
    assert!(
        matches!(l.errors[..], [(_, Error::WaitTimeout { .. })]),
        "{:?}",
        l.errors
    );
    assert_eq!((sem_a.in_use(), sem_b.in_use()), (0, 1));
}

#[test]
fn policy_loop_closed_and_dropped_give_everything_back() {
    let (a, (sem_a, qa), (sem_b, qb), _c) = two_levels(None);
    let l = first_step_queued(&a, &[&qb]);
    l.waits.native.close(&Inline, l.waits.chan.close());
    assert_eq!((sem_a.in_use(), qb.waiting()), (0, 0));
    drop(a);
    assert_eq!((sem_a.in_use(), sem_b.in_use()), (0, 1));

    // Granted on its level while the loop closes: the grant goes back too.
    let (a, (sem_a, _qa), (sem_b, qb), _c) = two_levels(None);
    let l = first_step_queued(&a, &[&qb]);
    qb.give_back(&[1], None);
    assert_eq!(sem_b.in_use(), 1, "b granted to the await, undelivered");
    l.waits.native.close(&Inline, l.waits.chan.close());
    drop(a);
    assert_eq!((sem_a.in_use(), sem_b.in_use()), (0, 0));
    let _ = qa;
}

/// A level whose finish runs `hook` after deciding (a task leaving meanwhile).
struct Racing {
    inner: Kept<LevelAcquire>,
    hook: Mutex<Option<Box<dyn FnOnce() + Send>>>,
}

impl Acquire for Racing {
    type Grant = Arc<Permit>;

    fn begin(&self, d: &dyn Unlock, wake: &(dyn Fn() -> Wake + Sync)) -> Result<Begun<Self::Grant>, Error> {
        self.inner.begin(d, wake)
    }

    fn finish(&self, d: &dyn Unlock, ticket: u64, o: Outcome) -> Result<Option<Self::Grant>, Error> {
        let r = self.inner.finish(d, ticket, o);
        if let Some(h) = lock(&self.hook).take() {
            h();
        }
        r
    }

    fn leave(&self, d: &dyn Unlock, ticket: u64) -> bool {
        self.inner.leave(d, ticket)
    }

    fn give_back(&self, d: &dyn Unlock, ticket: u64, o: Outcome) {
        self.inner.give_back(d, ticket, o);
    }

    fn undo(&self, d: &dyn Unlock, grant: Option<Self::Grant>) {
        self.inner.undo(d, grant);
    }
}

#[test]
fn a_task_leaving_while_its_outcome_is_finished_gets_it_undone_once() {
    let (_clock, sem, gate) = semaphore(1);
    let mut l = LevelLoop::new();
    gate.queue.try_now(&[1], 0).unwrap();
    let a: Arc<Awaiting<Racing, u64>> = Arc::new(Awaiting::new(Racing {
        inner: Kept(LevelAcquire::new(&gate, &[1], 0, None)),
        hook: Mutex::new(None),
    }));
    let waits = l.waits.clone();
    let outcomes = {
        let mut host = TestLoop {
            waits: l.waits.clone(),
            next: 0,
            woken: Vec::new(),
            errors: Vec::new(),
            panic_on: None,
            panic_running: false,
            fail_running: false,
        };
        match a.step(&mut host, &Inline) {
            Ok(Next::Wait(_)) => {}
            other => panic!("{other:?}"),
        }
        gate.queue.give_back(&[1], None);
        waits.chan.drain()
    };
    let weak = Arc::downgrade(&a);
    *lock(&a.acquire().hook) = Some(Box::new(move || weak.upgrade().unwrap().end(&Inline)));
    let (rest, panicked) = waits.resolve(&Inline, outcomes, &mut l);
    assert!(rest.is_empty() && panicked.is_none());
    assert!(l.woken.is_empty(), "the task left: nobody to wake");
    assert_eq!(sem.in_use(), 0, "its grant went back");
    gate.queue.try_now(&[1], 0).unwrap();
    assert_eq!(sem.in_use(), 1, "once");
}

/// Two levels held by others; the await granted `a` (its task not resumed yet), then
/// `b`'s holder releases.
fn granted_first_level() -> (PolicyAwait, PolicyLoop, Arc<Semaphore>, Arc<Semaphore>) {
    let (a, (sem_a, qa), (sem_b, qb), _c) = two_levels(None);
    let mut l = first_step_queued(&a, &[&qa, &qb]);
    qa.give_back(&[1], None);
    l.drain();
    assert_eq!(sem_a.in_use(), 1, "a granted to the await, held in its core state");
    qb.give_back(&[1], None);
    (a, l, sem_a, sem_b)
}

/// (review15) The task resumes after its first level's grant and the next step's loop
/// lookup fails: the acquire ends with the host's error, and the level it held goes back.
#[test]
fn policy_next_step_failing_in_the_host_gives_back_the_held_level() {
    let (a, mut l, sem_a, sem_b) = granted_first_level();
    l.fail_running = true;
    assert!(matches!(a.step(&mut l, &Inline), Err(Failed::Host(_))));
    assert!(matches!(a.step(&mut l, &Inline), Ok(Next::Over)), "the await is over");
    a.end(&Inline);
    drop(a);
    assert_eq!(
        (sem_a.in_use(), sem_b.in_use()),
        (0, 0),
        "the level granted before the failed step was never given back"
    );
}

/// (review15) The same when the loop's channel closed before the task resumed.
#[test]
fn policy_next_step_on_a_closed_channel_gives_back_the_held_level() {
    let (a, l, sem_a, sem_b) = granted_first_level();
    let mut l = l;
    let undelivered = l.waits.chan.close();
    assert!(l.waits.native.close(&Inline, undelivered).is_empty());
    assert!(matches!(a.step(&mut l, &Inline), Err(Failed::Closed)));
    drop(a);
    assert_eq!(
        (sem_a.in_use(), sem_b.in_use()),
        (0, 0),
        "the level granted before the closed channel was never given back"
    );
}
