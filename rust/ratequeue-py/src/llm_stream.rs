//! A streamed JSON response body read natively as it passes (the transport's common
//! path over a network): its chunks kept (no copy; none past `max_body`) and the call
//! settled at the end of the body or on a close, by the same settle as a body that was
//! here, or handed to the Python reference where that settle defers.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, PoisonError};

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyIterator, PyList, PyTuple, PyType};
use pyo3::{ffi, intern};

use crate::llm_settle::{settle_body, Settled};

/// What has passed of the body.
#[derive(Default)]
struct Body {
    chunks: Vec<Py<PyBytes>>,
    size: usize,
    /// Past `max_body`: the usage cannot be read, nothing more is kept.
    over: bool,
    /// `finish` ran: nothing more is kept.
    finished: bool,
}

/// A call's streamed body (ratequeue.httpx only): `feed` each chunk, `finish` at its end
/// or on close (settles once; again: nothing).
#[pyclass(frozen, name = "_BodyReader", module = "ratequeue._ratequeue")]
pub struct BodyReaderPy {
    call: Py<PyAny>,
    once: Py<PyList>,
    permit: Py<PyAny>,
    charged: Py<PyDict>,
    plan: Py<PyTuple>,
    usage_type: Py<PyType>,
    transport: Py<PyAny>,
    max_body: usize,
    body: Mutex<Body>,
}

impl BodyReaderPy {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        call: &Bound<'_, PyAny>,
        once: &Bound<'_, PyList>,
        permit: &Bound<'_, PyAny>,
        charged: &Bound<'_, PyDict>,
        plan: &Bound<'_, PyTuple>,
        max_body: usize,
        usage_type: &Bound<'_, PyType>,
        transport: &Bound<'_, PyAny>,
    ) -> Self {
        Self {
            call: call.clone().unbind(),
            once: once.clone().unbind(),
            permit: permit.clone().unbind(),
            charged: charged.clone().unbind(),
            plan: plan.clone().unbind(),
            usage_type: usage_type.clone().unbind(),
            transport: transport.clone().unbind(),
            max_body,
            body: Mutex::new(Body::default()),
        }
    }

    /// The body, for this thread alone while the guard lives (no Python runs under it).
    fn body(&self) -> std::sync::MutexGuard<'_, Body> {
        self.body.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[pymethods]
impl BodyReaderPy {
    /// Keeps a chunk (a `bytes` as it is; another buffer copied) until the body passes
    /// `max_body`; nothing once finished.
    fn feed(&self, chunk: &Bound<'_, PyAny>) -> PyResult<()> {
        let chunk = match chunk.cast::<PyBytes>() {
            Ok(b) => b.clone(),
            // SAFETY: `chunk` is a live object; the result is a new reference or null
            // with an error set.
            Err(_) => unsafe { Bound::from_owned_ptr_or_err(chunk.py(), ffi::PyBytes_FromObject(chunk.as_ptr()))? }
                .cast_into::<PyBytes>()?,
        };
        let n = chunk.as_bytes().len();
        let dropped = {
            let mut body = self.body();
            if body.finished || body.over || n == 0 {
                return Ok(());
            }
            body.size = body.size.saturating_add(n);
            if body.size > self.max_body {
                body.over = true;
                std::mem::take(&mut body.chunks)
            } else {
                body.chunks.push(chunk.unbind());
                Vec::new()
            }
        };
        drop(dropped);
        Ok(())
    }

    /// Settles the call from what was kept (once; later calls do nothing): natively, or by
    /// the transport's `_stream_deferred(call, body)` where the native settle defers.
    fn finish(&self, py: Python<'_>) -> PyResult<()> {
        let (chunks, over) = {
            let mut body = self.body();
            if body.finished {
                return Ok(());
            }
            body.finished = true;
            (std::mem::take(&mut body.chunks), body.over)
        };
        let once = self.once.bind(py);
        if once.is_empty() {
            return Ok(()); // settled already (a cancel, a failure)
        }
        let body = match chunks.len() {
            _ if over => None,
            0 => None,
            1 => chunks.into_iter().next().map(|c| c.into_bound(py)),
            _ => {
                let total = chunks.iter().map(|c| c.bind(py).as_bytes().len()).sum();
                Some(PyBytes::new_with(py, total, |buf| {
                    let mut at = 0;
                    for c in &chunks {
                        let b = c.bind(py).as_bytes();
                        buf[at..at + b.len()].copy_from_slice(b);
                        at += b.len();
                    }
                    Ok(())
                })?)
            }
        };
        let call = self.call.bind(py);
        let kept = body.clone();
        let settled = settle_body(
            py,
            call,
            once,
            self.permit.bind(py),
            self.charged.bind(py),
            self.plan.bind(py),
            body.as_ref(),
            self.max_body,
            None,
            self.usage_type.bind(py),
        )
        .and_then(|settled| match settled {
            Settled::Done => Ok(()),
            Settled::Deferred => {
                let body = body.map_or_else(|| py.None().into_bound(py), Bound::into_any);
                self.transport
                    .bind(py)
                    .call_method1(intern!(py, "_stream_deferred"), (call, body))
                    .map(drop)
            }
        });
        if settled.is_err() && !once.is_empty() {
            // Not settled (a Ctrl-C, a failure before the settle): unfinished again, with
            // the body read, so that the stream's close or drop settles it.
            let mut b = self.body();
            b.finished = false;
            b.chunks = kept.into_iter().map(Bound::unbind).collect();
        }
        settled
    }

    /// An iterator over `inner` that feeds each chunk and finishes at its end; it keeps
    /// `owner` (the stream it iterates for) alive while it lives, so that the owner's
    /// finalizer runs only once nothing can feed the reader any more.
    fn iterate(slf: &Bound<'_, Self>, inner: &Bound<'_, PyAny>, owner: &Bound<'_, PyAny>) -> PyResult<BodyIterPy> {
        Ok(BodyIterPy {
            inner: inner.try_iter()?.unbind(),
            reader: slf.clone().unbind(),
            _owner: owner.clone().unbind(),
            ended: AtomicBool::new(false),
        })
    }

    /// `finish` ran (or began): the body ended, was closed or cut.
    #[getter]
    fn finished(&self) -> bool {
        self.body().finished
    }

    /// The call this body settles.
    #[getter]
    fn call(&self, py: Python<'_>) -> Py<PyAny> {
        self.call.clone_ref(py)
    }

    /// The transport that made the call.
    #[getter]
    fn transport(&self, py: Python<'_>) -> Py<PyAny> {
        self.transport.clone_ref(py)
    }
}

/// Iterates a stream's chunks through its [`BodyReaderPy`]; no lock is held while the
/// inner stream is asked for a chunk (it may wait on a socket; another thread may close).
#[pyclass(frozen, name = "_BodyIter", module = "ratequeue._ratequeue")]
pub struct BodyIterPy {
    inner: Py<PyIterator>,
    reader: Py<BodyReaderPy>,
    _owner: Py<PyAny>,
    ended: AtomicBool,
}

#[pymethods]
impl BodyIterPy {
    fn __iter__(slf: Bound<'_, Self>) -> Bound<'_, Self> {
        slf
    }

    /// The next chunk, fed to the reader; at the end the reader finishes; after the end
    /// or an error of the inner stream: nothing more (as a generator).
    fn __next__<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyAny>>> {
        if self.ended.load(Ordering::Acquire) {
            return Ok(None);
        }
        let mut inner = self.inner.bind(py).clone();
        match inner.next() {
            Some(Ok(chunk)) => {
                self.reader.get().feed(&chunk)?;
                Ok(Some(chunk))
            }
            Some(Err(e)) => {
                self.ended.store(true, Ordering::Release);
                Err(e)
            }
            None => {
                if self.ended.swap(true, Ordering::AcqRel) {
                    return Ok(None);
                }
                self.reader.get().finish(py)?;
                Ok(None)
            }
        }
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<BodyReaderPy>()?;
    m.add_class::<BodyIterPy>()?;
    Ok(())
}
