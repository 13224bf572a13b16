//! Vectorcall entries of `Limiter.acquire`, `Limiter.acquire_async`, `Permit.settle` and
//! `Policy.acquire` over PyO3's: a method with `**costs` gets the tuple-and-dict convention from PyO3
//! (a dict built per call, then read again); these read the keywords from `kwnames`
//! beside their values, and hand a call with too many positional arguments to PyO3's
//! method for its TypeError. Same checks, same results, same messages.

use std::panic::{catch_unwind, AssertUnwindSafe};

use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyString, PyType};
use pyo3::{intern, Borrowed};

use crate::errors::{not_installed, panicked};
use crate::limiter::LimiterPy;
use crate::policy::PolicyPy;
use crate::waiting::{GatePy, PermitPy};

/// A call's keywords: the names (`kwnames`, a tuple of str) and their values.
#[derive(Clone, Copy)]
pub(crate) struct Keywords<'py> {
    py: Python<'py>,
    names: *mut ffi::PyObject,
    values: *const *mut ffi::PyObject,
}

impl<'py> Keywords<'py> {
    fn len(&self) -> isize {
        if self.names.is_null() {
            0
        } else {
            // SAFETY: a non-null `kwnames` is a tuple.
            unsafe { ffi::PyTuple_GET_SIZE(self.names) }
        }
    }

    /// (name, value) per keyword, in the call's order.
    pub(crate) fn iter(self) -> impl Iterator<Item = (Bound<'py, PyAny>, Bound<'py, PyAny>)> {
        (0..self.len()).map(move |i| unsafe {
            // SAFETY: `values` holds one object per name, alive for the call.
            (
                Bound::from_borrowed_ptr(self.py, ffi::PyTuple_GET_ITEM(self.names, i)),
                Bound::from_borrowed_ptr(self.py, *self.values.offset(i)),
            )
        })
    }
}

/// True when the keyword `k` is `name` (an interned name first by identity, as the
/// interpreter passes the names written in a call).
fn is_named(k: &Bound<'_, PyAny>, interned: &Bound<'_, PyString>, name: &str) -> bool {
    k.is(interned) || k.cast::<PyString>().is_ok_and(|s| s.to_str().is_ok_and(|s| s == name))
}

/// A method body: the instance, its positional argument (at most one), its keywords.
type Body =
    for<'py> fn(Python<'py>, &Bound<'py, PyAny>, Option<&Bound<'py, PyAny>>, Keywords<'py>) -> PyResult<Py<PyAny>>;

/// Runs `body` for a vectorcall with at most `positional` positional arguments; more go
/// to PyO3's method (`full`), which raises its TypeError. No panic leaves it.
///
/// # Safety
/// Called by the interpreter, attached, with `nargs` arguments at `args` followed by one
/// per name in `kwnames`.
unsafe fn fast_call(
    slf: *mut ffi::PyObject,
    args: *const *mut ffi::PyObject,
    nargs: ffi::Py_ssize_t,
    kwnames: *mut ffi::PyObject,
    (full, what, positional): (&PyOnceLock<Py<PyAny>>, &'static str, isize),
    body: Body,
) -> *mut ffi::PyObject {
    let py = unsafe { Python::assume_attached() };
    let out = catch_unwind(AssertUnwindSafe(|| -> PyResult<Py<PyAny>> {
        let kw = Keywords {
            py,
            names: kwnames,
            values: args.wrapping_offset(nargs),
        };
        if nargs <= positional {
            let obj = unsafe { Borrowed::from_ptr(py, slf) };
            // As PyO3 reads an optional argument: None is the argument left out.
            let n = (nargs == 1)
                .then(|| unsafe { Bound::from_borrowed_ptr(py, *args) })
                .filter(|n| !n.is_none());
            return body(py, &obj, n.as_ref(), kw);
        }
        let full = full.get(py).ok_or_else(|| not_installed(what))?;
        let nkw = kw.len();
        let mut all = Vec::with_capacity(1 + (nargs + nkw) as usize);
        all.push(slf);
        // SAFETY: the argument vector holds nargs + nkw objects.
        all.extend_from_slice(unsafe { std::slice::from_raw_parts(args, (nargs + nkw) as usize) });
        let r = unsafe { ffi::PyObject_Vectorcall(full.as_ptr(), all.as_ptr(), (nargs + 1) as usize, kwnames) };
        unsafe { Bound::from_owned_ptr_or_err(py, r) }.map(Bound::unbind)
    }));
    match out {
        Ok(Ok(v)) => v.into_ptr(),
        Ok(Err(e)) => {
            e.restore(py);
            std::ptr::null_mut()
        }
        Err(_) => {
            panicked(what).restore(py);
            std::ptr::null_mut()
        }
    }
}

/// Acquire's arguments as PyO3's signature reads them: `priority=` and `timeout=` (None
/// as absent), every other keyword a unit's cost; checked in PyO3's method's order
/// (costs, priority, timeout).
fn acquire_args<'py>(
    py: Python<'py>,
    lim: &LimiterPy,
    n: Option<&Bound<'py, PyAny>>,
    kw: Keywords<'py>,
) -> PyResult<(crate::limiter::Costs, usize, Option<u64>)> {
    let (p_name, t_name) = (intern!(py, "priority"), intern!(py, "timeout"));
    let (mut priority, mut timeout) = (None, None);
    let costs = lim.costs_named(
        n,
        kw.iter().filter(|(k, v)| {
            if lim.unit_names.iter().any(|u| u.as_ptr() == k.as_ptr()) {
                true // a unit (never named like these keywords)
            } else if is_named(k, p_name, "priority") {
                priority = Some(v.clone()).filter(|v| !v.is_none());
                false
            } else if is_named(k, t_name, "timeout") {
                timeout = Some(v.clone()).filter(|v| !v.is_none());
                false
            } else {
                true
            }
        }),
    )?;
    let class = lim.gate.class(priority.as_ref())?;
    let timeout_ns = lim.gate.timeout(timeout.as_ref())?;
    Ok((costs, class, timeout_ns))
}

fn acquire_body<'py>(
    py: Python<'py>,
    slf: &Bound<'py, PyAny>,
    n: Option<&Bound<'py, PyAny>>,
    kw: Keywords<'py>,
) -> PyResult<Py<PyAny>> {
    let lim = slf.cast::<LimiterPy>()?.get();
    let (c, class, timeout_ns) = acquire_args(py, lim, n, kw)?;
    let units = lim.core.units().len();
    let permit = lim.gate.acquire(py, &c[..units], class, timeout_ns)?;
    Ok(Py::new(py, permit)?.into_any())
}

fn acquire_async_body<'py>(
    py: Python<'py>,
    slf: &Bound<'py, PyAny>,
    n: Option<&Bound<'py, PyAny>>,
    kw: Keywords<'py>,
) -> PyResult<Py<PyAny>> {
    let lim = slf.cast::<LimiterPy>()?.get();
    let (c, class, timeout_ns) = acquire_args(py, lim, n, kw)?;
    let units = lim.core.units().len();
    crate::waiting::acquire_async(py, &lim.gate, &c[..units], class, timeout_ns)
}

fn settle_body<'py>(
    py: Python<'py>,
    slf: &Bound<'py, PyAny>,
    _n: Option<&Bound<'py, PyAny>>,
    kw: Keywords<'py>,
) -> PyResult<Py<PyAny>> {
    slf.cast::<PermitPy>()?.get().settle_named(kw.iter())?;
    Ok(py.None())
}

fn policy_acquire_body<'py>(
    py: Python<'py>,
    slf: &Bound<'py, PyAny>,
    _n: Option<&Bound<'py, PyAny>>,
    kw: Keywords<'py>,
) -> PyResult<Py<PyAny>> {
    let pol = slf.cast::<PolicyPy>()?.get();
    let t_name = intern!(py, "timeout");
    let mut timeout = None;
    // As PyO3's method: the levels' keywords first, then `timeout=` (None as absent).
    let args = pol.args_named(kw.iter().filter(|(k, v)| {
        let own = is_named(k, t_name, "timeout");
        if own {
            timeout = Some(v.clone()).filter(|v| !v.is_none());
        }
        !own
    }))?;
    Ok(Py::new(py, pol.acquire_args(py, args, timeout.as_ref())?)?.into_any())
}

static POLICY_ACQUIRE: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
static ACQUIRE: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
static ACQUIRE_ASYNC: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
static SETTLE: PyOnceLock<Py<PyAny>> = PyOnceLock::new();

unsafe extern "C" fn acquire_fast(
    slf: *mut ffi::PyObject,
    args: *const *mut ffi::PyObject,
    nargs: ffi::Py_ssize_t,
    kwnames: *mut ffi::PyObject,
) -> *mut ffi::PyObject {
    let how = (&ACQUIRE, "Limiter.acquire", 1);
    unsafe { fast_call(slf, args, nargs, kwnames, how, acquire_body) }
}

unsafe extern "C" fn acquire_async_fast(
    slf: *mut ffi::PyObject,
    args: *const *mut ffi::PyObject,
    nargs: ffi::Py_ssize_t,
    kwnames: *mut ffi::PyObject,
) -> *mut ffi::PyObject {
    let how = (&ACQUIRE_ASYNC, "Limiter.acquire_async", 1);
    unsafe { fast_call(slf, args, nargs, kwnames, how, acquire_async_body) }
}

unsafe extern "C" fn settle_fast(
    slf: *mut ffi::PyObject,
    args: *const *mut ffi::PyObject,
    nargs: ffi::Py_ssize_t,
    kwnames: *mut ffi::PyObject,
) -> *mut ffi::PyObject {
    let how = (&SETTLE, "Permit.settle", 0);
    unsafe { fast_call(slf, args, nargs, kwnames, how, settle_body) }
}

unsafe extern "C" fn policy_acquire_fast(
    slf: *mut ffi::PyObject,
    args: *const *mut ffi::PyObject,
    nargs: ffi::Py_ssize_t,
    kwnames: *mut ffi::PyObject,
) -> *mut ffi::PyObject {
    let how = (&POLICY_ACQUIRE, "Policy.acquire", 0);
    unsafe { fast_call(slf, args, nargs, kwnames, how, policy_acquire_body) }
}

type Entry = unsafe extern "C" fn(
    *mut ffi::PyObject,
    *const *mut ffi::PyObject,
    ffi::Py_ssize_t,
    *mut ffi::PyObject,
) -> *mut ffi::PyObject;

/// Puts `entry` in `ty` as its method `name`, over PyO3's (kept in `full` for the calls
/// the entry hands it); its doc and text signature are PyO3's.
fn install_one(
    py: Python<'_>,
    ty: &Bound<'_, PyType>,
    name: &'static std::ffi::CStr,
    entry: Entry,
    full: &PyOnceLock<Py<PyAny>>,
) -> PyResult<()> {
    let old_descr = ty.getattr(name.to_str().expect("ASCII name"))?;
    let tp = ty.as_type_ptr();
    // SAFETY: `old_descr` is PyO3's method descriptor of this type (its PyMethodDef is
    // static); the new one is leaked once, as a type's methods live as long as the process.
    unsafe {
        if ffi::Py_TYPE(old_descr.as_ptr()) != std::ptr::addr_of_mut!(ffi::PyMethodDescr_Type) {
            return Err(not_installed("a fast entry's method is not a method descriptor"));
        }
        let old = (*old_descr.as_ptr().cast::<ffi::PyMethodDescrObject>()).d_method;
        let def = Box::leak(Box::new(ffi::PyMethodDef {
            ml_name: (*old).ml_name,
            ml_meth: ffi::PyMethodDefPointer {
                PyCFunctionFastWithKeywords: entry,
            },
            ml_flags: ffi::METH_FASTCALL | ffi::METH_KEYWORDS,
            ml_doc: (*old).ml_doc,
        }));
        let descr = Bound::from_owned_ptr_or_err(py, ffi::PyDescr_NewMethod(tp, def))?;
        let _ = full.set(py, old_descr.unbind());
        let dict = (*tp).tp_dict;
        if dict.is_null() || ffi::PyDict_SetItemString(dict, name.as_ptr(), descr.as_ptr()) != 0 {
            return Err(PyErr::fetch(py));
        }
        ffi::PyType_Modified(tp);
    }
    Ok(())
}

/// Installs the fast entries of `Limiter.acquire`, `Limiter.acquire_async`,
/// `Permit.settle` and `Policy.acquire`.
pub fn install(py: Python<'_>) -> PyResult<()> {
    let lim = py.get_type::<LimiterPy>();
    install_one(py, &lim, c"acquire", acquire_fast, &ACQUIRE)?;
    install_one(py, &lim, c"acquire_async", acquire_async_fast, &ACQUIRE_ASYNC)?;
    install_one(py, &py.get_type::<PermitPy>(), c"settle", settle_fast, &SETTLE)?;
    install_one(
        py,
        &py.get_type::<PolicyPy>(),
        c"acquire",
        policy_acquire_fast,
        &POLICY_ACQUIRE,
    )
}
