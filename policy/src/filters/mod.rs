//! Candidate filters: each a unit in its own file with its id (the metric label), the words it
//! gives a filtered candidate, the signals it reads and the validation of its part of a rule's
//! `filter`. A decision applies [`REGISTERED`] in order; the first that removes a candidate
//! says why.
//!
//! Adding a filter: a file here implementing [`CandidateFilter`] (its field in
//! [`crate::kinds::Filter`] if rules configure it) and one line in [`REGISTERED`].

mod exclude_external;
mod labels;
mod max_kv_cache_usage;
mod max_queued;
mod worker_down;

use crate::candidate::{Candidate, FilterId, Filtered, Signals};
use crate::catalog::{Catalog, Check};
use crate::kinds::Filter;

pub use worker_down::WORKER_DOWN;

/// One eligibility check.
pub trait CandidateFilter: Sync {
    fn id(&self) -> FilterId;
    /// A load limit applies to a rule's own candidates, not to its fallback (which exists for
    /// when the fleet is busy).
    fn load_limit(&self) -> bool {
        false
    }
    /// What it reads besides the worker's metrics.
    fn needs(&self, _f: &Filter) -> Signals {
        Signals::NONE
    }
    /// Why `c` is not eligible under `f`, or `None`.
    fn check(&self, f: &Filter, c: &Candidate, catalog: &Catalog) -> Option<String>;
    /// Problems with `f` (at `at`, e.g. `spec.rules[0].filter`).
    fn problems(&self, _f: &Filter, _at: &str, _c: &mut Check<'_>) {}
}

/// Every filter, in the order they are tried.
pub static REGISTERED: &[&dyn CandidateFilter] = &[
    &worker_down::WorkerDown,
    &exclude_external::ExcludeExternal,
    &labels::LabelsMatch,
    &max_queued::MaxQueued,
    &max_kv_cache_usage::MaxKvCacheUsage,
];

/// Marks the candidates `f` removes (`fallback`: only the filters that are no load limits).
pub fn apply(catalog: &Catalog, f: &Filter, cands: &mut [Candidate], fallback: bool) {
    for c in cands.iter_mut().filter(|c| c.filtered.is_none()) {
        c.filtered = REGISTERED
            .iter()
            .filter(|u| !(fallback && u.load_limit()))
            .find_map(|u| {
                u.check(f, c, catalog)
                    .map(|text| Filtered { by: u.id(), text })
            });
    }
}

/// What the filters of `f` read.
pub fn needs(f: &Filter) -> Signals {
    REGISTERED
        .iter()
        .fold(Signals::NONE, |s, u| s.union(u.needs(f)))
}

/// Every problem of a rule's filter.
pub fn problems(f: &Filter, at: &str, c: &mut Check<'_>) {
    for u in REGISTERED {
        u.problems(f, at, c);
    }
}

/// Every filter id (for metrics and docs).
pub fn ids() -> impl Iterator<Item = FilterId> {
    REGISTERED.iter().map(|u| u.id())
}
