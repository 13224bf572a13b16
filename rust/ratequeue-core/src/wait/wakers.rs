//! How a waiter learns its outcome: a blocked thread's slot or an event-loop channel.

use super::*;

/// A one-shot mailbox for a blocked thread.
#[derive(Default)]
pub struct Slot {
    pub(super) state: Mutex<Option<Outcome>>,
    cv: Condvar,
}

impl Slot {
    /// A new empty slot.
    pub fn new() -> Arc<Slot> {
        Arc::new(Slot::default())
    }

    fn put(&self, o: Outcome) {
        *lock(&self.state) = Some(o);
        self.cv.notify_one();
    }

    /// Waits up to `slice` for the outcome; None if still waiting.
    pub fn wait(&self, slice: Option<Duration>) -> Option<Outcome> {
        let mut g = lock(&self.state);
        loop {
            if let Some(o) = *g {
                return Some(o);
            }
            match slice {
                None => g = self.cv.wait(g).unwrap_or_else(|e| e.into_inner()),
                Some(d) => {
                    let (g2, to) = self.cv.wait_timeout(g, d).unwrap_or_else(|e| e.into_inner());
                    g = g2;
                    if to.timed_out() {
                        return *g;
                    }
                }
            }
        }
    }

    /// Takes the outcome if one has arrived.
    pub fn take(&self) -> Option<Outcome> {
        lock(&self.state).take()
    }
}

impl Wake {
    fn deliver(&self, ticket: u64, o: Outcome) -> Result<(), Outcome> {
        match self {
            Wake::Thread(s) => {
                s.put(o);
                Ok(())
            }
            Wake::Channel(c) => c.put(ticket, o),
            Wake::Nobody => Ok(()),
        }
    }
}

/// Delivers each outcome; returns the grants a closed channel handed back.
pub(super) fn deliver(out: Deliveries) -> Gone {
    let mut gone = Vec::new();
    for (wake, t, o, costs) in out {
        if let Err(Outcome::Granted { token, .. }) = wake.deliver(t, o) {
            gone.push((costs, token));
        }
    }
    gone
}
