//! What a permit is worth in a forked child: a semaphore's permit from before the fork
//! gives nothing back there, and a parent's owed charge is the parent's to debit.
//!
//! These live in a test binary of their own: `fork()` runs the core's prepare handler,
//! which holds every registered queue's and resource's lock until the child exists, so a
//! test of another file running beside it on another thread could find an idle queue's
//! lock busy (a release that detaches, a `try_now` that says "busy") and fail on a race
//! that is the fork's, not its own. Tests of one binary run in parallel; binaries do not.

use std::sync::{Arc, Mutex};

use ratequeue_core::fork::{ForkLocks, Held, Rank};
use ratequeue_core::wait::{Gate, GrantRef, Inline, Reserved, Submitted, WaitQueue};
use ratequeue_core::{AnyClock, Limiter, ManualClock, QueueConfig, Rate, Semaphore};

mod common;
use common::{granted_at, waiter};

const MS: u64 = 1_000_000;

/// The tests here hold every registered lock of the process (a fork, the hook) or need an
/// idle queue's lock free: one at a time (a test that panicked leaves it usable).
static SERIAL: Mutex<()> = Mutex::new(());

fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

#[test]
fn a_permit_from_before_a_fork_gives_nothing_back_in_the_child() {
    let _one = one_at_a_time();
    let sem = Arc::new(Semaphore::new(2).unwrap());
    ratequeue_core::fork::register_arc(&sem);
    let clock = AnyClock::Manual(Arc::new(ManualClock::new(0).unwrap()));
    let q = WaitQueue::new(
        sem.clone(),
        1,
        clock,
        QueueConfig::new(Vec::new(), 1_000, None).unwrap(),
    );
    let gate = Gate::new(q, Vec::new(), true);
    let p = gate.try_now(&[1], 0).unwrap().expect("a free permit");
    assert!(p.granted_here());
    // SAFETY: the child only reads atomics and takes locks the fork handlers released,
    // then leaves with _exit.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0);
    if pid == 0 {
        // The child starts with every permit free; the parent's permit is not its own.
        let ok = sem.in_use() == 0
            && !p.granted_here()
            && gate.try_now(&[1], 0).is_ok_and(|c| c.is_some())
            && p.release(&Inline)
            && sem.in_use() == 1;
        unsafe { libc::_exit(if ok { 0 } else { 1 }) };
    }
    let mut status = 0;
    // SAFETY: waits for the child forked above.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "{status}");
    assert_eq!(sem.in_use(), 1);
    assert!(p.release(&Inline));
    assert_eq!(sem.in_use(), 0);
}

#[test]
fn in_a_forked_child_a_permit_that_owed_a_charge_gives_back_only_what_the_bucket_holds() {
    let _one = one_at_a_time();
    // One unit per 0.1 s, burst 2. A permit of two at 0; a waiter (due 0.1 s) and a
    // reservation (promised 0.2 s) queue; the permit settles up to five: three units
    // owed behind the reservation. Then the process forks.
    let clock = Arc::new(ManualClock::new(0).unwrap());
    let any = AnyClock::Manual(clock.clone());
    let lim = Arc::new(Limiter::new(vec![("requests".into(), Rate::new(10.0, 1e9, 2).unwrap())], any.clone()).unwrap());
    let q = WaitQueue::new(lim.clone(), 1, any, QueueConfig::new(vec![], 100, None).unwrap());
    let Submitted::Granted { at_ns } = q.submit(&[2], 0, None, || unreachable!()).unwrap() else {
        panic!("granted at once")
    };
    let _w = waiter(&q, 1);
    let Reserved::Queued(r) = q.reserve(&[1], 0, None, |_| Ok(())).unwrap() else {
        panic!("queued behind the waiter")
    };
    assert_eq!(r.at_ns, 200 * MS);
    let g = q.settle(&[2], &[5], GrantRef::new(at_ns, None));
    assert!(g.owed.is_some());
    // SAFETY: the child only takes locks the fork handlers released and reads the
    // bucket, then leaves with _exit.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0);
    if pid == 0 {
        // The three owed units went with the parent's queue (the parent debits them): the
        // child's bucket holds two units of the permit, so settling it to one gives one
        // back, as the parent would (cancelling what it owes first): one unit held, one
        // free at 0, not two.
        q.settle(&[5], &[1], g);
        // The child's answer: when two units conform (ms), 255 when anything else is off.
        let code = match (q.waiting(), lim.delay_at(0, &[1]), lim.delay_at(0, &[2])) {
            (0, Ok(0), Ok(d)) => (d / MS).min(254) as i32,
            (n, d1, _) => 200 + n.min(9) as i32 * 10 + d1.map_or(9, |d| (d / MS / 100).min(9) as i32),
        };
        // SAFETY: leaves the child without running the parent's destructors or tests.
        unsafe { libc::_exit(code) };
    }
    let mut status = 0;
    // SAFETY: waits for the child forked above.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    assert!(libc::WIFEXITED(status), "{status}");
    assert_eq!(
        libc::WEXITSTATUS(status),
        100,
        "in the child, two units conform after this many ms (255: the queue or one unit is off)"
    );
    // The parent is untouched: its waiter at 0.1 s, the reservation at 0.2 s, the owed
    // three units after it.
    q.run_until(&clock, 1000 * MS).unwrap();
    assert_eq!(granted_at(r.outcome()), 200 * MS);
    assert_eq!(q.waiting(), 0);
}

/// An object with two locks (as a limiter's multi-rate and rate-change locks).
struct Two {
    a: Mutex<u32>,
    b: Mutex<u32>,
}

impl ForkLocks for Two {
    fn rank(&self) -> Rank {
        Rank::Resource
    }
    fn lock_for_fork<'a>(&'a self, held: &mut Vec<Box<dyn Held + 'a>>) {
        // As the core's locks: a poisoned one is taken all the same (prepare must not panic).
        held.push(Box::new(self.a.lock().unwrap_or_else(|e| e.into_inner())));
        held.push(Box::new(self.b.lock().unwrap_or_else(|e| e.into_inner())));
    }
}

#[test]
fn prepare_holds_every_lock_until_release() {
    let _one = one_at_a_time();
    let t = Arc::new(Two {
        a: Mutex::new(0),
        b: Mutex::new(0),
    });
    ratequeue_core::fork::register_arc(&t);
    ratequeue_core::fork::while_held_for_fork(|| assert!(t.a.try_lock().is_err() && t.b.try_lock().is_err()));
    assert!(t.a.try_lock().is_ok() && t.b.try_lock().is_ok());
    // Released when what runs in between panics, too.
    let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        ratequeue_core::fork::while_held_for_fork(|| panic!("in between"))
    }));
    assert!(caught.is_err());
    // (Poisoned by the unwind, as the core's locks tolerate: not held.)
    let free = |m: &Mutex<u32>| !matches!(m.try_lock(), Err(std::sync::TryLockError::WouldBlock));
    assert!(free(&t.a) && free(&t.b));
}

#[test]
fn registry_stays_bounded() {
    let _one = one_at_a_time();
    for _ in 0..10_000 {
        let t = Arc::new(Two {
            a: Mutex::new(0),
            b: Mutex::new(0),
        });
        ratequeue_core::fork::register_arc(&t);
    }
    assert!(
        ratequeue_core::fork::registered() < 1_000,
        "{}",
        ratequeue_core::fork::registered()
    );
}

/// Keeps it so (a text search for the spellings this crate uses): no other test binary of
/// the crate forks or holds the fork locks (the race above failed CI once,
/// `lifecycle.rs`'s "an idle queue gives back without waiting" beside its fork test).
#[test]
fn only_this_binary_forks() {
    fn sources(dir: &std::path::Path, out: &mut Vec<std::path::PathBuf>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                sources(&p, out);
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    sources(&root.join("tests"), &mut files);
    sources(&root.join("src"), &mut files);
    let calls = [["libc::", "fork()"].concat(), ["while_held_", "for_fork("].concat()];
    let forking: Vec<_> = files
        .iter()
        .filter(|p| !p.ends_with("tests/forked.rs") && !p.ends_with("src/fork.rs"))
        .filter(|p| {
            let text = std::fs::read_to_string(p).unwrap();
            calls.iter().any(|c| text.contains(c.as_str()))
        })
        .collect();
    assert!(forking.is_empty(), "fork only in tests/forked.rs: {forking:?}");
}
