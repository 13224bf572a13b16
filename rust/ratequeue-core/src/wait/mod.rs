//! The wait queue: a deterministic state machine over the clock that turns waiting into
//! an explicit reservation — FIFO within a class, start-time fair queuing across
//! weighted classes, grants in schedule time, bounded depth and deadlines, exact
//! cancellation — plus the real-time driver thread that runs it.
//!
//! `submit` admits at once, queues or refuses; `poll(now)` grants every waiter whose
//! schedule time has come (debiting the resource *at that schedule time*, so a late
//! wake-up never costs throughput) and expires deadlines; `cancel` removes a waiter or,
//! when it lost the race to a grant, gives the grant back. Each waiter is woken once.

pub mod awaiting;
pub mod channel;
mod config;
mod drive;
pub mod driver;
mod fork;
mod gate;
mod give_back;
mod grant;
mod outcome;
mod permit;
mod predict;
mod reserve;
mod resource;
mod state;
mod submit;
#[cfg(test)]
mod tests;
mod timed;
#[cfg(test)]
use timed::timers_precise;
use timed::TAKEOVER_NS;
#[cfg(test)]
mod timed_tests;
mod wakers;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::time::Duration;

use crate::bucket::Deny;
use crate::clock::AnyClock;
use crate::error::Error;
use crate::histogram::Histogram;
pub use channel::Channel;

pub use config::{QueueConfig, QueueCounts};
pub use drive::Stalled;
pub use gate::{Gate, Host, Stopped};
pub use outcome::{Cancelled, GrantRef, Joined, Outcome, QueuedReservation, Reserved, Submitted, Wake};
use permit::Costs;
pub use permit::{Detach, Inline, Permit, PermitOwner};
use predict::{charges_to_retime, promised};
use resource::saturated;
pub use resource::{Queued, Resource, Sim};
pub use submit::SubmitTail;
use wakers::deliver;
pub use wakers::Slot;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

struct Waiter {
    /// Inline for up to two units: no allocation made by one thread and freed by another.
    costs: Costs,
    arrival_ns: u64,
    deadline_ns: Option<u64>,
    /// A reservation's promised grant time.
    due_ns: Option<u64>,
    start_tag: f64,
    wake: Wake,
}

impl Waiter {
    fn queued(&self) -> Queued<'_> {
        Queued {
            costs: &self.costs,
            due: self.due_ns,
            charge: matches!(self.wake, Wake::Nobody),
        }
    }
}

#[derive(Default)]
struct Class {
    weight: f64,
    waiters: BTreeMap<u64, Waiter>,
    last_finish: f64,
    /// Cost per unit of this class's waiters, exact (no sum of u64 costs can overflow it).
    queued: Vec<u128>,
}

#[derive(Default)]
struct Counters {
    tried_admitted: AtomicU64,
    tried_refused: AtomicU64,
    immediate: AtomicU64,
    queued_grants: AtomicU64,
    refused_full: AtomicU64,
    refused_deadline: AtomicU64,
    timed_out: AtomicU64,
    cancelled: AtomicU64,
}

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

struct Inner {
    classes: Vec<Class>,
    vtime: f64,
    last_grant_ns: u64,
    /// The class of each ticket (tickets are consecutive: their hash keeps them close).
    where_is: awaiting::ByTicket<usize>,
    deadlines: BTreeSet<(u64, u64)>,
    /// Queued reservations by promised grant time.
    reserved: BTreeSet<(u64, u64)>,
    len: usize,
    /// Waiters that are not self-timed threads (event loops, driver-served threads,
    /// charges): a self-timed head's poll, or the driver's, serves them.
    others: usize,
    /// Self-timed waiters that woke before their turn and wait untimed for the head's
    /// poll to time them (kept until they leave the queue).
    untimed: BTreeSet<u64>,
    /// In a forked child: the overage charges queued in the parent, dropped here, by
    /// ticket (what the grant that owed each one holds less than its estimate).
    forgiven: HashMap<u64, Costs>,
}

/// A wait queue in front of a resource, with its driver.
pub struct WaitQueue {
    resource: Arc<dyn Resource>,
    clock: AnyClock,
    config: QueueConfig,
    waiting: AtomicUsize,
    inner: Mutex<Inner>,
    scheduled: AtomicU64,
    scheduled_pid: std::sync::atomic::AtomicI32,
    generation: AtomicU64,
    /// The next due time found is a grant to a blocked thread (a hint for the driver).
    thread_next: AtomicBool,
    counters: Counters,
    waits: Vec<Arc<Histogram>>,
}

/// Tickets are unique in the process, so one event-loop channel can serve many queues.
static NEXT_TICKET: AtomicU64 = AtomicU64::new(1);

/// Outcomes to deliver: wake, ticket, outcome and the waiter's costs.
type Deliveries = Vec<(Wake, u64, Outcome, Costs)>;

/// Grants whose waiter is gone (its channel closed), to give back: costs and token.
type Gone = Vec<(Costs, u64)>;
