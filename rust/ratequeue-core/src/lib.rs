//! ratequeue-core: the pure-Rust engine of ratequeue — clocks, the lock-free GCRA
//! bucket, multi-rate limiters and the errors they report. No Python in here.

pub mod bucket;
pub mod clock;
pub mod concurrency;
pub mod error;
pub mod fork;
pub mod histogram;
pub mod keyed;
pub mod keyed_queue;
pub mod limiter;
pub mod llm;
pub mod policy;
pub mod rate;
mod sync;
pub mod wait;

pub use bucket::{Bucket, Deny};
pub use clock::{AnyClock, ManualClock};
pub use concurrency::Semaphore;
pub use error::Error;
pub use histogram::{Histogram, Snapshot};
pub use keyed::{KeyHasher, KeyedLimiter, KeyedSemaphore};
pub use keyed_queue::{KeyQueue, KeyQueues};
pub use limiter::{Limiter, Reservation};
pub use policy::{Level, LevelArgs, LevelKind, Policy};
pub use rate::Rate;
pub use wait::{
    GrantRef, Joined, Outcome, QueueConfig, QueuedReservation, Reserved, Resource, Submitted, WaitQueue, Wake,
};

/// Nanoseconds in one second.
pub const NS_PER_SEC: f64 = 1e9;
