//! `filter.excludeExternal`: external providers are not candidates.

use super::{CandidateFilter, Words};
use crate::candidate::{Candidate, FilterId};
use crate::catalog::Catalog;
use crate::kinds::Filter;
use crate::resolve::Request;

pub(super) struct ExcludeExternal;

impl CandidateFilter for ExcludeExternal {
    fn id(&self) -> FilterId {
        FilterId("exclude_external")
    }

    fn configured(&self, f: &Filter, _req: &Request<'_>) -> bool {
        f.exclude_external
    }

    fn refuses(
        &self,
        f: &Filter,
        _req: &Request<'_>,
        c: &Candidate<'_>,
        _catalog: &Catalog,
        why: &mut Words,
    ) -> bool {
        let refused = f.exclude_external && c.external;
        if refused {
            why.say(format_args!("external providers are excluded"));
        }
        refused
    }
}
