//! One crossing per request for the transport: its own headers, its body's model and
//! estimate, and its costs per unit, read from the request in a single call. `None`
//! means "prepare the call in Python" (nothing was changed: the reader has no side
//! effects), wherever the native readers defer or a setting needs the reference.

use pyo3::exceptions::{PyAttributeError, PyException};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PySet, PyString, PyTuple, PyType};
use ratequeue_core::llm::cap::ask_stream_usage;
use ratequeue_core::llm::headers::{scan_request, RequestHeader};
use ratequeue_core::llm::plan::{UnitCost, UnitPlan};
use ratequeue_core::llm::request_facts;

use crate::llm::{latin1, pairs, read};

/// Methods whose body the transport reads.
const BODY_METHODS: [&str; 3] = ["POST", "PUT", "PATCH"];

/// A transport's request plan, read natively: its units (name, where the cost comes
/// from, clamp) and the settings the Python `_prepare` would consult.
#[pyclass(frozen, name = "_RequestReader", module = "ratequeue._ratequeue")]
pub struct RequestReaderPy {
    units: Vec<(Py<PyString>, UnitPlan)>,
    /// The costs of a call that needs no estimate (shared, never changed).
    unit_costs: Py<PyDict>,
    /// Header types whose `_list` holds httpx's `(name, lower-case name, value)` triples.
    triples: Py<PySet>,
    token_estimator: Py<PyType>,
    chars_estimate: Py<PyAny>,
    chars: Py<PyAny>,
    estimate: Py<PyType>,
    /// `_body.replace_body(request, new)`: a stream's body asked for its usage is sent.
    replace_body: Option<Py<PyAny>>,
    tuple_new: Py<PyAny>,
    needs_body: bool,
    stream_usage: bool,
    caps: bool,
    max_body: u64,
}

/// The estimator's character-count settings when the native reader can stand in for it
/// (a `TokenEstimator` counting characters, settled): `(chars_per_token, default)`.
fn char_settings(r: &RequestReaderPy, estimator: &Bound<'_, PyAny>) -> PyResult<Option<(u64, u64)>> {
    let py = estimator.py();
    let mut e = estimator.clone();
    if !e.get_type().is(r.token_estimator.bind(py)) {
        if !e.is(r.chars_estimate.bind(py)) {
            return Ok(None);
        }
        e = r.chars.bind(py).clone();
    }
    if !e.getattr(intern!(py, "_encoding"))?.is_none() || !e.getattr(intern!(py, "_started"))?.is_truthy()? {
        return Ok(None);
    }
    let (Ok(cpt), Ok(default)) = (
        e.getattr(intern!(py, "chars_per_token"))?.extract::<u64>(),
        e.getattr(intern!(py, "default_output_tokens"))?.extract::<u64>(),
    ) else {
        return Ok(None);
    };
    Ok(Some((cpt, default)))
}

/// `b.isdigit()` and `int(b) <= max` of a `Content-Length` value.
fn length_within(v: &[u8], max: u64) -> bool {
    if v.is_empty() || !v.iter().all(u8::is_ascii_digit) {
        return false;
    }
    let mut n: u64 = 0;
    for &c in v {
        n = match n.checked_mul(10).and_then(|n| n.checked_add(u64::from(c - b'0'))) {
            Some(n) => n,
            None => return false,
        };
    }
    n <= max
}

#[pymethods]
impl RequestReaderPy {
    #[new]
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (plan, unit_costs, triples, token_estimator, chars_estimate, chars, estimate, *, needs_body, stream_usage, caps, max_body, replace_body=None))]
    fn new(
        py: Python<'_>,
        plan: Vec<(Bound<'_, PyString>, i64, Option<u64>)>,
        unit_costs: Bound<'_, PyDict>,
        triples: Bound<'_, PySet>,
        token_estimator: Bound<'_, PyType>,
        chars_estimate: Bound<'_, PyAny>,
        chars: Bound<'_, PyAny>,
        estimate: Bound<'_, PyType>,
        needs_body: bool,
        stream_usage: bool,
        caps: bool,
        max_body: u64,
        replace_body: Option<Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        Ok(RequestReaderPy {
            units: plan
                .into_iter()
                .map(|(u, i, clamp)| {
                    (
                        u.unbind(),
                        UnitPlan {
                            cost: UnitCost::from_index(i),
                            clamp,
                        },
                    )
                })
                .collect(),
            unit_costs: unit_costs.unbind(),
            triples: triples.unbind(),
            token_estimator: token_estimator.unbind(),
            chars_estimate: chars_estimate.unbind(),
            chars: chars.unbind(),
            estimate: estimate.unbind(),
            replace_body: replace_body.map(Bound::unbind),
            tuple_new: py.get_type::<PyTuple>().getattr("__new__")?.unbind(),
            needs_body,
            stream_usage,
            caps,
            max_body,
        })
    }

    /// `(priority, task, account, request_id, model, estimate, costs, clamped, data,
    /// None)` of a request on `path` (`want_estimate`: a budget needs it; `estimator`: the
    /// transport's), or None where the Python reference must prepare it.
    fn read<'py>(
        &self,
        request: &Bound<'py, PyAny>,
        path: &Bound<'py, PyString>,
        want_estimate: bool,
        estimator: &Bound<'py, PyAny>,
    ) -> PyResult<Option<Bound<'py, PyTuple>>> {
        let py = request.py();
        let headers = request.getattr(intern!(py, "headers"))?;
        if !self.triples.bind(py).contains(headers.get_type())? {
            return Ok(None);
        }
        let Ok(hl) = headers.getattr(intern!(py, "_list"))?.cast_into::<PyList>() else {
            return Ok(None);
        };
        let Some(pairs) = pairs(&hl)? else {
            return Ok(None);
        };
        let found = scan_request(pairs.iter().map(|(k, _)| k.as_bytes()));
        let text = |h: RequestHeader| match found[h as usize] {
            Some(i) => latin1(py, pairs[i].1.as_bytes()).into_any(),
            None => py.None().into_bound(py),
        };
        let mut data: Option<Bound<'py, PyAny>> = None;
        if let Some(i) = found[RequestHeader::ContentLength as usize] {
            let method = request.getattr(intern!(py, "method"))?;
            let is_body = match method.cast::<PyString>() {
                Ok(m) => BODY_METHODS.iter().any(|b| m.to_str().is_ok_and(|m| m == *b)),
                Err(_) => return Ok(None),
            };
            if is_body && length_within(pairs[i].1.as_bytes(), self.max_body) {
                // httpx's `content` property is `_content` once read: read it without the
                // property's Python frame; the property decides when it is missing.
                let content = match request.getattr(intern!(py, "_content")) {
                    Ok(d) => Ok(d),
                    Err(e) if e.is_instance_of::<PyAttributeError>(py) => request.getattr(intern!(py, "content")),
                    Err(e) => Err(e),
                };
                match content {
                    Ok(d) => data = Some(d),
                    // A stream not read (RequestNotRead): estimated without its body.
                    Err(e) if e.is_instance_of::<PyException>(py) => {}
                    Err(e) => return Err(e),
                }
            }
        }
        let body: Option<Bound<'py, PyBytes>> = match &data {
            None => None,
            Some(d) => match d.cast::<PyBytes>() {
                Ok(b) => Some(b.clone()),
                Err(_) => return Ok(None),
            },
        };
        let bytes = body.as_ref().map_or(&[][..], |b| b.as_bytes());
        let none = || py.None().into_bound(py);
        let data_obj = data.unwrap_or_else(none);
        let needed = self.needs_body
            || want_estimate
            || (self.stream_usage && !bytes.is_empty() && bytes.windows(8).any(|w| w == b"\"stream\""));
        let head = [
            text(RequestHeader::Priority),
            text(RequestHeader::Task),
            text(RequestHeader::Account),
            text(RequestHeader::IdempotencyKey),
        ];
        if !needed {
            let [p, t, a, r] = head;
            let costs = self.unit_costs.bind(py).clone().into_any();
            let items = [
                p,
                t,
                a,
                r,
                none(),
                none(),
                costs,
                PyTuple::empty(py).into_any(),
                data_obj,
                none(),
            ];
            return Ok(Some(PyTuple::new(py, items)?));
        }
        if self.caps {
            return Ok(None);
        }
        let Some((cpt, default)) = char_settings(self, estimator)? else {
            return Ok(None);
        };
        let (model, input, output) = if bytes.is_empty() {
            (none(), 0, default)
        } else {
            match read(py, bytes, request_facts) {
                Err(_) => return Ok(None),
                Ok(None) => (none(), 0, default),
                Ok(Some(mut f)) => {
                    // A stream to ask for its usage: the body is rewritten (a path that is
                    // not UTF-8 is left to the reference too), and read again as sent.
                    let mut sent = None;
                    if f.stream_wants_usage && self.stream_usage {
                        let Ok(p) = path.to_str() else {
                            return Ok(None);
                        };
                        if !p.ends_with("/chat/completions") {
                            // Not a chat call: nothing to ask for.
                        } else if let Some(replace) = &self.replace_body {
                            let Ok(new) = read(py, bytes, ask_stream_usage) else {
                                return Ok(None);
                            };
                            match read(py, &new, request_facts) {
                                Ok(Some(g)) if !g.stream_wants_usage => f = g,
                                _ => return Ok(None),
                            }
                            sent = Some((replace, new));
                        } else {
                            return Ok(None);
                        }
                    }
                    let Ok((i, o)) = f.estimate(cpt, default) else {
                        return Ok(None);
                    };
                    // Nothing defers past here: the body is replaced only now (None
                    // still means "nothing changed").
                    let cost_ok = self.units.iter().all(|(_, plan)| plan.cost(i, o).is_ok());
                    if !cost_ok {
                        return Ok(None);
                    }
                    if let Some((replace, new)) = sent {
                        replace.bind(py).call1((request, PyBytes::new(py, &new)))?;
                    }
                    let m = match f.model {
                        Some(m) => PyString::new(py, &m).into_any(),
                        None => none(),
                    };
                    (m, i, o)
                }
            }
        };
        let costs = PyDict::new(py);
        let mut clamped = Vec::new();
        for (unit, plan) in &self.units {
            let Ok((c, was_clamped)) = plan.cost(input, output) else {
                return Ok(None);
            };
            costs.set_item(unit.bind(py), c)?;
            if was_clamped {
                clamped.push(unit.bind(py).clone());
            }
        }
        let est = self
            .tuple_new
            .bind(py)
            .call1((self.estimate.bind(py), (input, output)))?;
        let [p, t, a, r] = head;
        let items = [
            p,
            t,
            a,
            r,
            model,
            est,
            costs.into_any(),
            PyTuple::new(py, clamped)?.into_any(),
            data_obj,
            none(),
        ];
        Ok(Some(PyTuple::new(py, items)?))
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<RequestReaderPy>()
}

#[cfg(test)]
mod tests {
    use super::length_within;

    #[test]
    fn lengths() {
        assert!(length_within(b"0", 0));
        assert!(length_within(b"0012", 12));
        assert!(!length_within(b"13", 12));
        assert!(!length_within(b"", 12));
        assert!(!length_within(b"+1", 12));
        assert!(!length_within(b"1 ", 12));
        assert!(!length_within(b"99999999999999999999999", u64::MAX));
    }
}
