//! The one place where core errors become Python exceptions (defined in
//! ratequeue._errors so they can inherit from both RateQueueError and ValueError, which
//! hands them over at import: no error path imports Python).

use pyo3::exceptions::{PyRuntimeError, PyStopIteration, PyTypeError, PyValueError};
use pyo3::panic::PanicException;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyType;
use ratequeue_core::Error;

static OVERLOADED: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static WAIT_TIMEOUT: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static COST_TOO_LARGE: PyOnceLock<Py<PyType>> = PyOnceLock::new();

fn raise(py: Python<'_>, cell: &'static PyOnceLock<Py<PyType>>, name: &str, msg: String, retry_after: f64) -> PyErr {
    // Handed over by ratequeue._errors, which the package imports before anything can
    // raise: the native module never imports the package.
    match cell.get(py) {
        Some(cls) => PyErr::from_type(cls.bind(py).clone(), (msg, retry_after)),
        None => PyRuntimeError::new_err(format!("{name}: {msg} (ratequeue._errors is not imported)")),
    }
}

/// Takes the exception classes core errors map onto (ratequeue._errors calls it once,
/// at import; later calls change nothing).
#[pyfunction]
pub fn _use_errors(
    py: Python<'_>,
    overloaded: Bound<'_, PyType>,
    wait_timeout: Bound<'_, PyType>,
    cost_too_large: Bound<'_, PyType>,
) {
    let _ = OVERLOADED.set(py, overloaded.unbind());
    let _ = WAIT_TIMEOUT.set(py, wait_timeout.unbind());
    let _ = COST_TOO_LARGE.set(py, cost_too_large.unbind());
}

/// Maps a core error onto the Python hierarchy under ratequeue.RateQueueError.
pub fn to_py(py: Python<'_>, e: Error) -> PyErr {
    let msg = match &e {
        Error::CostTooLarge {
            unit,
            cost: u64::MAX,
            burst,
        } => match crate::args::saturated_cost() {
            Some(given) => format!("cost {given} {unit} exceeds the burst of {burst} {unit} and can never be admitted"),
            None => e.to_string(),
        },
        _ => e.to_string(),
    };
    match e {
        Error::Invalid { .. } => PyValueError::new_err(msg),
        Error::CostTooLarge { .. } => raise(py, &COST_TOO_LARGE, "CostTooLarge", msg, f64::INFINITY),
        Error::Overloaded { retry_after_ns, .. } => {
            raise(py, &OVERLOADED, "Overloaded", msg, retry_after_ns as f64 / 1e9)
        }
        Error::WaitTimeout { retry_after_ns, .. } => {
            raise(py, &WAIT_TIMEOUT, "WaitTimeout", msg, retry_after_ns as f64 / 1e9)
        }
    }
}

/// A ValueError naming the argument, its value as given and the rule it breaks:
/// "`name`=`given` `rule`".
pub fn value_err(name: &str, given: &str, rule: &str) -> PyErr {
    PyValueError::new_err(format!("{name}={given} {rule}"))
}

/// A TypeError naming the argument and what it got.
pub fn type_err(name: &str, want: &str, got: &Bound<'_, PyAny>) -> PyErr {
    let ty = got
        .get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "?".into());
    PyTypeError::new_err(format!("{name} must be {want}, got {ty}"))
}

/// A ValueError for a value found inside a collection argument: "`name` holds `bad`:
/// `rule`".
pub fn holds_err(name: &str, bad: impl std::fmt::Display, rule: &str) -> PyErr {
    PyValueError::new_err(format!("{name} holds {bad}: {rule}"))
}

/// A ValueError for a batch argument of the wrong length.
pub fn length_err(name: &str, got: usize, want: usize, of: &str) -> PyErr {
    PyValueError::new_err(format!("{name} has {got} entries for {want} {of}"))
}

/// A ValueError for a name that is not one of `options`.
pub fn not_one_of(name: &str, given: &str, options: &[impl std::fmt::Debug]) -> PyErr {
    PyValueError::new_err(format!("{name}={given:?} is not one of {options:?}"))
}

/// A ValueError for a call that needs virtual time.
pub fn needs_manual_clock(call: &str) -> PyErr {
    PyValueError::new_err(format!("{call} needs a limiter on a ManualClock"))
}

/// A ValueError for a set-up that can never work as given (several arguments at once,
/// or a name that clashes): `msg` says which and what to change.
pub fn setup_err(msg: String) -> PyErr {
    PyValueError::new_err(msg)
}

/// A TypeError for a keyword the call does not take: "unexpected keyword `name`: `why`".
pub fn unexpected_keyword(name: &str, why: &str) -> PyErr {
    PyTypeError::new_err(format!("unexpected keyword {name:?}: {why}"))
}

/// A TypeError for a keyword the call needs: "missing `what`".
pub fn missing_keyword(what: &str) -> PyErr {
    PyTypeError::new_err(format!("missing {what}"))
}

/// A TypeError for a cost given both ways (positionally and by keyword).
pub fn given_twice(unit: &str) -> PyErr {
    PyTypeError::new_err(format!("cost for unit {unit:?} given twice"))
}

/// A TypeError for an object of none of the accepted types, when no argument names it.
pub fn wrong_type(want: &str) -> PyErr {
    PyTypeError::new_err(want.to_owned())
}

/// The RuntimeError for a submit on a closed event-loop channel.
pub fn channel_closed() -> PyErr {
    PyRuntimeError::new_err("the channel is closed")
}

/// A ValueError for a priority that is not one of the queue's classes.
pub fn not_a_class(given: &str, classes: &[&str]) -> PyErr {
    PyValueError::new_err(format!("priority={given:?} is not one of the classes {classes:?}"))
}

/// A RuntimeError for an awaitable driven out of turn (awaited twice, resumed after it
/// ended): `msg` says what happened.
pub fn misuse(msg: &'static str) -> PyErr {
    PyRuntimeError::new_err(msg)
}

/// A ValueError for a channel made without a wake-up descriptor, asked for one.
pub fn no_descriptor() -> PyErr {
    PyValueError::new_err("this channel has no wake-up descriptor")
}

/// The PanicException raised in place of a Rust panic caught at the boundary (`what`
/// panicked), so no panic crosses into Python.
pub fn panicked(what: &'static str) -> PyErr {
    PanicException::new_err(what)
}

/// `StopIteration(value)`: the end of an awaitable with its result. The value is passed
/// as is (not in a tuple), so the interpreter takes it without making an exception
/// object (it is never a tuple or an exception here).
pub fn stop_iteration(value: Py<PyAny>) -> PyErr {
    PyStopIteration::new_err(value)
}

/// The RuntimeError of an asyncio wait before `ratequeue.aio` handed over its bridge
/// (never, once the `ratequeue` package is imported: it imports `ratequeue.aio` first).
pub fn aio_not_ready() -> PyErr {
    PyRuntimeError::new_err("ratequeue.aio is not imported: import ratequeue first")
}

/// The RuntimeError of a native fast path that could not be set up (`what` says why).
pub fn not_installed(what: &'static str) -> PyErr {
    PyRuntimeError::new_err(what)
}
