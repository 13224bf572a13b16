//! The one error type of the core; the bindings map it once onto Python exceptions.

use std::fmt;

/// Everything the core can refuse or reject.
#[derive(Clone, Debug, PartialEq)]
pub enum Error {
    /// A bad argument or configuration: names the argument, its value and the rule.
    Invalid {
        name: String,
        value: String,
        reason: String,
    },
    /// A cost above the burst can never conform; refused at once, never queued.
    CostTooLarge { unit: String, cost: u64, burst: u64 },
    /// Refused at once (queue full or deadline unreachable); nothing was consumed.
    Overloaded { reason: String, retry_after_ns: u64 },
    /// Waited until its deadline without a grant; nothing was consumed.
    WaitTimeout { waited_ns: u64, retry_after_ns: u64 },
}

impl Error {
    /// An invalid-argument error for `name` = `value`, which `reason`.
    pub fn invalid(name: &str, value: impl fmt::Display, reason: &str) -> Self {
        Error::Invalid {
            name: name.to_owned(),
            value: value.to_string(),
            reason: reason.to_owned(),
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Invalid { name, value, reason } => write!(f, "{name}={value} {reason}"),
            Error::CostTooLarge { unit, cost, burst } => write!(
                f,
                "cost {cost} {unit} exceeds the burst of {burst} {unit} and can never be admitted"
            ),
            Error::Overloaded { reason, retry_after_ns } => {
                write!(
                    f,
                    "overloaded: {reason} (retry after {:.6} s)",
                    *retry_after_ns as f64 / 1e9
                )
            }
            Error::WaitTimeout { waited_ns, .. } => {
                write!(
                    f,
                    "no grant within the deadline (waited {:.6} s)",
                    *waited_ns as f64 / 1e9
                )
            }
        }
    }
}

impl std::error::Error for Error {}
