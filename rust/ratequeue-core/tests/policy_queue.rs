//! Randomized: a policy's wait joins its rate levels' queues (issue 10). On a manual
//! clock, waiters, queued reservations, immediate takes and policy acquires (over a busy
//! level and an idle one) arrive in random order, some are cancelled; afterwards every
//! level admitted at most burst + rate·d in any window, and no policy was granted
//! before a waiter that arrived earlier on the same level.

mod common;

use std::sync::Arc;

use common::{check_windows, Lcg, S};
use ratequeue_core::policy::{Held, LevelQueues, QueueRef};
use ratequeue_core::wait::{Slot, Submitted, Wake};
use ratequeue_core::{
    AnyClock, Level, LevelArgs, LevelKind, Limiter, ManualClock, Outcome, Policy, QueueConfig, Rate, Reserved,
    WaitQueue,
};

struct Queues(Arc<WaitQueue>);

impl LevelQueues for Queues {
    fn existing(&self, _key: u64) -> Option<QueueRef> {
        Some(QueueRef::new(self.0.clone()))
    }
}

struct RateLevel {
    lim: Arc<Limiter>,
    q: Arc<WaitQueue>,
    per_sec: f64,
    burst: u64,
}

fn rate_level(clock: &Arc<ManualClock>, per_sec: f64, burst: u64) -> RateLevel {
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
        QueueConfig::new(vec![], 1000, None).unwrap(),
    );
    RateLevel { lim, q, per_sec, burst }
}

/// Something granted or to be granted on one level: how to learn its time, its cost,
/// its arrival and whether it is a policy's.
enum Pending {
    /// Granted at this time.
    At(u64),
    /// A waiter or queued reservation: its outcome arrives in the slot / handle.
    Slot(Arc<Slot>),
    Reserved(ratequeue_core::QueuedReservation),
    /// A policy's held level.
    Policy(u64),
}

struct Grant {
    arrival: u64,
    seq: usize,
    cost: u64,
    policy: bool,
    what: Pending,
    cancelled: bool,
}

fn grant_time(p: &Pending) -> Option<u64> {
    match p {
        Pending::At(t) => Some(*t),
        Pending::Slot(s) => match s.take() {
            Some(Outcome::Granted { at_ns, .. }) => Some(at_ns),
            _ => None,
        },
        Pending::Reserved(r) => match r.outcome() {
            Some(Outcome::Granted { at_ns, .. }) => Some(at_ns),
            _ => None,
        },
        Pending::Policy(t) => Some(*t),
    }
}

fn run(seed: u64) {
    let mut rng = Lcg(seed);
    let clock = Arc::new(ManualClock::new(0).unwrap());
    let busy = rate_level(&clock, [2.0, 5.0, 10.0][rng.below(3) as usize], 1 + rng.below(3));
    let idle = rate_level(&clock, [1.0, 5.0][rng.below(2) as usize], 1 + rng.below(3));
    let level = |name: &str, l: &RateLevel| Level {
        name: name.into(),
        kind: LevelKind::Rate(l.lim.clone()),
        shadow: false,
        wake: None,
        queues: Some(Arc::new(Queues(l.q.clone()))),
    };
    let both = Arc::new(Policy::new(vec![level("busy", &busy), level("idle", &idle)]).unwrap());
    let levels = [&busy, &idle];
    let mut grants: [Vec<Grant>; 2] = [Vec::new(), Vec::new()];
    for seq in 1..=300 {
        let now = clock.now_ns();
        let which = rng.below(2) as usize;
        let l = levels[which];
        let cost = 1 + rng.below(l.burst);
        match rng.below(10) {
            0 | 1 => {
                if let Ok(t) = l.q.try_now(&[cost], 0) {
                    grants[which].push(Grant {
                        arrival: now,
                        seq,
                        cost,
                        policy: false,
                        what: Pending::At(t),
                        cancelled: false,
                    });
                }
            }
            2..=4 => {
                let slot = Slot::new();
                let s2 = slot.clone();
                let what = match l.q.submit(&[cost], 0, None, || Wake::Thread(s2)).unwrap() {
                    Submitted::Granted { at_ns } => Pending::At(at_ns),
                    Submitted::Queued(_) => Pending::Slot(slot),
                };
                grants[which].push(Grant {
                    arrival: now,
                    seq,
                    cost,
                    policy: false,
                    what,
                    cancelled: false,
                });
            }
            5 => {
                let lim = l.lim.clone();
                let r =
                    l.q.reserve(&[cost], 0, None, move |_| lim.reserve(&[cost], None))
                        .unwrap();
                let what = match r {
                    Reserved::Now(r) => Pending::At(r.at_ns),
                    Reserved::Queued(r) => Pending::Reserved(r),
                };
                grants[which].push(Grant {
                    arrival: now,
                    seq,
                    cost,
                    policy: false,
                    what,
                    cancelled: false,
                });
            }
            6..=7 => {
                let args = vec![
                    LevelArgs {
                        key: 0,
                        costs: vec![1 + rng.below(busy.burst)],
                    },
                    LevelArgs {
                        key: 0,
                        costs: vec![1 + rng.below(idle.burst)],
                    },
                ];
                let (delay, held) = both.reserve_queued(&args, now, u64::MAX).unwrap();
                let mut held: Vec<Held> = held;
                let undo = rng.below(4) == 0;
                for (i, a) in args.iter().enumerate() {
                    grants[i].push(Grant {
                        arrival: now,
                        seq,
                        cost: a.costs[0],
                        policy: true,
                        what: Pending::Policy(now + delay),
                        cancelled: undo && now + delay > now,
                    });
                }
                if undo && delay > 0 {
                    // Before its time: every level gives it back (queued shares leave
                    // their queue; a debit for that time is undone by the one rule).
                    both.undo_all(&mut held, &args, now);
                }
            }
            _ => {
                let step = rng.below(300_000_000);
                for l in levels {
                    l.q.run_until(&clock, now + step).unwrap();
                }
            }
        }
    }
    let end = clock.now_ns() + 100 * S;
    for l in levels {
        l.q.run_until(&clock, end).unwrap();
    }
    for (i, gs) in grants.iter().enumerate() {
        let l = levels[i];
        let mut times = Vec::new();
        for g in gs {
            let t = grant_time(&g.what);
            if let (Some(t), false) = (t, g.cancelled) {
                times.push((t, g.cost as f64, g.arrival, g.seq, g.policy));
            }
        }
        check_windows(times.iter().map(|x| (x.0, x.1)), l.per_sec, l.burst);
        // A policy never goes before a waiter or reservation that arrived earlier.
        for p in times.iter().filter(|x| x.4) {
            for w in times.iter().filter(|x| !x.4 && x.3 < p.3) {
                assert!(
                    p.0 + 2 >= w.0,
                    "seed {seed} level {i}: policy (arrived {}) granted at {} before an earlier \
                     arrival granted at {}",
                    p.2,
                    p.0,
                    w.0
                );
            }
        }
    }
}

#[test]
fn random_histories_with_policies_keep_rates_and_order() {
    for seed in 1..=60 {
        run(seed);
    }
}
