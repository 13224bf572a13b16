//! The one validation path for every Python argument: text, numbers, seconds, periods,
//! counts and costs, sequences. Errors name the argument and show the value as given.

use pyo3::exceptions::{PyOverflowError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBool, PyBytes, PyDict, PyFloat, PyInt, PyString, PyTuple};
use pyo3::Borrowed;

use crate::errors::{type_err, value_err};

static INDEX: PyOnceLock<Py<PyAny>> = PyOnceLock::new();

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
    let index = INDEX.import(v.py(), "operator", "index")?;
    match index.call1((v,)) {
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

/// How a policy call's keywords address one level: a keyed level takes its key from the
/// keyword of its name; each unit's cost from the keyword of the unit ("requests" costs
/// 1 when not named); a level without units takes one permit.
pub struct LevelKeywords<'a> {
    pub name: &'a str,
    pub keyed: bool,
    pub units: &'a [String],
}

/// One level's arguments as a call gave them: its key (keyed levels only) and a cost per
/// unit (`[1]`, one permit, for a level without units).
pub struct LevelCall<'py> {
    pub key: Option<Bound<'py, PyAny>>,
    pub costs: Vec<u64>,
}

/// Keywords of policy calls: never a level's name.
pub const POLICY_KEYWORDS: [&str; 2] = ["timeout", "max_wait"];

/// The one reading of a policy call's keywords (`rq.Policy` and `ratequeue.redis`'s
/// policies): every level's key and costs, or a TypeError naming the missing key or
/// cost, or the keyword that is neither a keyed level's name nor a unit of any level.
pub fn policy_keywords<'py>(
    levels: &[LevelKeywords<'_>],
    kw: Option<&Bound<'py, PyDict>>,
) -> PyResult<Vec<LevelCall<'py>>> {
    // The keywords once, as text (a call passes a few): no Python string is made per lookup.
    let mut given: Vec<(String, Bound<'py, PyAny>, bool)> = Vec::new();
    if let Some(d) = kw {
        given.reserve(d.len());
        for (k, v) in d.iter() {
            let k = k.cast::<PyString>().map_err(|_| type_err("keyword", "a str", &k))?;
            given.push((k.to_str()?.to_owned(), v, false));
        }
    }
    let mut take = |name: &str| -> Option<Bound<'py, PyAny>> {
        given.iter_mut().find(|(k, _, _)| k == name).map(|(_, v, used)| {
            *used = true;
            v.clone()
        })
    };
    let mut out = Vec::with_capacity(levels.len());
    for l in levels {
        let key = if l.keyed {
            Some(take(l.name).ok_or_else(|| {
                PyTypeError::new_err(format!("missing key for level {:?}: pass {}=...", l.name, l.name))
            })?)
        } else {
            None
        };
        let mut costs = Vec::with_capacity(l.units.len().max(1));
        for u in l.units {
            costs.push(match take(u) {
                Some(v) => cost(u, &v)?,
                None if u == "requests" => 1,
                None => {
                    return Err(PyTypeError::new_err(format!(
                        "missing cost for unit {u:?} (level {:?}): pass {u}=...",
                        l.name
                    )))
                }
            });
        }
        if l.units.is_empty() {
            costs.push(1);
        }
        out.push(LevelCall { key, costs });
    }
    if let Some((k, _, _)) = given.iter().find(|(_, _, used)| !used) {
        return Err(PyTypeError::new_err(format!(
            "unexpected keyword {k:?}: not a keyed level's name nor a unit of any level"
        )));
    }
    Ok(out)
}

/// Refuses policy set-ups that can never work: a level named like a call keyword or
/// like a unit of any level (its keyword would be both a key and a cost).
pub fn check_policy_levels(levels: &[LevelKeywords<'_>]) -> PyResult<()> {
    for l in levels {
        if POLICY_KEYWORDS.contains(&l.name) {
            return Err(PyValueError::new_err(format!(
                "level {:?} is named like a keyword of Policy calls {POLICY_KEYWORDS:?}: rename the level",
                l.name
            )));
        }
        if levels.iter().any(|o| o.units.iter().any(|u| u == l.name)) {
            return Err(PyValueError::new_err(format!(
                "level {:?} is named like a unit a level counts: its keyword would be both a key \
                 and a cost; rename the level",
                l.name
            )));
        }
    }
    Ok(())
}

/// Private (for `ratequeue.redis`): a policy's levels as its calls' keywords address
/// them, checked as `rq.Policy` checks them; `parse` reads a call as `rq.Policy` does.
#[pyclass(frozen, name = "_PolicyKeywords", module = "ratequeue._ratequeue")]
pub struct PolicyKeywordsPy {
    specs: Vec<(String, bool, Vec<String>)>,
}

#[pymethods]
impl PolicyKeywordsPy {
    /// `levels`: (name, keyed, units) per level.
    #[new]
    fn new(levels: &Bound<'_, PyAny>) -> PyResult<Self> {
        let specs: Vec<(String, bool, Vec<String>)> = levels
            .extract()
            .map_err(|_| type_err("levels", "a sequence of (name, keyed, units)", levels))?;
        check_policy_levels(&keywords_of(&specs))?;
        Ok(PolicyKeywordsPy { specs })
    }

    /// The keys per level (None for an unkeyed level), as given, and the cost per unit.
    #[pyo3(signature = (kw = None))]
    fn parse<'py>(
        &self,
        py: Python<'py>,
        kw: Option<&Bound<'py, PyDict>>,
    ) -> PyResult<(Bound<'py, PyTuple>, Bound<'py, PyDict>)> {
        let levels = keywords_of(&self.specs);
        let calls = policy_keywords(&levels, kw)?;
        let costs = PyDict::new(py);
        for (l, c) in levels.iter().zip(&calls) {
            for (u, n) in l.units.iter().zip(&c.costs) {
                costs.set_item(u, n)?;
            }
        }
        let keys = PyTuple::new(
            py,
            calls
                .into_iter()
                .map(|c| c.key.unwrap_or_else(|| py.None().into_bound(py))),
        )?;
        Ok((keys, costs))
    }
}

fn keywords_of(specs: &[(String, bool, Vec<String>)]) -> Vec<LevelKeywords<'_>> {
    specs
        .iter()
        .map(|(name, keyed, units)| LevelKeywords {
            name,
            keyed: *keyed,
            units,
        })
        .collect()
}

/// The most units a call's costs are read for (one bit each).
pub const MAX_UNITS: usize = 64;

/// The cost of a unit a Limiter call does not name: 1 for "requests" or a limiter's only
/// unit; None for any other (the call must name it).
pub fn default_cost(units: &[String], unit: &str) -> Option<u64> {
    (units.len() == 1 || unit == "requests").then_some(1)
}

/// The one reading of a Limiter call's costs (`rq.Limiter` and `ratequeue.redis`'s
/// limiters): `n` is the first unit's cost, each keyword names a unit once, a unit not
/// named costs `defaults[i]` or is a TypeError. Writes one cost per unit into `out`.
/// At most [`MAX_UNITS`] units; allocates nothing.
pub fn unit_costs(
    units: &[String],
    defaults: &[Option<u64>],
    n: Option<&Bound<'_, PyAny>>,
    kw: Option<&Bound<'_, PyDict>>,
    out: &mut [u64],
) -> PyResult<()> {
    debug_assert!(units.len() <= MAX_UNITS && out.len() >= units.len());
    let mut given: u64 = 0;
    if let Some(n) = n {
        out[0] = cost(&units[0], n)?;
        given = 1;
    }
    if let Some(kw) = kw {
        for (k, v) in kw.iter() {
            let k = k.cast::<PyString>()?;
            let name = k.to_str()?;
            let Some(i) = units.iter().position(|u| u == name) else {
                return Err(PyTypeError::new_err(format!(
                    "unexpected keyword {name:?}: this limiter counts units {units:?}"
                )));
            };
            if given & (1 << i) != 0 {
                return Err(PyTypeError::new_err(format!("cost for unit {name:?} given twice")));
            }
            out[i] = cost(name, &v)?;
            given |= 1 << i;
        }
    }
    for (i, u) in units.iter().enumerate() {
        if given & (1 << i) == 0 {
            out[i] = defaults[i]
                .ok_or_else(|| PyTypeError::new_err(format!("missing cost for unit {u:?} (pass {u}=...)")))?;
        }
    }
    Ok(())
}

/// Private (for `ratequeue.redis`): a limiter's units, read as `rq.Limiter` reads a
/// call's costs.
#[pyclass(frozen, name = "_LimiterKeywords", module = "ratequeue._ratequeue")]
pub struct LimiterKeywordsPy {
    units: Vec<String>,
    defaults: Vec<Option<u64>>,
}

#[pymethods]
impl LimiterKeywordsPy {
    /// `units`: the units the costs are named by, first one first (at least one).
    #[new]
    fn new(units: &Bound<'_, PyAny>) -> PyResult<Self> {
        let units = texts("units", units)?;
        if units.is_empty() || units.len() > MAX_UNITS {
            return Err(value_err(
                "units",
                &format!("{units:?}"),
                &format!("must name from 1 to {MAX_UNITS} units"),
            ));
        }
        let defaults = units.iter().map(|u| default_cost(&units, u)).collect();
        Ok(LimiterKeywordsPy { units, defaults })
    }

    /// The cost per unit of a call `(n, **kw)`, in the order of the units.
    #[pyo3(signature = (n = None, kw = None))]
    fn parse(&self, n: Option<&Bound<'_, PyAny>>, kw: Option<&Bound<'_, PyDict>>) -> PyResult<Vec<u64>> {
        let mut out = vec![0; self.units.len()];
        unit_costs(&self.units, &self.defaults, n, kw, &mut out)?;
        Ok(out)
    }
}
