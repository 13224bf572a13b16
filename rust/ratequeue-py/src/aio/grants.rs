//! What is awaited, as the core's await lifecycle drives it, with its grants made the
//! Python objects a task gets: a level's Permit, or a policy's PolicyPermit.

use super::*;
use ratequeue_core::wait::awaiting::{unlocked, Begun, Unlock};
use ratequeue_core::wait::Wake;
use ratequeue_core::Error;

/// A grant made a Python object; only a failed allocation fails (reported as refused).
fn made(r: PyResult<Py<PyAny>>) -> Result<Py<PyAny>, Error> {
    r.map_err(|_| Error::invalid("permit", "a grant", "could not be made a Python object"))
}

fn permit(p: ratequeue_core::wait::Permit) -> Result<Py<PyAny>, Error> {
    Python::attach(|py| made(Py::new(py, PermitPy::from(p)).map(Py::into_any)))
}

/// One level (a limiter, a semaphore, a key's queue), its grants Permits.
pub(super) struct PyLevel(pub(super) LevelAcquire);

impl Acquire for PyLevel {
    type Grant = Py<PyAny>;

    fn begin(&self, d: &dyn Unlock, wake: &(dyn Fn() -> Wake + Sync)) -> Result<Begun<Py<PyAny>>, Error> {
        Ok(match self.0.begin(d, wake)? {
            Begun::Done(p) => Begun::Done(permit(p)?),
            Begun::Queued(t) => Begun::Queued(t),
        })
    }

    fn finish(&self, d: &dyn Unlock, ticket: u64, o: Outcome) -> Result<Option<Py<PyAny>>, Error> {
        self.0.finish(d, ticket, o)?.map(permit).transpose()
    }

    fn leave(&self, d: &dyn Unlock, ticket: u64) -> bool {
        self.0.leave(d, ticket)
    }

    fn give_back(&self, d: &dyn Unlock, ticket: u64, o: Outcome) {
        self.0.give_back(d, ticket, o);
    }

    fn undo(&self, d: &dyn Unlock, grant: Option<Py<PyAny>>) {
        let Some(g) = grant else { return };
        Python::attach(|py| {
            if let Ok(p) = g.bind(py).cast::<PermitPy>() {
                self.0.undo_permit(d, p.get().permit());
            }
        });
    }
}

/// A policy's levels, all or nothing; its grant the PolicyPermit `acq` makes.
pub(super) struct PyPolicy {
    pub(super) core: Arc<PolicyAcquire>,
    pub(super) acq: Py<PolicyAcquiringPy>,
}

impl Acquire for PyPolicy {
    type Grant = Py<PyAny>;

    fn begin(&self, d: &dyn Unlock, wake: &(dyn Fn() -> Wake + Sync)) -> Result<Begun<Py<PyAny>>, Error> {
        Ok(match self.core.begin(d, wake)? {
            Begun::Done(f) => Begun::Done(Python::attach(|py| made(self.acq.get().finished(py, f)))?),
            Begun::Queued(t) => Begun::Queued(t),
        })
    }

    fn finish(&self, d: &dyn Unlock, ticket: u64, o: Outcome) -> Result<Option<Py<PyAny>>, Error> {
        // A wait's grant is held in the core; the PolicyPermit comes with the last step.
        self.core.finish(d, ticket, o).map(|_| None)
    }

    fn leave(&self, d: &dyn Unlock, ticket: u64) -> bool {
        self.core.leave(d, ticket)
    }

    fn give_back(&self, d: &dyn Unlock, ticket: u64, o: Outcome) {
        self.core.give_back(d, ticket, o);
    }

    fn undo(&self, d: &dyn Unlock, _grant: Option<Py<PyAny>>) {
        unlocked(d, || self.core.abandon());
    }
}
