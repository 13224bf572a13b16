//! The transport's response side in one crossing: on the common path (a 2xx response
//! whose body is here, a Limiter's permit) the headers are scanned, the usage read, the
//! permit settled from the token plan and the call's record and HTTP histogram updated,
//! or nothing is done and the Python reference (`_transport._received`) takes the call.

use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBool, PyBytes, PyDict, PyList, PyTuple, PyType};
use pyo3::{intern, IntoPyObjectExt};
use ratequeue_core::llm::headers::scan_headers;
use ratequeue_core::llm::response_usage;

use crate::histogram::{to_ns, HistogramPy};
use crate::llm::{pairs, read};
use crate::waiting::{PermitPy, Unblocked};

/// Most units a plan corrects (`tokens`, `input_tokens`, `output_tokens`).
const MOST_UNITS: usize = 3;

/// The Python reference's answer: nothing was done.
fn defer(py: Python<'_>) -> Bound<'_, PyAny> {
    PyBool::new(py, false).to_owned().into_any()
}

/// `tuple.__new__`, to make a `Usage` (a NamedTuple) without its Python `__new__`.
fn tuple_new(py: Python<'_>) -> PyResult<&Bound<'_, PyAny>> {
    static NEW: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
    NEW.get_or_try_init(py, || Ok::<_, PyErr>(py.get_type::<PyTuple>().getattr("__new__")?.unbind()))
        .map(|n| n.bind(py))
}

/// One correction of the plan: the unit's index in the permit, its name, its actual.
struct Correction<'py> {
    index: usize,
    name: Bound<'py, PyAny>,
    actual: u64,
}

/// Settles a call whose 2xx response body (`body`, already read) is here, as
/// `_received` + `_settle` would: None when done (settled now, or by another caller
/// before), False when the Python reference must take the call (nothing was done: a
/// header entry that is not a triple of bytes, an SSE content type, an exhausted quota,
/// a usage only the reference reads, a permit that is not a Limiter's).
///
/// `plan`: `((unit, index in (requests, tokens, input, output)), ...)` of the units a
/// usage corrects (empty: the body is kept for the record to read when asked for);
/// `charged`: what acquire took per unit; `once`: the call's settle-once list.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub fn _settle_response<'py>(
    py: Python<'py>,
    call: &Bound<'py, PyAny>,
    once: &Bound<'py, PyList>,
    permit: &Bound<'py, PyAny>,
    charged: &Bound<'py, PyDict>,
    plan: &Bound<'py, PyTuple>,
    headers: &Bound<'py, PyList>,
    body: &Bound<'py, PyBytes>,
    max_body: usize,
    histogram: &Bound<'py, HistogramPy>,
    http_seconds: f64,
    usage_type: &Bound<'py, PyType>,
) -> PyResult<Bound<'py, PyAny>> {
    // Everything that may defer comes first: nothing is changed before the settle.
    let Ok(ns) = to_ns("seconds", http_seconds) else {
        return Ok(defer(py));
    };
    let Some(pairs) = pairs(headers)? else {
        return Ok(defer(py));
    };
    let scan = scan_headers(pairs.iter().map(|(k, v)| (k.as_bytes(), v.as_bytes())));
    if scan.exhausted {
        return Ok(defer(py));
    }
    if let Some(i) = scan.content_type {
        let v = pairs[i].1.as_bytes();
        if v.len() >= 17 && v[..17].eq_ignore_ascii_case(b"text/event-stream") {
            return Ok(defer(py));
        }
    }
    let Ok(permit) = permit.cast::<PermitPy>() else {
        return Ok(defer(py));
    };
    let data = body.as_bytes();
    let readable = !data.is_empty() && data.len() <= max_body;
    let mut usage = None;
    let mut fixes: [Option<Correction<'py>>; MOST_UNITS] = [None, None, None];
    let mut n = 0;
    if !plan.is_empty() && readable {
        let Ok(found) = read(py, data, response_usage) else {
            return Ok(defer(py));
        };
        usage = found;
        if let Some(u) = found {
            let (i, o) = (u.input_tokens, u.output_tokens);
            // As `Permit.settle` reads a cost past 64 bits: saturated.
            let actual = [1, i.saturating_add(o), i, o];
            let units = permit.get().permit().owner().units();
            for item in plan.iter() {
                let Ok((name, j)) = item.extract::<(Bound<'py, PyAny>, usize)>() else {
                    return Ok(defer(py));
                };
                let (Some(&a), Some(was)) = (actual.get(j), charged.get_item(&name)?) else {
                    return Ok(defer(py));
                };
                let Ok(was) = was.extract::<u64>() else {
                    return Ok(defer(py));
                };
                if a == was {
                    continue;
                }
                let Ok(text) = name.extract::<&str>() else {
                    return Ok(defer(py));
                };
                let Some(index) = units.iter().position(|u| u == text) else {
                    return Ok(defer(py));
                };
                if n == MOST_UNITS {
                    return Ok(defer(py));
                }
                fixes[n] = Some(Correction {
                    index,
                    name,
                    actual: a,
                });
                n += 1;
            }
        }
    }
    // One caller settles (the list's pop is atomic); a call settled already is left.
    if once.len() == 0 || once.call_method0(intern!(py, "pop")).is_err() {
        histogram.get().inner.record(ns);
        return Ok(py.None().into_bound(py));
    }
    call.setattr(intern!(py, "_done"), true)?;
    call.setattr(intern!(py, "settled"), true)?;
    if plan.is_empty() {
        if readable {
            // Only the record wants the usage: read when asked for.
            call.setattr(intern!(py, "_usage_body"), body)?;
        }
    } else if let Some(u) = usage {
        let value = tuple_new(py)?.call1((usage_type, (u.input_tokens, u.output_tokens)))?;
        call.setattr(intern!(py, "_usage"), value)?;
        if n > 0 {
            let correction = PyDict::new(py);
            let mut named = [(0usize, 0u64); MOST_UNITS];
            for (k, fix) in fixes.iter().flatten().enumerate() {
                correction.set_item(&fix.name, fix.actual.into_py_any(py)?)?;
                named[k] = (fix.index, fix.actual);
            }
            call.setattr(intern!(py, "_correction"), correction)?;
            let clamped = call.getattr(intern!(py, "clamped"))?;
            if clamped.is_truthy()? {
                call.setattr(intern!(py, "clamped"), PyTuple::empty(py))?;
            }
            // Locks are tried first; only a busy one is waited for, detached from Python.
            permit.get().permit().settle(&named[..n], &Unblocked);
        }
    }
    histogram.get().inner.record(ns);
    Ok(py.None().into_bound(py))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(_settle_response, m)?)?;
    Ok(())
}
