//! Review of the await lifecycle (`wait/awaiting.rs`) from outside the crate: the
//! transitions where a step fails after a policy's earlier level was granted, on a
//! ManualClock, with a loop whose futures are numbers and whose lookup can fail.

use std::sync::Arc;

use ratequeue_core::policy::{Finished, LevelQueues, PolicyAcquire, QueueRef};
use ratequeue_core::wait::awaiting::{Acquire, Awaiting, Failed, Loop, Native, Next, Waits, Wakeup};
use ratequeue_core::wait::{Channel, Inline};
use ratequeue_core::{
    AnyClock, Error, Level, LevelArgs, LevelKind, ManualClock, Policy, QueueConfig, Semaphore, WaitQueue,
};

/// A loop whose `running` fails once `fail` is set (no running loop, Ctrl-C in the
/// host's lookup, ...).
struct FlakyLoop {
    waits: Arc<Waits<u64, Arc<Finished>>>,
    next: u64,
    fail: bool,
}

impl FlakyLoop {
    fn new() -> FlakyLoop {
        FlakyLoop {
            waits: Arc::new(Waits::new(Channel::new(), Arc::new(Native::default()))),
            next: 0,
            fail: false,
        }
    }

    fn drain(&mut self) {
        let waits = self.waits.clone();
        let outcomes = waits.chan.drain();
        let (rest, panicked) = waits.resolve(&Inline, outcomes, self);
        assert!(rest.is_empty() && panicked.is_none());
    }
}

impl Loop for FlakyLoop {
    type Future = u64;
    type Grant = Arc<Finished>;
    type Error = &'static str;

    fn running(&mut self) -> Result<(Arc<Waits<u64, Arc<Finished>>>, u64), &'static str> {
        if self.fail {
            return Err("no running event loop");
        }
        self.next += 1;
        Ok((self.waits.clone(), self.next))
    }

    fn share(&mut self, fut: &u64) -> u64 {
        *fut
    }
}

impl Wakeup<u64, Arc<Finished>> for FlakyLoop {
    fn keep(&mut self, grant: &Arc<Finished>) -> Arc<Finished> {
        grant.clone()
    }

    fn wake(&mut self, _fut: u64, _r: Result<Option<Arc<Finished>>, Error>) {}
}

/// The policy acquire with its grants shared (as a host keeps one for the task).
struct Shared(Arc<PolicyAcquire>);

impl Acquire for Shared {
    type Grant = Arc<Finished>;

    fn begin(
        &self,
        d: &dyn ratequeue_core::wait::awaiting::Unlock,
        wake: &(dyn Fn() -> ratequeue_core::Wake + Sync),
    ) -> Result<ratequeue_core::wait::awaiting::Begun<Arc<Finished>>, Error> {
        use ratequeue_core::wait::awaiting::Begun;
        Ok(match self.0.begin(d, wake)? {
            Begun::Done(f) => Begun::Done(Arc::new(f)),
            Begun::Queued(t) => Begun::Queued(t),
        })
    }

    fn finish(
        &self,
        d: &dyn ratequeue_core::wait::awaiting::Unlock,
        ticket: u64,
        o: ratequeue_core::Outcome,
    ) -> Result<Option<Arc<Finished>>, Error> {
        Ok(self.0.finish(d, ticket, o)?.map(Arc::new))
    }

    fn undo(&self, d: &dyn ratequeue_core::wait::awaiting::Unlock, _grant: Option<Arc<Finished>>) {
        self.0.undo(d, None);
    }

    fn leave(&self, d: &dyn ratequeue_core::wait::awaiting::Unlock, ticket: u64) -> bool {
        self.0.leave(d, ticket)
    }

    fn give_back(&self, d: &dyn ratequeue_core::wait::awaiting::Unlock, ticket: u64, o: ratequeue_core::Outcome) {
        self.0.give_back(d, ticket, o);
    }
}

struct Queues(Arc<WaitQueue>);

impl LevelQueues for Queues {
    fn existing(&self, _key: u64) -> Option<QueueRef> {
        Some(QueueRef::new(self.0.clone()))
    }
}

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

type PolicyAwait = Awaiting<Shared, u64>;

/// Two one-permit semaphore levels, both held by someone else, and an await of both
/// that has been granted `a` (its task not resumed yet); `b`'s holder then releases.
fn granted_first_level() -> (PolicyAwait, FlakyLoop, Arc<Semaphore>, Arc<Semaphore>) {
    let clock = Arc::new(ManualClock::new(0).unwrap());
    let (a, sem_a, qa) = sem_level(&clock, "a");
    let (b, sem_b, qb) = sem_level(&clock, "b");
    let p = Arc::new(Policy::new(vec![a, b]).unwrap());
    let args = vec![
        LevelArgs { key: 0, costs: vec![1] },
        LevelArgs { key: 0, costs: vec![1] },
    ];
    let acq = Arc::new(PolicyAcquire::new(p, args, AnyClock::Manual(clock), None));
    let aw = Awaiting::new(Shared(acq));
    let mut l = FlakyLoop::new();
    qa.try_now(&[1], 0).unwrap();
    qb.try_now(&[1], 0).unwrap();
    assert!(matches!(aw.step(&mut l, &Inline), Ok(Next::Wait(_))));
    qa.give_back(&[1], None);
    l.drain();
    assert_eq!(sem_a.in_use(), 1, "a granted to the await, held in its core state");
    qb.give_back(&[1], None);
    (aw, l, sem_a, sem_b)
}

/// The task resumes after its first level's grant, and the next step's loop lookup
/// fails (no running loop, a KeyboardInterrupt landing in the host's lookup): the
/// acquire ends with the host's error, so the level it held must go back.
#[test]
fn policy_next_step_failing_in_the_host_gives_back_the_held_level() {
    let (aw, mut l, sem_a, sem_b) = granted_first_level();
    l.fail = true;
    assert!(matches!(aw.step(&mut l, &Inline), Err(Failed::Host(_))));
    assert!(matches!(aw.step(&mut l, &Inline), Ok(Next::Over)), "the await is over");
    aw.end(&Inline);
    drop(aw);
    assert_eq!(
        (sem_a.in_use(), sem_b.in_use()),
        (0, 0),
        "the level granted before the failed step was never given back"
    );
}

/// The same when the loop's channel closed before the task resumed.
#[test]
fn policy_next_step_on_a_closed_channel_gives_back_the_held_level() {
    let (aw, mut l, sem_a, sem_b) = granted_first_level();
    let undelivered = l.waits.chan.close();
    assert!(l.waits.native.close(&Inline, undelivered).is_empty());
    assert!(matches!(aw.step(&mut l, &Inline), Err(Failed::Closed)));
    drop(aw);
    assert_eq!(
        (sem_a.in_use(), sem_b.in_use()),
        (0, 0),
        "the level granted before the closed channel was never given back"
    );
}
