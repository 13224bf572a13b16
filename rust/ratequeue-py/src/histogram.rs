//! Python Histogram over the core's lock-free log-linear histogram; values in seconds.

use std::sync::Arc;

use numpy::{PyArray1, PyReadonlyArray1};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBytes, PyString, PyType};
use ratequeue_core::histogram::{lower_of, upper_of, Summary, BUCKETS};
use ratequeue_core::{Histogram, Snapshot};

use crate::args::{number, numbers, shown};
use crate::errors::{holds_err, to_py, type_err, value_err};

/// A histogram of durations (seconds): lock-free recording, ≤ 1 % relative error from
/// 1 µs to centuries (exact sum, min and max), percentiles, numpy export, merge and bytes.
#[pyclass(frozen, name = "Histogram", module = "ratequeue")]
pub struct HistogramPy {
    pub inner: Arc<Histogram>,
}

pub(crate) fn to_ns(name: &str, s: f64) -> PyResult<u64> {
    if !s.is_finite() || s < 0.0 {
        return Err(value_err(
            name,
            &s.to_string(),
            "must be a finite number of seconds >= 0",
        ));
    }
    Ok((s * 1e9).round().min(u64::MAX as f64) as u64)
}

fn secs(ns: f64) -> f64 {
    ns / 1e9
}

impl HistogramPy {
    fn snap(&self) -> Snapshot {
        self.inner.snapshot()
    }

    /// Count, sum, min and max without copying the buckets.
    fn summary(&self) -> Summary {
        self.inner.summary()
    }

    fn at_percentiles(&self, qs: Vec<f64>) -> Vec<f64> {
        self.inner
            .percentiles(&qs)
            .1
            .into_iter()
            .map(|v| v.map_or(f64::NAN, secs))
            .collect()
    }
}

/// A percentile: a number within [0, 100].
fn percent(name: &str, v: &Bound<'_, PyAny>) -> PyResult<f64> {
    let q = number(name, v)?;
    if !(0.0..=100.0).contains(&q) {
        return Err(value_err(name, &shown(v), "must be a percentile within [0, 100]"));
    }
    Ok(q)
}

/// A bucket bound in seconds as nanoseconds (+inf: everything).
fn bound_ns(name: &str, v: &Bound<'_, PyAny>) -> PyResult<u64> {
    let le = number(name, v)?;
    if le == f64::INFINITY {
        return Ok(u64::MAX);
    }
    to_ns(name, le).map_err(|_| value_err(name, &shown(v), "must be a number of seconds >= 0 (or inf)"))
}

static ASARRAY: PyOnceLock<Py<PyAny>> = PyOnceLock::new();

/// `values` as a 1-D float64 array: any integer or float array or sequence of numbers
/// converts; anything else is a TypeError naming `values`.
fn as_f64_array<'py>(values: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
    let py = values.py();
    let refuse = || type_err("values", "a 1-D array or sequence of numbers of seconds", values);
    if values.is_instance_of::<PyString>() || values.is_instance_of::<PyBytes>() {
        return Err(refuse());
    }
    let asarray = ASARRAY.import(py, "numpy", "asarray")?;
    let a = asarray.call1((values,)).map_err(|_| refuse())?;
    let kind: String = a.getattr("dtype")?.getattr("kind")?.extract()?;
    let ndim: usize = a.getattr("ndim")?.extract()?;
    if ndim != 1 || !matches!(kind.as_str(), "i" | "u" | "f") {
        return Err(refuse());
    }
    a.call_method1("astype", ("float64",))
}

#[pymethods]
impl HistogramPy {
    #[new]
    fn new() -> Self {
        HistogramPy {
            inner: Arc::new(Histogram::new()),
        }
    }

    /// Records one duration in seconds.
    fn record(&self, seconds: &Bound<'_, PyAny>) -> PyResult<()> {
        let s = number("seconds", seconds)?;
        self.inner.record(to_ns("seconds", s)?);
        Ok(())
    }

    /// Records every value of a 1-D array (any integer or float dtype) or sequence of
    /// seconds (GIL released for a float64 array); all or nothing: a NaN, infinite or
    /// negative value raises and records none.
    fn record_many(&self, py: Python<'_>, values: &Bound<'_, PyAny>) -> PyResult<()> {
        let converted;
        let values = match values.extract::<PyReadonlyArray1<'_, f64>>() {
            Ok(v) => v,
            Err(_) => {
                converted = as_f64_array(values)?;
                converted.extract::<PyReadonlyArray1<'_, f64>>()?
            }
        };
        let view = values.as_array();
        let inner = &self.inner;
        let fill = |values: &[f64]| {
            let s = Snapshot::from_seconds(values)?;
            inner.add_snapshot(&s);
            Ok(())
        };
        let filled: Result<(), f64> = match view.as_slice() {
            Some(slice) => py.detach(|| fill(slice)),
            None => {
                let owned = view.iter().copied().collect::<Vec<f64>>();
                py.detach(|| fill(&owned))
            }
        };
        match filled {
            Ok(()) => Ok(()),
            Err(bad) => Err(holds_err(
                "values",
                bad,
                "every value must be a finite number of seconds >= 0",
            )),
        }
    }

    /// Number of recorded values (reads 121 group subtotals, not the buckets).
    #[getter]
    fn count(&self) -> u64 {
        self.inner.count()
    }

    fn __len__(&self) -> usize {
        self.count() as usize
    }

    /// Sum of recorded values, seconds.
    #[getter]
    fn sum(&self) -> f64 {
        secs(self.inner.sum() as f64)
    }

    /// Smallest value (nan when empty).
    #[getter]
    fn min(&self) -> f64 {
        let s = self.summary();
        if s.count == 0 {
            f64::NAN
        } else {
            secs(s.min as f64)
        }
    }

    /// Largest value (nan when empty).
    #[getter]
    fn max(&self) -> f64 {
        let s = self.summary();
        if s.count == 0 {
            f64::NAN
        } else {
            secs(s.max as f64)
        }
    }

    /// Mean (nan when empty).
    #[getter]
    fn mean(&self) -> f64 {
        let s = self.summary();
        let n = s.count;
        if n == 0 {
            f64::NAN
        } else {
            secs(s.sum as f64 / n as f64)
        }
    }

    /// Values under 1 µs (recorded exactly) and over 10^10 s (in the top bucket; sum, min
    /// and max stay exact).
    #[getter]
    fn underflow(&self) -> u64 {
        self.inner.underflow()
    }

    #[getter]
    fn overflow(&self) -> u64 {
        self.inner.overflow()
    }

    /// The value at percentile `q` (0–100), seconds; nan when empty.
    fn percentile(&self, q: &Bound<'_, PyAny>) -> PyResult<f64> {
        Ok(self.at_percentiles(vec![percent("q", q)?])[0])
    }

    /// Several percentiles from one read (exact ranks against one count), seconds; nan
    /// when empty.
    fn percentiles(&self, qs: &Bound<'_, PyAny>) -> PyResult<Vec<f64>> {
        let qs = numbers("qs", qs, percent)?;
        Ok(self.at_percentiles(qs))
    }

    /// Values at or below `le` seconds (exact when `le` has at most three significant
    /// digits in nanoseconds, as Prometheus boundaries do).
    fn count_le(&self, le: &Bound<'_, PyAny>) -> PyResult<u64> {
        Ok(self.inner.count_le(bound_ns("le", le)?))
    }

    /// Cumulative counts at each of `les` (seconds, ascending), against one count.
    fn cumulative(&self, les: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
        let les = numbers("les", les, bound_ns)?;
        Ok(self.inner.cumulative(&les))
    }

    /// (counts, edges) like numpy.histogram: counts per bucket (uint64) and the
    /// len(counts)+1 bucket edges in seconds (float64). Only buckets up to the last
    /// non-empty one are included.
    fn to_numpy<'py>(&self, py: Python<'py>) -> (Bound<'py, PyArray1<u64>>, Bound<'py, PyArray1<f64>>) {
        let s = self.snap();
        let last = s.counts.iter().rposition(|c| *c != 0).map_or(0, |i| i + 1);
        let counts = PyArray1::from_slice(py, &s.counts[..last]);
        let mut edges: Vec<f64> = (0..last).map(|i| secs(lower_of(i) as f64)).collect();
        edges.push(secs(if last == 0 { 0.0 } else { upper_of(last - 1) as f64 }));
        (counts, PyArray1::from_vec(py, edges))
    }

    /// A compact byte form for shipping between processes.
    fn to_bytes<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.snap().to_bytes())
    }

    /// A histogram from `to_bytes` output.
    #[classmethod]
    fn from_bytes(_cls: &Bound<'_, PyType>, py: Python<'_>, data: &[u8]) -> PyResult<Self> {
        let s = Snapshot::from_bytes(data).map_err(|e| to_py(py, e))?;
        let h = Histogram::new();
        h.add_snapshot(&s);
        Ok(HistogramPy { inner: Arc::new(h) })
    }

    /// Adds every value of `other` into this histogram.
    fn merge(&self, other: &Bound<'_, HistogramPy>) {
        self.inner.add_snapshot(&other.get().snap());
    }

    /// An independent copy as of now.
    fn copy(&self) -> Self {
        let h = Histogram::new();
        h.add_snapshot(&self.snap());
        HistogramPy { inner: Arc::new(h) }
    }

    /// An independent copy (as `copy`).
    fn __copy__(&self) -> Self {
        self.copy()
    }

    /// An independent copy (as `copy`; nothing inside is shared).
    #[pyo3(signature = (_memo = None))]
    fn __deepcopy__(&self, _memo: Option<&Bound<'_, PyAny>>) -> Self {
        self.copy()
    }

    /// Pickles through the byte form: `Histogram.from_bytes(h.to_bytes())`.
    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> PyResult<(Bound<'py, PyAny>, (Bound<'py, PyBytes>,))> {
        let py = slf.py();
        let make = slf.get_type().getattr("from_bytes")?;
        Ok((make, (slf.get().to_bytes(py),)))
    }

    /// Empties the histogram; returns what it held, as a new Histogram.
    fn reset(&self) -> Self {
        let h = Histogram::new();
        h.add_snapshot(&self.inner.reset());
        HistogramPy { inner: Arc::new(h) }
    }

    /// Number of buckets (fixed).
    #[classattr]
    fn buckets() -> usize {
        BUCKETS
    }

    fn __repr__(&self) -> String {
        let (s, p) = self.inner.percentiles(&[50.0, 99.0]);
        let f = |v: Option<f64>| v.map_or("nan".to_owned(), |x| format!("{:.6}", secs(x)));
        format!("Histogram(count={}, p50={}, p99={})", s.count, f(p[0]), f(p[1]))
    }
}
