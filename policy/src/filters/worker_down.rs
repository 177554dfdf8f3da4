//! A worker that is down (announced down, or never up) is never a candidate.

use super::CandidateFilter;
use crate::candidate::{Candidate, FilterId, Target};
use crate::catalog::Catalog;
use crate::kinds::Filter;

pub const WORKER_DOWN: FilterId = FilterId("worker_down");

pub(super) struct WorkerDown;

impl CandidateFilter for WorkerDown {
    fn id(&self) -> FilterId {
        WORKER_DOWN
    }

    fn check(&self, _f: &Filter, c: &Candidate, _catalog: &Catalog) -> Option<String> {
        match &c.target {
            Target::Worker { state, .. } if !state.up => Some("worker is down".into()),
            _ => None,
        }
    }
}
