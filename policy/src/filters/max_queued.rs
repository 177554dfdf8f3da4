//! `filter.maxQueued`: workers with more waiting requests (the engine's queue and what this
//! replica sent there since) are not candidates. A load limit: fallbacks ignore it.

use super::{CandidateFilter, Words};
use crate::candidate::{Candidate, FilterId};
use crate::catalog::Catalog;
use crate::kinds::Filter;
use crate::resolve::Request;

pub(super) struct MaxQueued;

impl CandidateFilter for MaxQueued {
    fn id(&self) -> FilterId {
        FilterId("max_queued")
    }

    fn load_limit(&self) -> bool {
        true
    }

    fn configured(&self, f: &Filter, _req: &Request<'_>) -> bool {
        f.max_queued.is_some()
    }

    fn refuses(
        &self,
        f: &Filter,
        _req: &Request<'_>,
        c: &Candidate<'_>,
        _catalog: &Catalog,
        why: &mut Words,
    ) -> bool {
        let (Some((_, w)), Some(max)) = (c.worker(), f.max_queued) else {
            return false;
        };
        let refused = w.waiting > max;
        if refused {
            why.say(format_args!("{} queued > maxQueued {max}", w.waiting));
        }
        refused
    }
}
