//! The transport's body readers (ratequeue_core::llm): bytes in, plain values out.
//! `False` means "decide with the Python reference" (the core deferred, or an argument
//! is past what it reads). Bodies of at least `DETACH_AT` bytes are read detached from
//! Python (other threads run meanwhile); smaller ones cost less than a detach.

use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyList, PyString, PyTuple, PyType};
use ratequeue_core::llm::cap::{cap_output, Capping, Refusal, CHOICES, CONTAINERS, NESTED_CHOICES, OUTPUT_BOUNDS};
use ratequeue_core::llm::headers::{scan_headers, scan_request, RequestHeader};
use ratequeue_core::llm::route::{
    emits_no_tokens, spends_no_tokens, FREE_CALLS, MANAGEMENT, MANAGEMENT_ACTIONS, MODEL_CALLS, NO_TEXT_ROUTES,
    NO_TOKEN_ROUTES,
};
use ratequeue_core::llm::sse::SseFrames;
use ratequeue_core::llm::{request_facts, response_usage};

/// Bodies this long or longer are read with the interpreter released.
const DETACH_AT: usize = 64 << 10;

pub(crate) fn read<T: Send>(py: Python<'_>, body: &[u8], f: impl FnOnce(&[u8]) -> T + Send) -> T {
    if body.len() >= DETACH_AT {
        py.detach(|| f(body))
    } else {
        f(body)
    }
}

/// `(input_tokens, output_tokens)` of a response body, None when it reports none (or is
/// not a JSON object), False when only the Python reader can tell.
#[pyfunction]
pub fn _read_usage<'py>(py: Python<'py>, body: &Bound<'py, PyBytes>) -> PyResult<Bound<'py, PyAny>> {
    Ok(match read(py, body.as_bytes(), response_usage) {
        Ok(Some(u)) => PyTuple::new(py, [u.input_tokens, u.output_tokens])?.into_any(),
        Ok(None) => py.None().into_bound(py),
        Err(_) => PyBool::new(py, false).to_owned().into_any(),
    })
}

/// True when a call on `path` produces no output tokens (embeddings, moderations, token
/// counts): its estimate charges no output unless the body names a bound.
#[pyfunction]
pub fn _emits_no_tokens(path: &Bound<'_, PyString>) -> bool {
    path_emits_no_tokens(path)
}

/// [`emits_no_tokens`] of a Python path (one that is not UTF-8 read with replacements:
/// the routes are ASCII).
pub(crate) fn path_emits_no_tokens(path: &Bound<'_, PyString>) -> bool {
    match path.to_str() {
        Ok(p) => emits_no_tokens(p),
        Err(_) => emits_no_tokens(&path.to_string_lossy()),
    }
}

/// True when a call on `path` spends none of the model's tokens (batch, file and
/// fine-tuning management, token counts): nothing is estimated nor settled for it.
#[pyfunction]
pub fn _spends_no_tokens(path: &Bound<'_, PyString>) -> bool {
    path_spends_no_tokens(path)
}

/// [`spends_no_tokens`] of a Python path (read as [`path_emits_no_tokens`] reads it).
pub(crate) fn path_spends_no_tokens(path: &Bound<'_, PyString>) -> bool {
    match path.to_str() {
        Ok(p) => spends_no_tokens(p),
        Err(_) => spends_no_tokens(&path.to_string_lossy()),
    }
}

/// `(model, stream_wants_usage, input_tokens, output_tokens)` of a request body under
/// the character estimate, None when it is not a JSON object, False when only the
/// Python reader can tell.
#[pyfunction]
pub fn _read_request<'py>(
    py: Python<'py>,
    body: &Bound<'py, PyBytes>,
    chars_per_token: &Bound<'py, PyAny>,
    default_output_tokens: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyAny>> {
    let no = || PyBool::new(py, false).to_owned().into_any();
    let (Ok(cpt), Ok(default)) = (chars_per_token.extract::<u64>(), default_output_tokens.extract::<u64>()) else {
        return Ok(no());
    };
    let facts = match read(py, body.as_bytes(), request_facts) {
        Ok(Some(f)) => f,
        Ok(None) => return Ok(py.None().into_bound(py)),
        Err(_) => return Ok(no()),
    };
    let Ok((input, output)) = facts.estimate(cpt, default) else {
        return Ok(no());
    };
    let model = match facts.model {
        Some(m) => m.into_pyobject(py)?.into_any(),
        None => py.None().into_bound(py),
    };
    let stream = PyBool::new(py, facts.stream_wants_usage).to_owned().into_any();
    Ok(PyTuple::new(
        py,
        [
            model,
            stream,
            input.into_pyobject(py)?.into_any(),
            output.into_pyobject(py)?.into_any(),
        ],
    )?
    .into_any())
}

/// A `Content-Length` value as httpx keeps it: ASCII digits only (no sign, no white
/// space), within 64 bits; None otherwise.
pub(crate) fn decimal(v: &[u8]) -> Option<u64> {
    if v.is_empty() {
        return None;
    }
    v.iter().try_fold(0u64, |n, &c| {
        if !c.is_ascii_digit() {
            return None;
        }
        n.checked_mul(10)?.checked_add(u64::from(c - b'0'))
    })
}

/// A header's lower-case name and value.
pub(crate) type Pair<'py> = (Bound<'py, PyBytes>, Bound<'py, PyBytes>);

/// `(lower-case name, value)` of httpx's header triples `(name, lower-case name,
/// value)`, None when an entry is not such a triple of bytes.
pub(crate) fn pairs<'py>(headers: &Bound<'py, PyList>) -> PyResult<Option<Vec<Pair<'py>>>> {
    let mut out = Vec::with_capacity(headers.len());
    for item in headers.iter() {
        let Ok(t) = item.cast::<PyTuple>() else {
            return Ok(None);
        };
        if t.len() != 3 {
            return Ok(None);
        }
        let (Ok(lk), Ok(v)) = (
            t.get_item(1)?.cast_into::<PyBytes>(),
            t.get_item(2)?.cast_into::<PyBytes>(),
        ) else {
            return Ok(None);
        };
        out.push((lk, v));
    }
    Ok(Some(out))
}

/// The content type (b"" without one) and whether a quota may be exhausted.
fn scan<'py>(py: Python<'py>, pairs: &[Pair<'py>]) -> (Bound<'py, PyAny>, bool) {
    let scan = scan_headers(pairs.iter().map(|(k, v)| (k.as_bytes(), v.as_bytes())));
    let ctype = match scan.content_type {
        Some(i) => pairs[i].1.clone(),
        None => PyBytes::new(py, b""),
    };
    (ctype.into_any(), scan.exhausted)
}

/// `(content_type, exhausted)` of httpx's header triples `(name, lower-case name,
/// value)`, None when an entry is not such a triple of bytes.
#[pyfunction]
pub fn _scan_response<'py>(py: Python<'py>, headers: &Bound<'py, PyList>) -> PyResult<Bound<'py, PyAny>> {
    let Some(pairs) = pairs(headers)? else {
        return Ok(py.None().into_bound(py));
    };
    let (ctype, exhausted) = scan(py, &pairs);
    Ok(PyTuple::new(py, [ctype, PyBool::new(py, exhausted).to_owned().into_any()])?.into_any())
}

/// `_scan_response` and, when `body` is given, `_read_usage` of it in one call:
/// `(content_type, exhausted, usage)` (usage None without a body); None when an entry
/// of `headers` is not a triple of bytes.
#[pyfunction]
#[pyo3(signature = (headers, body=None))]
pub fn _read_response<'py>(
    py: Python<'py>,
    headers: &Bound<'py, PyList>,
    body: Option<&Bound<'py, PyBytes>>,
) -> PyResult<Bound<'py, PyAny>> {
    let Some(pairs) = pairs(headers)? else {
        return Ok(py.None().into_bound(py));
    };
    let (ctype, exhausted) = scan(py, &pairs);
    let usage = match body {
        None => py.None().into_bound(py),
        Some(b) => _read_usage(py, b)?,
    };
    Ok(PyTuple::new(py, [ctype, PyBool::new(py, exhausted).to_owned().into_any(), usage])?.into_any())
}

/// `tuple.__new__(ty, (a, b))` of a tuple subclass (`Estimate`, `Usage`), made as that
/// call makes it (the instance allocated by its type, its two items set) without the
/// call; a type that adds to a tuple's layout through the call itself.
pub(crate) fn pair_of<'py>(ty: &Bound<'py, PyType>, a: u64, b: u64) -> PyResult<Bound<'py, PyAny>> {
    let py = ty.py();
    let (a, b) = (a.into_pyobject(py)?, b.into_pyobject(py)?);
    let tp = ty.as_type_ptr();
    // SAFETY: both type objects are live (`ty` holds one, the other is static); their
    // fields are read only.
    let tuple = py.get_type::<PyTuple>().as_type_ptr();
    let plain = ty.is_subclass_of::<PyTuple>()?
        && unsafe { (*tp).tp_basicsize == (*tuple).tp_basicsize && (*tp).tp_alloc.is_some() };
    if !plain {
        return py
            .get_type::<PyTuple>()
            .call_method1(intern!(py, "__new__"), (ty, (a, b)));
    }
    // SAFETY: a tuple subclass of a tuple's own layout: its `tp_alloc` returns a new
    // instance of two NULL items (or null with an error set), each set once below with a
    // reference it takes, as `tuple_subtype_new` does.
    unsafe {
        let alloc = (*tp).tp_alloc.unwrap_or(pyo3::ffi::PyType_GenericAlloc);
        let obj = Bound::from_owned_ptr_or_err(py, alloc(tp, 2))?;
        pyo3::ffi::PyTuple_SET_ITEM(obj.as_ptr(), 0, a.into_any().into_ptr());
        pyo3::ffi::PyTuple_SET_ITEM(obj.as_ptr(), 1, b.into_any().into_ptr());
        Ok(obj)
    }
}

/// A header value as Python's `bytes.decode("latin-1")` gives it.
pub(crate) fn latin1<'py>(py: Python<'py>, v: &[u8]) -> Bound<'py, PyString> {
    if v.is_ascii() {
        // ASCII is UTF-8 as it is.
        PyString::new(py, std::str::from_utf8(v).unwrap_or_default())
    } else {
        PyString::new(py, &v.iter().map(|&b| char::from(b)).collect::<String>())
    }
}

/// The request headers the transport reads, from httpx's header triples: `(priority,
/// task, account, request_id, content_length)`, the first four as latin-1 text, the last
/// as bytes, each None when absent (the last of a repeated name wins); None when an
/// entry is not a triple of bytes.
#[pyfunction]
pub fn _read_call_headers<'py>(py: Python<'py>, headers: &Bound<'py, PyList>) -> PyResult<Bound<'py, PyAny>> {
    let Some(pairs) = pairs(headers)? else {
        return Ok(py.None().into_bound(py));
    };
    let found = scan_request(pairs.iter().map(|(k, _)| k.as_bytes()));
    let none = || py.None().into_bound(py);
    let text = |h: RequestHeader| match found[h as usize] {
        Some(i) => latin1(py, pairs[i].1.as_bytes()).into_any(),
        None => none(),
    };
    let length = match found[RequestHeader::ContentLength as usize] {
        Some(i) => pairs[i].1.clone().into_any(),
        None => none(),
    };
    Ok(PyTuple::new(
        py,
        [
            text(RequestHeader::Priority),
            text(RequestHeader::Task),
            text(RequestHeader::Account),
            text(RequestHeader::IdempotencyKey),
            length,
        ],
    )?
    .into_any())
}

/// `(body, field, requested, sent)` of a request body with its output bounds capped at
/// `limit` for the whole call (`field`: index in `_OUTPUT_BOUNDS`; `add`: the one added
/// when the body has no bound and no container; `sent`: the bound written, the cap
/// divided among the choices), None when nothing changes, a reason (str) when the cap
/// cannot be applied (the call is refused), False when only the Python reference can
/// tell.
#[pyfunction]
pub fn _cap_output<'py>(
    py: Python<'py>,
    body: &Bound<'py, PyBytes>,
    limit: &Bound<'py, PyAny>,
    add: usize,
) -> PyResult<Bound<'py, PyAny>> {
    let no = || PyBool::new(py, false).to_owned().into_any();
    let Ok(limit) = limit.extract::<u64>() else {
        return Ok(no());
    };
    Ok(match read(py, body.as_bytes(), |b| cap_output(b, limit, add)) {
        Ok(Capping::Kept) => py.None().into_bound(py),
        Err(_) => no(),
        Ok(Capping::Refused(why)) => PyString::new(py, refusal(why)).into_any(),
        Ok(Capping::Capped(c)) => {
            let requested = match c.requested {
                Some(v) => v.into_pyobject(py)?.into_any(),
                None => py.None().into_bound(py),
            };
            PyTuple::new(
                py,
                [
                    PyBytes::new(py, &c.body).into_any(),
                    c.field.into_pyobject(py)?.into_any(),
                    requested,
                    c.sent.into_pyobject(py)?.into_any(),
                ],
            )?
            .into_any()
        }
    })
}

/// The reason a refusal gives (the Python reference words it the same way).
pub(crate) fn refusal(why: Refusal) -> &'static str {
    match why {
        Refusal::Choices => "asks for n or best_of choices that are not a positive integer",
        Refusal::TooManyChoices => "asks for more choices (n, best_of) than the cap has tokens",
        Refusal::RepeatedContainer => "names an object of output bounds twice",
    }
}

/// A stream's Server-Sent Events framed natively (`ratequeue_core::llm::sse`): `feed`
/// returns the payloads of the events that mention a usage object (None when no event
/// does), for the Python reader to take the usage from.
#[pyclass(name = "_SSEFrames", module = "ratequeue._ratequeue")]
pub struct SseFramesPy {
    inner: SseFrames,
}

#[pymethods]
impl SseFramesPy {
    #[new]
    fn new(max_event: usize) -> Self {
        SseFramesPy {
            inner: SseFrames::new(max_event),
        }
    }

    /// The payloads (`data:` lines joined) of the complete events of this chunk that
    /// mention a usage object, or None.
    fn feed<'py>(&mut self, chunk: &Bound<'py, PyBytes>) -> PyResult<Option<Bound<'py, PyList>>> {
        let py = chunk.py();
        let mut found: Vec<Vec<u8>> = Vec::new();
        read(py, chunk.as_bytes(), |b| self.inner.feed(b, |p| found.push(p)));
        if found.is_empty() {
            return Ok(None);
        }
        Ok(Some(PyList::new(py, found.iter().map(|p| PyBytes::new(py, p)))?))
    }

    /// Events read (complete, not skipped).
    #[getter]
    fn events(&self) -> u64 {
        self.inner.events
    }

    /// Bytes kept of a partial event.
    #[getter]
    fn buffered(&self) -> usize {
        self.inner.buffered()
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<SseFramesPy>()?;
    m.add_function(wrap_pyfunction!(_read_usage, m)?)?;
    m.add_function(wrap_pyfunction!(_read_request, m)?)?;
    m.add_function(wrap_pyfunction!(_scan_response, m)?)?;
    m.add_function(wrap_pyfunction!(_read_response, m)?)?;
    m.add_function(wrap_pyfunction!(_read_call_headers, m)?)?;
    m.add_function(wrap_pyfunction!(_cap_output, m)?)?;
    m.add_function(wrap_pyfunction!(_emits_no_tokens, m)?)?;
    m.add_function(wrap_pyfunction!(_spends_no_tokens, m)?)?;
    m.add("_OUTPUT_BOUNDS", PyTuple::new(m.py(), OUTPUT_BOUNDS)?)?;
    m.add("_CHOICES", PyTuple::new(m.py(), CHOICES)?)?;
    m.add("_NESTED_CHOICES", PyTuple::new(m.py(), NESTED_CHOICES)?)?;
    m.add("_CONTAINERS", PyTuple::new(m.py(), CONTAINERS)?)?;
    m.add("_NO_TOKEN_ROUTES", PyTuple::new(m.py(), NO_TOKEN_ROUTES)?)?;
    m.add("_MODEL_CALLS", PyTuple::new(m.py(), MODEL_CALLS)?)?;
    m.add("_NO_TEXT_ROUTES", PyTuple::new(m.py(), NO_TEXT_ROUTES)?)?;
    m.add("_MANAGEMENT", PyTuple::new(m.py(), MANAGEMENT)?)?;
    m.add("_MANAGEMENT_ACTIONS", PyTuple::new(m.py(), MANAGEMENT_ACTIONS)?)?;
    m.add("_FREE_CALLS", PyTuple::new(m.py(), FREE_CALLS)?)?;
    Ok(())
}
