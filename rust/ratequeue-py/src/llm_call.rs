//! One crossing per request for the transport: its own headers, its body's model and
//! estimate, and its costs per unit, read from the request in a single call. `None`
//! means "prepare the call in Python" (nothing was changed: the reader has no side
//! effects), wherever the native readers defer or a setting needs the reference.

use std::sync::atomic::{AtomicU64, Ordering};

use pyo3::exceptions::{PyAttributeError, PyException, PyValueError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyDict, PyList, PySet, PyString, PyTuple, PyType};
use ratequeue_core::limiter::MAX_RATES;
use ratequeue_core::llm::cap::ask_stream_usage;
use ratequeue_core::llm::headers::{scan_request, RequestHeader};
use ratequeue_core::llm::plan::{UnitCost, UnitPlan};
use ratequeue_core::llm::request_facts;
use ratequeue_core::llm::route::RouteMemo;

use crate::histogram::HistogramPy;
use crate::limiter::LimiterPy;
use crate::llm::{decimal, latin1, pair_of, pairs, path_emits_no_tokens, path_spends_no_tokens, read};
use crate::waiting::PermitPy;

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
    needs_body: bool,
    stream_usage: bool,
    caps: bool,
    max_body: u64,
    /// What `prepare` makes a call of (None: `prepare` always defers): the record type,
    /// the budget and call-options context variables, the options' empty value, the
    /// request-id module (`_PREFIX`) and the own headers' names.
    call: Option<CallParts>,
    /// The transport's Limiter when `prepare` may take its permit (a Limiter, no ledger),
    /// and where each unit of the plan is among its units: a call granted at once leaves
    /// with its permit (`_permit`) and its wait recorded.
    limiter: Option<(Py<LimiterPy>, Vec<usize>)>,
    /// The route test (`spends_no_tokens`), remembered for the last path.
    routes: RouteMemo,
}

/// The slots of `_Call` a call sets from its request, in `prepare`'s order (the others
/// are `_record._CONSTANT_SLOTS`, and `_once`, a new `[None]`).
const CALL_SLOTS: [&str; 16] = [
    "_request",
    "request_id",
    "path",
    "_model",
    "_estimate",
    "capped",
    "priority",
    "task",
    "_pending",
    "_charged",
    "clamped",
    "_kw",
    "_account",
    "_async",
    "_tokenless",
    "_bodyless",
];

/// What `prepare` needs besides the reader (see `RequestReaderPy::call`).
struct CallParts {
    record: Py<PyType>,
    /// Where each of `CALL_SLOTS` is in a record (byte offsets of its slots).
    slots: [isize; CALL_SLOTS.len()],
    /// `_record._CONSTANT_SLOTS`: (offset, value) set the same in every record.
    constants: Vec<(isize, Py<PyAny>)>,
    /// Where `_once` and `_permit` are.
    once: isize,
    permit: isize,
    budget: Py<PyAny>,
    options: Py<PyAny>,
    empty: Py<PyAny>,
    ids_module: Py<PyAny>,
    own: [Py<PyString>; 3],
}

/// A request as read natively: its own headers (priority, task, account, request id;
/// latin-1 text or None), model, estimate, costs per unit, units clamped and the body.
struct Read<'py> {
    head: [Bound<'py, PyAny>; 4],
    model: Bound<'py, PyAny>,
    est: Bound<'py, PyAny>,
    costs: Bound<'py, PyAny>,
    clamped: Bound<'py, PyAny>,
    data: Bound<'py, PyAny>,
    /// The estimate the costs follow (`(input, output)`); None: 1 per unit.
    io: Option<(u64, u64)>,
    /// Spends none of the model's tokens (manages batches or files, counts tokens): the
    /// usage its response reports is not its own (`_Call._tokenless`).
    tokenless: bool,
    /// Sends no body: a response without a usage settles it to nothing
    /// (`_Call._bodyless`).
    bodyless: bool,
}

/// `PyContextVar_Get` without a default: the variable's value in this context (its own
/// default when unset).
fn context_get<'py>(var: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
    let py = var.py();
    let mut out: *mut pyo3::ffi::PyObject = std::ptr::null_mut();
    // SAFETY: `var` is a live object (the call checks it is a ContextVar and raises
    // otherwise); `out` receives a new reference or stays null with an error set.
    let rc = unsafe { pyo3::ffi::PyContextVar_Get(var.as_ptr(), std::ptr::null_mut(), &mut out) };
    if rc < 0 {
        return Err(PyErr::fetch(py));
    }
    if out.is_null() {
        return Ok(py.None().into_bound(py));
    }
    // SAFETY: a new reference, owned from here.
    Ok(unsafe { Bound::from_owned_ptr(py, out) })
}

/// httpx's `request.url.path` (the path, percent-decoded, "/" when empty) without the
/// property's Python frames where no decoding is needed.
fn url_path<'py>(request: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyString>> {
    let py = request.py();
    let url = request.getattr(intern!(py, "url"))?;
    if let Ok(reference) = url.getattr(intern!(py, "_uri_reference")) {
        if let Ok(p) = reference.getattr(intern!(py, "path")) {
            if let Ok(p) = p.cast_into_exact::<PyString>() {
                if p.to_str().is_ok_and(|s| !s.is_empty() && !s.contains('%')) {
                    return Ok(p);
                }
            }
        }
    }
    Ok(url.getattr(intern!(py, "path"))?.cast_into::<PyString>()?)
}

/// A header value the way `value or fallback` reads it (an empty string is absent).
fn or_else<'py>(v: &Bound<'py, PyAny>, fallback: impl FnOnce() -> Bound<'py, PyAny>) -> Bound<'py, PyAny> {
    match v.cast::<PyString>() {
        Ok(s) if s.len().is_ok_and(|n| n > 0) => v.clone(),
        _ => fallback(),
    }
}

/// `call=` of the constructor: `(record type, budget variable, options variable, empty
/// options, request-id module, own header names)`.
type CallArgs<'py> = (
    Bound<'py, PyType>,
    Bound<'py, PyAny>,
    Bound<'py, PyAny>,
    Bound<'py, PyAny>,
    Bound<'py, PyAny>,
    [Bound<'py, PyString>; 3],
    Vec<(Bound<'py, PyString>, Bound<'py, PyAny>)>,
);

/// The constant slots of the record type, checked: with `CALL_SLOTS` and `_once` they
/// are every slot of the type and its bases, and the type has no `__dict__` (a record
/// made natively has every attribute `_Call.__init__` sets).
fn record_constants(
    record: &Bound<'_, PyType>,
    constants: &[(Bound<'_, PyString>, Bound<'_, PyAny>)],
) -> PyResult<Vec<(isize, Py<PyAny>)>> {
    let py = record.py();
    let mut named: Vec<String> = CALL_SLOTS.iter().map(|n| (*n).to_owned()).collect();
    named.push("_once".to_owned());
    for (n, _) in constants {
        named.push(n.to_str()?.to_owned());
    }
    let mut slots: Vec<String> = Vec::new();
    for base in record.mro().iter() {
        let base = base.cast_into::<PyType>()?;
        if base.is(py.get_type::<pyo3::types::PyAny>()) {
            continue;
        }
        let Some(declared) = base.getattr("__dict__")?.get_item("__slots__").ok() else {
            return Err(PyValueError::new_err(format!("{base} has no __slots__")));
        };
        for n in declared.try_iter()? {
            slots.push(n?.extract()?);
        }
    }
    named.sort();
    slots.sort();
    if named != slots {
        return Err(PyValueError::new_err(format!(
            "the record's slots {slots:?} are not the ones prepare sets {named:?}"
        )));
    }
    constants
        .iter()
        .map(|(n, v)| Ok((slot_offset(record, n.to_str()?)?, v.clone().unbind())))
        .collect()
}

/// The byte offset of a slot of `record`: its descriptor must be a writable object
/// member (what `__slots__` makes), else a ValueError.
fn slot_offset(record: &Bound<'_, PyType>, name: &str) -> PyResult<isize> {
    let d = record.getattr(name)?;
    // SAFETY: the type of a live object is read; a member descriptor's layout is
    // `PyMemberDescrObject` (checked by its exact type first), whose `d_member` points to
    // the type's `PyMemberDef` for as long as the type lives (the reader holds it).
    unsafe {
        let member_type = &raw mut pyo3::ffi::PyMemberDescr_Type;
        if pyo3::ffi::Py_TYPE(d.as_ptr()) == member_type {
            let def = (*d.as_ptr().cast::<pyo3::ffi::PyMemberDescrObject>()).d_member;
            if !def.is_null()
                && (*def).type_code == pyo3::ffi::Py_T_OBJECT_EX
                && (*def).flags & pyo3::ffi::Py_READONLY == 0
                && (*def).offset > 0
            {
                return Ok((*def).offset);
            }
        }
    }
    Err(PyValueError::new_err(format!(
        "{name} is not a writable slot of {record}"
    )))
}

/// The estimator's character-count settings when the native reader can stand in for it
/// (a `TokenEstimator` counting characters, settled): `(chars_per_token, default)`.
/// Read from the instance's `__dict__`: an exact `TokenEstimator` sets all four there
/// and its class defines none of them (what `getattr` would find); one missing defers.
fn char_settings(r: &RequestReaderPy, estimator: &Bound<'_, PyAny>) -> PyResult<Option<(u64, u64)>> {
    let py = estimator.py();
    let mut e = estimator.clone();
    if !e.get_type().is(r.token_estimator.bind(py)) {
        if !e.is(r.chars_estimate.bind(py)) {
            return Ok(None);
        }
        e = r.chars.bind(py).clone();
    }
    // SAFETY: `e` is a live object; the call returns a new reference or null with an
    // error set (an object without a `__dict__`).
    let Ok(d) = (unsafe {
        Bound::from_owned_ptr_or_err(py, pyo3::ffi::PyObject_GenericGetDict(e.as_ptr(), std::ptr::null_mut()))
    }) else {
        return Ok(None);
    };
    let Ok(d) = d.cast_into_exact::<PyDict>() else {
        return Ok(None);
    };
    let (Some(encoding), Some(started), Some(cpt), Some(default)) = (
        d.get_item(intern!(py, "_encoding"))?,
        d.get_item(intern!(py, "_started"))?,
        d.get_item(intern!(py, "chars_per_token"))?,
        d.get_item(intern!(py, "default_output_tokens"))?,
    ) else {
        return Ok(None);
    };
    if !encoding.is_none() || !started.is_truthy()? {
        return Ok(None);
    }
    let (Ok(cpt), Ok(default)) = (cpt.extract::<u64>(), default.extract::<u64>()) else {
        return Ok(None);
    };
    Ok(Some((cpt, default)))
}

/// True when the request sends no body: its stream is httpx's in-memory one, empty (a
/// GET's, an empty POST's); any other stream may send bytes.
fn sends_nothing(request: &Bound<'_, PyAny>) -> PyResult<bool> {
    let py = request.py();
    let stream = request.getattr(intern!(py, "stream"))?;
    if stream.get_type().name()?.to_str()? != "ByteStream" {
        return Ok(false);
    }
    match stream.getattr(intern!(py, "_stream")) {
        Ok(b) => Ok(b.is_exact_instance_of::<PyBytes>() && b.cast::<PyBytes>()?.as_bytes().is_empty()),
        Err(e) if e.is_instance_of::<PyAttributeError>(py) => Ok(false),
        Err(e) => Err(e),
    }
}

/// `b.isdigit()` and `int(b) <= max` of a `Content-Length` value.
fn length_within(v: &[u8], max: u64) -> bool {
    decimal(v).is_some_and(|n| n <= max)
}

#[pymethods]
impl RequestReaderPy {
    #[new]
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (plan, unit_costs, triples, token_estimator, chars_estimate, chars, estimate, *, needs_body, stream_usage, caps, max_body, replace_body=None, call=None, limiter=None))]
    fn new(
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
        call: Option<CallArgs<'_>>,
        limiter: Option<Bound<'_, LimiterPy>>,
    ) -> PyResult<Self> {
        let call = match call {
            None => None,
            Some((record, budget, options, empty, ids_module, own, constants)) => Some(CallParts {
                slots: {
                    let mut at = [0; CALL_SLOTS.len()];
                    for (a, name) in at.iter_mut().zip(CALL_SLOTS) {
                        *a = slot_offset(&record, name)?;
                    }
                    at
                },
                constants: record_constants(&record, &constants)?,
                once: slot_offset(&record, "_once")?,
                permit: slot_offset(&record, "_permit")?,
                record: record.unbind(),
                budget: budget.unbind(),
                options: options.unbind(),
                empty: empty.unbind(),
                ids_module: ids_module.unbind(),
                own: own.map(Bound::unbind),
            }),
        };
        let plan_units: Vec<String> = plan.iter().map(|(u, _, _)| u.to_string()).collect();
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
            needs_body,
            stream_usage,
            caps,
            max_body,
            call,
            limiter: match limiter {
                Some(lim) => {
                    let names = lim.get().core().units();
                    let at: Option<Vec<usize>> = plan_units.iter().map(|u| names.iter().position(|n| n == u)).collect();
                    at.filter(|at| at.len() == names.len()).map(|at| (lim.unbind(), at))
                }
                None => None,
            },
            routes: RouteMemo::default(),
        })
    }

    /// `(priority, task, account, request_id, model, estimate, costs, clamped, data,
    /// None, tokenless, bodyless)` of a request on `path` (`want_estimate`: a budget needs it; `estimator`: the
    /// transport's), or None where the Python reference must prepare it.
    fn read<'py>(
        &self,
        request: &Bound<'py, PyAny>,
        path: &Bound<'py, PyString>,
        want_estimate: bool,
        estimator: &Bound<'py, PyAny>,
    ) -> PyResult<Option<Bound<'py, PyTuple>>> {
        let py = request.py();
        let Some(r) = self.read_request(request, path, want_estimate, estimator)? else {
            return Ok(None);
        };
        let [p, t, a, id] = r.head;
        let items = [
            p,
            t,
            a,
            id,
            r.model,
            r.est,
            r.costs,
            r.clamped,
            r.data,
            py.None().into_bound(py),
            PyBool::new(py, r.tokenless).to_owned().into_any(),
            PyBool::new(py, r.bodyless).to_owned().into_any(),
        ];
        Ok(Some(PyTuple::new(py, items)?))
    }

    /// The call's record (`_Call`) of a request outside budgets and call options, its own
    /// headers removed: what `_prepare` makes, in one crossing (`priority`, `timeout`,
    /// `account`: the transport's settings; a Policy's calls are prepared in Python). None
    /// where the Python `_prepare` must make it; nothing has changed then. With the
    /// transport's Limiter (`limiter=`), a call it grants at once leaves with its permit
    /// (`_permit`; its wait, none, recorded in `wait`, when that is a `Histogram`): the
    /// transport acquires only for the others.
    #[allow(clippy::too_many_arguments)]
    fn prepare<'py>(
        &self,
        request: &Bound<'py, PyAny>,
        estimator: &Bound<'py, PyAny>,
        is_async: bool,
        priority: &Bound<'py, PyAny>,
        timeout: &Bound<'py, PyAny>,
        account: &Bound<'py, PyAny>,
        wait: &Bound<'py, PyAny>,
    ) -> PyResult<Option<Bound<'py, PyAny>>> {
        let py = request.py();
        let Some(parts) = &self.call else {
            return Ok(None);
        };
        if !account.is_exact_instance_of::<PyString>()
            || !context_get(parts.budget.bind(py))?.is_none()
            || !context_get(parts.options.bind(py))?.is(parts.empty.bind(py))
        {
            return Ok(None);
        }
        let path = url_path(request)?;
        let Some(r) = self.read_request(request, &path, false, estimator)? else {
            return Ok(None);
        };
        let [p, t, a, id] = r.head;
        if !(p.is_none() && t.is_none() && a.is_none()) {
            // As `_prepare`: each one there now is removed (Python may have run since the
            // scan, e.g. another thread while a long body was read detached).
            let headers = request.getattr(intern!(py, "headers"))?;
            for name in &parts.own {
                if headers.contains(name.bind(py))? {
                    headers.del_item(name.bind(py))?;
                }
            }
        }
        let none = || py.None().into_bound(py);
        // As `_prepare` outside call options: an empty priority or account header is
        // absent (the transport's own is used), a task header is kept as sent.
        let priority = or_else(&p, || priority.clone());
        let task = t;
        let account = or_else(&a, || account.clone());
        let id = match id.cast::<PyString>() {
            Ok(s) if s.len()? > 0 => id,
            _ => new_id(parts, py)?.into_any(),
        };
        let kw = if priority.is_none() && timeout.is_none() {
            r.costs.clone()
        } else {
            let kw = r.costs.cast::<PyDict>()?.copy()?;
            kw.set_item(intern!(py, "timeout"), timeout)?;
            if !priority.is_none() {
                kw.set_item(intern!(py, "priority"), &priority)?;
            }
            kw.into_any()
        };
        // What the grant at once asks, kept for after the record is made (only with a
        // `Histogram` to record its wait in: any other object is the Python path's).
        let grant = match (&self.limiter, wait.cast::<HistogramPy>()) {
            (Some((lim, at)), Ok(h)) => Some((lim, at, h, r.io, priority.clone())),
            _ => None,
        };
        let pending = if r.est.is_none() {
            PyTuple::new(py, [r.data, estimator.clone()])?.into_any()
        } else {
            none()
        };
        let args = [
            request.clone(),
            id,
            path.into_any(),
            r.model,
            r.est,
            none(),
            priority,
            task,
            pending,
            r.costs,
            r.clamped,
            kw,
            account,
            PyBool::new(py, is_async).to_owned().into_any(),
            PyBool::new(py, r.tokenless).to_owned().into_any(),
            PyBool::new(py, r.bodyless).to_owned().into_any(),
        ];
        // `_Call(*args)` without its `__init__` frame: the instance made empty, then its
        // slots set (every one: `record_constants` checked the names).
        let record = parts.record.bind(py);
        // SAFETY (the allocation): `record` is a live heap type of slots only (checked at
        // construction); `PyType_GenericAlloc` returns a new, zeroed, tracked instance or
        // null with an error set; its traverse and dealloc accept NULL slots.
        let once = PyList::new(py, [py.None()])?;
        let obj = unsafe { Bound::from_owned_ptr_or_err(py, pyo3::ffi::PyType_GenericAlloc(record.as_type_ptr(), 0))? };
        let base = obj.as_ptr().cast::<u8>();
        // SAFETY: each offset is one of the type's object slots (`slot_offset`), inside
        // the instance just made, and NULL there (zeroed): a slot takes the reference it
        // is given, as `PyMember_SetOne` does. Nothing runs Python between the allocation
        // and the last write.
        unsafe {
            let put = |at: isize, value: *mut pyo3::ffi::PyObject| {
                *base.offset(at).cast::<*mut pyo3::ffi::PyObject>() = value;
            };
            for (&at, value) in parts.slots.iter().zip(args) {
                put(at, value.into_ptr());
            }
            for (at, value) in &parts.constants {
                put(*at, value.clone_ref(py).into_ptr());
            }
            put(parts.once, once.into_ptr());
        }
        // Granted last, the record made: only the permit's own object can fail after it
        // (a MemoryError; the permit dropped keeps its costs charged, never more admitted).
        let Some((lim, at, h, io, priority)) = grant else {
            return Ok(Some(obj));
        };
        let mut costs = [0u64; MAX_RATES];
        for ((_, plan), &k) in self.units.iter().zip(at) {
            // As the costs read: 1 per unit without an estimate.
            costs[k] = match io {
                Some((i, o)) => match plan.cost(i, o) {
                    Ok((c, _)) => c,
                    Err(_) => return Ok(Some(obj)),
                },
                None => 1,
            };
        }
        if let Some(permit) = lim.get().grant_costs_now(py, &costs[..at.len()], &priority, timeout) {
            let permit = Bound::new(py, permit)?;
            // SAFETY: the `_permit` slot of the record made above holds a reference (None):
            // it is replaced by the permit's and released.
            unsafe {
                let at = base.offset(parts.permit).cast::<*mut pyo3::ffi::PyObject>();
                let old = std::mem::replace(&mut *at, permit.into_ptr());
                pyo3::ffi::Py_DECREF(old);
            }
            h.get().inner.record(0);
        }
        Ok(Some(obj))
    }
}

/// `prepare`'s grant on its own (`Limiter.grant_now`): the permit of `costs` when it is
/// granted at once, else None and nothing changed (the history checker's operation of it).
#[pyfunction]
pub fn _grant_now(
    limiter: &Bound<'_, LimiterPy>,
    costs: &Bound<'_, PyDict>,
    priority: &Bound<'_, PyAny>,
    timeout: &Bound<'_, PyAny>,
) -> Option<PermitPy> {
    limiter.get().grant_now(limiter.py(), costs, priority, timeout)
}

/// Request ids of this process: one counter for the native `prepare` and `_wire.new_id`
/// (never repeated while the process lives; a fork's child has another prefix).
static IDS: AtomicU64 = AtomicU64::new(1);

/// `prefix` followed by the next count in decimal.
fn next_id<'py>(py: Python<'py>, prefix: &Bound<'py, PyString>) -> PyResult<Bound<'py, PyString>> {
    let n = IDS.fetch_add(1, Ordering::Relaxed);
    let p = prefix.to_str()?;
    let mut digits = [0u8; 20];
    let mut at = digits.len();
    let mut k = n;
    loop {
        at -= 1;
        digits[at] = b'0' + (k % 10) as u8;
        k /= 10;
        if k == 0 {
            break;
        }
    }
    let mut s = String::with_capacity(p.len() + digits.len() - at);
    s.push_str(p);
    s.extend(digits[at..].iter().map(|&d| char::from(d)));
    Ok(PyString::new(py, &s))
}

/// A request id: `prefix` (the process's, `_wire._PREFIX`) and the next count.
#[pyfunction]
pub fn _next_id<'py>(py: Python<'py>, prefix: &Bound<'py, PyString>) -> PyResult<Bound<'py, PyString>> {
    next_id(py, prefix)
}

/// `_wire.new_id()`: the module's prefix (set again after a fork) and the next count.
fn new_id<'py>(parts: &CallParts, py: Python<'py>) -> PyResult<Bound<'py, PyString>> {
    let prefix = parts.ids_module.bind(py).getattr(intern!(py, "_PREFIX"))?;
    next_id(py, prefix.cast::<PyString>()?)
}

impl RequestReaderPy {
    /// What `read` gives, as Rust values (None: the Python reference prepares the call).
    fn read_request<'py>(
        &self,
        request: &Bound<'py, PyAny>,
        path: &Bound<'py, PyString>,
        want_estimate: bool,
        estimator: &Bound<'py, PyAny>,
    ) -> PyResult<Option<Read<'py>>> {
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
        // Spends none of the model's tokens: manages batches and files, or counts tokens.
        // Nothing is estimated for it, and the usage its response reports (a batch's own)
        // is not its own (`_Call._tokenless`).
        let tokenless = match path.to_str() {
            Ok(p) => self.routes.spends_no_tokens(p),
            Err(_) => path_spends_no_tokens(path),
        };
        // Sends no body (httpx's own empty stream: a GET, a DELETE, an empty POST; whatever
        // the headers or a stale `_content` say): estimated as a body not read, and settled
        // to nothing when its response reports no usage (`_Call._bodyless`).
        let bodyless = !tokenless && bytes.is_empty() && sends_nothing(request)?;
        if !needed {
            let est = if tokenless {
                pair_of(self.estimate.bind(py), 0, 0)?
            } else {
                none()
            };
            return Ok(Some(Read {
                head,
                model: none(),
                est,
                costs: self.unit_costs.bind(py).clone().into_any(),
                clamped: PyTuple::empty(py).into_any(),
                data: data_obj,
                io: None,
                tokenless,
                bodyless,
            }));
        }
        if self.caps {
            return Ok(None);
        }
        let (model, input, output) = if tokenless {
            (none(), 0, 0)
        } else {
            let Some((cpt, default)) = char_settings(self, estimator)? else {
                return Ok(None);
            };
            // No output where the route produces none (embeddings) and the body names no
            // bound.
            let route_default = || {
                if default != 0 && path_emits_no_tokens(path) {
                    0
                } else {
                    default
                }
            };
            if bytes.is_empty() {
                // A body not read (a stream): estimated without it.
                (none(), 0, route_default())
            } else {
                match read(py, bytes, request_facts) {
                    Err(_) => return Ok(None),
                    Ok(None) => (none(), 0, route_default()),
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
                        let default = if f.uses_default() { route_default() } else { default };
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
        let est = pair_of(self.estimate.bind(py), input, output)?;
        Ok(Some(Read {
            head,
            model,
            est,
            costs: costs.into_any(),
            clamped: PyTuple::new(py, clamped)?.into_any(),
            data: data_obj,
            io: Some((input, output)),
            tokenless,
            bodyless,
        }))
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<RequestReaderPy>()?;
    m.add_function(wrap_pyfunction!(_grant_now, m)?)?;
    m.add_function(wrap_pyfunction!(_next_id, m)?)
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
