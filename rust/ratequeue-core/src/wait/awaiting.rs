//! The await lifecycle: an acquire awaited on an event loop, from its first step to its
//! end, whatever ends it (granted, timed out, refused, cancelled, the loop closed, the
//! awaitable dropped).
//!
//! An [`Awaiting`] steps through Idle → Starting → Queued → Done. Queued, its ticket is
//! in two tables of the loop ([`Waits`]): the channel's [`Pending`] entries (what must be
//! settled once the loop is gone; no object of the loop) and the loop's futures.
//! [`Waits::resolve`] finishes each outcome (the grant made, kept for the task) and
//! wakes its task, which takes the grant when it resumes. Whoever takes the ticket out
//! of the channel's table settles it: the resolve (a grant whose waiter left goes back),
//! the waiter leaving ([`Awaiting::end`]: a grant finished but not taken is undone), or
//! the channel's close ([`Native::close`]). Exactly once in every case.
//!
//! What the host supplies: its event loop ([`Loop`]: the running loop's tables and its
//! futures; [`Wakeup`]: how a task is woken) and how a wait runs outside its own lock
//! ([`Unlock`]). What is acquired is an [`Acquire`], whose grant is what the host's task
//! gets: one level ([`LevelAcquire`]) or a policy's levels all-or-nothing
//! (`policy::PolicyAcquire`); a host wraps either to make its grants its own objects.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::panic::{catch_unwind, AssertUnwindSafe};

use super::permit::{Costs, Detach, Permit, PermitOwner};
use super::*;

/// A [`Detach`] behind `dyn`: runs `f`, which may wait for a lock, outside the host's.
pub trait Unlock {
    /// Runs `f` outside the host's lock.
    fn unlocked(&self, f: &mut (dyn FnMut() + Send));
}

impl<D: Detach> Unlock for D {
    fn unlocked(&self, f: &mut (dyn FnMut() + Send)) {
        self.detached(f);
    }
}

/// `f()` run through `d`.
pub fn unlocked<T: Send>(d: &dyn Unlock, f: impl FnOnce() -> T + Send) -> T {
    let mut f = Some(f);
    let mut out = None;
    d.unlocked(&mut || {
        if let Some(f) = f.take() {
            out = Some(f());
        }
    });
    out.expect("Unlock::unlocked runs its function")
}

/// What [`Acquire::begin`] reached.
#[derive(Debug)]
pub enum Begun<G> {
    /// Finished at once with this grant.
    Done(G),
    /// Queued under this ticket; the outcome arrives through the wake given.
    Queued(u64),
}

/// One acquire as the core decides it, driven by an [`Awaiting`]. Every method settles
/// exactly what it says, once, and waits for locks only through `d`.
pub trait Acquire: Send + Sync + 'static {
    /// What a finished acquire hands its task.
    type Grant: Send;
    /// Goes as far as it can without waiting: finished, or queued under a ticket whose
    /// outcome `wake` delivers. An error refuses it with nothing held.
    fn begin(&self, d: &dyn Unlock, wake: &(dyn Fn() -> Wake + Sync)) -> Result<Begun<Self::Grant>, Error>;
    /// The outcome of its wait `ticket`, delivered for its task: the grant; None when
    /// another wait follows (begin again); an error (timed out) with nothing held.
    fn finish(&self, d: &dyn Unlock, ticket: u64, o: Outcome) -> Result<Option<Self::Grant>, Error>;
    /// A finished wait whose task left before taking it: its grant (None: the levels
    /// held so far) goes back, once.
    fn undo(&self, d: &dyn Unlock, grant: Option<Self::Grant>);
    /// Leaves the queue with everything given back: true when removed, false when the
    /// queue decided already (its outcome then goes to [`Acquire::give_back`]).
    fn leave(&self, d: &dyn Unlock, ticket: u64) -> bool;
    /// The outcome of `ticket` reached no task (its waiter left): everything it held and
    /// a grant go back.
    fn give_back(&self, d: &dyn Unlock, ticket: u64, o: Outcome);
}

impl<A: Acquire> Acquire for Arc<A> {
    type Grant = A::Grant;

    fn begin(&self, d: &dyn Unlock, wake: &(dyn Fn() -> Wake + Sync)) -> Result<Begun<A::Grant>, Error> {
        (**self).begin(d, wake)
    }

    fn finish(&self, d: &dyn Unlock, ticket: u64, o: Outcome) -> Result<Option<A::Grant>, Error> {
        (**self).finish(d, ticket, o)
    }

    fn leave(&self, d: &dyn Unlock, ticket: u64) -> bool {
        (**self).leave(d, ticket)
    }

    fn give_back(&self, d: &dyn Unlock, ticket: u64, o: Outcome) {
        (**self).give_back(d, ticket, o);
    }

    fn undo(&self, d: &dyn Unlock, grant: Option<A::Grant>) {
        (**self).undo(d, grant);
    }
}

/// An acquire of one level (a limiter, a semaphore, one key's queue) through its gate.
pub struct LevelAcquire {
    gate: Arc<Gate>,
    costs: Costs,
    class: usize,
    timeout_ns: Option<u64>,
    /// The queue's clock reading at the submit (the arrival): grant time = this + wait.
    submitted_ns: AtomicU64,
    /// Who the permit belongs to, when not the gate (e.g. a key of a keyed limiter).
    owner: Option<Arc<dyn PermitOwner>>,
}

impl LevelAcquire {
    /// `costs` in `class` on `gate`, within `timeout_ns` (None: the queue's max_wait).
    pub fn new(gate: &Arc<Gate>, costs: &[u64], class: usize, timeout_ns: Option<u64>) -> LevelAcquire {
        LevelAcquire {
            gate: gate.clone(),
            costs: Costs::new(costs),
            class,
            timeout_ns,
            submitted_ns: AtomicU64::new(0),
            owner: None,
        }
    }

    /// The same, its permits owned by `owner`.
    pub fn owned_by(mut self, owner: Arc<dyn PermitOwner>) -> LevelAcquire {
        self.owner = Some(owner);
        self
    }

    /// Its gate.
    pub fn gate(&self) -> &Arc<Gate> {
        &self.gate
    }

    fn permit(&self, waited_ns: u64, grant: GrantRef) -> Permit {
        match &self.owner {
            Some(o) => Permit::new(o.clone(), &self.costs, waited_ns, grant),
            None => self.gate.issue(&self.costs, waited_ns, grant),
        }
    }

    fn dated(&self, r: Result<(Submitted, u64), Error>) -> Result<Begun<Permit>, Error> {
        let (s, now) = r?;
        self.submitted_ns.store(now, Ordering::Release);
        Ok(match s {
            Submitted::Granted { at_ns } => Begun::Done(self.permit(0, GrantRef::new(at_ns, None))),
            Submitted::Queued(t) => Begun::Queued(t),
        })
    }

    /// Gives back the grant of `p`, a permit its task never used, once (marked released;
    /// nothing in a process forked after the grant).
    pub fn undo_permit(&self, d: &dyn Unlock, p: &Permit) {
        if p.mark_released() && p.granted_here() {
            let token = p.held(&Inline).1.token;
            unlocked(d, || self.gate.queue.give_back(&self.costs, token));
        }
    }

    /// Gives back a grant whose token is unknown (see [`Resource::give_back`]).
    pub fn give_back_untracked(&self, d: &dyn Unlock) {
        unlocked(d, || self.gate.queue.give_back(&self.costs, None));
    }

    /// Submits without waiting for the queue's outcome, on whatever `wake` says (e.g. a
    /// channel its owner drains): the permit when granted at once, else the ticket.
    pub fn submit(&self, d: &dyn Unlock, wake: impl FnOnce() -> Wake + Send) -> Result<Begun<Permit>, Error> {
        let q = &self.gate.queue;
        let r = unlocked(d, || q.submit_dated(&self.costs, self.class, self.timeout_ns, wake));
        self.dated(r)
    }
}

impl Acquire for LevelAcquire {
    type Grant = Permit;

    fn begin(&self, d: &dyn Unlock, wake: &(dyn Fn() -> Wake + Sync)) -> Result<Begun<Permit>, Error> {
        let q = &self.gate.queue;
        let (c, class, t) = (&self.costs, self.class, self.timeout_ns);
        let r = match q.try_submit_dated(c, class, t, wake) {
            Some(tail) if tail.is_light() => tail.finish(),
            Some(tail) => unlocked(d, || tail.finish()),
            None => unlocked(d, || q.submit_dated(c, class, t, wake)),
        };
        self.dated(r)
    }

    fn finish(&self, d: &dyn Unlock, _ticket: u64, o: Outcome) -> Result<Option<Permit>, Error> {
        match o {
            Outcome::Granted { waited_ns, token, .. } => {
                let at_ns = self.submitted_ns.load(Ordering::Acquire).saturating_add(waited_ns);
                Ok(Some(self.permit(
                    waited_ns,
                    GrantRef {
                        at_ns,
                        token: Some(token),
                        owed: None,
                    },
                )))
            }
            Outcome::TimedOut { waited_ns } => Err(Error::WaitTimeout {
                waited_ns,
                retry_after_ns: unlocked(d, || self.gate.queue.retry_after_ns(&self.costs)),
            }),
        }
    }

    fn leave(&self, d: &dyn Unlock, ticket: u64) -> bool {
        unlocked(d, || self.gate.queue.cancel(ticket)) == Cancelled::Removed
    }

    fn give_back(&self, d: &dyn Unlock, _ticket: u64, o: Outcome) {
        if let Outcome::Granted { token, .. } = o {
            unlocked(d, || self.gate.queue.give_back(&self.costs, Some(token)));
        }
    }

    fn undo(&self, d: &dyn Unlock, grant: Option<Permit>) {
        if let Some(p) = grant {
            self.undo_permit(d, &p);
        }
    }
}

/// Hashes tickets (one sequence for the process): consecutive tickets keep consecutive
/// slots (their low bits are kept), the top bits mixed for the table's tags.
#[derive(Default, Clone, Copy)]
pub struct TicketHash(u64);

impl Hasher for TicketHash {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.write_u64(self.0.rotate_left(8) ^ u64::from(*b));
        }
    }

    fn write_u64(&mut self, t: u64) {
        self.0 = t ^ (t.wrapping_mul(0x9E37_79B9_7F4A_7C15) & (0x7F << 57));
    }
}

/// A map by ticket.
pub type ByTicket<V> = HashMap<u64, V, BuildHasherDefault<TicketHash>>;

/// A queued wait as its channel's table holds it: settled by whoever takes it out.
pub trait Pending<G>: Send + Sync {
    /// Finishes the outcome of `ticket` for its task, keeping a copy of the grant (made
    /// by `keep`) for the task; the error of a wait that failed. None when the task left
    /// meanwhile (what it was granted went back).
    #[allow(clippy::type_complexity)]
    fn finish(
        &self,
        d: &dyn Unlock,
        ticket: u64,
        o: Outcome,
        keep: &mut dyn FnMut(&G) -> G,
    ) -> Option<Result<Option<G>, Error>>;
    /// The outcome of `ticket` reached no task: a grant goes back.
    fn give_back(&self, d: &dyn Unlock, ticket: u64, o: Outcome);
    /// Its channel closed before an outcome: it leaves its queue with everything given
    /// back (an outcome decided meanwhile went back to its queue, the channel closed).
    fn close(&self, d: &dyn Unlock, ticket: u64);
    /// Marks the ticket's future taken by the resolve: its outcome is being finished.
    fn delivering(&self);
}

/// Where a queued wait's outcome is, between the resolve and its task.
enum Slot<G> {
    /// Not delivered.
    Empty,
    /// The resolve is finishing it (the task may not leave unseen meanwhile).
    Delivering,
    /// Finished for the task (None: another wait follows), in this fork generation.
    Kept(Option<G>, u64),
    /// The task left while it was being finished: the resolve undoes it.
    Left,
}

/// What an [`Awaiting`] shares with its channel's table.
struct Shared<A: Acquire> {
    acquire: A,
    slot: Mutex<Slot<A::Grant>>,
}

impl<A: Acquire> Pending<A::Grant> for Shared<A> {
    fn finish(
        &self,
        d: &dyn Unlock,
        ticket: u64,
        o: Outcome,
        keep: &mut dyn FnMut(&A::Grant) -> A::Grant,
    ) -> Option<Result<Option<A::Grant>, Error>> {
        let r = self.acquire.finish(d, ticket, o);
        let mut slot = lock(&self.slot);
        if matches!(*slot, Slot::Left) {
            *slot = Slot::Empty;
            drop(slot);
            if let Ok(g) = r {
                self.acquire.undo(d, g);
            }
            return None;
        }
        *slot = match &r {
            Ok(g) => Slot::Kept(g.as_ref().map(&mut *keep), crate::fork::generation()),
            Err(_) => Slot::Empty,
        };
        Some(r)
    }

    fn give_back(&self, d: &dyn Unlock, ticket: u64, o: Outcome) {
        self.acquire.give_back(d, ticket, o);
    }

    fn close(&self, d: &dyn Unlock, ticket: u64) {
        self.acquire.leave(d, ticket);
    }

    fn delivering(&self) {
        *lock(&self.slot) = Slot::Delivering;
    }
}

/// The queued waits of one channel, by ticket: what its owner settles when the channel
/// closes (no object of the loop in it). `G`: the grant a task gets.
pub struct Native<G>(Mutex<ByTicket<Arc<dyn Pending<G>>>>);

impl<G> Default for Native<G> {
    fn default() -> Self {
        Native(Mutex::new(ByTicket::default()))
    }
}

impl<G> Native<G> {
    /// How many waits expect an outcome.
    pub fn len(&self) -> usize {
        lock(&self.0).len()
    }

    /// True when none does.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn insert(&self, ticket: u64, p: Arc<dyn Pending<G>>) {
        lock(&self.0).insert(ticket, p);
    }

    fn remove(&self, ticket: u64) -> Option<Arc<dyn Pending<G>>> {
        lock(&self.0).remove(&ticket)
    }

    fn contains(&self, ticket: u64) -> bool {
        lock(&self.0).contains_key(&ticket)
    }

    /// The channel closed, leaving `undelivered` outcomes in it: each wait of this table
    /// settles (a grant goes back, a pending wait leaves its queue); returns the outcomes
    /// of other tickets, for the caller to settle.
    pub fn close(&self, d: &dyn Unlock, undelivered: Vec<(u64, Outcome)>) -> Vec<(u64, Outcome)> {
        let mut native = std::mem::take(&mut *lock(&self.0));
        let mut rest = Vec::new();
        for (t, o) in undelivered {
            match native.remove(&t) {
                Some(p) => p.give_back(d, t, o),
                None => rest.push((t, o)),
            }
        }
        for (t, p) in native {
            p.close(d, t);
        }
        rest
    }
}

/// An event loop's tables of queued waits on its channel: the channel's entries, shared
/// with the channel's owner, and the loop's futures `F`; `G`: the grant a task gets.
pub struct Waits<F, G> {
    /// The loop's channel.
    pub chan: Arc<Channel>,
    /// The channel's entries.
    pub native: Arc<Native<G>>,
    futs: Mutex<ByTicket<F>>,
}

/// How a host wakes a task: resolves its loop's future with its grant (None: another
/// wait follows) or its error.
pub trait Wakeup<F, G> {
    /// Another handle to a grant (the task takes one, the future is resolved with the
    /// other).
    fn keep(&mut self, grant: &G) -> G;
    /// Wakes the task waiting on `fut` with `r`.
    fn wake(&mut self, fut: F, r: Result<Option<G>, Error>);
}

impl<F, G> Waits<F, G> {
    /// The tables of the loop whose channel is `chan`, its entries in `native`.
    pub fn new(chan: Arc<Channel>, native: Arc<Native<G>>) -> Waits<F, G> {
        Waits {
            chan,
            native,
            futs: Mutex::new(ByTicket::default()),
        }
    }

    /// Visits every future (for a garbage collector); false when the table is busy (the
    /// lock is never waited for).
    pub fn visit<E>(&self, mut f: impl FnMut(&F) -> Result<(), E>) -> Result<bool, E> {
        let Ok(futs) = self.futs.try_lock() else {
            return Ok(false);
        };
        for fut in futs.values() {
            f(fut)?;
        }
        Ok(true)
    }

    /// Drops every future (the loop's side goes).
    pub fn clear(&self) {
        let futs = std::mem::take(&mut *lock(&self.futs));
        drop(futs);
    }

    /// Finishes each outcome for its wait, in delivery (grant) order, and wakes its task
    /// through `host`; a grant whose waiter left goes back. A panic of `host` leaves the
    /// rest of the batch delivered and is returned. Returns the outcomes of tickets not
    /// in this table.
    #[allow(clippy::type_complexity)]
    pub fn resolve(
        &self,
        d: &dyn Unlock,
        outcomes: Vec<(u64, Outcome)>,
        host: &mut impl Wakeup<F, G>,
    ) -> (Vec<(u64, Outcome)>, Option<Box<dyn std::any::Any + Send>>) {
        let mut rest = Vec::new();
        let mut panicked = None;
        for (t, o) in outcomes {
            let Some(p) = self.native.remove(t) else {
                rest.push((t, o));
                continue;
            };
            let fut = {
                // The future is taken and the outcome marked under one lock: a waiter
                // leaving sees either its future or an outcome on the way.
                let mut futs = lock(&self.futs);
                let fut = futs.remove(&t);
                if fut.is_some() {
                    p.delivering();
                }
                fut
            };
            let Some(f) = fut else {
                p.give_back(d, t, o);
                continue;
            };
            let woken = catch_unwind(AssertUnwindSafe(|| {
                if let Some(r) = p.finish(d, t, o, &mut |g| host.keep(g)) {
                    host.wake(f, r);
                }
            }));
            if let Err(e) = woken {
                panicked.get_or_insert(e);
            }
        }
        (rest, panicked)
    }
}

/// What a host supplies for an await: the running event loop's tables and futures.
pub trait Loop {
    /// The loop's future a task waits on.
    type Future: Send;
    /// The grant a task gets.
    type Grant;
    /// The host's own failure.
    type Error;
    /// The running loop's tables, and a new future of that loop.
    #[allow(clippy::type_complexity)]
    fn running(&mut self) -> Result<(Arc<Waits<Self::Future, Self::Grant>>, Self::Future), Self::Error>;
    /// Another handle to `fut` (the table keeps one, the task waits on the other).
    fn share(&mut self, fut: &Self::Future) -> Self::Future;
}

/// The next thing an awaiting task does.
#[derive(Debug)]
pub enum Next<G, F> {
    /// Waits for this future of its loop.
    Wait(F),
    /// Ends with this grant.
    Granted(G),
    /// Was over already (the host returns what it kept, or says it ended without one).
    Over,
}

/// Why a step failed.
#[derive(Debug)]
pub enum Failed<E> {
    /// Refused, timed out: nothing held.
    Refused(Error),
    /// The host failed (e.g. no running loop); nothing held.
    Host(E),
    /// The loop's channel is closed.
    Closed,
    /// Stepped while its first step runs (awaited twice at once).
    Busy,
    /// Resumed after its wait ended without a grant (e.g. left).
    Lost,
}

/// Where an awaiting acquire is.
enum State<F, G> {
    /// Not awaited yet.
    Idle,
    /// A step is under way.
    Starting,
    /// In the queue under `ticket`; its future is in `waits`.
    Queued { ticket: u64, waits: Arc<Waits<F, G>> },
    /// Over: granted, timed out, refused or left.
    Done,
}

/// An acquire awaited on an event loop: the state machine of its task's steps and the
/// one leave rule (whatever ends it, it leaves its queue or gives back its grant,
/// exactly once).
pub struct Awaiting<A: Acquire, F> {
    shared: Arc<Shared<A>>,
    state: Mutex<State<F, A::Grant>>,
}

/// Resets a step that unwinds (a panic) to Done: nothing was queued, or it left.
struct Unwinding<'a, F, G>(&'a Mutex<State<F, G>>, bool);

impl<F, G> Drop for Unwinding<'_, F, G> {
    fn drop(&mut self) {
        if self.1 {
            let mut st = lock(self.0);
            if matches!(*st, State::Starting) {
                *st = State::Done;
            }
        }
    }
}

/// What a step resumes with.
enum Resumed<G> {
    /// The first step.
    First,
    /// A wait finished without a grant: the next wait.
    Next,
    /// The grant.
    Granted(G),
}

impl<A: Acquire, F: Send + 'static> Awaiting<A, F> {
    /// `acquire`, not awaited yet.
    pub fn new(acquire: A) -> Awaiting<A, F> {
        Awaiting {
            shared: Arc::new(Shared {
                acquire,
                slot: Mutex::new(Slot::Empty),
            }),
            state: Mutex::new(State::Idle),
        }
    }

    /// What it acquires.
    pub fn acquire(&self) -> &A {
        &self.shared.acquire
    }

    /// The task's next step: it waits for a future of `host`'s running loop, or ends
    /// with its grant or an error. Every wait of `acquire` runs through `d`.
    #[allow(clippy::type_complexity)]
    pub fn step<L: Loop<Future = F, Grant = A::Grant>>(
        &self,
        host: &mut L,
        d: &dyn Unlock,
    ) -> Result<Next<A::Grant, F>, Failed<L::Error>> {
        let mut st = lock(&self.state);
        let resumed = match &*st {
            State::Idle => Resumed::First,
            State::Starting => return Err(Failed::Busy),
            State::Done => return Ok(Next::Over),
            State::Queued { ticket, waits } => {
                let ticket = *ticket;
                let mut slot = lock(&self.shared.slot);
                match std::mem::replace(&mut *slot, Slot::Empty) {
                    Slot::Kept(g, generation) if generation == crate::fork::generation() => match g {
                        Some(g) => Resumed::Granted(g),
                        None => Resumed::Next,
                    },
                    Slot::Delivering => {
                        *slot = Slot::Delivering;
                        return Err(Failed::Busy);
                    }
                    _ => {
                        drop(slot);
                        if waits.native.contains(ticket) {
                            // Resumed before its outcome (driven by hand): the same future.
                            if let Some(f) = lock(&waits.futs).get(&ticket).map(|f| host.share(f)) {
                                return Ok(Next::Wait(f));
                            }
                        }
                        *st = State::Done;
                        return Err(Failed::Lost);
                    }
                }
            }
        };
        if let Resumed::Granted(g) = resumed {
            *st = State::Done;
            return Ok(Next::Granted(g));
        }
        *st = State::Starting;
        drop(st);
        let mut guard = Unwinding(&self.state, true);
        let r = self.begin(host, d);
        guard.1 = false;
        if !matches!(r, Ok(Next::Wait(_))) {
            *lock(&self.state) = State::Done;
        }
        r
    }

    /// Starts a wait on the running loop: the grant when decided at once, else the
    /// loop's future registered under the ticket.
    #[allow(clippy::type_complexity)]
    fn begin<L: Loop<Future = F, Grant = A::Grant>>(
        &self,
        host: &mut L,
        d: &dyn Unlock,
    ) -> Result<Next<A::Grant, F>, Failed<L::Error>> {
        let (waits, fut) = host.running().map_err(Failed::Host)?;
        if waits.chan.is_closed() {
            return Err(Failed::Closed);
        }
        let theirs = host.share(&fut);
        let chan = &waits.chan;
        let ticket = match self.shared.acquire.begin(d, &|| Wake::Channel(chan.clone())) {
            Ok(Begun::Done(g)) => return Ok(Next::Granted(g)),
            Ok(Begun::Queued(t)) => t,
            Err(e) => return Err(Failed::Refused(e)),
        };
        {
            let mut futs = lock(&waits.futs);
            futs.insert(ticket, fut);
            waits.native.insert(ticket, self.shared.clone());
        }
        *lock(&self.state) = State::Queued { ticket, waits };
        Ok(Next::Wait(theirs))
    }
}

impl<A: Acquire, F> Awaiting<A, F> {
    /// Ends the wait from outside (an exception thrown in, close, the awaitable
    /// dropped): it leaves the queue, or gives back what raced the exit, exactly once.
    pub fn end(&self, d: &dyn Unlock) {
        let st = std::mem::replace(&mut *lock(&self.state), State::Done);
        if let State::Queued { ticket, waits } = st {
            self.leave(d, ticket, &waits);
        }
    }

    /// A queued wait ended without its task taking the outcome: whoever takes the ticket
    /// out of the channel's table settles it (this, the resolve, or the channel's close).
    fn leave(&self, d: &dyn Unlock, ticket: u64, waits: &Waits<F, A::Grant>) {
        let fut = lock(&waits.futs).remove(&ticket);
        let sh = &self.shared;
        if waits.native.contains(ticket) {
            if sh.acquire.leave(d, ticket) {
                waits.native.remove(ticket);
            }
            // Else decided, its outcome on the way: the resolve (or the close) gives it
            // back, as the ticket has no future any more.
        } else {
            let kept = {
                let mut slot = lock(&sh.slot);
                match std::mem::replace(&mut *slot, Slot::Empty) {
                    Slot::Kept(g, generation) => (generation == crate::fork::generation()).then_some(g),
                    // Being finished by the resolve, which undoes it.
                    Slot::Delivering => {
                        *slot = Slot::Left;
                        None
                    }
                    Slot::Empty | Slot::Left => None,
                }
            };
            if let Some(g) = kept {
                // Finished, but the task left before it resumed.
                sh.acquire.undo(d, g);
            }
        }
        drop(fut);
    }
}

impl<A: Acquire, F> Drop for Awaiting<A, F> {
    fn drop(&mut self) {
        // Dropped while queued without its host ending it: it leaves now.
        self.end(&Inline);
    }
}

#[cfg(test)]
#[path = "awaiting_tests.rs"]
mod tests;
