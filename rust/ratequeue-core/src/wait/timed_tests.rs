//! Self-timed blocked waiters on a manual clock: each test plays the threads by hand
//! (a thread whose timer is due calls `poll_for`) and the driver by `take_wake_asked`.

use super::*;
use crate::{Limiter, ManualClock, Rate};

const MS: u64 = 1_000_000;

/// 10/s, burst 1, the burst used up: queued grants fall at 100, 200, 300 ms...
fn setup(classes: Vec<(String, f64)>) -> (Arc<WaitQueue>, Arc<ManualClock>) {
    let (q, clock, _) = setup_with_limiter(classes);
    (q, clock)
}

/// [`setup`], with the queue's limiter.
fn setup_with_limiter(classes: Vec<(String, f64)>) -> (Arc<WaitQueue>, Arc<ManualClock>, Arc<Limiter>) {
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
        QueueConfig::new(classes, 1000, None).unwrap(),
    );
    assert!(q.try_now(&[1], 0).is_ok());
    assert_eq!(q.take_wake_asked(), None);
    (q, clock, lim)
}

fn join(q: &Arc<WaitQueue>, class: usize, slot: &Arc<Slot>) -> u64 {
    let s = slot.clone();
    match q.submit(&[1], class, None, || Wake::Thread(s)).unwrap() {
        Submitted::Queued(t) => t,
        other => panic!("not queued: {other:?}"),
    }
}

/// Three classes of equal weight, four self-timed threads joined as a1, b1, c1, a2 (fair
/// order: 100, 200, 300, 400 ms): the queue, its clock, the slots and their tickets.
#[allow(clippy::type_complexity)]
fn three_classes_four_waiters() -> (Arc<WaitQueue>, Arc<ManualClock>, [Arc<Slot>; 4], [u64; 4]) {
    let classes = vec![("a".into(), 1.0), ("b".into(), 1.0), ("c".into(), 1.0)];
    let (q, clock) = setup(classes);
    let slots = [
        Slot::self_timed(),
        Slot::self_timed(),
        Slot::self_timed(),
        Slot::self_timed(),
    ];
    let tickets = [
        join(&q, 0, &slots[0]),
        join(&q, 1, &slots[1]),
        join(&q, 2, &slots[2]),
        join(&q, 0, &slots[3]),
    ];
    (q, clock, slots, tickets)
}

fn granted(slot: &Slot) -> Option<u64> {
    match *lock(&slot.state) {
        Some(Outcome::Granted { at_ns, .. }) => Some(at_ns),
        _ => None,
    }
}

#[test]
fn self_timed_waiters_sleep_until_their_grant_and_the_driver_is_never_asked() {
    let (q, clock) = setup(vec![]);
    let slots: Vec<_> = (0..3).map(|_| Slot::self_timed()).collect();
    let tickets: Vec<_> = slots.iter().map(|s| join(&q, 0, s)).collect();
    let timers: Vec<_> = slots.iter().map(|s| s.timer()).collect();
    assert_eq!(timers, [Some(100 * MS), Some(200 * MS), Some(300 * MS)]);
    assert_eq!(q.take_wake_asked(), None, "no driver wake-up for self-timed grants");
    for (k, (s, t)) in slots.iter().zip(&tickets).enumerate() {
        clock.set(s.timer().unwrap()).unwrap();
        q.poll_for(*t, s);
        assert_eq!(granted(s), Some(100 * MS * (k as u64 + 1)));
        assert_eq!(q.take_wake_asked(), None);
    }
    assert_eq!(q.counts().queued_grants, 3);
}

#[test]
fn a_late_head_is_granted_in_its_turn_by_the_thread_behind_it() {
    let (q, clock) = setup(vec![]);
    let slots: Vec<_> = (0..2).map(|_| Slot::self_timed()).collect();
    let tickets: Vec<_> = slots.iter().map(|s| join(&q, 0, s)).collect();
    // The head's thread has not run by the second one's time: FIFO and schedule times kept.
    clock.set(200 * MS).unwrap();
    q.poll_for(tickets[1], &slots[1]);
    assert_eq!(granted(&slots[0]), Some(100 * MS));
    assert_eq!(granted(&slots[1]), Some(200 * MS));
}

#[test]
fn a_waiter_leaving_ahead_moves_the_next_timer_earlier() {
    let (q, clock) = setup(vec![]);
    let slots: Vec<_> = (0..3).map(|_| Slot::self_timed()).collect();
    let tickets: Vec<_> = slots.iter().map(|s| join(&q, 0, s)).collect();
    assert_eq!(q.cancel(tickets[0]), Cancelled::Removed);
    // The new head is re-timed to its grant; the one behind it when it becomes the head.
    assert_eq!(slots[1].timer(), Some(100 * MS));
    assert_eq!(slots[2].timer(), Some(300 * MS));
    clock.set(100 * MS).unwrap();
    q.poll_for(tickets[1], &slots[1]);
    assert_eq!(granted(&slots[1]), Some(100 * MS));
    assert_eq!(slots[2].timer(), Some(200 * MS));
    assert_eq!(q.take_wake_asked(), None);
}

#[test]
fn a_head_woken_by_the_driver_still_asks_the_driver() {
    let (q, clock) = setup(vec![]);
    let plain = Slot::new();
    let timed = Slot::self_timed();
    join(&q, 0, &plain);
    join(&q, 0, &timed);
    assert_eq!(q.take_wake_asked(), Some(100 * MS));
    clock.set(100 * MS).unwrap();
    q.poll(100 * MS);
    assert_eq!(granted(&plain), Some(100 * MS));
    assert_eq!(timed.timer(), Some(200 * MS));
    assert_eq!(q.take_wake_asked(), None);
}

#[test]
fn a_submission_that_grants_a_late_self_timed_head_asks_the_driver_for_the_next() {
    let (q, clock) = setup(vec![]);
    let timed = Slot::self_timed();
    let plain = Slot::new();
    join(&q, 0, &timed);
    join(&q, 0, &plain);
    // Only a take-over, should the head's thread be late by more than TAKEOVER_NS.
    assert_eq!(q.take_wake_asked(), Some(100 * MS + TAKEOVER_NS));
    // The head's thread is late; a newcomer's submission grants it, and the new head
    // (woken by the driver) must not wait for a wake-up nobody asked for.
    clock.set(150 * MS).unwrap();
    assert!(q.submit(&[1], 0, Some(0), || unreachable!()).is_err());
    assert_eq!(granted(&timed), Some(100 * MS));
    assert_eq!(q.take_wake_asked(), Some(200 * MS));
}

#[test]
fn with_several_classes_an_early_waiter_waits_untimed_until_it_is_the_head() {
    let (q, clock, [a1, b1, c1, a2], [ta1, tb1, tc1, ta2]) = three_classes_four_waiters();
    // Fair order: a1 100, b1 200, c1 300, a2 400 ms; a2 predicted from its class alone.
    assert_eq!(a2.timer(), Some(200 * MS));
    // No driver while every thread is timed (an early waiter, once untimed, leaves its
    // head to the driver past TAKEOVER_NS of lateness: see the tests below).
    assert_eq!(q.take_wake_asked(), None);
    clock.set(100 * MS).unwrap();
    q.poll_for(ta1, &a1);
    assert_eq!(b1.timer(), Some(200 * MS));
    clock.set(200 * MS).unwrap();
    q.poll_for(ta2, &a2);
    assert_eq!(granted(&b1), Some(200 * MS));
    assert_eq!(granted(&a2), None);
    assert_eq!(a2.timer(), None, "not the head: waits to be timed");
    assert_eq!(c1.timer(), Some(300 * MS));
    q.poll_for(tb1, &b1);
    clock.set(300 * MS).unwrap();
    q.poll_for(tc1, &c1);
    assert_eq!(granted(&c1), Some(300 * MS));
    assert_eq!(a2.timer(), Some(400 * MS));
    clock.set(400 * MS).unwrap();
    q.poll_for(ta2, &a2);
    assert_eq!(granted(&a2), Some(400 * MS));
}

#[test]
fn a_self_timed_waiters_deadline_stays_the_drivers() {
    let (q, clock) = setup(vec![]);
    let s = Slot::self_timed();
    let s2 = s.clone();
    let Submitted::Queued(t) = q.submit(&[1], 0, Some(150 * MS), || Wake::Thread(s2)).unwrap() else {
        panic!("not queued")
    };
    assert_eq!(s.timer(), Some(100 * MS));
    assert_eq!(q.take_wake_asked(), Some(150 * MS), "the deadline, not the grant");
    clock.set(100 * MS).unwrap();
    q.poll_for(t, &s);
    assert_eq!(granted(&s), Some(100 * MS));
}

#[test]
fn a_thread_away_from_its_wait_leaves_its_grant_to_the_driver() {
    let (q, _clock) = setup(vec![]);
    let s = Slot::self_timed();
    join(&q, 0, &s);
    assert_eq!(q.take_wake_asked(), None);
    // As `wait_slot` does between slices (its host checks for signals meanwhile).
    s.present.store(false, Ordering::Release);
    q.poll(0);
    assert_eq!(q.take_wake_asked(), Some(100 * MS));
    assert_eq!(s.timer(), Some(100 * MS), "kept for when it comes back");
}

/// A queue and gate of one rate, 1,000/s burst 1, on the monotonic clock (self-timed).
fn monotonic_gate() -> (Arc<WaitQueue>, Arc<Gate>) {
    let lim = Limiter::new(
        vec![("requests".into(), Rate::new(1000.0, 1e9, 1).unwrap())],
        AnyClock::Monotonic,
    )
    .unwrap();
    let q = WaitQueue::new(
        Arc::new(lim),
        1,
        AnyClock::Monotonic,
        QueueConfig::new(vec![], 1000, None).unwrap(),
    );
    let gate = Gate::new(q.clone(), vec!["requests".into()], false);
    (q, gate)
}

#[test]
fn on_the_real_time_clock_a_blocked_thread_times_itself_and_is_granted_in_fifo_order() {
    let (q, gate) = monotonic_gate();
    assert!(q.self_timing());
    let threads: Vec<_> = (0..4)
        .map(|_| {
            let gate = gate.clone();
            std::thread::spawn(move || {
                (0..50)
                    .map(|_| {
                        let p = gate.acquire_blocking(&mut Blocked, &[1], 0, None).unwrap();
                        p.held(&Inline).1.at_ns
                    })
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    let mut at: Vec<u64> = threads.into_iter().flat_map(|t| t.join().unwrap()).collect();
    at.sort_unstable();
    // Schedule times 1 ms apart (the burst of 1 aside): the rate kept, whoever polled.
    for w in at.windows(2).skip(1) {
        assert!(w[1] - w[0] >= 999_000, "{w:?}");
    }
    assert_eq!(q.waiting(), 0);
}

/// This thread's timer slack in nanoseconds.
#[cfg(target_os = "linux")]
fn timer_slack() -> i32 {
    // SAFETY: PR_GET_TIMERSLACK reads only this thread's slack.
    unsafe { libc::prctl(libc::PR_GET_TIMERSLACK, 0, 0, 0, 0) }
}

#[cfg(target_os = "linux")]
fn set_timer_slack(ns: u64) {
    // SAFETY: PR_SET_TIMERSLACK changes only this thread's slack.
    assert_eq!(unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, ns, 0, 0, 0) }, 0);
}

#[cfg(target_os = "linux")]
#[test]
fn a_self_timed_thread_sets_its_timer_slack_to_1_ns_once_and_keeps_a_slack_set_after() {
    let (q, gate) = monotonic_gate();
    let queued = |gate: &Arc<Gate>| {
        // The burst taken first: the next acquire queues and its thread times itself
        // (unless the thread was descheduled past its grant time in between).
        let _ = gate.try_now(&[1], 0);
        let _permit = gate.acquire_blocking(&mut Blocked, &[1], 0, None).unwrap();
    };
    std::thread::spawn(move || {
        set_timer_slack(50_000);
        assert!(!timers_precise());
        // Until a wait has slept to its timer (one does at once unless the machine is
        // starved).
        for _ in 0..1000 {
            queued(&gate);
            if timers_precise() {
                break;
            }
        }
        assert!(timers_precise());
        // Left at 1 ns after the wait: no system call between the timer and the return.
        assert_eq!(timer_slack(), 1);
        queued(&gate);
        assert_eq!(timer_slack(), 1);
        // A slack the thread sets afterwards is its own: later waits leave it.
        set_timer_slack(30_000);
        queued(&gate);
        assert_eq!(timer_slack(), 30_000);
    })
    .join()
    .unwrap();
    assert_eq!(q.waiting(), 0);
}

/// A host without a lock of its own that never stops a wait.
struct Blocked;

impl Detach for Blocked {
    fn detached<T: Send, F: FnOnce() -> T + Send>(&self, f: F) -> T {
        f()
    }
}

impl Host for Blocked {
    type Interrupt = ();
    fn slice(&mut self) -> Result<Option<Duration>, ()> {
        Ok(Some(Duration::from_millis(5)))
    }
    fn check(&mut self) -> Result<(), ()> {
        Ok(())
    }
}

// A self-timed head whose thread does not run (descheduled, starved of CPU)
// must not hold up, without bound, waiters behind it that count on its poll: an event
// loop's or a driver-served thread's grant, or a waiter of another class that woke early
// and waits untimed. The driver takes over past `TAKEOVER_NS` of lateness.

#[test]
fn a_stalled_self_timed_head_is_taken_over_by_the_driver_for_a_plain_waiter_behind_it() {
    let (q, clock) = setup(vec![]);
    let timed = Slot::self_timed();
    let plain = Slot::new();
    join(&q, 0, &timed);
    join(&q, 0, &plain);
    let t = q
        .take_wake_asked()
        .expect("the driver must look once the head's thread is late, for the waiter behind it");
    assert!((100 * MS..=100 * MS + TAKEOVER_NS).contains(&t), "{t}");
    // The head's thread never ran: the driver grants both, in order, at schedule times.
    clock.set(t).unwrap();
    q.poll(t);
    assert_eq!(granted(&timed), Some(100 * MS));
    assert_eq!(q.take_wake_asked(), Some(200 * MS));
    clock.set(200 * MS).unwrap();
    q.poll(200 * MS);
    assert_eq!(granted(&plain), Some(200 * MS));
}

#[test]
fn a_stalled_self_timed_head_is_taken_over_for_an_untimed_waiter_of_another_class() {
    let (q, clock, [a1, b1, c1, a2], [ta1, _, _, ta2]) = three_classes_four_waiters();
    clock.set(100 * MS).unwrap();
    q.poll_for(ta1, &a1);
    clock.set(200 * MS).unwrap();
    // a2 wakes early (predicted from its class alone) and grants b1 (due); c1 is now the
    // head and a2 waits untimed for c1's thread to grant c1 and time a2.
    q.poll_for(ta2, &a2);
    assert_eq!(granted(&b1), Some(200 * MS));
    assert_eq!(a2.timer(), None);
    assert_eq!(c1.timer(), Some(300 * MS));
    // c1's thread never runs. The driver's take-overs asked before c1 was the head find
    // nothing due; then one is asked for c1.
    let t = loop {
        let t = q
            .take_wake_asked()
            .expect("the driver must take over a late head that an untimed waiter waits behind");
        if t >= 300 * MS {
            break t;
        }
        let now = clock.set(t.max(clock.now_ns())).unwrap();
        q.poll(now);
        assert_eq!(granted(&c1), None);
    };
    assert!((300 * MS..=300 * MS + TAKEOVER_NS).contains(&t), "{t}");
    clock.set(t).unwrap();
    q.poll(t);
    assert_eq!(granted(&c1), Some(300 * MS));
    assert_eq!(a2.timer(), Some(400 * MS), "a2, now the head, is timed");
    clock.set(400 * MS).unwrap();
    q.poll_for(ta2, &a2);
    assert_eq!(granted(&a2), Some(400 * MS));
}

#[test]
fn a_lone_self_timed_head_or_one_class_of_self_timed_threads_still_needs_no_driver() {
    let (q, clock) = setup(vec![]);
    let slots: Vec<_> = (0..3).map(|_| Slot::self_timed()).collect();
    let tickets: Vec<_> = slots.iter().map(|s| join(&q, 0, s)).collect();
    // Each thread behind polls at its own (exact) time: none depends on the head's poll.
    assert_eq!(q.take_wake_asked(), None);
    clock.set(300 * MS).unwrap();
    q.poll_for(tickets[2], &slots[2]);
    assert_eq!(
        slots.iter().map(|s| granted(s)).collect::<Vec<_>>(),
        [Some(100 * MS), Some(200 * MS), Some(300 * MS)]
    );
    assert_eq!(q.take_wake_asked(), None);
}

#[test]
fn a_stalled_self_timed_head_is_taken_over_for_a_waiter_of_its_class_woken_early_by_a_pause() {
    let (q, clock, lim) = setup_with_limiter(vec![]);
    let (a, b) = (Slot::self_timed(), Slot::self_timed());
    let (_ta, tb) = (join(&q, 0, &a), join(&q, 0, &b));
    assert_eq!((a.timer(), b.timer()), (Some(100 * MS), Some(200 * MS)));
    // A pause moves every grant later (a at 250 ms, b at 350 ms): b, timed for 200 ms,
    // wakes early, finds itself behind a and waits untimed for a's poll.
    assert!(lim.hold_until(250 * MS, None));
    q.poll(0);
    let _ = q.take_wake_asked();
    clock.set(200 * MS).unwrap();
    q.poll_for(tb, &b);
    assert_eq!(b.timer(), None);
    let at = a.timer().unwrap();
    assert!(at > 200 * MS, "{at}");
    // a's thread never runs.
    let t = q
        .take_wake_asked()
        .expect("the driver must take over a late head that an untimed waiter waits behind");
    assert!((at..=at + TAKEOVER_NS).contains(&t), "{t}");
    clock.set(t).unwrap();
    q.poll(t);
    assert_eq!(granted(&a), Some(at));
    assert!(b.timer().is_some(), "b, now the head, is timed");
}
