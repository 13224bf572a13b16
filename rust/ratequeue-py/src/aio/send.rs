//! The awaitables' send protocol: `am_send` (the interpreter takes an end value
//! without an exception object) and `__next__`'s StopIteration.

use super::*;
use crate::errors::{panicked, stop_iteration};

/// One step of an awaitable: it waits for this future, or it ends with this value.
pub(super) enum Step {
    Yield(Py<PyAny>),
    Return(Py<PyAny>),
}

impl Step {
    /// As `__next__` gives it: the future, or StopIteration with the value.
    pub(super) fn into_next(self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        match self {
            Step::Yield(f) => Ok(f),
            Step::Return(v) => Err(stop(py, v)),
        }
    }
}

/// `am_send` of an awaitable of type `T`: the step as a send result, so the interpreter
/// takes an end value without an exception object. No panic leaves it.
pub(super) unsafe extern "C" fn am_send<T: Stepping>(
    slf: *mut ffi::PyObject,
    _arg: *mut ffi::PyObject,
    result: *mut *mut ffi::PyObject,
) -> ffi::PySendResult {
    // SAFETY: the interpreter calls am_send attached, with a live `slf` of this slot's
    // type and a valid `result`.
    let py = unsafe { Python::assume_attached() };
    let out = catch_unwind(AssertUnwindSafe(|| {
        let obj = unsafe { Bound::from_borrowed_ptr(py, slf) };
        obj.cast::<T>().map_err(PyErr::from)?.get().step_py(py)
    }));
    let (ptr, status) = match out {
        Ok(Ok(Step::Yield(f))) => (f.into_ptr(), ffi::PySendResult::PYGEN_NEXT),
        Ok(Ok(Step::Return(v))) => (v.into_ptr(), ffi::PySendResult::PYGEN_RETURN),
        Ok(Err(e)) => {
            e.restore(py);
            (std::ptr::null_mut(), ffi::PySendResult::PYGEN_ERROR)
        }
        Err(_) => {
            panicked("a ratequeue awaitable panicked").restore(py);
            (std::ptr::null_mut(), ffi::PySendResult::PYGEN_ERROR)
        }
    };
    // SAFETY: `result` is the caller's out pointer.
    unsafe { *result = ptr };
    status
}

/// An awaitable whose steps `am_send` gives.
pub(super) trait Stepping: pyo3::PyClass<Frozen = pyo3::pyclass::boolean_struct::True> + Sync {
    fn step_py(&self, py: Python<'_>) -> PyResult<Step>;
}

impl Stepping for Ready {
    fn step_py(&self, py: Python<'_>) -> PyResult<Step> {
        Ok(Step::Return(self.value.clone_ref(py)))
    }
}

impl Stepping for AcquiringPy {
    fn step_py(&self, py: Python<'_>) -> PyResult<Step> {
        self.step(py)
    }
}

pub(super) fn install_send<T: Stepping>(py: Python<'_>) -> PyResult<()> {
    let tp = py.get_type::<T>().as_type_ptr();
    // SAFETY: a heap type of this module, attached; its async methods are its own.
    unsafe {
        let am = (*tp).tp_as_async;
        if am.is_null() {
            return Err(PyErr::fetch(py));
        }
        (*am).am_send = Some(am_send::<T>);
        ffi::PyType_Modified(tp);
    }
    Ok(())
}

/// Gives the awaitables their `am_send` slot (PyO3 has no attribute for it).
pub fn install(py: Python<'_>) -> PyResult<()> {
    install_send::<Ready>(py)?;
    install_send::<AcquiringPy>(py)
}

/// `StopIteration(value)`: the end of an awaitable with its result.
pub(super) fn stop(py: Python<'_>, value: Py<PyAny>) -> PyErr {
    let _ = py;
    stop_iteration(value)
}
