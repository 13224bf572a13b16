//! Python Rate, Limiter and Reservation over the core's multi-rate limiter.

use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyString, PyTuple};
use ratequeue_core::limiter::MAX_RATES;
use ratequeue_core::{AnyClock, Limiter};

use crate::args::{opt_text, period_seconds, rate_index, seconds_ns};
use crate::blocking::unblocked;
use crate::errors::{needs_manual_clock, not_one_of, to_py};
use crate::histogram::HistogramPy;
use crate::rate::{burst_arg, new_rate, RatePy};
use crate::reservation::ReservationPy;
use crate::waiting::{queue_stats, submit, wait_histogram, ChannelPy, Gate, GatePy, PermitPy};

/// Costs per unit, as parsed from a call.
pub(crate) type Costs = [u64; MAX_RATES];

/// A rate limiter over one or more rates; lock-free decisions, all-or-nothing.
#[pyclass(frozen, name = "Limiter", module = "ratequeue")]
pub struct LimiterPy {
    pub(crate) core: Arc<Limiter>,
    pub(crate) gate: Arc<Gate>,
    /// Cost of a unit not named in a call (None: it must be named).
    pub(crate) defaults: [Option<u64>; MAX_RATES],
    /// The units' names, interned: a call's keywords are matched by identity first.
    pub(crate) unit_names: Box<[Py<PyString>]>,
    /// With one unit, its default cost (`defaults[0]`): the cost of `try_acquire()`
    /// without arguments, read by the fast entry with no further check; None otherwise.
    pub(crate) default_one: Option<u64>,
    pub(crate) max_wait_ns: Option<u64>,
    pub(crate) clock: Py<PyAny>,
    #[pyo3(get)]
    pub(crate) name: Option<String>,
}

#[pymethods]
impl LimiterPy {
    #[new]
    #[pyo3(signature = (*rates, clock = None, max_wait = None, max_queue = None, classes = None, name = None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        rates: &Bound<'_, PyTuple>,
        clock: Option<&Bound<'_, PyAny>>,
        max_wait: Option<&Bound<'_, PyAny>>,
        max_queue: Option<&Bound<'_, PyAny>>,
        classes: Option<&Bound<'_, PyAny>>,
        name: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        LimiterPy::build(py, rates, clock, max_wait, max_queue, classes, name)
    }

    /// Admits now or returns False; never waits, never queues, takes no lock.
    #[pyo3(signature = (n = None, /, **costs))]
    fn try_acquire(
        &self,
        py: Python<'_>,
        n: Option<&Bound<'_, PyAny>>,
        costs: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<bool> {
        let decided = match costs.map_or_else(|| self.one_cost(n), |_| None) {
            Some(c) => self.decide_now(&[c]),
            None => self.decide_now(&self.costs(n, costs)?),
        };
        self.answer(py, decided)
    }

    /// Seconds after which try_acquire of the given costs is admitted, the requests
    /// queued now served first (0.0 = now): exact with one class and no new arrivals
    /// (equal to predicted_wait); changes nothing.
    #[pyo3(signature = (n = None, /, **costs))]
    fn retry_after(
        &self,
        py: Python<'_>,
        n: Option<&Bound<'_, PyAny>>,
        costs: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<f64> {
        let c = self.costs(n, costs)?;
        if self.gate.queue.waiting() == 0 {
            return match self.core.delay_for(&c) {
                Ok(ns) => Ok(ns as f64 / 1e9),
                Err(d) => Err(self.deny(py, d)),
            };
        }
        let (q, units) = (self.gate.queue.clone(), self.core.units().len());
        match py.detach(move || q.predict_delay(&c[..units])) {
            Ok(p) => Ok(p.map_or(f64::INFINITY, |(_, d)| d as f64 / 1e9)),
            Err(d) => Err(self.deny(py, d)),
        }
    }

    /// Reserves the costs in arrival order: returns a Reservation whose `delay` says how
    /// long to wait before proceeding. Nobody waiting: debited at once at its Lindley
    /// time. Someone waiting: queued behind them in the first class, debited when the
    /// queue grants it; its `delay` is the FIFO schedule with one class, a prediction
    /// from the whole backlog with several. Raises Overloaded at once (consuming
    /// nothing) when the queue is full or the delay would exceed max_wait.
    #[pyo3(signature = (n = None, /, *, max_wait = None, **costs))]
    fn reserve(
        slf: &Bound<'_, Self>,
        n: Option<&Bound<'_, PyAny>>,
        max_wait: Option<&Bound<'_, PyAny>>,
        costs: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<ReservationPy> {
        LimiterPy::reserve_in_order(slf, n, max_wait, costs)
    }

    /// Units of `unit` that could be admitted now (negative while in debt).
    #[pyo3(signature = (unit = None))]
    fn available(&self, unit: Option<&Bound<'_, PyAny>>) -> PyResult<f64> {
        let unit = opt_text("unit", unit)?;
        let i = match unit.as_deref() {
            None => 0,
            Some(u) => self
                .core
                .unit_index(u)
                .ok_or_else(|| not_one_of("unit", u, self.core.units()))?,
        };
        Ok(self.core.available(i))
    }

    /// Changes a rate at run time (`which`: index or unit name); the bucket keeps what
    /// it has used. `per` and `burst` default to the current ones.
    #[pyo3(signature = (amount, per = None, *, burst = None, which = None))]
    fn set_rate(
        &self,
        py: Python<'_>,
        amount: &Bound<'_, PyAny>,
        per: Option<&Bound<'_, PyAny>>,
        burst: Option<&Bound<'_, PyAny>>,
        which: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let i = rate_index(&self.core, which)?;
        let (_, cur) = self.core.rate(i).expect("index checked");
        let amount = crate::args::positive("amount", amount)?;
        let period_ns = per.map(period_seconds).transpose()?.map_or(cur.period_ns, |s| s * 1e9);
        let burst = match burst {
            Some(b) => burst_arg(b)?,
            None => cur.burst,
        };
        let rate = new_rate(amount, period_ns, burst)?;
        self.set_rate_now(py, i, rate)
    }

    /// Admits nothing in `unit` (default: every unit) for `seconds`, then one unit:
    /// the buckets go into a debt the clock repays by then; a longer debt is kept.
    /// True when a bucket moved.
    #[pyo3(signature = (seconds, *, unit = None))]
    fn pause(&self, py: Python<'_>, seconds: &Bound<'_, PyAny>, unit: Option<&Bound<'_, PyAny>>) -> PyResult<bool> {
        let ns = crate::args::seconds_ns("seconds", seconds)?;
        let unit = opt_text("unit", unit)?;
        let i = match unit.as_deref() {
            None => None,
            Some(u) => Some(
                self.core
                    .unit_index(u)
                    .ok_or_else(|| not_one_of("unit", u, self.core.units()))?,
            ),
        };
        let until = self.gate.queue.now_ns().saturating_add(ns);
        let core = &self.core;
        Ok(py.detach(|| core.hold_until(until, i)))
    }

    /// Changes the burst of a rate at run time, keeping its amount and period.
    #[pyo3(signature = (burst, *, which = None))]
    fn set_burst(&self, py: Python<'_>, burst: &Bound<'_, PyAny>, which: Option<&Bound<'_, PyAny>>) -> PyResult<()> {
        let i = rate_index(&self.core, which)?;
        let (_, cur) = self.core.rate(i).expect("index checked");
        let rate = new_rate(cur.amount, cur.period_ns, burst_arg(burst)?)?;
        self.set_rate_now(py, i, rate)
    }

    /// The current rates, in the order given.
    #[getter]
    fn rates(&self) -> Vec<RatePy> {
        (0..self.core.rate_count())
            .filter_map(|i| self.core.rate(i))
            .map(|(u, r)| RatePy {
                rate: r,
                unit: u.to_owned(),
            })
            .collect()
    }

    /// The distinct units, in order of first appearance.
    #[getter]
    fn units(&self) -> Vec<String> {
        self.core.units().to_vec()
    }

    /// The clock this limiter reads.
    #[getter]
    fn clock(&self, py: Python<'_>) -> Py<PyAny> {
        self.clock.clone_ref(py)
    }

    /// The default bound on waiting, in seconds (None: unbounded).
    #[getter]
    fn max_wait(&self) -> Option<f64> {
        self.max_wait_ns.map(|n| n as f64 / 1e9)
    }

    /// Waits in the queue until granted (GIL released); a context manager. Raises
    /// Overloaded at once when the queue is full or the deadline cannot be met,
    /// WaitTimeout at the deadline.
    #[pyo3(signature = (n = None, /, *, priority = None, timeout = None, **costs))]
    fn acquire(
        &self,
        py: Python<'_>,
        n: Option<&Bound<'_, PyAny>>,
        priority: Option<&Bound<'_, PyAny>>,
        timeout: Option<&Bound<'_, PyAny>>,
        costs: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<PermitPy> {
        let c = self.costs(n, costs)?;
        let units = self.core.units().len();
        self.gate
            .acquire(py, &c[..units], self.gate.class(priority)?, self.gate.timeout(timeout)?)
    }

    /// Awaitable (and async context manager) version of acquire; no polling, one wake.
    #[pyo3(signature = (n = None, /, *, priority = None, timeout = None, **costs))]
    fn acquire_async(
        &self,
        py: Python<'_>,
        n: Option<&Bound<'_, PyAny>>,
        priority: Option<&Bound<'_, PyAny>>,
        timeout: Option<&Bound<'_, PyAny>>,
        costs: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Py<PyAny>> {
        let c = self.costs(n, costs)?;
        let units = self.core.units().len();
        crate::waiting::acquire_async(
            py,
            &self.gate,
            &c[..units],
            self.gate.class(priority)?,
            self.gate.timeout(timeout)?,
        )
    }

    /// Submits without blocking: returns a Permit when granted at once, else a ticket
    /// (int) whose outcome — (ticket, granted, waited_ns) — is drained from `channel`
    /// later. Raises Overloaded/CostTooLarge like acquire. For simulators and custom
    /// event loops; acquire and acquire_async are built on the same path.
    #[pyo3(signature = (channel, n = None, /, *, priority = None, timeout = None, **costs))]
    #[allow(clippy::too_many_arguments)]
    fn submit(
        &self,
        py: Python<'_>,
        channel: &Bound<'_, ChannelPy>,
        n: Option<&Bound<'_, PyAny>>,
        priority: Option<&Bound<'_, PyAny>>,
        timeout: Option<&Bound<'_, PyAny>>,
        costs: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Py<PyAny>> {
        let c = self.costs(n, costs)?;
        let units = self.core.units().len();
        submit(
            py,
            &self.gate,
            channel,
            &c[..units],
            self.gate.class(priority)?,
            self.gate.timeout(timeout)?,
        )
    }

    /// Seconds a request with these costs would wait if it arrived now in class
    /// `priority` (None: the first class): behind the waiters the fair queue serves
    /// before it. Exact with one class, and with several as long as nothing else
    /// arrives; inf when it depends on releases.
    #[pyo3(signature = (n = None, /, *, priority = None, **costs))]
    fn predicted_wait(
        &self,
        py: Python<'_>,
        n: Option<&Bound<'_, PyAny>>,
        priority: Option<&Bound<'_, PyAny>>,
        costs: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<f64> {
        let c = self.costs(n, costs)?;
        let class = self.gate.class(priority)?;
        let units = self.core.units().len();
        let q = &self.gate.queue;
        match py.detach(|| q.predict_delay_in(&c[..units], class)) {
            Ok(p) => Ok(p.map_or(f64::INFINITY, |(_, d)| d as f64 / 1e9)),
            Err(d) => Err(self.deny(py, d)),
        }
    }

    /// Grants and expires whatever is due now; returns the next due time (clock
    /// seconds) or None. The virtual-time driver calls this on a ManualClock.
    fn poll(&self) -> Option<f64> {
        unblocked(|| self.gate.queue.poll_now()).map(crate::clock::due_seconds)
    }

    /// The next due time (clock seconds) of the queue, or None when nobody waits.
    fn next_wake(&self) -> Option<f64> {
        unblocked(|| self.gate.queue.next_wake()).map(crate::clock::due_seconds)
    }

    /// On a ManualClock: advances the clock through every due time up to `until`
    /// (clock seconds), granting and expiring as real time would. Returns the number
    /// of wake-ups.
    fn run_until(&self, py: Python<'_>, until: &Bound<'_, PyAny>) -> PyResult<usize> {
        let AnyClock::Manual(m) = self.core.clock() else {
            return Err(needs_manual_clock("run_until"));
        };
        let t = seconds_ns("until", until)?;
        let (q, m) = (self.gate.queue.clone(), m.clone());
        py.detach(move || q.run_until(&m, t)).map_err(|e| to_py(py, e))
    }

    /// Requests now waiting in the queue.
    #[getter]
    fn waiting(&self) -> usize {
        self.gate.queue.waiting()
    }

    /// Counters, queue depths, wait histograms and available capacity per unit, in one
    /// snapshot (each part read atomically).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = queue_stats(py, &self.gate.queue)?;
        let avail = PyDict::new(py);
        for (i, u) in self.core.units().iter().enumerate() {
            avail.set_item(u, self.core.available(i))?;
        }
        d.set_item("available", avail)?;
        d.set_item("refunds_dropped", self.core.refunds_dropped())?;
        d.set_item("name", self.name.clone())?;
        Ok(d)
    }

    /// The live histogram of queue waits (seconds, arrival to grant) of a class.
    #[pyo3(signature = (priority = None))]
    fn wait_histogram(&self, priority: Option<&Bound<'_, PyAny>>) -> PyResult<HistogramPy> {
        wait_histogram(&self.gate, priority)
    }

    /// The class names, in order.
    #[getter]
    fn classes(&self) -> Vec<String> {
        self.gate.class_names()
    }

    fn __repr__(&self) -> String {
        let rates: Vec<String> = self.rates().iter().map(|r| r.__repr__()).collect();
        format!("Limiter({})", rates.join(", "))
    }
}
