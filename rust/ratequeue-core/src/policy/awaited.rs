//! A policy acquire awaited on an event loop: [`PolicyAcquire`] as an [`Acquire`] of the
//! await lifecycle (each concurrency level's wait one queued step, the rate levels held
//! at the last; everything given back however the await ends).

use super::{Held, PolicyAcquire, Step};
use crate::error::Error;
use crate::wait::awaiting::{unlocked, Acquire, Begun, Unlock};
use crate::wait::{Outcome, Wake};

/// What a finished policy acquire holds (see [`Step::Done`]).
#[derive(Debug)]
pub struct Finished {
    /// From the last step until the rate levels' common grant time.
    pub delay_ns: u64,
    /// From the start of the acquire until the last step.
    pub waited_ns: u64,
    /// What is held, per level.
    pub held: Vec<Held>,
}

impl Acquire for PolicyAcquire {
    type Grant = Finished;

    fn begin(&self, d: &dyn Unlock, wake: &(dyn Fn() -> Wake + Sync)) -> Result<Begun<Finished>, Error> {
        Ok(match unlocked(d, || self.advance(wake))? {
            Step::Queued(t) => Begun::Queued(t),
            Step::Done {
                delay_ns,
                waited_ns,
                held,
            } => Begun::Done(Finished {
                delay_ns,
                waited_ns,
                held,
            }),
        })
    }

    fn finish(&self, d: &dyn Unlock, _ticket: u64, o: Outcome) -> Result<Option<Finished>, Error> {
        unlocked(d, || self.outcome(o))?;
        match o {
            Outcome::Granted { .. } => Ok(None),
            Outcome::TimedOut { waited_ns } => Err(Error::WaitTimeout {
                waited_ns,
                retry_after_ns: 0,
            }),
        }
    }

    fn leave(&self, d: &dyn Unlock, _ticket: u64) -> bool {
        unlocked(d, || self.abandon())
    }

    fn undo(&self, d: &dyn Unlock, _grant: Option<Finished>) {
        // Only a wait's grant is finished for the task (a level held in the core state).
        unlocked(d, || self.abandon());
    }

    fn give_back(&self, d: &dyn Unlock, _ticket: u64, o: Outcome) {
        unlocked(d, || match o {
            Outcome::Granted { token, .. } => self.give_back_late(token),
            // Everything held goes back; a wait abandoned already ends on its level.
            Outcome::TimedOut { .. } => {
                let _ = self.outcome(o);
            }
        });
    }
}
