//! `filter.labels`: only candidates whose worker set or provider carries every label.

use super::CandidateFilter;
use crate::candidate::{Candidate, FilterId, Target};
use crate::catalog::{Catalog, Check};
use crate::kinds::Filter;

pub(super) struct LabelsMatch;

impl CandidateFilter for LabelsMatch {
    fn id(&self) -> FilterId {
        FilterId("labels")
    }

    fn check(&self, f: &Filter, c: &Candidate, catalog: &Catalog) -> Option<String> {
        if f.labels.is_empty() {
            return None;
        }
        let labels = match &c.target {
            Target::Worker { worker_set, .. } => {
                catalog.worker_sets.get(&**worker_set).map(|w| &w.labels)
            }
            Target::Provider { name, .. } => catalog.providers.get(name).map(|p| &p.labels),
        };
        f.labels
            .iter()
            .find(|(k, v)| labels.and_then(|l| l.get(*k)) != Some(*v))
            .map(|(k, v)| format!("label {k}={v} does not match"))
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
