//! `filter.labels`: only candidates whose worker set or provider carries every label.

use super::{CandidateFilter, Words};
use crate::candidate::{Candidate, FilterId};
use crate::catalog::{Catalog, Check};
use crate::kinds::Filter;
use crate::resolve::Request;

pub(super) struct LabelsMatch;

impl CandidateFilter for LabelsMatch {
    fn id(&self) -> FilterId {
        FilterId("labels")
    }

    fn configured(&self, f: &Filter, _req: &Request<'_>) -> bool {
        !f.labels.is_empty()
    }

    fn refuses(
        &self,
        f: &Filter,
        _req: &Request<'_>,
        c: &Candidate<'_>,
        catalog: &Catalog,
        why: &mut Words,
    ) -> bool {
        if f.labels.is_empty() {
            return false;
        }
        let labels = super::labels_of(catalog, c);
        let Some((k, v)) = f
            .labels
            .iter()
            .find(|(k, v)| labels.and_then(|l| l.get(*k)) != Some(*v))
        else {
            return false;
        };
        why.say(format_args!("label {k}={v} does not match"));
        true
    }

    fn problems(&self, f: &Filter, at: &str, c: &mut Check<'_>) {
        for k in f.labels.keys().filter(|k| k.is_empty()) {
            c.fail(
                format!("{at}.labels"),
                format!("label name {k:?} must not be empty"),
            );
        }
    }
}
