//! The benchmarks' floor (private): what calling a method of the extension costs at all.

use pyo3::prelude::*;

/// A frozen object whose one method does nothing, called as the public types' are.
#[pyclass(frozen, name = "_Floor", module = "ratequeue._ratequeue")]
pub struct FloorPy;

#[pymethods]
impl FloorPy {
    #[new]
    fn new() -> Self {
        FloorPy
    }

    /// Does nothing: the floor of a method call, for benchmarks.
    fn noop(&self) {}
}
