//! Argument parsing shared by the bindings: seconds, periods and integer costs.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyFloat, PyInt, PyString};
use pyo3::Borrowed;

use crate::errors::type_err;

/// Seconds (int or float, finite, >= 0) as nanoseconds.
pub fn seconds_ns(name: &str, v: &Bound<'_, PyAny>) -> PyResult<u64> {
    let s = seconds(name, v)?;
    if s < 0.0 {
        return Err(PyValueError::new_err(format!("{name}={s} must be >= 0 seconds")));
    }
    Ok((s * 1e9).round().min(u64::MAX as f64) as u64)
}

/// A finite number of seconds.
pub fn seconds(name: &str, v: &Bound<'_, PyAny>) -> PyResult<f64> {
    if v.is_instance_of::<PyBool>() || !(v.is_instance_of::<PyFloat>() || v.is_instance_of::<PyInt>()) {
        return Err(type_err(name, "a number of seconds", v));
    }
    let s: f64 = v.extract()?;
    if !s.is_finite() {
        return Err(PyValueError::new_err(format!(
            "{name}={s} must be a finite number of seconds"
        )));
    }
    Ok(s)
}

/// A period: seconds, or "second" | "minute" | "hour" | "day".
pub fn period_seconds(v: &Bound<'_, PyAny>) -> PyResult<f64> {
    if let Ok(s) = v.cast::<PyString>() {
        let s = s.to_str()?;
        return match s.strip_suffix('s').unwrap_or(s) {
            "second" | "sec" => Ok(1.0),
            "minute" | "min" => Ok(60.0),
            "hour" => Ok(3600.0),
            "day" => Ok(86_400.0),
            _ => Err(PyValueError::new_err(format!(
                "per={s:?} is not a period: use seconds or 'second', 'minute', 'hour', 'day'"
            ))),
        };
    }
    let s = seconds("per", v)?;
    if s <= 0.0 {
        return Err(PyValueError::new_err(format!("per={s} must be > 0 seconds")));
    }
    Ok(s)
}

/// A finite number > 0 (an amount, a weight).
pub fn positive(name: &str, v: &Bound<'_, PyAny>) -> PyResult<f64> {
    if v.is_instance_of::<PyBool>() || !(v.is_instance_of::<PyFloat>() || v.is_instance_of::<PyInt>()) {
        return Err(type_err(name, "a number", v));
    }
    let x: f64 = v.extract()?;
    if !x.is_finite() || x <= 0.0 {
        return Err(PyValueError::new_err(format!("{name}={x} must be a finite number > 0")));
    }
    Ok(x)
}

/// A non-negative integer cost.
pub fn cost(name: &str, v: &Bound<'_, PyAny>) -> PyResult<u64> {
    if v.is_instance_of::<PyBool>() || !v.is_instance_of::<PyInt>() {
        return Err(type_err(name, "an int", v));
    }
    match v.extract::<u64>() {
        Ok(c) => Ok(c),
        Err(_) => {
            let big: i128 = v.extract().unwrap_or(-1);
            if big < 0 {
                Err(PyValueError::new_err(format!("{name}={v} must be >= 0")))
            } else {
                Ok(u64::MAX)
            }
        }
    }
}

/// A number of permits: an int from 0 to 2**64 - 1. Unlike a cost it never saturates,
/// since a limit may itself be 2**64 - 1.
pub fn permits(name: &str, v: &Bound<'_, PyAny>) -> PyResult<u64> {
    let n = cost(name, v)?;
    if n == u64::MAX && v.extract::<u64>().is_err() {
        return Err(PyValueError::new_err(format!("{name}={v} must be < 2**64")));
    }
    Ok(n)
}

/// A `cost` argument, read as [`cost`] reads it.
pub struct Cost(pub u64);

impl<'py> FromPyObject<'_, 'py> for Cost {
    type Error = PyErr;

    fn extract(obj: Borrowed<'_, 'py, PyAny>) -> PyResult<Self> {
        cost("cost", &obj).map(Cost)
    }
}

/// An `n` (permits) argument, read as [`permits`] reads it.
pub struct Permits(pub u64);

impl<'py> FromPyObject<'_, 'py> for Permits {
    type Error = PyErr;

    fn extract(obj: Borrowed<'_, 'py, PyAny>) -> PyResult<Self> {
        permits("n", &obj).map(Permits)
    }
}
