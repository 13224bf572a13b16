//! A queue's bounds and classes, and the counters of what it decided.

use super::*;

/// A queue's bounds and classes.
#[derive(Clone, Debug)]
pub struct QueueConfig {
    /// Class names and weights (at least one; weights > 0).
    pub classes: Vec<(String, f64)>,
    /// The most waiters at once; more are refused with `Overloaded`.
    pub max_queue: usize,
    /// Default deadline for waiting, in nanoseconds.
    pub max_wait_ns: Option<u64>,
}

impl QueueConfig {
    /// Validates names and weights.
    pub fn new(classes: Vec<(String, f64)>, max_queue: usize, max_wait_ns: Option<u64>) -> Result<Self, Error> {
        let classes = if classes.is_empty() {
            vec![("default".to_owned(), 1.0)]
        } else {
            classes
        };
        for (name, w) in &classes {
            if !w.is_finite() || *w <= 0.0 {
                return Err(Error::invalid(
                    "classes",
                    format!("{name}={w}"),
                    "weights must be finite numbers > 0",
                ));
            }
        }
        if max_queue == 0 {
            return Err(Error::invalid("max_queue", 0, "must be >= 1"));
        }
        Ok(QueueConfig {
            classes,
            max_queue,
            max_wait_ns,
        })
    }
}

/// Counters of what a queue decided.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QueueCounts {
    /// `try_acquire` calls admitted (they never queue).
    pub tried_admitted: u64,
    /// `try_acquire` calls refused.
    pub tried_refused: u64,
    /// Granted at once, without queueing.
    pub immediate: u64,
    /// Granted after queueing.
    pub queued_grants: u64,
    /// Refused because the queue was full.
    pub refused_full: u64,
    /// Refused because the deadline could not be met.
    pub refused_deadline: u64,
    /// Left the queue at their deadline.
    pub timed_out: u64,
    /// Cancelled while queued.
    pub cancelled: u64,
}
