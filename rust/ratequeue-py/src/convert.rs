//! Conversions of Python values the argument checks share: integers through the
//! `__index__` protocol (no Python module imported), keys of keyed limits, cost arrays.

use numpy::PyReadonlyArray1;
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyInt, PyString};
use ratequeue_core::KeyHasher;

use crate::errors::{length_err, type_err};

/// What a key may be, in a TypeError.
const KEY_KINDS: &str = "a str, bytes or int";

/// `operator.index(v)`: `v` as a Python int through its `__index__` (a TypeError when it
/// has none), called through the C API.
pub fn index<'py>(v: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyInt>> {
    // SAFETY: `v` is a valid object of this thread's attached interpreter; the result is
    // a new reference or NULL with an exception set.
    let i = unsafe { Bound::from_owned_ptr_or_err(v.py(), pyo3::ffi::PyNumber_Index(v.as_ptr()))? };
    Ok(i.cast_into::<PyInt>()?)
}

/// The map key of a Python key: a str by its text, bytes by its bytes, an integer (int of
/// any size, bool, numpy integer: whatever `operator.index` accepts) by its exact value.
pub fn key_of(h: &KeyHasher, key: &Bound<'_, PyAny>) -> PyResult<u64> {
    key_named(h, key, "key")
}

/// As [`key_of`], naming the argument `name` in the TypeError for anything else.
pub fn key_named(h: &KeyHasher, key: &Bound<'_, PyAny>, name: &str) -> PyResult<u64> {
    if let Ok(s) = key.cast::<PyString>() {
        return Ok(h.str(s.to_str()?));
    }
    if let Ok(b) = key.cast::<PyBytes>() {
        return Ok(h.bytes(b.as_bytes()));
    }
    if let Ok(v) = key.extract::<i64>() {
        return Ok(h.signed(v));
    }
    if let Ok(v) = key.extract::<u64>() {
        return Ok(h.int(v));
    }
    // An integer outside [-2^63, 2^64), by its decimal digits; or not an integer.
    let v = index(key).map_err(|e| {
        if e.is_instance_of::<PyTypeError>(key.py()) {
            type_err(name, KEY_KINDS, key)
        } else {
            e
        }
    })?;
    Ok(h.big_int(v.str()?.to_str()?))
}

/// The optional `costs` of a batch of `n` keys: a numpy uint64 array or a sequence of
/// costs, exactly `n` of them.
pub fn costs_array(costs: Option<&Bound<'_, PyAny>>, n: usize) -> PyResult<Option<Vec<u64>>> {
    let Some(c) = costs else { return Ok(None) };
    let v: Vec<u64> = if let Ok(a) = c.extract::<PyReadonlyArray1<'_, u64>>() {
        a.as_slice()
            .map(|s| s.to_vec())
            .unwrap_or_else(|_| a.as_array().iter().copied().collect())
    } else {
        crate::args::numbers("costs", c, crate::args::cost)?
    };
    if v.len() != n {
        return Err(length_err("costs", v.len(), n, "keys"));
    }
    Ok(Some(v))
}
