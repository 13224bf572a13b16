//! The blocking acquire: a gate in front of a queue admits at once, or queues the
//! caller and waits for its outcome in slices, asking its host between slices whether
//! to stop (e.g. Ctrl-C). However it ends, the queue is left clean: a waiter that stops
//! is removed, or the grant that won the race is given back, exactly once.

use super::permit::{Detach, Permit, PermitOwner};
use super::*;

/// Where a blocking acquire waits: its host detaches around every wait and says, between
/// slices of the wait, whether to stop.
pub trait Host: Detach {
    /// Why a wait stopped early (e.g. a Python exception raised by a signal handler).
    type Interrupt;
    /// The longest single wait before [`Host::check`] is asked again (None: no checks),
    /// asked once the waiter is queued. Err stops the wait as [`Host::check`] does (asking
    /// may run the host's code, where an interrupt can arrive: a Python signal handler).
    fn slice(&mut self) -> Result<Option<Duration>, Self::Interrupt>;
    /// Err stops the wait; the waiter leaves the queue with nothing taken.
    fn check(&mut self) -> Result<(), Self::Interrupt>;
}

/// How a blocking acquire ended without a grant.
#[derive(Debug, PartialEq)]
pub enum Stopped<I> {
    /// Refused (at once or at its deadline); nothing consumed.
    Failed(Error),
    /// The host stopped it; nothing consumed.
    Interrupted(I),
}

/// A queue plus how its permits behave on exit.
pub struct Gate {
    /// The queue the permits come from.
    pub queue: Arc<WaitQueue>,
    /// Unit names, indexed as the costs (empty for a semaphore: nothing to settle).
    pub units: Vec<String>,
    /// True for a semaphore: the permit is returned when the holder is done.
    pub returns_on_exit: bool,
}

impl PermitOwner for Gate {
    fn units(&self) -> &[String] {
        &self.units
    }

    fn returns_on_exit(&self) -> bool {
        self.returns_on_exit
    }

    fn give_back(&self, costs: &[u64]) {
        self.queue.give_back(costs, None);
    }

    fn try_give_back(&self, costs: &[u64]) -> bool {
        self.queue.try_give_back(costs, None)
    }

    fn settle(&self, estimated: &[u64], actual: &[u64], grant: GrantRef) -> GrantRef {
        self.queue.settle(estimated, actual, grant)
    }

    fn try_settle(&self, estimated: &[u64], actual: &[u64], grant: GrantRef) -> Option<GrantRef> {
        self.queue.try_settle(estimated, actual, grant)
    }
}

impl Gate {
    /// A gate over `queue`; its permits are returned on exit when `returns_on_exit`.
    pub fn new(queue: Arc<WaitQueue>, units: Vec<String>, returns_on_exit: bool) -> Arc<Gate> {
        Arc::new(Gate {
            queue,
            units,
            returns_on_exit,
        })
    }

    /// A permit of this gate holding `costs` under `grant`.
    pub fn issue(self: &Arc<Self>, costs: &[u64], waited_ns: u64, grant: GrantRef) -> Permit {
        Permit::new(self.clone(), costs, waited_ns, grant)
    }

    /// Admits `costs` in `class` at once, without waiting for any lock: Ok(None) when it
    /// must queue (or a lock is busy), Err when it can never be admitted.
    pub fn try_now(self: &Arc<Self>, costs: &[u64], class: usize) -> Result<Option<Permit>, Error> {
        self.try_now_in(&Inline, costs, class)
    }

    /// [`Gate::try_now`] for a host with a lock of its own: the driver's lock (asked for
    /// after a take undone for a joiner) is waited for detached by `host`.
    pub fn try_now_in<D: Detach>(
        self: &Arc<Self>,
        host: &D,
        costs: &[u64],
        class: usize,
    ) -> Result<Option<Permit>, Error> {
        let undone = |q: &Arc<WaitQueue>| host.detached(|| q.rewake_after_undo());
        match self.queue.try_now_token_then(costs, class, undone) {
            Ok((at_ns, token)) => Ok(Some(self.issue(costs, 0, GrantRef::new(at_ns, token)))),
            Err(Some(d)) => Err(self.queue.error_for(d)),
            Err(None) => Ok(None),
        }
    }

    /// Admits `costs` in `class`, waiting in the queue up to `timeout_ns` (else the
    /// queue's `max_wait`) when it cannot be admitted at once. Every wait runs detached
    /// by `host`; between slices `host` may stop it. Ends granted, refused (Overloaded,
    /// WaitTimeout, CostTooLarge) or interrupted, the queue clean in every case.
    pub fn acquire_blocking<H: Host>(
        self: &Arc<Self>,
        host: &mut H,
        costs: &[u64],
        class: usize,
        timeout_ns: Option<u64>,
    ) -> Result<Permit, Stopped<H::Interrupt>> {
        if let Some(p) = self.try_now_in(host, costs, class).map_err(Stopped::Failed)? {
            return Ok(p);
        }
        // On the real-time clock the thread wakes itself at its grant time (one wake-up).
        let slot = if self.queue.self_timing() {
            Slot::self_timed()
        } else {
            Slot::new()
        };
        let submitted = host.detached(|| {
            self.queue
                .submit(costs, class, timeout_ns, || Wake::Thread(slot.clone()))
        });
        let ticket = match submitted.map_err(Stopped::Failed)? {
            Submitted::Granted { at_ns } => return Ok(self.issue(costs, 0, GrantRef::new(at_ns, None))),
            Submitted::Queued(t) => t,
        };
        let slice = match host.slice() {
            Ok(slice) => slice,
            Err(i) => {
                // Queued (or granted meanwhile): leave exactly as for a failed check.
                host.detached(|| self.abandon(ticket, &slot, costs));
                return Err(Stopped::Interrupted(i));
            }
        };
        loop {
            if let Some(o) = host.detached(|| self.queue.wait_slot(ticket, &slot, slice)) {
                return self.outcome(host, costs, o);
            }
            if let Err(i) = host.check() {
                host.detached(|| self.abandon(ticket, &slot, costs));
                return Err(Stopped::Interrupted(i));
            }
        }
    }

    fn outcome<H: Host>(
        self: &Arc<Self>,
        host: &H,
        costs: &[u64],
        o: Outcome,
    ) -> Result<Permit, Stopped<H::Interrupt>> {
        match o {
            Outcome::Granted {
                at_ns,
                waited_ns,
                token,
            } => Ok(self.issue(costs, waited_ns, GrantRef::new(at_ns, Some(token)))),
            Outcome::TimedOut { waited_ns } => Err(Stopped::Failed(Error::WaitTimeout {
                waited_ns,
                retry_after_ns: host.detached(|| self.queue.retry_after_ns(costs)),
            })),
        }
    }

    /// Leaves the queue after an interruption: removed, or the grant that won the race
    /// is given back. Exactly once either way.
    fn abandon(&self, ticket: u64, slot: &Slot, costs: &[u64]) {
        if self.queue.cancel(ticket) == Cancelled::NotQueued {
            if let Some(Outcome::Granted { token, .. }) = slot.take() {
                self.queue.give_back(costs, Some(token));
            }
        }
    }
}
