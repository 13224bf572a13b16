//! The one place where core errors become Python exceptions (defined in
//! ratequeue._errors so they can inherit from both RateQueueError and ValueError).

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyType;
use ratequeue_core::Error;

static OVERLOADED: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static WAIT_TIMEOUT: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static COST_TOO_LARGE: PyOnceLock<Py<PyType>> = PyOnceLock::new();

fn raise(py: Python<'_>, cell: &'static PyOnceLock<Py<PyType>>, name: &str, msg: String, retry_after: f64) -> PyErr {
    match cell.import(py, "ratequeue._errors", name) {
        Ok(cls) => PyErr::from_type(cls.clone(), (msg, retry_after)),
        Err(e) => e,
    }
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
