//! The lock-free fast path against a waiter joining between its "nobody waits" check and
//! its take (deterministic: the resource runs a hook at the moment of the take). The
//! take must not move the time promised to a reservation queued meanwhile, nor let the
//! rate be exceeded: it is undone and the caller refused (it queues behind them).

mod common;

use std::sync::{Arc, Mutex};

use common::{check_joiners, granted_at, S};
use ratequeue_core::bucket::Deny;
use ratequeue_core::wait::{GrantRef, Queued, Sim, Slot, Submitted, Wake};
use ratequeue_core::{
    AnyClock, Error, Limiter, ManualClock, QueueConfig, QueuedReservation, Rate, Reserved, Resource, WaitQueue,
};

type Hook = Box<dyn FnOnce() + Send>;

/// A limiter that runs `hook` once, right before its first fast-path take.
struct Hooked {
    inner: Arc<Limiter>,
    hook: Mutex<Option<Hook>>,
}

impl Hooked {
    fn run_hook(&self) {
        let hook = self.hook.lock().unwrap().take();
        if let Some(h) = hook {
            h();
        }
    }
}

impl Resource for Hooked {
    fn try_take(&self, now_ns: u64, costs: &[u64]) -> Result<(), Deny> {
        Resource::try_take(&*self.inner, now_ns, costs)
    }
    fn try_take_token(&self, now_ns: u64, costs: &[u64]) -> Result<Option<u64>, Deny> {
        Resource::try_take_token(&*self.inner, now_ns, costs)
    }
    fn try_take_token_nowait(&self, now_ns: u64, costs: &[u64]) -> Option<Result<Option<u64>, Deny>> {
        self.run_hook();
        Resource::try_take_token_nowait(&*self.inner, now_ns, costs)
    }
    fn try_take_token_idle_nowait(
        &self,
        now_ns: u64,
        costs: &[u64],
        joined: &dyn Fn() -> bool,
    ) -> Option<Result<Option<u64>, Deny>> {
        self.run_hook();
        Resource::try_take_token_idle_nowait(&*self.inner, now_ns, costs, joined)
    }
    fn ready_at(&self, at_ns: u64, costs: &[u64]) -> Result<Option<u64>, Deny> {
        Resource::ready_at(&*self.inner, at_ns, costs)
    }
    fn take_at(&self, at_ns: u64, costs: &[u64]) -> Result<u64, Deny> {
        Resource::take_at(&*self.inner, at_ns, costs)
    }
    fn charge_at(&self, at_ns: u64, costs: &[u64]) {
        Resource::charge_at(&*self.inner, at_ns, costs)
    }
    fn give_back(&self, costs: &[u64], token: Option<u64>) {
        Resource::give_back(&*self.inner, costs, token)
    }
    fn schedules_in_time(&self) -> bool {
        Resource::schedules_in_time(&*self.inner)
    }
    fn settle(&self, estimated: &[u64], actual: &[u64], grant: GrantRef) -> GrantRef {
        Resource::settle(&*self.inner, estimated, actual, grant)
    }
    fn try_settle(&self, estimated: &[u64], actual: &[u64], grant: GrantRef) -> Option<GrantRef> {
        Resource::try_settle(&*self.inner, estimated, actual, grant)
    }
    fn service_ns(&self, costs: &[u64]) -> f64 {
        Resource::service_ns(&*self.inner, costs)
    }
    fn error_for(&self, d: Deny) -> Error {
        Resource::error_for(&*self.inner, d)
    }
    fn predict(&self, now_ns: u64, ahead: &[u64], costs: &[u64]) -> Option<u64> {
        Resource::predict(&*self.inner, now_ns, ahead, costs)
    }
    fn sim(&self, now_ns: u64) -> Option<Sim> {
        Resource::sim(&*self.inner, now_ns)
    }
    fn predict_backlog(&self, now_ns: u64, backlog: &[Queued<'_>], costs: &[u64]) -> Option<u64> {
        Resource::predict_backlog(&*self.inner, now_ns, backlog, costs)
    }
}

/// What the hook queued: a waiter of cost 2 and a reservation of cost 1 behind it.
#[derive(Default)]
struct Joined {
    waiter: Option<Arc<Slot>>,
    reservation: Option<QueuedReservation>,
}

/// One unit per second, burst 2, one unit used: a fast-path take of 1 would conform.
fn setup(units: usize) -> (Arc<ManualClock>, Arc<Limiter>, Arc<Hooked>, Arc<WaitQueue>) {
    let clock = Arc::new(ManualClock::new(0).unwrap());
    let mut rates = vec![("requests".to_string(), Rate::new(1.0, 1e9, 2).unwrap())];
    if units == 2 {
        rates.push(("tokens".to_string(), Rate::new(100.0, 1e9, 200).unwrap()));
    }
    let lim = Arc::new(Limiter::new(rates, AnyClock::Manual(clock.clone())).unwrap());
    let costs = vec![1u64; units];
    lim.try_acquire(&costs).unwrap();
    let hooked = Arc::new(Hooked {
        inner: lim.clone(),
        hook: Mutex::new(None),
    });
    let q = WaitQueue::new(
        hooked.clone(),
        units,
        AnyClock::Manual(clock.clone()),
        QueueConfig::new(vec![], 100, None).unwrap(),
    );
    (clock, lim, hooked, q)
}

/// Arms the hook: in the fast path's window, a waiter of cost 2 queues (1 unit is left)
/// and a reservation of cost 1 is promised a time behind it.
fn arm(hooked: &Hooked, q: &Arc<WaitQueue>, lim: &Arc<Limiter>, units: usize) -> Arc<Mutex<Joined>> {
    let joined = Arc::new(Mutex::new(Joined::default()));
    let (q2, lim2, j2) = (q.clone(), lim.clone(), joined.clone());
    *hooked.hook.lock().unwrap() = Some(Box::new(move || {
        let slot = Slot::new();
        let mut two = vec![1u64; units];
        two[0] = 2;
        let s = q2.submit(&two, 0, None, || Wake::Thread(slot.clone())).unwrap();
        assert!(matches!(s, Submitted::Queued(_)), "the waiter must queue");
        let one = vec![1u64; units];
        let c = one.clone();
        let r = q2.reserve(&one, 0, None, move |_| lim2.reserve(&c, None)).unwrap();
        let Reserved::Queued(r) = r else {
            panic!("the reservation must queue behind the waiter")
        };
        let mut j = j2.lock().unwrap();
        j.waiter = Some(slot);
        j.reservation = Some(r);
    }));
    joined
}

fn race_keeps_the_promise(units: usize) {
    let (clock, lim, hooked, q) = setup(units);
    let joined = arm(&hooked, &q, &lim, units);
    let costs = vec![1u64; units];
    let fast = q.try_now_token(&costs, 0);
    let (waiter, reservation) = {
        let mut j = joined.lock().unwrap();
        (j.waiter.take().unwrap(), j.reservation.take().unwrap())
    };
    assert_eq!(reservation.at_ns, 2 * S, "promised behind the waiter (1 s) at 2 s");
    let kept: Vec<_> = fast.iter().map(|(at, _)| (*at, 1.0)).collect();
    check_joiners(&q, &clock, (&waiter, &reservation), &kept, "the fast path");
    assert!(
        fast.is_err(),
        "the fast path overtook the waiter that joined in its window"
    );
}

#[test]
fn fast_path_take_racing_a_joiner_is_undone_one_rate() {
    race_keeps_the_promise(1);
}

#[test]
fn fast_path_take_racing_a_joiner_is_undone_two_rates() {
    race_keeps_the_promise(2);
}

/// Queues, as in the window, a waiter of cost 2 and a reservation of cost 1 behind it.
fn join_now(q: &Arc<WaitQueue>, lim: &Arc<Limiter>, units: usize) -> (Arc<Slot>, QueuedReservation) {
    let hooked = Hooked {
        inner: lim.clone(),
        hook: Mutex::new(None),
    };
    let joined = arm(&hooked, q, lim, units);
    hooked.run_hook();
    let mut j = joined.lock().unwrap();
    (j.waiter.take().unwrap(), j.reservation.take().unwrap())
}

/// Python's try_acquire: checks the queue, then the limiter's take re-checks it.
fn try_acquire_keeps_the_promise(units: usize) {
    let (clock, lim, _, q) = setup(units);
    assert_eq!(q.waiting(), 0, "the caller's own check passes");
    let j = join_now(&q, &lim, units);
    let costs = vec![1u64; units];
    let fast = lim.try_acquire_idle_nowait(&costs, || q.joined()).unwrap();
    assert_eq!(fast, Err(Deny::Wait(0)), "refused: a waiter joined before the take");
    check_joiners(&q, &clock, (&j.0, &j.1), &[], "the fast path");
}

#[test]
fn try_acquire_racing_a_joiner_is_undone_one_rate() {
    try_acquire_keeps_the_promise(1);
}

#[test]
fn try_acquire_racing_a_joiner_is_undone_two_rates() {
    try_acquire_keeps_the_promise(2);
}

#[test]
fn try_acquire_undo_after_a_later_change_refunds_by_the_rule() {
    let (_, lim, _, q) = setup(1);
    let before = lim.available(0);
    let other = std::cell::RefCell::new(None);
    let got = lim.try_acquire_idle_nowait(&[1], || {
        // Another change lands after the take: no exact undo, the refund rule applies.
        *other.borrow_mut() = Some(lim.reserve(&[1], None).unwrap());
        true
    });
    assert_eq!(got, Some(Err(Deny::Wait(0))));
    let other = other.into_inner().unwrap();
    assert_eq!(other.delay_ns, S, "the later reservation stood behind the take");
    assert!(
        lim.available(0) <= before - 1.0 + 1e-9,
        "never more back than the take held"
    );
    assert_eq!(q.waiting(), 0);
}

#[test]
fn reservation_when_idle_racing_a_joiner_is_undone() {
    let (clock, lim, _, q) = setup(1);
    let (q2, lim2) = (q.clone(), lim.clone());
    let j = std::cell::RefCell::new(None);
    let now_path = |_| {
        // The window: after the queue's check, before the reservation's debit.
        *j.borrow_mut() = Some(join_now(&q2, &lim2, 1));
        lim2.reserve(&[1], None)
    };
    let lim3 = lim.clone();
    let idle = q.reserve_if_idle(now_path, move |r| {
        lim3.cancel(&r);
    });
    assert!(
        idle.is_none(),
        "the reservation overtook the waiter that joined in its window"
    );
    let lim4 = lim.clone();
    let r = q.reserve(&[1], 0, None, move |_| lim4.reserve(&[1], None)).unwrap();
    let Reserved::Queued(mine) = r else {
        panic!("queued behind the joiners")
    };
    assert_eq!(mine.at_ns, 3 * S);
    let j = j.into_inner().unwrap();
    check_joiners(&q, &clock, (&j.0, &j.1), &[], "the fast path");
    assert_eq!(granted_at(mine.outcome()), 3 * S);
}

/// A host with a lock of its own (Python's GIL) takes the driver's wake-up after an
/// undone take through `try_now_token_then`: called exactly once when the take raced a
/// joiner (so the host can release its lock around it), never on an admitted take.
#[test]
fn an_undone_take_hands_its_wake_up_to_the_caller() {
    let calls = std::cell::Cell::new(0);
    let (_clock, _lim, _hooked, q) = setup(1);
    assert!(
        q.try_now_token_then(&[1], 0, |_| calls.set(calls.get() + 1)).is_ok(),
        "nobody waits: admitted"
    );
    assert_eq!(calls.get(), 0, "an admitted take owes no wake-up");

    let (_clock, lim, hooked, q) = setup(1);
    let _joined = arm(&hooked, &q, &lim, 1);
    let undone = q.try_now_token_then(&[1], 0, |w| {
        calls.set(calls.get() + 1);
        w.rewake_after_undo();
    });
    assert_eq!(undone, Err(None), "refused: it queues behind the joiner");
    assert_eq!(calls.get(), 1, "the undone take's wake-up goes to the caller, once");
}
