//! What a submission, a wait, a cancel and a reservation end in.

use super::*;

/// What a permit keeps of its grant, so that settling it follows the one undo rule.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GrantRef {
    /// When the grant was taken (an earlier time is safe: it only refunds less).
    pub at_ns: u64,
    /// The grant's token (see [`Resource::take_at`]) while nothing is known to have
    /// come after it.
    pub token: Option<u64>,
    /// The ticket of this grant's overage charge still queued (see
    /// [`WaitQueue::settle`]): owed, not debited yet.
    pub owed: Option<u64>,
}

impl GrantRef {
    /// A grant taken at `at_ns` with `token`, owing nothing.
    pub fn new(at_ns: u64, token: Option<u64>) -> GrantRef {
        GrantRef {
            at_ns,
            token,
            owed: None,
        }
    }
}

/// How a waiter learns its outcome.
#[derive(Clone)]
pub enum Wake {
    /// A blocked thread.
    Thread(Arc<Slot>),
    /// An event loop: the outcome goes to the channel (a closed channel hands a grant
    /// back to the queue, which returns it to the resource).
    Channel(Arc<Channel>),
    /// Nobody: an overage charge the queue debits in turn (see [`WaitQueue::settle`]).
    Nobody,
}

/// The end of a wait.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Granted at schedule time `at_ns` after waiting `waited_ns` from arrival; `token`
    /// lets an unused grant be given back exactly (see [`Resource::give_back`]).
    Granted { at_ns: u64, waited_ns: u64, token: u64 },
    /// Left the queue at its deadline; nothing consumed.
    TimedOut { waited_ns: u64 },
}

/// Result of a submission.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Submitted {
    /// Granted without waiting (at the current time).
    Granted { at_ns: u64 },
    /// Queued under this ticket; the outcome arrives through its `Wake`.
    Queued(u64),
}

/// What cancel did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cancelled {
    /// Removed from the queue before any grant.
    Removed,
    /// Not in the queue: already granted or timed out (the caller settles it).
    NotQueued,
}

/// What a reservation got from [`WaitQueue::reserve`].
#[derive(Clone, Debug)]
pub enum Reserved<R> {
    /// Nobody waited: what the resource's own reservation gave (debited at once).
    Now(R),
    /// Queued behind the waiters; debited when the queue grants it.
    Queued(QueuedReservation),
}

/// What [`WaitQueue::reserve_at`] did.
#[derive(Clone, Debug)]
pub enum Joined<R> {
    /// Held for the asked time: debited now for it (nobody waited) or queued behind the
    /// waiters and debited by the queue at that time.
    Held(Reserved<R>),
    /// Nothing held: the earliest time (later than asked) the level could grant it.
    Later(u64),
}

/// A reservation waiting in the queue: the queue debits the resource when it grants
/// it, at its schedule time, so no waiter ahead or behind is moved.
#[derive(Clone)]
pub struct QueuedReservation {
    /// Its ticket in the queue.
    pub ticket: u64,
    /// The predicted grant time (exact for one class: the FIFO schedule; with several
    /// weighted classes a prediction from the whole backlog).
    pub at_ns: u64,
    /// From the reservation until `at_ns`.
    pub delay_ns: u64,
    pub(super) slot: Arc<Slot>,
}

impl std::fmt::Debug for QueuedReservation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QueuedReservation")
            .field("ticket", &self.ticket)
            .field("at_ns", &self.at_ns)
            .field("delay_ns", &self.delay_ns)
            .finish()
    }
}

impl QueuedReservation {
    /// The queue's outcome so far: `Some` once granted, without consuming it.
    pub fn outcome(&self) -> Option<Outcome> {
        *lock(&self.slot.state)
    }
}
