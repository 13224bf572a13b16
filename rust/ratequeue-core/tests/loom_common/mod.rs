//! What the loom models share: how a model is run.

/// Runs `f` under loom, with a preemption bound of 3 unless LOOM_MAX_PREEMPTIONS says.
pub fn model<F: Fn() + Sync + Send + 'static>(f: F) {
    let mut b = loom::model::Builder::new();
    if b.preemption_bound.is_none() {
        b.preemption_bound = Some(3);
    }
    b.check(f);
}
