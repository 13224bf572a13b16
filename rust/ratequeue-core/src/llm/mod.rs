//! Reading LLM request and response bodies for the transport: one validating pass per
//! body, no tree built. Each reader gives exactly what the Python reference gives over
//! a full `json` parse, or [`Defer`] where only that parser can tell (the caller then
//! runs it): other encodings, nesting past [`scan::MAX_DEPTH`], numbers past `u64`.
//! Memory is bounded by the nesting bound and the keys of the objects open at once.

pub mod cap;
pub mod headers;
pub mod plan;
mod request;
pub mod route;
pub mod scan;
pub mod sse;
mod usage;

pub use request::{request_facts, RequestFacts, MAX_MEMBERS, PROMPT_DEPTH};
pub use usage::response_usage;

/// The reference parser must decide this body.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Defer;

/// Tokens a call really used, as a response reports them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Usage {
    pub input_tokens: u64,
    pub output_tokens: u64,
}

impl Usage {
    /// A usage of these counts.
    pub fn new(input_tokens: u64, output_tokens: u64) -> Self {
        Usage {
            input_tokens,
            output_tokens,
        }
    }
}
