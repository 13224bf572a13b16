//! Model checks of the core's lock-free protocols with loom: every interleaving (up to
//! the preemption bound) of a few threads, with the weak memory orderings loom models.
//!
//! Run: `RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=3 cargo test -p ratequeue-core
//! --release --test loom` (`make test-loom`). The bucket, the semaphore and the event-
//! loop channel are checked as they are (their atomics and locks come from
//! `crate::sync`, loom's under `cfg(loom)`). The queue's grant-versus-cancel hand-off
//! and the driver's schedule/wake protocol live beside process-wide statics that loom
//! cannot build, so their protocols are checked here as faithful copies on loom types.
#![cfg(loom)]

use loom::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use loom::sync::{Arc, Mutex};
use loom::thread;
use ratequeue_core::bucket::Undo;
use ratequeue_core::wait::channel::Channel;
use ratequeue_core::{Bucket, Outcome, Rate, Resource, Semaphore};

const SEC: u64 = 1_000_000_000;

mod loom_common;
use loom_common::model;

/// One unit per second, `burst` at once; the tests never move time, so nothing refills.
fn bucket(burst: u64) -> Arc<Bucket> {
    Arc::new(Bucket::new(Rate::new(1.0, 1e9, burst).unwrap()))
}

#[test]
fn bucket_concurrent_takes_admit_exactly_the_burst() {
    model(|| {
        let b = bucket(2);
        let ts: Vec<_> = (0..3)
            .map(|_| {
                let b = b.clone();
                thread::spawn(move || b.take(0, 1, 0).is_ok())
            })
            .collect();
        let admitted = ts.into_iter().map(|t| t.join().unwrap()).filter(|ok| *ok).count();
        assert_eq!(admitted, 2);
        assert_eq!(b.available(0), 0.0);
    });
}

#[test]
fn bucket_concurrent_try_takes_admit_exactly_the_burst() {
    model(|| {
        let b = bucket(2);
        let ts: Vec<_> = (0..3)
            .map(|_| {
                let b = b.clone();
                thread::spawn(move || b.try_take(0, 1).is_ok())
            })
            .collect();
        let admitted = ts.into_iter().map(|t| t.join().unwrap()).filter(|ok| *ok).count();
        assert_eq!(admitted, 2);
        assert_eq!(b.available(0), 0.0);
    });
}

#[test]
fn bucket_try_take_and_untake_race_exactly() {
    model(|| {
        let b = bucket(1);
        let first = b.take(0, 1, 0).unwrap();
        let undo = {
            let b = b.clone();
            thread::spawn(move || b.untake(&first))
        };
        let other = {
            let b = b.clone();
            thread::spawn(move || b.try_take(0, 1).is_ok())
        };
        let (undone, took) = (undo.join().unwrap(), other.join().unwrap());
        // A refused try_take changes nothing, so the undo is exact; the unit it freed is
        // taken at most once.
        assert!(undone);
        assert_eq!(b.available(0), if took { 0.0 } else { 1.0 });
    });
}

#[test]
fn bucket_try_take_under_a_rate_change_keeps_content() {
    model(|| {
        let b = bucket(2);
        let change = {
            let b = b.clone();
            thread::spawn(move || b.set_rate(0, Rate::new(1.0, 1e9, 4).unwrap()))
        };
        let other = {
            let b = b.clone();
            thread::spawn(move || b.try_take(0, 1).is_ok())
        };
        change.join().unwrap();
        assert!(other.join().unwrap());
        assert_eq!(b.available(0), 3.0);
    });
}

/// Two fast takes, one of which may lose its CAS and retry (out of line, `debit_retry`),
/// racing a rate change that moves the generation under the retry: every take is decided
/// once, and the content used carries over (burst 1 → 2: the new burst less what was
/// admitted is left, whatever the order).
#[test]
fn bucket_try_take_retries_across_a_rate_change_keep_content() {
    model(|| {
        let b = bucket(1);
        let change = {
            let b = b.clone();
            thread::spawn(move || b.set_rate(0, Rate::new(1.0, 1e9, 2).unwrap()))
        };
        let ts: Vec<_> = (0..2)
            .map(|_| {
                let b = b.clone();
                thread::spawn(move || b.try_take(0, 1).is_ok())
            })
            .collect();
        change.join().unwrap();
        let admitted = ts.into_iter().map(|t| t.join().unwrap()).filter(|ok| *ok).count();
        assert!(admitted >= 1);
        assert_eq!(b.available(0), 2.0 - admitted as f64);
    });
}

#[test]
fn bucket_concurrent_reservations_get_distinct_slots() {
    model(|| {
        let b = bucket(1);
        let ts: Vec<_> = (0..2)
            .map(|_| {
                let b = b.clone();
                thread::spawn(move || b.take(0, 1, u64::MAX).unwrap().delay_ns)
            })
            .collect();
        let mut delays: Vec<u64> = ts.into_iter().map(|t| t.join().unwrap()).collect();
        delays.sort_unstable();
        assert_eq!(delays[0], 0);
        assert!(delays[1].abs_diff(SEC) <= 1, "{delays:?}");
    });
}

#[test]
fn bucket_untake_restores_exactly_or_is_refused() {
    model(|| {
        let b = bucket(2);
        let first = b.take(0, 1, 0).unwrap();
        let undo = {
            let b = b.clone();
            thread::spawn(move || b.untake(&first))
        };
        let other = {
            let b = b.clone();
            thread::spawn(move || b.take(0, 1, 0).is_ok())
        };
        let undone = undo.join().unwrap();
        assert!(other.join().unwrap());
        // Undone: only the other take holds a unit. Refused (a take came after it): the
        // unit stays used, nothing is given back under the later grant.
        assert_eq!(b.available(0), if undone { 1.0 } else { 0.0 });
    });
}

#[test]
fn bucket_two_undos_race_a_take() {
    model(|| {
        let b = bucket(2);
        let t1 = b.take(0, 1, 0).unwrap();
        let t2 = b.take(0, 1, 0).unwrap();
        let u2 = {
            let b = b.clone();
            thread::spawn(move || b.untake(&t2))
        };
        let u1 = {
            let b = b.clone();
            thread::spawn(move || b.untake(&t1))
        };
        let other = {
            let b = b.clone();
            thread::spawn(move || b.take(0, 1, 0).is_ok())
        };
        let (undone2, undone1, took) = (u2.join().unwrap(), u1.join().unwrap(), other.join().unwrap());
        let held = 2 - undone1 as u64 - undone2 as u64 + took as u64;
        assert!(held <= 2, "admitted {held} units at one instant with a burst of 2");
        assert_eq!(b.available(0), 2.0 - held as f64);
    });
}

#[test]
fn bucket_give_back_never_lets_a_newcomer_share_a_reserved_slot() {
    model(|| {
        let b = bucket(1);
        let mut first = b.take(0, 1, 0).unwrap();
        let back = {
            let b = b.clone();
            thread::spawn(move || b.give_back(&mut first, 1, 0))
        };
        let other = {
            let b = b.clone();
            thread::spawn(move || b.take(0, 1, u64::MAX).unwrap().delay_ns)
        };
        let undo = back.join().unwrap();
        let delay = other.join().unwrap();
        // Exact before the reservation; after it, a grant is scheduled ahead: kept.
        match undo {
            Undo::Exact => assert_eq!((delay, b.available(0)), (0, 0.0)),
            Undo::Dropped => {
                assert!(delay.abs_diff(SEC) <= 1, "{delay}");
                assert_eq!(b.available(0), -1.0);
            }
            other => panic!("{other:?}"),
        }
    });
}

#[test]
fn bucket_give_back_after_a_later_take_refunds_what_it_held() {
    model(|| {
        let b = bucket(2);
        let mut first = b.take(0, 1, 0).unwrap();
        let back = {
            let b = b.clone();
            thread::spawn(move || b.give_back(&mut first, 1, 0))
        };
        let other = {
            let b = b.clone();
            thread::spawn(move || b.take(0, 1, 0).is_ok())
        };
        let undo = back.join().unwrap();
        assert!(other.join().unwrap());
        // Exact, or refunded under the later take (nothing is scheduled ahead of now).
        assert!(undo.gave(), "{undo:?}");
        assert_eq!(b.available(0), 1.0);
    });
}

#[test]
fn bucket_refund_races_take() {
    model(|| {
        let b = bucket(1);
        b.take(0, 1, 0).unwrap();
        let refund = {
            let b = b.clone();
            thread::spawn(move || b.refund(0, 1))
        };
        let other = {
            let b = b.clone();
            thread::spawn(move || b.take(0, 1, 0).is_ok())
        };
        // Nothing is ever scheduled ahead here, so the refund always applies.
        assert_eq!(refund.join().unwrap(), Undo::Refunded);
        let took = other.join().unwrap();
        assert_eq!(b.available(0), if took { 0.0 } else { 1.0 });
    });
}

#[test]
fn bucket_charge_races_take() {
    model(|| {
        let b = bucket(1);
        let charge = {
            let b = b.clone();
            thread::spawn(move || b.charge(0, 1))
        };
        let other = {
            let b = b.clone();
            thread::spawn(move || b.take(0, 1, 0).is_ok())
        };
        charge.join().unwrap();
        let took = other.join().unwrap();
        assert_eq!(b.available(0), if took { -1.0 } else { 0.0 });
    });
}

#[test]
fn bucket_rate_change_keeps_content_under_a_take() {
    model(|| {
        let b = bucket(2);
        let change = {
            let b = b.clone();
            thread::spawn(move || b.set_rate(0, Rate::new(1.0, 1e9, 4).unwrap()))
        };
        let other = {
            let b = b.clone();
            thread::spawn(move || b.take(0, 1, 0).is_ok())
        };
        change.join().unwrap();
        assert!(other.join().unwrap());
        assert_eq!(b.rate().burst, 4);
        assert_eq!(b.available(0), 3.0);
    });
}

#[test]
fn bucket_undo_across_a_rate_change_restores_exactly_or_is_refused() {
    model(|| {
        let b = bucket(2);
        let first = b.take(0, 1, 0).unwrap();
        let change = {
            let b = b.clone();
            thread::spawn(move || b.set_rate(0, Rate::new(1.0, 1e9, 3).unwrap()))
        };
        let undo = {
            let b = b.clone();
            thread::spawn(move || b.untake(&first))
        };
        change.join().unwrap();
        let undone = undo.join().unwrap();
        assert_eq!(b.available(0), if undone { 3.0 } else { 2.0 });
    });
}

fn semaphore(limit: u64) -> Arc<Semaphore> {
    Arc::new(Semaphore::new(limit).unwrap())
}

#[test]
fn semaphore_takes_never_exceed_the_limit() {
    model(|| {
        let s = semaphore(2);
        let ts: Vec<_> = (0..3)
            .map(|_| {
                let s = s.clone();
                thread::spawn(move || {
                    let ok = s.try_take(0, &[1]).is_ok();
                    assert!(s.in_use() <= 2);
                    ok
                })
            })
            .collect();
        let granted = ts.into_iter().map(|t| t.join().unwrap()).filter(|ok| *ok).count();
        assert_eq!(granted, 2);
        assert_eq!(s.in_use(), 2);
    });
}

#[test]
fn semaphore_give_back_never_loses_a_permit() {
    model(|| {
        let s = semaphore(1);
        s.try_take(0, &[1]).unwrap();
        let back = {
            let s = s.clone();
            thread::spawn(move || s.give_back(&[1], None))
        };
        let other = {
            let s = s.clone();
            thread::spawn(move || {
                let ok = s.try_take(0, &[1]).is_ok();
                assert!(s.in_use() <= 1);
                ok
            })
        };
        back.join().unwrap();
        let took = other.join().unwrap();
        assert_eq!(s.in_use(), took as u64);
    });
}

#[test]
fn semaphore_huge_costs_never_wrap() {
    model(|| {
        let s = semaphore(u64::MAX);
        let a = {
            let s = s.clone();
            thread::spawn(move || s.try_take(0, &[1 << 63]).is_ok())
        };
        let b = {
            let s = s.clone();
            thread::spawn(move || s.try_take(0, &[(1 << 63) + 1]).is_ok())
        };
        let (ta, tb) = (a.join().unwrap(), b.join().unwrap());
        assert!(ta != tb, "exactly one fits");
        assert_eq!(s.in_use(), if ta { 1 << 63 } else { (1 << 63) + 1 });
    });
}

#[test]
fn semaphore_limit_change_races_take() {
    model(|| {
        let s = semaphore(1);
        s.try_take(0, &[1]).unwrap();
        let change = {
            let s = s.clone();
            thread::spawn(move || s.set_limit(2).unwrap())
        };
        let other = {
            let s = s.clone();
            thread::spawn(move || s.try_take(0, &[1]).is_ok())
        };
        change.join().unwrap();
        let took = other.join().unwrap();
        assert_eq!(s.in_use(), 1 + took as u64);
        assert!(s.in_use() <= s.limit());
    });
}

fn granted(token: u64) -> Outcome {
    Outcome::Granted {
        at_ns: 0,
        waited_ns: 0,
        token,
    }
}

/// channel.rs's put/drain protocol: `put`, under the lock, signals the wake-up
/// descriptor unless a signal is pending (`signalled`), then pushes; `drain` clears the
/// descriptor and re-arms, then takes everything. Copied with the descriptor as a loom
/// counter (`bytes`): the real eventfd orders the writer before the reader through the
/// kernel, which loom cannot see, so checked on the real Channel it reports a false
/// lost wake-up.
struct Chan {
    ready: Mutex<Vec<u64>>,
    signalled: AtomicBool,
    bytes: AtomicUsize,
}

impl Chan {
    fn put(&self, x: u64) {
        let mut ready = self.ready.lock().unwrap();
        if !self.signalled.swap(true, Ordering::AcqRel) {
            self.bytes.fetch_add(1, Ordering::AcqRel);
        }
        ready.push(x);
    }

    fn drain(&self) -> Vec<u64> {
        self.bytes.swap(0, Ordering::AcqRel);
        self.signalled.store(false, Ordering::Release);
        std::mem::take(&mut *self.ready.lock().unwrap())
    }

    fn readable(&self) -> bool {
        self.bytes.load(Ordering::Acquire) > 0
    }
}

#[test]
fn channel_every_put_is_drained_once_and_never_without_a_wake_up() {
    model(|| {
        let ch = Arc::new(Chan {
            ready: Mutex::new(Vec::new()),
            signalled: AtomicBool::new(false),
            bytes: AtomicUsize::new(0),
        });
        let producers: Vec<_> = (1..=2)
            .map(|x| {
                let ch = ch.clone();
                thread::spawn(move || ch.put(x))
            })
            .collect();
        let event_loop = {
            let ch = ch.clone();
            thread::spawn(move || {
                let mut got = Vec::new();
                for _ in 0..2 {
                    if ch.readable() {
                        got.extend(ch.drain());
                    }
                }
                got
            })
        };
        for p in producers {
            p.join().unwrap();
        }
        let mut got = event_loop.join().unwrap();
        let signalled = ch.readable();
        let rest = ch.drain();
        assert!(signalled || rest.is_empty(), "outcomes left with no wake-up");
        got.extend(rest);
        got.sort_unstable();
        assert_eq!(got, vec![1, 2]);
    });
}

/// The real Channel (its flags and lock are loom's under `cfg(loom)`):
/// a put racing close lands before it (close hands it over) or comes back to the
/// caller; nothing is delivered after a close.
#[test]
fn channel_close_never_loses_an_outcome() {
    model(|| {
        let ch = Channel::with_wakeup().unwrap();
        let put = {
            let ch = ch.clone();
            thread::spawn(move || ch.put_for_model(1, granted(1)).is_ok())
        };
        let close = {
            let ch = ch.clone();
            thread::spawn(move || ch.close())
        };
        let delivered = put.join().unwrap();
        let handed = close.join().unwrap();
        assert_eq!(delivered, handed.iter().any(|(t, _)| *t == 1));
        assert!(ch.drain().is_empty());
        assert!(ch.put_for_model(2, granted(2)).is_err());
    });
}

/// queue.rs's grant-versus-cancel hand-off: a grant removes the waiter and delivers its
/// outcome to the waiter's slot before the queue lock is released; a cancel that finds
/// the waiter gone (NotQueued) therefore finds the outcome and gives a grant back. The
/// resource is the real Semaphore.
#[test]
fn queue_grant_and_cancel_return_the_permit_exactly_once() {
    model(|| {
        let sem = semaphore(1);
        sem.try_take(0, &[1]).unwrap();
        // One waiter for one permit; its slot for the outcome.
        let queued = Arc::new(Mutex::new(Some(1u64)));
        let slot: Arc<Mutex<Option<bool>>> = Arc::new(Mutex::new(None));
        let grant = {
            let (sem, queued, slot) = (sem.clone(), queued.clone(), slot.clone());
            thread::spawn(move || {
                // A holder releases, then polls the queue.
                sem.give_back(&[1], None);
                let mut q = queued.lock().unwrap();
                if let Some(cost) = *q {
                    if sem.try_take(0, &[cost]).is_ok() {
                        *q = None;
                        *slot.lock().unwrap() = Some(true);
                    }
                }
            })
        };
        let cancel = {
            let (sem, queued, slot) = (sem.clone(), queued.clone(), slot.clone());
            thread::spawn(move || {
                let removed = queued.lock().unwrap().take().is_some();
                if !removed {
                    let outcome = slot.lock().unwrap().take();
                    assert_eq!(outcome, Some(true), "NotQueued without an outcome");
                    sem.give_back(&[1], None);
                }
                removed
            })
        };
        grant.join().unwrap();
        let removed = cancel.join().unwrap();
        assert_eq!(sem.in_use(), 0, "the permit must come back exactly once");
        if removed {
            assert_eq!(*slot.lock().unwrap(), None);
        }
    });
}

/// queue.rs's wake-up protocol with the driver: a queue asks for a wake-up at `t` only
/// when `t` is earlier than the one already asked for (`scheduled.fetch_min`); the
/// driver, at a due time `t`, clears `scheduled` if it is still `t`, then polls, and the
/// poll asks again for the queue's next due time. Checked: after any interleaving of
/// two submissions with the driver's wake-ups, the driver, run on to the end, serves
/// every waiter (no waiter is left without a wake-up).
#[test]
fn driver_schedule_never_loses_a_wake_up() {
    struct Queue {
        due: Mutex<Vec<u64>>,
        scheduled: AtomicU64,
        heap: Mutex<Vec<u64>>,
    }
    impl Queue {
        fn schedule(&self, t: u64) {
            if t < self.scheduled.fetch_min(t, Ordering::AcqRel) {
                self.heap.lock().unwrap().push(t);
            }
        }
        fn submit(&self, t: u64) {
            let next = {
                let mut d = self.due.lock().unwrap();
                d.push(t);
                d.iter().copied().min()
            };
            if let Some(n) = next {
                self.schedule(n);
            }
        }
        fn driver_wake(&self, t: u64) {
            let _ = self
                .scheduled
                .compare_exchange(t, u64::MAX, Ordering::AcqRel, Ordering::Acquire);
            // The poll at time t: grants what is due, then asks for the next due time.
            let next = {
                let mut d = self.due.lock().unwrap();
                d.retain(|x| *x > t);
                d.iter().copied().min()
            };
            if let Some(n) = next {
                self.schedule(n);
            }
        }
        /// The driver's step: pop the earliest entry and wake the queue at it.
        fn step(&self) -> bool {
            let t = {
                let mut h = self.heap.lock().unwrap();
                h.sort_unstable();
                (!h.is_empty()).then(|| h.remove(0))
            };
            t.map(|t| self.driver_wake(t)).is_some()
        }
    }
    model(|| {
        let q = Arc::new(Queue {
            due: Mutex::new(vec![10]),
            scheduled: AtomicU64::new(10),
            heap: Mutex::new(vec![10]),
        });
        let subs: Vec<_> = [20u64, 5]
            .into_iter()
            .map(|t| {
                let q = q.clone();
                thread::spawn(move || q.submit(t))
            })
            .collect();
        let driver = {
            let q = q.clone();
            thread::spawn(move || {
                q.step();
            })
        };
        for s in subs {
            s.join().unwrap();
        }
        driver.join().unwrap();
        while q.step() {}
        assert_eq!(*q.due.lock().unwrap(), Vec::<u64>::new(), "a waiter with no wake-up");
    });
}
