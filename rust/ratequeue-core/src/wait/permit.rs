//! Permits: what a grant holds (costs and its [`GrantRef`]), released or settled once
//! against its owner by the one undo rule, never waiting for a lock inside the host's
//! own lock unless that lock is busy (see [`Detach`]).

use super::*;

/// How a host runs a call that may wait (for a lock or an outcome): Python detaches from
/// the interpreter there, so no thread waits on a core lock while holding the GIL.
pub trait Detach {
    /// Runs `f`, which may wait, outside the host's lock.
    fn detached<T: Send, F: FnOnce() -> T + Send>(&self, f: F) -> T;
}

/// A host without a lock of its own (Rust callers): a call that may wait just runs.
#[derive(Clone, Copy, Debug, Default)]
pub struct Inline;

impl Detach for Inline {
    #[inline]
    fn detached<T: Send, F: FnOnce() -> T + Send>(&self, f: F) -> T {
        f()
    }
}

/// What a permit returns to when released or settled.
pub trait PermitOwner: Send + Sync {
    /// Unit names, indexed as the costs (empty: nothing to settle).
    fn units(&self) -> &[String];
    /// True when the permit is returned on exit (a semaphore).
    fn returns_on_exit(&self) -> bool;
    /// Returns the permits of a grant.
    fn give_back(&self, costs: &[u64]);
    /// [`PermitOwner::give_back`] without waiting for a lock: false (nothing done) when
    /// one is busy (by default always).
    fn try_give_back(&self, _costs: &[u64]) -> bool {
        false
    }
    /// Settles estimated costs to actual ones by the one undo rule; returns the grant
    /// as it now stands, for the next settle.
    fn settle(&self, estimated: &[u64], actual: &[u64], grant: GrantRef) -> GrantRef;
    /// [`PermitOwner::settle`] without waiting for a lock: None (nothing changed) when
    /// one is busy (by default always).
    fn try_settle(&self, _estimated: &[u64], _actual: &[u64], _grant: GrantRef) -> Option<GrantRef> {
        None
    }
}

/// Costs per unit: up to two units inline (no allocation), more on the heap.
#[derive(Clone, Debug)]
pub(crate) enum Costs {
    Inline([u64; 2], usize),
    Heap(Box<[u64]>),
}

impl Costs {
    /// A copy of `c`.
    pub(crate) fn new(c: &[u64]) -> Costs {
        match *c {
            [] => Costs::Inline([0; 2], 0),
            [a] => Costs::Inline([a, 0], 1),
            [a, b] => Costs::Inline([a, b], 2),
            _ => Costs::Heap(c.into()),
        }
    }
}

impl std::ops::Deref for Costs {
    type Target = [u64];

    fn deref(&self) -> &[u64] {
        match self {
            Costs::Inline(a, n) => &a[..*n],
            Costs::Heap(v) => v,
        }
    }
}

impl std::ops::DerefMut for Costs {
    fn deref_mut(&mut self) -> &mut [u64] {
        match self {
            Costs::Inline(a, n) => &mut a[..*n],
            Costs::Heap(v) => v,
        }
    }
}

/// What a permit holds: its costs and its grant, changed together by a settle.
#[derive(Clone, Debug)]
struct Held {
    costs: Costs,
    grant: GrantRef,
}

impl Held {
    /// The costs with `named` (unit index, cost) replaced.
    fn actual(&self, named: &[(usize, u64)]) -> Costs {
        let mut actual = self.costs.clone();
        for &(i, c) in named {
            actual[i] = c;
        }
        actual
    }
}

/// A grant held by its caller: released at most once, settled any number of times, and
/// worth nothing in a process forked after it was granted (the child starts free).
pub struct Permit {
    owner: Arc<dyn PermitOwner>,
    held: Mutex<Held>,
    waited_ns: u64,
    released: AtomicBool,
    fork_gen: u64,
}

impl std::fmt::Debug for Permit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Permit")
            .field("waited_ns", &self.waited_ns)
            .field("released", &self.released())
            .finish()
    }
}

impl Permit {
    /// A permit of `owner` holding `costs` under `grant`, after `waited_ns` in the queue.
    pub fn new(owner: Arc<dyn PermitOwner>, costs: &[u64], waited_ns: u64, grant: GrantRef) -> Permit {
        Permit {
            owner,
            held: Mutex::new(Held {
                costs: Costs::new(costs),
                grant,
            }),
            waited_ns,
            released: AtomicBool::new(false),
            fork_gen: crate::fork::generation(),
        }
    }

    /// The same permit under `grant` instead.
    pub fn with_grant(mut self, grant: GrantRef) -> Permit {
        self.set_grant(grant);
        self
    }

    /// Puts it under `grant` instead (a permit just made: nobody else holds it).
    pub fn set_grant(&mut self, grant: GrantRef) {
        self.held.get_mut().unwrap_or_else(|e| e.into_inner()).grant = grant;
    }

    /// What it returns to.
    pub fn owner(&self) -> &Arc<dyn PermitOwner> {
        &self.owner
    }

    /// Nanoseconds spent in the queue, arrival to grant, in schedule time.
    pub fn waited_ns(&self) -> u64 {
        self.waited_ns
    }

    /// True once released.
    pub fn released(&self) -> bool {
        self.released.load(Ordering::Acquire)
    }

    /// True when granted in this process (not inherited across a fork).
    pub fn granted_here(&self) -> bool {
        self.fork_gen == crate::fork::generation()
    }

    /// Marks the permit released without returning anything; true if this call did (the
    /// first one).
    pub fn mark_released(&self) -> bool {
        !self.released.swap(true, Ordering::AcqRel)
    }

    /// Its costs and grant now, waiting for its lock through `d` only when it is busy.
    pub fn held(&self, d: &impl Detach) -> (Vec<u64>, GrantRef) {
        let h = self.now(d);
        (h.costs.to_vec(), h.grant)
    }

    fn now(&self, d: &impl Detach) -> Held {
        match self.held.try_lock() {
            Ok(g) => g.clone(),
            Err(std::sync::TryLockError::Poisoned(e)) => e.into_inner().clone(),
            Err(std::sync::TryLockError::WouldBlock) => d.detached(|| lock(&self.held).clone()),
        }
    }

    /// The same grant, owned by `owner` instead (e.g. a key rather than its queue).
    pub fn rehome(&self, owner: Arc<dyn PermitOwner>, d: &impl Detach) -> Permit {
        let h = self.now(d);
        Permit::new(owner, &h.costs, self.waited_ns, h.grant)
    }

    /// Releases the permit: a semaphore's permits go back (only when granted in this
    /// process). Only the first call has an effect; true if this call released it.
    pub fn release(&self, d: &impl Detach) -> bool {
        if !self.mark_released() {
            return false;
        }
        if self.owner.returns_on_exit() && self.granted_here() {
            let costs = self.now(d).costs;
            if !self.owner.try_give_back(&costs) {
                d.detached(|| self.owner.give_back(&costs));
            }
        }
        true
    }

    /// Settles the costs to `named` (unit index, actual cost; units not named keep
    /// theirs) by the one undo rule: refunds the difference or charges the overage.
    /// Each call settles against the previous one. Waits (through `d`) only when a lock
    /// it needs is busy.
    pub fn settle(&self, named: &[(usize, u64)], d: &impl Detach) {
        if let Ok(mut h) = self.held.try_lock() {
            let actual = h.actual(named);
            if let Some(grant) = self.owner.try_settle(&h.costs, &actual, h.grant) {
                *h = Held { costs: actual, grant };
                return;
            }
        }
        d.detached(|| {
            let mut h = lock(&self.held);
            let actual = h.actual(named);
            let grant = self.owner.settle(&h.costs, &actual, h.grant);
            *h = Held { costs: actual, grant };
        });
    }
}
