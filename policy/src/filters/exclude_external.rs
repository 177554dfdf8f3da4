//! `filter.excludeExternal`: external providers are not candidates.

use super::CandidateFilter;
use crate::candidate::{Candidate, FilterId};
use crate::catalog::Catalog;
use crate::kinds::Filter;

pub(super) struct ExcludeExternal;

impl CandidateFilter for ExcludeExternal {
    fn id(&self) -> FilterId {
        FilterId("exclude_external")
    }

    fn check(&self, f: &Filter, c: &Candidate, _catalog: &Catalog) -> Option<String> {
        (f.exclude_external && c.external).then(|| "external providers are excluded".into())
    }
}
