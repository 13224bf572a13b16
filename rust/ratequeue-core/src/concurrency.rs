//! A counting semaphore as a queue resource: at most `limit` permits in use; permits
//! come back on release instead of refilling over time.

use crate::bucket::Deny;
use crate::error::Error;
use crate::sync::{AtomicU64, Ordering};
use crate::wait::Resource;

/// At most `limit` permits held at once; lock-free take and release. A fast path over
/// its queue is ordered at its "nobody waits" check and not re-checked after its take
/// (no time is promised here to move): it never passes a waiter queued before the check,
/// and may pass one that joined after it, once (tests/fastpath_residue.rs).
#[derive(Debug)]
pub struct Semaphore {
    limit: AtomicU64,
    in_use: AtomicU64,
    serial: u64,
}

/// Serial numbers of concurrency limits, in the order they are made.
/// (A plain atomic under loom too: it orders nothing the models check.)
static SERIAL: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// The next concurrency limit's serial number (unique in the process).
pub(crate) fn next_serial() -> u64 {
    SERIAL.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

impl Semaphore {
    /// A semaphore with `limit` ≥ 1 permits.
    pub fn new(limit: u64) -> Result<Semaphore, Error> {
        if limit == 0 {
            return Err(Error::invalid("limit", 0, "must be an integer >= 1"));
        }
        Ok(Semaphore {
            limit: AtomicU64::new(limit),
            in_use: AtomicU64::new(0),
            serial: next_serial(),
        })
    }

    /// Its place in the one order every policy waits for its concurrency levels in
    /// (made earlier, waited for first).
    pub fn serial(&self) -> u64 {
        self.serial
    }

    /// Permits held now.
    pub fn in_use(&self) -> u64 {
        self.in_use.load(Ordering::Acquire)
    }

    /// The limit.
    pub fn limit(&self) -> u64 {
        self.limit.load(Ordering::Acquire)
    }

    /// Changes the limit; holders above a lowered limit keep their permits.
    pub fn set_limit(&self, limit: u64) -> Result<(), Error> {
        if limit == 0 {
            return Err(Error::invalid("limit", 0, "must be an integer >= 1"));
        }
        self.limit.store(limit, Ordering::Release);
        Ok(())
    }
}

/// In a child, the permits held before the fork belong to threads that are not there
/// (or, for the forking thread, to a permit that gives nothing back in the child): the
/// child starts with every permit free.
struct Reset<'a>(&'a Semaphore);

impl crate::fork::Held for Reset<'_> {
    fn in_child(&mut self) {
        self.0.in_use.store(0, Ordering::Release);
    }
}

impl crate::fork::ForkLocks for Semaphore {
    fn rank(&self) -> crate::fork::Rank {
        crate::fork::Rank::Resource
    }

    fn lock_for_fork<'a>(&'a self, held: &mut Vec<Box<dyn crate::fork::Held + 'a>>) {
        held.push(Box::new(Reset(self)));
    }
}

/// True when `n` more permits fit beside `in_use` under `limit` (no overflow, whatever
/// the numbers).
#[inline]
pub(crate) fn fits(in_use: u64, n: u64, limit: u64) -> bool {
    in_use.checked_add(n).is_some_and(|total| total <= limit)
}

/// The error a denial of permits stands for (shared by every permit resource).
pub(crate) fn permits_error(d: Deny) -> Error {
    match d {
        Deny::TooLarge { cost, burst, .. } => Error::CostTooLarge {
            unit: "permits".into(),
            cost,
            burst,
        },
        Deny::Wait(_) => Error::Overloaded {
            reason: "no permit free".into(),
            retry_after_ns: 0,
        },
    }
}

impl Resource for Semaphore {
    #[inline]
    fn try_take(&self, _now_ns: u64, costs: &[u64]) -> Result<(), Deny> {
        let c = costs[0];
        let limit = self.limit();
        if c > limit {
            return Err(Deny::TooLarge {
                cost: c,
                burst: limit,
                unit: 0,
            });
        }
        let mut cur = self.in_use.load(Ordering::Acquire);
        loop {
            if !fits(cur, c, limit) {
                return Err(Deny::Wait(u64::MAX));
            }
            match self
                .in_use
                .compare_exchange_weak(cur, cur + c, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => return Ok(()),
                Err(seen) => cur = seen,
            }
        }
    }

    fn ready_at(&self, at_ns: u64, costs: &[u64]) -> Result<Option<u64>, Deny> {
        let limit = self.limit();
        if costs[0] > limit {
            return Err(Deny::TooLarge {
                cost: costs[0],
                burst: limit,
                unit: 0,
            });
        }
        Ok(fits(self.in_use(), costs[0], limit).then_some(at_ns))
    }

    fn take_at(&self, at_ns: u64, costs: &[u64]) -> Result<u64, Deny> {
        self.try_take(at_ns, costs).map(|_| 0)
    }

    fn schedules_in_time(&self) -> bool {
        false
    }

    fn give_back(&self, costs: &[u64], _token: Option<u64>) {
        let c = costs[0];
        let _ = self
            .in_use
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| Some(v.saturating_sub(c)));
    }

    fn service_ns(&self, costs: &[u64]) -> f64 {
        costs[0] as f64
    }

    fn error_for(&self, d: Deny) -> Error {
        permits_error(d)
    }

    fn predict(&self, _now_ns: u64, _ahead: &[u64], _costs: &[u64]) -> Option<u64> {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fork::{ForkLocks, Held};
    use crate::wait::Resource;

    #[test]
    fn a_child_starts_with_every_permit_free() {
        let sem = Semaphore::new(3).unwrap();
        sem.try_take(0, &[2]).unwrap();
        let mut held: Vec<Box<dyn Held + '_>> = Vec::new();
        sem.lock_for_fork(&mut held);
        held.iter_mut().for_each(|h| h.in_child());
        drop(held);
        assert_eq!(sem.in_use(), 0);
        assert!(sem.try_take(0, &[3]).is_ok());
    }

    #[test]
    fn sums_never_wrap() {
        let s = Semaphore::new(u64::MAX).unwrap();
        assert!(s.try_take(0, &[1 << 63]).is_ok());
        assert_eq!(s.try_take(0, &[(1 << 63) + 1]), Err(Deny::Wait(u64::MAX)));
        assert_eq!(s.ready_at(7, &[(1 << 63) + 1]), Ok(None));
        assert_eq!(s.in_use(), 1 << 63);
        assert!(s.try_take(0, &[(1 << 63) - 1]).is_ok());
        assert_eq!(s.in_use(), u64::MAX);
        s.give_back(&[u64::MAX], None);
        assert_eq!(s.ready_at(7, &[u64::MAX]), Ok(Some(7)));
    }
}
