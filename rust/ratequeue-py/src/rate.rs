//! Python Rate: an amount per period with a burst, validated once.

use pyo3::prelude::*;
use ratequeue_core::Rate;

use crate::args::{opt_text, period_seconds, size};
use crate::errors::{setup_err, value_err};

/// Keyword names that are arguments, never units.
const RESERVED: [&str; 5] = ["max_wait", "timeout", "priority", "clock", "name"];
/// `amount` units per `per`, at most `burst` at once.
#[pyclass(frozen, name = "Rate", module = "ratequeue")]
#[derive(Clone)]
pub struct RatePy {
    pub rate: Rate,
    #[pyo3(get)]
    pub unit: String,
}

#[pymethods]
impl RatePy {
    #[new]
    #[pyo3(signature = (amount, per = None, burst = None, unit = None))]
    #[pyo3(text_signature = "(amount, per=None, burst=None, unit='requests')")]
    fn new(
        amount: &Bound<'_, PyAny>,
        per: Option<&Bound<'_, PyAny>>,
        burst: Option<&Bound<'_, PyAny>>,
        unit: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let unit = opt_text("unit", unit)?.unwrap_or_else(|| "requests".to_owned());
        let unit = unit.as_str();
        let amount_f = crate::args::positive("amount", amount)?;
        let per_s = per.map(period_seconds).transpose()?.unwrap_or(1.0);
        let burst_n = match burst {
            Some(b) => burst_arg(b)?,
            None => (amount_f.floor().max(1.0)).min(u64::MAX as f64) as u64,
        };
        if unit.is_empty() || RESERVED.contains(&unit) || !unit.chars().all(|c| c.is_alphanumeric() || c == '_') {
            return Err(value_err(
                "unit",
                &format!("{unit:?}"),
                &format!("must be an identifier other than {RESERVED:?}"),
            ));
        }
        let rate = new_rate(amount_f, per_s * 1e9, burst_n)?;
        Ok(RatePy {
            rate,
            unit: unit.to_owned(),
        })
    }

    /// Units per period.
    #[getter]
    fn amount(&self) -> f64 {
        self.rate.amount
    }

    /// The period in seconds.
    #[getter]
    fn per(&self) -> f64 {
        self.rate.period_ns / 1e9
    }

    /// The capacity: the most admitted at one instant.
    #[getter]
    fn burst(&self) -> u64 {
        self.rate.burst
    }

    /// Units per second.
    #[getter]
    fn per_second(&self) -> f64 {
        self.rate.per_second()
    }

    fn __eq__(&self, other: &Bound<'_, PyAny>) -> bool {
        other
            .cast::<RatePy>()
            .is_ok_and(|o| o.get().rate == self.rate && o.get().unit == self.unit)
    }

    pub(crate) fn __repr__(&self) -> String {
        format!(
            "Rate({}, per={}, burst={}, unit={:?})",
            self.rate.amount,
            self.rate.period_ns / 1e9,
            self.rate.burst,
            self.unit
        )
    }
}

/// A burst: an integer >= 1.
pub(crate) fn burst_arg(b: &Bound<'_, PyAny>) -> PyResult<u64> {
    size("burst", b, u64::MAX)
}

/// A validated rate; a burst window too long names all three arguments (any of them
/// may be what to change).
pub(crate) fn new_rate(amount: f64, period_ns: f64, burst: u64) -> PyResult<Rate> {
    Rate::new(amount, period_ns, burst).map_err(|e| match &e {
        ratequeue_core::Error::Invalid { name, reason, .. } if name == "burst" && reason.contains("window") => {
            setup_err(format!(
                "burst={burst} at amount={amount:?} per={:?} s makes the burst window (burst / rate) \
                 longer than 2**56 ns (about 2.3 years): raise amount, shorten per or lower burst",
                period_ns / 1e9
            ))
        }
        _ => setup_err(e.to_string()),
    })
}
