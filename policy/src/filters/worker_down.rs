//! A worker that is down (announced down, or never up) is never a candidate.

use super::{CandidateFilter, Words};
use crate::candidate::{Candidate, FilterId, Target};
use crate::catalog::Catalog;
use crate::kinds::Filter;
use crate::resolve::Request;

pub const WORKER_DOWN: FilterId = FilterId("worker_down");

pub(super) struct WorkerDown;

impl CandidateFilter for WorkerDown {
    fn id(&self) -> FilterId {
        WORKER_DOWN
    }

    fn refuses(
        &self,
        _f: &Filter,
        _req: &Request<'_>,
        c: &Candidate<'_>,
        _catalog: &Catalog,
        why: &mut Words,
    ) -> bool {
        let refused = matches!(&c.target, Target::Worker { state, .. } if !state.up);
        if refused {
            why.say(format_args!("worker is down"));
        }
        refused
    }
}
