//! The awaitable that is already done (the fast path of acquire_async, a policy granted at
//! once, every `__aexit__`), and how an exception thrown into an awaitable is raised.

use super::*;

/// An awaitable that is already done; with a permit, also an async context manager
/// that releases it on exit.
#[pyclass(frozen, module = "ratequeue")]
pub struct Ready {
    pub(super) value: Py<PyAny>,
}

impl Ready {
    /// Already done with `value`.
    pub fn new(value: Py<PyAny>) -> Ready {
        Ready { value }
    }
}

#[pymethods]
impl Ready {
    fn __await__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __iter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __next__(&self, py: Python<'_>) -> PyResult<()> {
        Err(stop(py, self.value.clone_ref(py)))
    }

    /// Coroutine protocol (so `asyncio.create_task` accepts it): done at once.
    fn send(&self, py: Python<'_>, _value: &Bound<'_, PyAny>) -> PyResult<()> {
        self.__next__(py)
    }

    /// Coroutine protocol: raises what is thrown in (nothing runs inside).
    #[pyo3(signature = (typ, val = None, _tb = None))]
    fn throw(
        &self,
        typ: &Bound<'_, PyAny>,
        val: Option<&Bound<'_, PyAny>>,
        _tb: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Py<PyAny>> {
        Err(thrown(typ, val))
    }

    /// Coroutine protocol: nothing to close.
    fn close(&self) {}

    fn __aenter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_exc))]
    fn __aexit__(&self, py: Python<'_>, _exc: &Bound<'_, PyTuple>) -> PyResult<Py<Ready>> {
        if let Ok(p) = self.value.bind(py).cast::<PermitPy>() {
            p.get().release();
        }
        done_false(py)
    }
}

/// The exception `throw(typ, val)` raises: `val` if given, else `typ` (an instance, or a
/// class to instantiate).
pub(super) fn thrown(typ: &Bound<'_, PyAny>, val: Option<&Bound<'_, PyAny>>) -> PyErr {
    let e = match val.filter(|v| !v.is_none()) {
        Some(v) => v.clone(),
        None if typ.is_instance_of::<pyo3::types::PyType>() => match typ.call0() {
            Ok(e) => e,
            Err(e) => return e,
        },
        None => typ.clone(),
    };
    PyErr::from_value(e)
}

/// The awaitable every `__aexit__` returns: done, False (exceptions propagate). Shared:
/// awaiting it changes nothing.
pub(super) fn done_false(py: Python<'_>) -> PyResult<Py<Ready>> {
    static DONE: PyOnceLock<Py<Ready>> = PyOnceLock::new();
    DONE.get_or_try_init(py, || {
        Py::new(
            py,
            Ready {
                value: false.into_pyobject(py)?.to_owned().into_any().unbind(),
            },
        )
    })
    .map(|r| r.clone_ref(py))
}
