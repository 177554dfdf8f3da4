//! `filter.maxQueued`: workers with more waiting requests (the engine's queue and what this
//! replica sent there since) are not candidates. A load limit: fallbacks ignore it.

use super::CandidateFilter;
use crate::candidate::{Candidate, FilterId};
use crate::catalog::Catalog;
use crate::kinds::Filter;

pub(super) struct MaxQueued;

impl CandidateFilter for MaxQueued {
    fn id(&self) -> FilterId {
        FilterId("max_queued")
    }

    fn load_limit(&self) -> bool {
        true
    }

    fn check(&self, f: &Filter, c: &Candidate, _catalog: &Catalog) -> Option<String> {
        let (_, w) = c.worker()?;
        f.max_queued
            .filter(|max| w.waiting > *max)
            .map(|max| format!("{} queued > maxQueued {max}", w.waiting))
    }
}
