//! The transport's response side in one crossing: on the common path (a 2xx response
//! whose body is here, a Limiter's permit) the headers are scanned, the usage read, the
//! permit settled from the token plan and the call's record and HTTP histogram updated,
//! or nothing is done and the Python reference (`_transport._received`) takes the call.

use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyDict, PyList, PyString, PyTuple, PyType};
use pyo3::{ffi, intern};
use ratequeue_core::llm::headers::scan_headers;
use ratequeue_core::llm::response_usage;

use crate::histogram::{to_ns, HistogramPy};
use crate::llm::{decimal, pair_of, read};
use crate::llm_stream::BodyReaderPy;
use crate::waiting::{PermitPy, Unblocked};

/// Most units a plan corrects (`tokens`, `input_tokens`, `output_tokens`).
const MOST_UNITS: usize = 3;

/// The Python reference's answer: nothing was done.
fn defer(py: Python<'_>) -> Bound<'_, PyAny> {
    PyBool::new(py, false).to_owned().into_any()
}

/// One correction of the plan: the unit's index in the permit, its name, its actual.
struct Correction<'a, 'py> {
    index: usize,
    name: Borrowed<'a, 'py, PyString>,
    actual: u64,
}

/// Item `i` of a tuple, borrowed for as long as the tuple is.
fn item<'a, 'py>(t: Borrowed<'a, 'py, PyTuple>, i: usize) -> Option<Borrowed<'a, 'py, PyAny>> {
    if i >= t.len() {
        return None;
    }
    // SAFETY: a tuple's items are set and live as long as the tuple; `i` is in range.
    Some(unsafe { Borrowed::from_ptr(t.py(), ffi::PyTuple_GET_ITEM(t.as_ptr(), i as ffi::Py_ssize_t)) })
}

/// The bytes of a `bytes` item, borrowed for as long as the tuple holding it is.
fn bytes_of<'a>(b: Borrowed<'a, '_, PyAny>) -> Option<&'a [u8]> {
    let b = b.cast::<PyBytes>().ok()?;
    // SAFETY: a `bytes` object is immutable and lives as long as the borrow (`'a`).
    Some(unsafe {
        std::slice::from_raw_parts(
            ffi::PyBytes_AS_STRING(b.as_ptr()).cast::<u8>(),
            usize::try_from(ffi::PyBytes_Size(b.as_ptr())).unwrap_or(0),
        )
    })
}

/// `(lower-case name, value)` of httpx's header triples `(name, lower-case name,
/// value)`, None when an entry is not such a triple of bytes.
fn pairs_of<'a>(headers: Borrowed<'a, '_, PyTuple>) -> Option<Vec<(&'a [u8], &'a [u8])>> {
    let n = headers.len();
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let t = item(headers, i)?.cast::<PyTuple>().ok()?;
        if t.len() != 3 {
            return None;
        }
        out.push((bytes_of(item(t, 1)?)?, bytes_of(item(t, 2)?)?));
    }
    Some(out)
}

/// A plan entry `(unit, index)`, None when it is not one.
fn unit_of<'a, 'py>(entry: Borrowed<'a, 'py, PyAny>) -> Option<(Borrowed<'a, 'py, PyString>, usize)> {
    let t = entry.cast::<PyTuple>().ok()?;
    if t.len() != 2 {
        return None;
    }
    let name = item(t, 0)?.cast::<PyString>().ok()?;
    let j = item(t, 1)?.extract::<usize>().ok()?;
    Some((name, j))
}

/// Settles a call whose 2xx response body (`body`, already read) is here, as
/// `_received` + `_settle` would: None when done (settled now, or by another caller
/// before); otherwise nothing was done and the Python reference takes the call: from
/// `_read_response`'s `(content_type, exhausted, False)` for an SSE content type or an
/// exhausted quota, from the start (False) for a header entry that is not a triple of
/// bytes, a usage only the reference reads, a permit that is not a Limiter's.
///
/// A body not read yet (`body` None, a stream over the network) without a
/// `Content-Encoding` (or only `identity`): with `read_ahead`, and one `Content-Length`
/// within `max_body`, that length (nothing done: the caller reads the body and calls
/// again with it); otherwise the HTTP time is recorded and a [`BodyReaderPy`] is returned
/// that buffers the body as it passes and settles at its end (`transport` takes the calls
/// it defers); any other such body: False.
///
/// `headers` None: they were checked by the call before on this response, which gave the
/// length of the body read since (`body`: it settles; None, a stream longer than that
/// length: its reader).
///
/// `plan`: `((unit, index in (requests, tokens, input, output)), ...)` of the units a
/// usage corrects (empty: the body is kept for the record to read when asked for);
/// `charged`: what acquire took per unit; `once`: the call's settle-once list.
#[pyfunction]
#[pyo3(signature = (call, once, permit, charged, plan, headers, body, max_body, histogram, http_seconds, usage_type, transport=None, read_ahead=false))]
#[allow(clippy::too_many_arguments)]
pub fn _settle_response<'py>(
    py: Python<'py>,
    call: &Bound<'py, PyAny>,
    once: &Bound<'py, PyList>,
    permit: &Bound<'py, PyAny>,
    charged: &Bound<'py, PyDict>,
    plan: &Bound<'py, PyTuple>,
    headers: Option<&Bound<'py, PyList>>,
    body: Option<&Bound<'py, PyBytes>>,
    max_body: usize,
    histogram: &Bound<'py, HistogramPy>,
    http_seconds: f64,
    usage_type: &Bound<'py, PyType>,
    transport: Option<&Bound<'py, PyAny>>,
    read_ahead: bool,
) -> PyResult<Bound<'py, PyAny>> {
    // Everything that may defer comes first: nothing is changed before the settle.
    let Ok(ns) = to_ns("seconds", http_seconds) else {
        return Ok(defer(py));
    };
    if let Some(headers) = headers {
        // A snapshot of the list (no Python runs meanwhile), read without a copy per entry.
        let headers = headers.to_tuple();
        let Some(pairs) = pairs_of(headers.as_borrowed()) else {
            return Ok(defer(py));
        };
        let scan = scan_headers(pairs.iter().copied());
        let sse = scan
            .content_type
            .and_then(|i| pairs.get(i))
            .is_some_and(|(_, v)| v.len() >= 17 && v[..17].eq_ignore_ascii_case(b"text/event-stream"));
        if scan.exhausted || sse {
            // What `_read_response` would say, the usage left to the reference.
            let ctype = match scan.content_type.and_then(|i| item(headers.as_borrowed(), i)) {
                Some(t) => {
                    item(t.cast::<PyTuple>()?, 2).map_or_else(|| PyBytes::new(py, b"").into_any(), |v| v.to_owned())
                }
                None => PyBytes::new(py, b"").into_any(),
            };
            return Ok(PyTuple::new(
                py,
                [ctype, PyBool::new(py, scan.exhausted).to_owned().into_any(), defer(py)],
            )?
            .into_any());
        }
        if body.is_none() {
            // A stream: read natively when nothing is to be decoded.
            if transport.is_none()
                || !pairs
                    .iter()
                    .all(|(name, value)| *name != b"content-encoding" || identity(value))
            {
                return Ok(defer(py));
            }
            if read_ahead {
                if let Some(n) = read_ahead_length(&pairs, max_body) {
                    return Ok(n.into_pyobject(py)?.into_any());
                }
            }
        }
    }
    let Some(body) = body else {
        let Some(transport) = transport else {
            return Ok(defer(py));
        };
        let reader = BodyReaderPy::new(call, once, permit, charged, plan, max_body, usage_type, transport);
        let reader = Bound::new(py, reader)?;
        histogram.get().inner.record(ns);
        return Ok(reader.into_any());
    };
    match settle_body(
        py,
        call,
        once,
        permit,
        charged,
        plan,
        Some(body),
        max_body,
        Some((histogram.get(), ns)),
        usage_type,
    )? {
        Settled::Done => Ok(py.None().into_bound(py)),
        Settled::Deferred => Ok(defer(py)),
    }
}

/// The length of a body to read ahead: one `Content-Length` (digits only) within
/// `max_body`, no `Transfer-Encoding` (which frames the body instead, RFC 9112 6.3), and a
/// JSON `Content-Type` (`application/json` or `+json`, every one given); None otherwise.
fn read_ahead_length(pairs: &[(&[u8], &[u8])], max_body: usize) -> Option<u64> {
    let mut length = None;
    let mut json = None;
    for (name, value) in pairs {
        match *name {
            b"content-length" if length.is_none() => length = Some(decimal(value)?),
            b"content-length" | b"transfer-encoding" => return None,
            b"content-type" => json = Some(json.unwrap_or(true) && is_json(value)),
            _ => {}
        }
    }
    let n = length?;
    (json == Some(true) && u64::try_from(max_body).is_ok_and(|m| n <= m)).then_some(n)
}

/// A JSON media type: `application/json` or a `+json` suffix, in any case, parameters
/// after `;` ignored.
fn is_json(value: &[u8]) -> bool {
    let media = value.split(|&b| b == b';').next().unwrap_or_default().trim_ascii();
    media.eq_ignore_ascii_case(b"application/json")
        || (media.len() > 5 && media[media.len() - 5..].eq_ignore_ascii_case(b"+json"))
}

/// A `Content-Encoding` value that asks for nothing to be undone: its comma-separated
/// tokens, without surrounding ASCII white space, empty or `identity` in any case.
fn identity(value: &[u8]) -> bool {
    value.split(|&b| b == b',').all(|token| {
        let t = token.trim_ascii();
        t.is_empty() || t.eq_ignore_ascii_case(b"identity")
    })
}

/// What [`settle_body`] did.
pub(crate) enum Settled {
    /// Settled now, or by another caller before.
    Done,
    /// Nothing was done: the Python reference takes the call.
    Deferred,
}

/// The settle of a 2xx call from its JSON body (None: none, or past `max_body`), shared
/// by a body that was here and a streamed body at its end: the usage read, the permit
/// settled from the token plan (once: `once`'s pop), the record set as `_settle` sets
/// it; `histogram`, when given, records the HTTP time. Deferred when only the
/// reference can settle it (nothing changed then), and when a body to read reports no
/// usage.
#[allow(clippy::too_many_arguments)]
pub(crate) fn settle_body<'py>(
    py: Python<'py>,
    call: &Bound<'py, PyAny>,
    once: &Bound<'py, PyList>,
    permit: &Bound<'py, PyAny>,
    charged: &Bound<'py, PyDict>,
    plan: &Bound<'py, PyTuple>,
    body: Option<&Bound<'py, PyBytes>>,
    max_body: usize,
    histogram: Option<(&HistogramPy, u64)>,
    usage_type: &Bound<'py, PyType>,
) -> PyResult<Settled> {
    let record = || {
        if let Some((h, ns)) = histogram {
            h.inner.record(ns);
        }
    };
    let Ok(permit) = permit.cast::<PermitPy>() else {
        return Ok(Settled::Deferred);
    };
    if !usage_type.is_subclass_of::<PyTuple>()? {
        return Ok(Settled::Deferred);
    }
    let data = body.map_or(&[][..], |b| b.as_bytes());
    let readable = !data.is_empty() && data.len() <= max_body;
    let mut usage = None;
    let mut fixes: [Option<Correction<'_, 'py>>; MOST_UNITS] = [None, None, None];
    let mut n = 0;
    if !plan.is_empty() && readable {
        let Ok(found) = read(py, data, response_usage) else {
            return Ok(Settled::Deferred);
        };
        usage = found;
        // A body without a usage (a background response's creation, answered before it
        // has run) is the reference's: it keeps the estimate, or waits for the poll.
        let Some(u) = found else {
            return Ok(Settled::Deferred);
        };
        let (i, o) = (u.input_tokens, u.output_tokens);
        // As `Permit.settle` reads a cost past 64 bits: saturated.
        let actual = [1, i.saturating_add(o), i, o];
        let units = permit.get().permit().owner().units();
        for item in plan.iter_borrowed() {
            let Some((name, j)) = unit_of(item) else {
                return Ok(Settled::Deferred);
            };
            let (Some(&a), Some(was)) = (actual.get(j), charged.get_item(name)?) else {
                return Ok(Settled::Deferred);
            };
            let Ok(was) = was.extract::<u64>() else {
                return Ok(Settled::Deferred);
            };
            if a == was {
                continue;
            }
            let Ok(text) = name.to_str() else {
                return Ok(Settled::Deferred);
            };
            let Some(index) = units.iter().position(|u| u == text) else {
                return Ok(Settled::Deferred);
            };
            if n == MOST_UNITS {
                return Ok(Settled::Deferred);
            }
            fixes[n] = Some(Correction { index, name, actual: a });
            n += 1;
        }
    }
    // One caller settles (the list's pop is atomic); a call settled already is left.
    if once.del_item(0).is_err() {
        record();
        return Ok(Settled::Done);
    }
    // The limiter first: nothing after the pop may lose the refund.
    let mut named = [(0usize, 0u64); MOST_UNITS];
    for (k, fix) in fixes.iter().flatten().enumerate() {
        named[k] = (fix.index, fix.actual);
    }
    if n > 0 {
        // Locks are tried first; only a busy one is waited for, detached from Python.
        permit.get().permit().settle(&named[..n], &Unblocked);
    }
    record();
    call.setattr(intern!(py, "_done"), true)?;
    call.setattr(intern!(py, "settled"), true)?;
    if plan.is_empty() {
        if let (true, Some(body)) = (readable, body) {
            // Only the record wants the usage: read when asked for.
            call.setattr(intern!(py, "_usage_body"), body)?;
        }
    } else if let Some(u) = usage {
        let value = pair_of(usage_type, u.input_tokens, u.output_tokens)?;
        call.setattr(intern!(py, "_usage"), value)?;
        if n > 0 {
            // What acquire took, corrected to the usage.
            let correction = PyDict::new(py);
            for fix in fixes.iter().flatten() {
                correction.set_item(fix.name, fix.actual)?;
            }
            call.setattr(intern!(py, "_correction"), correction)?;
            if call.getattr(intern!(py, "clamped"))?.is_truthy()? {
                call.setattr(intern!(py, "clamped"), PyTuple::empty(py))?;
            }
        }
    }
    Ok(Settled::Done)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(_settle_response, m)?)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{identity, read_ahead_length};

    #[test]
    fn identity_encodings() {
        assert!(identity(b""));
        assert!(identity(b"identity"));
        assert!(identity(b" Identity , IDENTITY,"));
        assert!(!identity(b"gzip"));
        assert!(!identity(b"identity, br"));
        assert!(!identity(b"identityx"));
        assert!(!identity(b"\xa0identity")); // not ASCII white space: the reference decides
    }

    #[test]
    fn read_ahead_lengths() {
        let json = &b"application/json"[..];
        let with = |v: &'static [u8]| vec![(&b"content-type"[..], json), (&b"content-length"[..], v)];
        assert_eq!(read_ahead_length(&with(b"120"), 8 << 20), Some(120));
        assert_eq!(read_ahead_length(&with(b"0"), 0), Some(0));
        assert_eq!(read_ahead_length(&with(b"121"), 120), None); // past the bound
        for bad in [&b" 12"[..], b"+12", b"", b"1e3", b"99999999999999999999999"] {
            assert_eq!(read_ahead_length(&with(bad), usize::MAX), None);
        }
        let length = (&b"content-length"[..], &b"5"[..]);
        let typed = |t: &'static [u8]| [(&b"content-type"[..], t), length];
        for t in [
            &b"application/json; charset=utf-8"[..],
            b" Application/JSON ",
            b"application/problem+json",
        ] {
            assert_eq!(read_ahead_length(&typed(t), 100), Some(5), "{t:?}");
        }
        for t in [&b"text/plain"[..], b"audio/mpeg", b"application/jsonl", b"+json", b""] {
            assert_eq!(read_ahead_length(&typed(t), 100), None, "{t:?}");
        }
        assert_eq!(read_ahead_length(&[length], 100), None); // no type
        let chunked = [
            (&b"content-type"[..], json),
            length,
            (&b"transfer-encoding"[..], &b"chunked"[..]),
        ];
        assert_eq!(read_ahead_length(&chunked, 100), None);
        let twice = [(&b"content-type"[..], json), length, length];
        assert_eq!(read_ahead_length(&twice, 100), None);
        let two_types = [
            (&b"content-type"[..], json),
            length,
            (&b"content-type"[..], &b"text/html"[..]),
        ];
        assert_eq!(read_ahead_length(&two_types, 100), None);
    }
}
