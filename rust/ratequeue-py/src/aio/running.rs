//! The running event loop and its table of waiting futures, found once per loop and
//! thread (asyncio's own record read without a system call where it is safe).

use super::*;
use crate::errors::aio_not_ready;

pub(super) static RUNNING_WAITERS: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
pub(super) static GET_RUNNING_LOOP: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
pub(super) static FUTURE: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
pub(super) static BASE_CREATE_FUTURE: PyOnceLock<Py<PyAny>> = PyOnceLock::new();

/// The last running loop this thread asked for and its waiters (both weak), in the
/// fork generation they were found in.
pub(super) struct LastLoop {
    generation: u64,
    event_loop: Py<PyWeakrefReference>,
    waiters: Py<PyWeakrefReference>,
    /// The loop makes its futures as asyncio's base loop does (`Future(loop=loop)`).
    plain: bool,
}

thread_local! {
    static LAST_LOOP: RefCell<Option<LastLoop>> = const { RefCell::new(None) };
}

/// True when `event_loop` makes its futures with asyncio's base `create_future`.
pub(super) fn plain_futures(py: Python<'_>, event_loop: &Bound<'_, PyAny>) -> PyResult<bool> {
    let base = BASE_CREATE_FUTURE.get_or_try_init(py, || {
        py.import("asyncio.base_events")?
            .getattr("BaseEventLoop")?
            .getattr("create_future")
            .map(Bound::unbind)
    })?;
    Ok(event_loop.get_type().getattr(intern!(py, "create_future"))?.is(base))
}

pub(super) type Running<'py> = (Bound<'py, PyAny>, Bound<'py, LoopWaitersPy>, bool);

/// asyncio's C holder of a thread's running loop on CPython 3.11.
#[repr(C)]
pub(super) struct RunningLoopHolder {
    ob_base: ffi::PyObject,
    rl_loop: *mut ffi::PyObject,
}

/// The loop asyncio's accelerator holds as running in this thread, read where its own
/// reader makes a getpid system call per read (CPython 3.11; the fork generation guards
/// the cache instead); None elsewhere, or when no such holder is found.
pub(super) fn held_running_loop(py: Python<'_>) -> Option<*mut ffi::PyObject> {
    static ON_311: PyOnceLock<bool> = PyOnceLock::new();
    static HOLDER_KEY: PyOnceLock<Py<PyString>> = PyOnceLock::new();
    if !*ON_311.get_or_init(py, || py.version_info() >= (3, 11) && py.version_info() < (3, 12)) {
        return None;
    }
    let key = HOLDER_KEY.get_or_init(py, || PyString::intern(py, "__asyncio_running_event_loop__").unbind());
    // SAFETY: attached; the thread's dict and its items are borrowed only for this read,
    // and a `_RunningLoopHolder` (checked by its type's name) starts with its loop.
    unsafe {
        let d = ffi::PyThreadState_GetDict();
        if d.is_null() {
            return None;
        }
        let h = ffi::PyDict_GetItemWithError(d, key.as_ptr());
        if h.is_null() {
            if !ffi::PyErr_Occurred().is_null() {
                ffi::PyErr_Clear();
            }
            return None;
        }
        let name = std::ffi::CStr::from_ptr((*ffi::Py_TYPE(h)).tp_name);
        (name == c"_RunningLoopHolder").then(|| (*h.cast::<RunningLoopHolder>()).rl_loop)
    }
}

/// The running loop, its waiters and whether it makes plain futures: from this thread's
/// last answer when it is the same loop, else from ratequeue.aio (which makes the loop's
/// channel on first use).
pub(super) fn running_waiters(py: Python<'_>) -> PyResult<Running<'_>> {
    let generation = ratequeue_core::fork::generation();
    let cached = LAST_LOOP.with(|c| {
        let c = c.borrow();
        let last = c.as_ref().filter(|l| l.generation == generation)?;
        Some((
            last.event_loop.bind(py).upgrade()?,
            last.waiters.bind(py).upgrade()?,
            last.plain,
        ))
    });
    let lp = match &cached {
        Some((l, _, _)) if held_running_loop(py) == Some(l.as_ptr()) => l.clone(),
        _ => GET_RUNNING_LOOP
            .import(py, "asyncio.events", "_get_running_loop")?
            .call0()?,
    };
    if let Some((l, w, plain)) = cached {
        if !lp.is_none() && l.is(&lp) {
            if let Ok(w) = w.cast_into::<LoopWaitersPy>() {
                return Ok((lp, w, plain));
            }
        }
    }
    let pair = RUNNING_WAITERS.get(py).ok_or_else(aio_not_ready)?.bind(py).call0()?;
    let (event_loop, waiters): (Bound<'_, PyAny>, Bound<'_, LoopWaitersPy>) = pair.extract()?;
    let plain = plain_futures(py, &event_loop)?;
    let last = LastLoop {
        generation,
        event_loop: PyWeakrefReference::new(&event_loop)?.unbind(),
        waiters: PyWeakrefReference::new(&waiters)?.unbind(),
        plain,
    };
    LAST_LOOP.with(|c| c.replace(Some(last)));
    Ok((event_loop, waiters, plain))
}
