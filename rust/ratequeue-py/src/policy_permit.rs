//! Python PolicyPermit (what a policy granted: released, settled or cancelled as one)
//! and PolicyAcquiring (the awaitable of `Policy.acquire_async`, whose waits
//! ratequeue.aio bridges to the running loop; the core decides every step).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyString, PyTuple};
use ratequeue_core::policy::{Finished, Held, PolicyAcquire};
use ratequeue_core::{AnyClock, LevelArgs, Policy};

use crate::errors::{aio_not_ready, unexpected_keyword};
use crate::keywords::plain_cost;
use crate::policy::PolicyPy;
use crate::waiting::Ready;

/// What a policy granted: a context manager that returns concurrency permits on exit;
/// `settle` corrects estimated costs on every rate level.
#[pyclass(frozen, name = "PolicyPermit", module = "ratequeue")]
pub struct PolicyPermitPy {
    policy: Arc<Policy>,
    units: Arc<[Vec<String>]>,
    state: Mutex<(Vec<LevelArgs>, Vec<Held>)>,
    delay_ns: u64,
    /// The time every level holds it, on the policy's clock.
    granted_at_ns: u64,
    released: AtomicBool,
    clock: AnyClock,
    /// The fork generation it was granted in: in a forked child every permit starts
    /// free, so one from before the fork gives nothing back there.
    fork_gen: u64,
}

impl PolicyPermitPy {
    /// What `policy` granted: `held` for `args` (units named per level), `delay_ns`
    /// after the call that read `clock` at `start_ns`.
    pub fn new(
        policy: Arc<Policy>,
        units: Arc<[Vec<String>]>,
        (args, held): (Vec<LevelArgs>, Vec<Held>),
        (start_ns, delay_ns): (u64, u64),
        clock: AnyClock,
    ) -> PolicyPermitPy {
        PolicyPermitPy {
            policy,
            units,
            state: Mutex::new((args, held)),
            delay_ns,
            granted_at_ns: start_ns.saturating_add(delay_ns),
            released: AtomicBool::new(false),
            clock,
            fork_gen: ratequeue_core::fork::generation(),
        }
    }

    /// `release`: the concurrency permits given back, once (True if this call did); the
    /// GIL is released meanwhile (the permit's lock and the queues' are taken without it).
    fn release_slots(&self, py: Python<'_>) -> bool {
        if self.released.swap(true, Ordering::AcqRel) {
            return false;
        }
        if self.fork_gen != ratequeue_core::fork::generation() {
            return true;
        }
        py.detach(|| {
            let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
            for (i, h) in st.1.iter_mut().enumerate() {
                self.policy.release(i, h);
            }
        });
        true
    }

    /// Gives back everything by each level's one undo rule (see `Policy::undo`), once,
    /// waking the levels' queues; the GIL is released meanwhile (the permit's lock and
    /// the queues' are taken without it).
    pub fn cancel(&self, py: Python<'_>) {
        if self.released.swap(true, Ordering::AcqRel) || self.fork_gen != ratequeue_core::fork::generation() {
            return;
        }
        py.detach(|| {
            let now = self.clock.now_ns();
            let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
            let (args, held) = &mut *st;
            self.policy.undo_all(held, args, now);
        });
    }
}

#[pymethods]
impl PolicyPermitPy {
    /// Seconds from the call to the time every level holds it (0.0: at once).
    #[getter]
    fn delay(&self) -> f64 {
        self.delay_ns as f64 / 1e9
    }

    /// The time every level holds it, in nanoseconds of the policy's clock: the call's
    /// own clock reading plus `delay` (exact, whatever the clock did meanwhile).
    #[getter]
    fn granted_at_ns(&self) -> u64 {
        self.granted_at_ns
    }

    /// True once released or cancelled.
    #[getter]
    fn released(&self) -> bool {
        self.released.load(Ordering::Acquire)
    }

    /// Returns the concurrency permits (rate capacity stays used); only the first call
    /// has an effect. Returns True if this call released.
    fn release(&self, py: Python<'_>) -> bool {
        self.release_slots(py)
    }

    /// Gives back everything taken, once: each rate exactly where nothing came after
    /// it, else refunded while no grant is scheduled ahead, else kept; permits returned.
    #[pyo3(name = "cancel")]
    fn cancel_py(&self, py: Python<'_>) {
        self.cancel(py);
    }

    /// Corrects estimated costs (keywords per unit) on every rate level that counts
    /// them: refunds (never past the burst) or charges the overage (possibly debt).
    #[pyo3(signature = (**kw))]
    fn settle(&self, py: Python<'_>, kw: Option<&Bound<'_, PyDict>>) -> PyResult<()> {
        let mut given: Vec<(usize, usize, u64)> = Vec::new();
        if let Some(d) = kw {
            for (k, v) in d.iter() {
                let k = k.cast_into::<PyString>()?;
                let name = k.to_str()?;
                let c = plain_cost(name, &v)?;
                let mut found = false;
                for (i, units) in self.units.iter().enumerate() {
                    if let Some(j) = units.iter().position(|u| u == name) {
                        given.push((i, j, c));
                        found = true;
                    }
                }
                if !found {
                    return Err(unexpected_keyword(name, "no level counts it"));
                }
            }
        }
        py.detach(|| {
            let now = self.clock.now_ns();
            let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
            let (args, held) = &mut *st;
            let mut actual = args.clone();
            for (i, j, c) in given {
                actual[i].costs[j] = c;
            }
            self.policy.settle(held, args, &actual, now);
            *args = actual;
        });
        Ok(())
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_exc))]
    fn __exit__(&self, py: Python<'_>, _exc: &Bound<'_, PyTuple>) -> bool {
        self.release(py);
        false
    }

    fn __repr__(&self) -> String {
        format!("PolicyPermit(delay={}, released={})", self.delay(), self.released())
    }
}

/// What `Policy.acquire_async` returns: await it for a PolicyPermit, or use `async
/// with`. The core decides every step (`PolicyAcquire`); ratequeue.aio only bridges its
/// waits to the running event loop.
#[pyclass(frozen, name = "PolicyAcquiring", module = "ratequeue")]
pub struct PolicyAcquiringPy {
    policy: Py<PolicyPy>,
    core: Arc<PolicyAcquire>,
    permit: OnceLock<Py<PolicyPermitPy>>,
    /// True once awaited: the permit is the caller's from then on.
    awaited: AtomicBool,
    /// Nanoseconds from the final step to the rate levels' common time.
    left_ns: AtomicU64,
}

impl PolicyAcquiringPy {
    /// The acquire `core` of `policy`; `permit`: what its fast path granted at once.
    pub fn new(policy: Py<PolicyPy>, core: Arc<PolicyAcquire>, permit: Option<Py<PolicyPermitPy>>) -> Self {
        let cell = OnceLock::new();
        if let Some(p) = permit {
            let _ = cell.set(p);
        }
        PolicyAcquiringPy {
            policy,
            core,
            permit: cell,
            awaited: AtomicBool::new(false),
            left_ns: AtomicU64::new(0),
        }
    }

    /// The core acquire.
    pub fn core(&self) -> &Arc<PolicyAcquire> {
        &self.core
    }
}

impl Drop for PolicyPermitPy {
    /// Dropped unreleased (never released, or lost to an interrupt as `acquire`
    /// returned it), its concurrency permits go back: a slot is never lost for good.
    /// Not while the interpreter shuts down (attaching then would abort the process on
    /// Python 3.13+): the process is ending.
    fn drop(&mut self) {
        if !*self.released.get_mut() {
            Python::try_attach(|py| {
                self.release_slots(py);
            });
        }
    }
}

impl Drop for PolicyAcquiringPy {
    /// Never awaited, a permit taken at once (every level free) goes back.
    fn drop(&mut self) {
        if !*self.awaited.get_mut() {
            if let Some(p) = self.permit.take() {
                Python::try_attach(|py| p.get().cancel(py));
            }
        }
    }
}

/// `ratequeue.aio._policy_wait`, the coroutine function that bridges a policy acquire to
/// the running loop (handed over by `_use_aio`).
pub(crate) static POLICY_WAIT: pyo3::sync::PyOnceLock<Py<PyAny>> = pyo3::sync::PyOnceLock::new();

#[pymethods]
impl PolicyAcquiringPy {
    fn __await__(slf: &Bound<'_, Self>) -> PyResult<Py<PyAny>> {
        let py = slf.py();
        slf.get().awaited.store(true, Ordering::Release);
        if let Some(p) = slf.get().permit.get() {
            // Granted at once (every level free, nobody waiting), or awaited again.
            return Ok(Py::new(py, Ready::new(p.clone_ref(py).into_any()))?.into_any());
        }
        let wait = POLICY_WAIT.get(py).ok_or_else(aio_not_ready)?.bind(py);
        Ok(wait.call1((slf,))?.call_method0("__await__")?.unbind())
    }

    fn __aenter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_exc))]
    fn __aexit__(&self, py: Python<'_>, _exc: &Bound<'_, PyTuple>) -> PyResult<Py<Ready>> {
        if let Some(p) = self.permit.get() {
            p.get().release(py);
        }
        Py::new(py, Ready::new(false.into_pyobject(py)?.to_owned().into_any().unbind()))
    }
}

/// The asyncio bridge's calls (`ratequeue.aio`, through `aio::bridge`): not Python methods.
impl PolicyAcquiringPy {
    /// The PolicyPermit of a finished acquire (every level held), kept for the caller.
    pub(crate) fn finished(&self, py: Python<'_>, f: Finished) -> PyResult<Py<PyAny>> {
        let core = &self.core;
        let policy = self.policy.get();
        let permit = policy.permit(
            core.args().to_vec(),
            f.held,
            core.start_ns(),
            f.waited_ns.saturating_add(f.delay_ns),
        );
        if !policy.clock().is_manual() {
            self.left_ns.store(f.delay_ns, Ordering::Release);
        }
        let p = Py::new(py, permit)?;
        let _ = self.permit.set(p.clone_ref(py));
        Ok(p.into_any())
    }

    /// Seconds to sleep after the final step until the common time (0 on a ManualClock).
    pub(crate) fn left(&self) -> f64 {
        self.left_ns.load(Ordering::Acquire) as f64 / 1e9
    }
}
