//! The fast entry of `Limiter.try_acquire`: a vectorcall method over PyO3's, reading the
//! positional cost and the keywords (`kwnames`) itself, with no dict and no second call.

use std::panic::{catch_unwind, AssertUnwindSafe};

use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyBool;
use pyo3::Borrowed;

use crate::errors::{not_installed, panicked};
use crate::limiter::LimiterPy;

/// The keyword-taking `Limiter.try_acquire` (its descriptor), which the fast entry below
/// hands every call it does not decide itself.
static TRY_ACQUIRE_FULL: PyOnceLock<Py<PyAny>> = PyOnceLock::new();

/// `Limiter.try_acquire` with the vectorcall convention (a method with `**costs` gets the
/// tuple-and-dict one from PyO3): a call with at most one positional argument is decided
/// here, its keywords read from `kwnames` as the full method reads its `**costs` (same
/// results and messages); more positional arguments go to the full method for its
/// TypeError. No panic leaves it.
unsafe extern "C" fn try_acquire_fast(
    slf: *mut ffi::PyObject,
    args: *const *mut ffi::PyObject,
    nargs: ffi::Py_ssize_t,
    kwnames: *mut ffi::PyObject,
) -> *mut ffi::PyObject {
    // The common call, `lim.try_acquire()` on one unit: decided here, with only True or
    // False carried out of the unwind guard; anything else (an error to raise, several
    // units, arguments) takes the general path, out of line.
    if nargs == 0 && (kwnames.is_null() || unsafe { ffi::PyTuple_GET_SIZE(kwnames) } == 0) {
        // SAFETY: the interpreter calls a method attached. The method's descriptor (made
        // for this type in `install`) calls it only with `slf` an instance of the type
        // (CPython checks it, a TypeError otherwise, before any call of a method
        // descriptor's function), alive for the call; Limiter has no subclasses.
        let lim = unsafe { Borrowed::from_ptr(Python::assume_attached(), slf).cast_unchecked::<LimiterPy>() }.get();
        if let Some(c) = lim.default_one {
            match catch_unwind(AssertUnwindSafe(|| lim.decide_default(c))) {
                Ok(Some(ok)) => return unsafe { py_bool(ok) },
                Ok(None) => {}
                Err(_) => {
                    // SAFETY: as above.
                    panicked("Limiter.try_acquire panicked").restore(unsafe { Python::assume_attached() });
                    return std::ptr::null_mut();
                }
            }
        }
    }
    unsafe { try_acquire_general(slf, args, nargs, kwnames) }
}

/// A new reference to True or False.
///
/// # Safety
/// Called attached.
#[inline(always)]
unsafe fn py_bool(ok: bool) -> *mut ffi::PyObject {
    let b = if ok {
        unsafe { ffi::Py_True() }
    } else {
        unsafe { ffi::Py_False() }
    };
    unsafe { ffi::Py_INCREF(b) };
    b
}

/// [`try_acquire_fast`] for every call it does not decide itself.
///
/// # Safety
/// As [`try_acquire_fast`]: called attached, with its arguments.
#[cold]
#[inline(never)]
unsafe fn try_acquire_general(
    slf: *mut ffi::PyObject,
    args: *const *mut ffi::PyObject,
    nargs: ffi::Py_ssize_t,
    kwnames: *mut ffi::PyObject,
) -> *mut ffi::PyObject {
    // SAFETY: the interpreter calls a method attached, with `nargs` arguments at `args`
    // followed by one per name in `kwnames`.
    let py = unsafe { Python::assume_attached() };
    let out = catch_unwind(AssertUnwindSafe(|| -> PyResult<Py<PyAny>> {
        if nargs <= 1 {
            let obj = unsafe { Bound::from_borrowed_ptr(py, slf) };
            if let Ok(lim) = obj.cast::<LimiterPy>() {
                let lim = lim.get();
                let n = (nargs == 1).then(|| unsafe { Bound::from_borrowed_ptr(py, *args) });
                let no_keywords = kwnames.is_null() || unsafe { ffi::PyTuple_GET_SIZE(kwnames) } == 0;
                if let Some(c) = no_keywords.then(|| lim.one_cost(n.as_ref())).flatten() {
                    let ok = lim.answer(py, lim.decide_now(&[c]))?;
                    return Ok(PyBool::new(py, ok).to_owned().into_any().unbind());
                }
                // SAFETY: the keywords' values follow the `nargs` positional ones.
                let values = args.wrapping_offset(nargs);
                return unsafe { with_keywords(py, lim, n.as_ref(), values, kwnames) };
            }
        }
        let nkw = if kwnames.is_null() {
            0
        } else {
            unsafe { ffi::PyTuple_GET_SIZE(kwnames) }
        };
        // More than one positional argument: PyO3's method says so, in its words.
        let full = TRY_ACQUIRE_FULL
            .get(py)
            .ok_or_else(|| not_installed("Limiter.try_acquire is not installed"))?;
        let mut all = Vec::with_capacity(1 + (nargs + nkw) as usize);
        all.push(slf);
        // SAFETY: the interpreter's argument vector holds nargs + nkw objects.
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
            panicked("Limiter.try_acquire panicked").restore(py);
            std::ptr::null_mut()
        }
    }
}

/// A call with keywords, or with costs for several units: `values` holds one value per
/// name in `kwnames` (NULL: none), read as the full method reads its `**costs`.
///
/// # Safety
/// Called attached, with `kwnames` NULL or a tuple of names and `values` pointing at as
/// many objects.
#[inline(never)]
unsafe fn with_keywords(
    py: Python<'_>,
    lim: &LimiterPy,
    n: Option<&Bound<'_, PyAny>>,
    values: *const *mut ffi::PyObject,
    kwnames: *mut ffi::PyObject,
) -> PyResult<Py<PyAny>> {
    let nkw = if kwnames.is_null() {
        0
    } else {
        unsafe { ffi::PyTuple_GET_SIZE(kwnames) }
    };
    let named = (0..nkw).map(|i| unsafe {
        (
            Bound::from_borrowed_ptr(py, ffi::PyTuple_GET_ITEM(kwnames, i)),
            Bound::from_borrowed_ptr(py, *values.offset(i)),
        )
    });
    let ok = lim.answer(py, lim.decide_now(&lim.costs_named(n, named)?))?;
    Ok(PyBool::new(py, ok).to_owned().into_any().unbind())
}

/// Puts the fast entry of `Limiter.try_acquire` in the type, over PyO3's (kept for the
/// calls it does not decide); its doc and text signature are PyO3's.
pub fn install(py: Python<'_>) -> PyResult<()> {
    let ty = py.get_type::<LimiterPy>();
    let full = ty.getattr("try_acquire")?;
    let tp = ty.as_type_ptr();
    // SAFETY: `full` is PyO3's method descriptor of this type (its PyMethodDef is static);
    // the new one is leaked once, as a type's methods live as long as the process.
    unsafe {
        if ffi::Py_TYPE(full.as_ptr()) != std::ptr::addr_of_mut!(ffi::PyMethodDescr_Type) {
            return Err(not_installed("Limiter.try_acquire is not a method descriptor"));
        }
        let old = (*full.as_ptr().cast::<ffi::PyMethodDescrObject>()).d_method;
        let def = Box::leak(Box::new(ffi::PyMethodDef {
            ml_name: (*old).ml_name,
            ml_meth: ffi::PyMethodDefPointer {
                PyCFunctionFastWithKeywords: try_acquire_fast,
            },
            ml_flags: ffi::METH_FASTCALL | ffi::METH_KEYWORDS,
            ml_doc: (*old).ml_doc,
        }));
        let descr = Bound::from_owned_ptr_or_err(py, ffi::PyDescr_NewMethod(tp, def))?;
        let _ = TRY_ACQUIRE_FULL.set(py, full.unbind());
        let dict = (*tp).tp_dict;
        if dict.is_null() || ffi::PyDict_SetItemString(dict, c"try_acquire".as_ptr(), descr.as_ptr()) != 0 {
            return Err(PyErr::fetch(py));
        }
        ffi::PyType_Modified(tp);
    }
    Ok(())
}
