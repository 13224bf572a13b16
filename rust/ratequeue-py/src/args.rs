//! The one validation path for every Python argument: text, numbers, seconds, periods,
//! counts and costs, sequences. Errors name the argument and show the value as given.

use pyo3::exceptions::{PyOverflowError, PyTypeError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyFloat, PyInt, PyString};
use pyo3::Borrowed;

use ratequeue_core::Limiter;

use crate::errors::{type_err, value_err};

/// The value as the caller wrote it (str of the object), for messages.
pub fn shown(v: &Bound<'_, PyAny>) -> String {
    v.str().map(|s| s.to_string()).unwrap_or_else(|_| "?".into())
}

/// True for Python and numpy booleans: never a number here.
fn is_bool(v: &Bound<'_, PyAny>) -> bool {
    v.is_instance_of::<PyBool>() || v.get_type().name().is_ok_and(|n| n == "bool_" || n == "bool")
}

/// `operator.index(v)` when `v` is an integer of any kind (int, numpy integer,
/// anything with `__index__`), else None.
fn as_int<'py>(v: &Bound<'py, PyAny>) -> PyResult<Option<Bound<'py, PyInt>>> {
    if is_bool(v) || v.is_instance_of::<PyFloat>() {
        return Ok(None);
    }
    if let Ok(i) = v.cast::<PyInt>() {
        return Ok(Some(i.clone()));
    }
    if !v.hasattr("__index__")? {
        return Ok(None);
    }
    match crate::convert::index(v) {
        Ok(i) => Ok(i.cast_into::<PyInt>().ok()),
        Err(e) if e.is_instance_of::<PyTypeError>(v.py()) => Ok(None),
        Err(e) => Err(e),
    }
}

/// Text: a str (TypeError naming the argument otherwise).
pub fn text(name: &str, v: &Bound<'_, PyAny>) -> PyResult<String> {
    match v.cast::<PyString>() {
        Ok(s) => Ok(s.to_str()?.to_owned()),
        Err(_) => Err(type_err(name, "a str", v)),
    }
}

/// Optional text (None stays None).
pub fn opt_text(name: &str, v: Option<&Bound<'_, PyAny>>) -> PyResult<Option<String>> {
    match v {
        Some(v) if !v.is_none() => text(name, v).map(Some),
        _ => Ok(None),
    }
}

/// A real number: int of any size, float, numpy scalar, anything with `__index__` or
/// `__float__`; never a bool. May be NaN or infinite (ints beyond float range are ±inf).
pub fn number(name: &str, v: &Bound<'_, PyAny>) -> PyResult<f64> {
    if let Ok(f) = v.cast::<PyFloat>() {
        return Ok(f.value());
    }
    if let Some(i) = as_int(v)? {
        return match i.extract::<f64>() {
            Ok(x) => Ok(x),
            Err(e) if e.is_instance_of::<PyOverflowError>(v.py()) => {
                Ok(if i.lt(0)? { f64::NEG_INFINITY } else { f64::INFINITY })
            }
            Err(e) => Err(e),
        };
    }
    if is_bool(v) || v.is_instance_of::<PyString>() || v.is_instance_of::<PyBytes>() || !v.hasattr("__float__")? {
        return Err(type_err(name, "a number", v));
    }
    match v.call_method0("__float__").and_then(|f| f.extract::<f64>()) {
        Ok(x) => Ok(x),
        Err(_) => Err(type_err(name, "a number", v)),
    }
}

/// A finite number of seconds.
pub fn seconds(name: &str, v: &Bound<'_, PyAny>) -> PyResult<f64> {
    let s = number(name, v).map_err(|_| type_err(name, "a number of seconds", v))?;
    if !s.is_finite() {
        return Err(value_err(name, &shown(v), "must be a finite number of seconds"));
    }
    Ok(s)
}

/// Seconds (finite, >= 0) as nanoseconds, saturating at the largest u64 (a bound that
/// far is never reached).
pub fn seconds_ns(name: &str, v: &Bound<'_, PyAny>) -> PyResult<u64> {
    let s = seconds(name, v)?;
    if s < 0.0 {
        return Err(value_err(name, &shown(v), "must be >= 0 seconds"));
    }
    Ok((s * 1e9).round().min(u64::MAX as f64) as u64)
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
            _ => Err(value_err(
                "per",
                &format!("{s:?}"),
                "is not a period: use seconds or 'second', 'minute', 'hour', 'day'",
            )),
        };
    }
    let s = seconds("per", v)?;
    if s <= 0.0 {
        return Err(value_err("per", &shown(v), "must be > 0 seconds"));
    }
    Ok(s)
}

/// A finite number > 0 (an amount, a weight).
pub fn positive(name: &str, v: &Bound<'_, PyAny>) -> PyResult<f64> {
    let x = number(name, v)?;
    if !x.is_finite() || x <= 0.0 {
        return Err(value_err(name, &shown(v), "must be a finite number > 0"));
    }
    Ok(x)
}

/// A whole number from 1 to `max` (a size: a limit, a queue bound, a burst).
pub fn size(name: &str, v: &Bound<'_, PyAny>, max: u64) -> PyResult<u64> {
    match int_u64(name, v)? {
        Ok(c) if (1..=max).contains(&c) => Ok(c),
        _ => Err(value_err(
            name,
            &shown(v),
            &format!("must be an integer from 1 to {max}"),
        )),
    }
}

thread_local! {
    /// The text of the last cost that saturated at u64::MAX on this thread (None when
    /// the last u64::MAX cost was exact), so a CostTooLarge shows the value as given.
    static SATURATED: std::cell::RefCell<Option<String>> = const { std::cell::RefCell::new(None) };
}

/// A cost >= 0: an integer; one above 2**64-1 becomes u64::MAX, which no burst holds
/// (CostTooLarge, showing the value as given).
pub fn cost(name: &str, v: &Bound<'_, PyAny>) -> PyResult<u64> {
    let c = int_u64(name, v)?;
    if matches!(c, Ok(u64::MAX) | Err(())) {
        let given = c.is_err().then(|| shown(v));
        SATURATED.with(|s| *s.borrow_mut() = given);
    }
    Ok(c.unwrap_or(u64::MAX))
}

/// The cost as given behind a CostTooLarge of u64::MAX, if it saturated.
pub fn saturated_cost() -> Option<String> {
    SATURATED.with(|s| s.borrow_mut().take())
}

/// Permits (concurrency): an integer from 1 to 2**64 - 1. Unlike a cost it never
/// saturates, since a limit may itself be 2**64 - 1.
pub fn permits(name: &str, v: &Bound<'_, PyAny>) -> PyResult<u64> {
    match int_u64(name, v)? {
        Ok(0) => Err(value_err(name, "0", "must be >= 1 permit")),
        Ok(n) => Ok(n),
        Err(()) => Err(value_err(name, &shown(v), "must be < 2**64")),
    }
}

/// An integer >= 0: Ok(Ok(v)) within u64, Ok(Err(())) above it; errors otherwise.
fn int_u64(name: &str, v: &Bound<'_, PyAny>) -> PyResult<Result<u64, ()>> {
    let Some(i) = as_int(v)? else {
        return Err(type_err(name, "an int", v));
    };
    if let Ok(c) = i.extract::<u64>() {
        return Ok(Ok(c));
    }
    if i.lt(0)? {
        return Err(value_err(name, &shown(v), "must be >= 0"));
    }
    Ok(Err(()))
}

/// A sequence of numbers (not str or bytes), each checked by `each` as `name[i]`.
pub fn numbers<T>(
    name: &str,
    v: &Bound<'_, PyAny>,
    each: impl Fn(&str, &Bound<'_, PyAny>) -> PyResult<T>,
) -> PyResult<Vec<T>> {
    if v.is_instance_of::<PyString>() || v.is_instance_of::<PyBytes>() {
        return Err(type_err(name, "a sequence of numbers", v));
    }
    let it = v.try_iter().map_err(|_| type_err(name, "a sequence of numbers", v))?;
    let mut out = Vec::new();
    for (i, x) in it.enumerate() {
        out.push(each(&format!("{name}[{i}]"), &x?)?);
    }
    Ok(out)
}

/// A collection of str (not a str itself), e.g. names.
pub fn texts(name: &str, v: &Bound<'_, PyAny>) -> PyResult<Vec<String>> {
    if v.is_instance_of::<PyString>() || v.is_instance_of::<PyBytes>() {
        return Err(type_err(name, "a collection of str", v));
    }
    let it = v.try_iter().map_err(|_| type_err(name, "a collection of str", v))?;
    let mut out = Vec::new();
    for (i, x) in it.enumerate() {
        out.push(text(&format!("{name}[{i}]"), &x?)?);
    }
    Ok(out)
}

/// A `cost` argument, read as [`cost`] reads it.
pub struct Cost(pub u64);

impl<'py> FromPyObject<'_, 'py> for Cost {
    type Error = PyErr;

    fn extract(obj: Borrowed<'_, 'py, PyAny>) -> PyResult<Self> {
        cost("cost", &obj).map(Cost)
    }
}

/// An `n` (permits) argument, read as [`permits`] reads it (>= 1).
pub struct Permits(pub u64);

impl<'py> FromPyObject<'_, 'py> for Permits {
    type Error = PyErr;

    fn extract(obj: Borrowed<'_, 'py, PyAny>) -> PyResult<Self> {
        permits("n", &obj).map(Permits)
    }
}

/// The rate `which` names (an index, or a unit with one rate), for a limiter's per-rate
/// calls; None means the only rate of its unit (the first unit).
pub fn rate_index(core: &Limiter, which: Option<&Bound<'_, PyAny>>) -> PyResult<usize> {
    let n = core.rate_count();
    let Some(w) = which.filter(|w| !w.is_none()) else {
        let first = core.rate(0).map(|(u, _)| u.to_owned()).unwrap_or_default();
        let same = (0..n)
            .filter(|i| core.rate(*i).is_some_and(|(u, _)| u == first))
            .count();
        if same > 1 {
            return Err(value_err(
                "which",
                "",
                &format!("is required: this limiter has {same} rates in {first:?} (pass an index)"),
            ));
        }
        return Ok(0);
    };
    if let Ok(s) = w.cast::<PyString>() {
        let s = s.to_str()?;
        let hits: Vec<usize> = (0..n).filter(|i| core.rate(*i).is_some_and(|(u, _)| u == s)).collect();
        return match hits.as_slice() {
            [i] => Ok(*i),
            [] => Err(value_err("which", &format!("{s:?}"), "names no rate of this limiter")),
            _ => Err(value_err(
                "which",
                &format!("{s:?}"),
                "names several rates: pass an index",
            )),
        };
    }
    if !w.is_instance_of::<pyo3::types::PyInt>() || w.is_instance_of::<pyo3::types::PyBool>() {
        return Err(type_err("which", "an index or a unit name", w));
    }
    let i: i64 = w
        .extract()
        .map_err(|_| value_err("which", &w.to_string(), "is out of range"))?;
    let out_of_range = || {
        value_err(
            "which",
            &i.to_string(),
            &format!("is out of range: this limiter has {n} rates"),
        )
    };
    let i = usize::try_from(i).map_err(|_| out_of_range())?;
    if i >= n {
        return Err(out_of_range());
    }
    Ok(i)
}
