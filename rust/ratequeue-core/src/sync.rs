//! The atomics and locks of the model-checked protocols: std's, or loom's when built
//! with `--cfg loom` (see tests/loom.rs). Only the modules loom checks import from here;
//! statics keep std's types, which loom cannot build in a const context.

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicBool, AtomicU64, Ordering};
#[cfg(loom)]
pub(crate) use loom::sync::{Mutex, MutexGuard};

#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
#[cfg(not(loom))]
pub(crate) use std::sync::{Mutex, MutexGuard};
