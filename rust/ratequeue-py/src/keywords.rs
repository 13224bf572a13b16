//! The one reading of a call's keywords: a policy's levels (keys and costs by keyword)
//! and a limiter's units (costs by keyword), shared by `rq.Policy`/`rq.Limiter` and the
//! private parsers `ratequeue.redis` uses, so both refuse alike.

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyInt, PyString, PyTuple};

use crate::args::{cost, texts};
use crate::errors::{given_twice, missing_keyword, setup_err, type_err, unexpected_keyword, value_err};

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
    policy_keywords_named(levels, kw.into_iter().flat_map(|d| d.iter()))
}

/// [`policy_keywords`] over keywords as (name, value) pairs (a dict's items, or a
/// vectorcall's `kwnames` beside its values): the same calls and the same TypeErrors.
pub fn policy_keywords_named<'py>(
    levels: &[LevelKeywords<'_>],
    named: impl IntoIterator<Item = (Bound<'py, PyAny>, Bound<'py, PyAny>)>,
) -> PyResult<Vec<LevelCall<'py>>> {
    // The keywords once (a call passes a few), checked as text here; a lookup reads the
    // text again (no Python string made, none copied).
    let named = named.into_iter();
    let mut given: Vec<(Bound<'py, PyString>, Bound<'py, PyAny>, bool)> = Vec::with_capacity(named.size_hint().0);
    for (k, v) in named {
        let k = k
            .cast_into::<PyString>()
            .map_err(|e| type_err("keyword", "a str", e.into_inner().as_any()))?;
        k.to_str()?;
        given.push((k, v, false));
    }
    let mut take = |name: &str| -> Option<Bound<'py, PyAny>> {
        given
            .iter_mut()
            .find(|(k, _, _)| k.to_str().is_ok_and(|k| k == name))
            .map(|(_, v, used)| {
                *used = true;
                v.clone()
            })
    };
    let mut out = Vec::with_capacity(levels.len());
    for l in levels {
        let key = if l.keyed {
            Some(
                take(l.name)
                    .ok_or_else(|| missing_keyword(&format!("key for level {:?}: pass {}=...", l.name, l.name)))?,
            )
        } else {
            None
        };
        let mut costs = Vec::with_capacity(l.units.len().max(1));
        for u in l.units {
            costs.push(match take(u) {
                Some(v) => plain_cost(u, &v)?,
                None if u == "requests" => 1,
                None => {
                    return Err(missing_keyword(&format!(
                        "cost for unit {u:?} (level {:?}): pass {u}=...",
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
        return Err(unexpected_keyword(
            k.to_str()?,
            "not a keyed level's name nor a unit of any level",
        ));
    }
    Ok(out)
}

/// Refuses policy set-ups that can never work: a level named like a call keyword or
/// like a unit of any level (its keyword would be both a key and a cost).
pub fn check_policy_levels(levels: &[LevelKeywords<'_>]) -> PyResult<()> {
    for l in levels {
        if POLICY_KEYWORDS.contains(&l.name) {
            return Err(setup_err(format!(
                "level {:?} is named like a keyword of Policy calls {POLICY_KEYWORDS:?}: rename the level",
                l.name
            )));
        }
        if levels.iter().any(|o| o.units.iter().any(|u| u == l.name)) {
            return Err(setup_err(format!(
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
    unit_costs_named(units, &[], defaults, n, kw.into_iter().flat_map(|d| d.iter()), out)
}

/// [`unit_costs`] over keywords as (name, value) pairs (a dict's items, or a vectorcall's
/// `kwnames` beside its values): the same costs and the same TypeErrors. `interned`: the
/// units' names as interned strings (or empty), matched by identity before by text.
pub fn unit_costs_named<'py>(
    units: &[String],
    interned: &[Py<PyString>],
    defaults: &[Option<u64>],
    n: Option<&Bound<'py, PyAny>>,
    named: impl IntoIterator<Item = (Bound<'py, PyAny>, Bound<'py, PyAny>)>,
    out: &mut [u64],
) -> PyResult<()> {
    debug_assert!(units.len() <= MAX_UNITS && out.len() >= units.len());
    let mut given: u64 = 0;
    if let Some(n) = n {
        out[0] = plain_cost(&units[0], n)?;
        given = 1;
    }
    for (k, v) in named {
        // The interpreter passes the names written in a call as interned strings.
        let i = match interned.iter().position(|u| u.as_ptr() == k.as_ptr()) {
            Some(i) => i,
            None => {
                let k = k.cast_into::<PyString>()?;
                let name = k.to_str()?;
                units
                    .iter()
                    .position(|u| u == name)
                    .ok_or_else(|| unexpected_keyword(name, &format!("this limiter counts units {units:?}")))?
            }
        };
        let name = &units[i];
        if given & (1 << i) != 0 {
            return Err(given_twice(name));
        }
        out[i] = plain_cost(name, &v)?;
        given |= 1 << i;
    }
    for (i, u) in units.iter().enumerate() {
        if given & (1 << i) == 0 {
            out[i] = defaults[i].ok_or_else(|| missing_keyword(&format!("cost for unit {u:?} (pass {u}=...)")))?;
        }
    }
    Ok(())
}

/// [`cost`], with a plain int below 2**64 - 1 read at once (the one validation path
/// decides every other value, including the saturating 2**64 - 1).
#[inline]
pub(crate) fn plain_cost(name: &str, v: &Bound<'_, PyAny>) -> PyResult<u64> {
    if v.is_exact_instance_of::<PyInt>() {
        if let Ok(c) = v.extract::<u64>() {
            if c != u64::MAX {
                return Ok(c);
            }
        }
    }
    cost(name, v)
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
