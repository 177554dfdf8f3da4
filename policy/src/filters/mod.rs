//! Candidate filters: each a unit in its own file with its id (the metric label), the words it
//! gives a filtered candidate, the signals it reads and the validation of its part of a rule's
//! `filter`. A decision applies [`REGISTERED`] in order; the first that removes a candidate
//! says why. Then `preferLocality`, which judges the survivors together, drops those elsewhere
//! when a local one is fast enough.
//!
//! Adding a filter: a file here implementing [`CandidateFilter`] (its field in
//! [`crate::kinds::Filter`] if rules configure it) and one line in [`REGISTERED`].

mod endpoint_subset;
mod exclude_external;
mod labels;
mod max_kv_cache_usage;
mod max_queued;
mod prefer_locality;
mod same_locality;
mod worker_down;

use std::fmt::Write as _;

use crate::candidate::{Candidate, FilterId, Filtered, Signals};
use crate::catalog::{Catalog, Check};
use crate::kinds::Filter;
use crate::resolve::Request;

pub use endpoint_subset::{ENDPOINT_SUBSET, host_port};
pub use worker_down::WORKER_DOWN;

/// A refusal's words: written only when the decision keeps words (Explain), so that Route
/// formats nothing for the candidates it filters.
#[derive(Debug, Default)]
pub struct Words(Option<String>);

impl Words {
    /// Words that are kept (`true`) or dropped.
    pub fn kept(keep: bool) -> Self {
        Self(keep.then(String::new))
    }

    pub fn say(&mut self, args: std::fmt::Arguments<'_>) {
        if let Some(s) = &mut self.0 {
            // Writing to a String does not fail.
            let _ = s.write_fmt(args);
        }
    }

    fn take(&mut self) -> String {
        self.0.as_mut().map(std::mem::take).unwrap_or_default()
    }
}

/// The labels of `c`'s worker set or provider (none when the catalog lacks it).
fn labels_of<'c>(catalog: &'c Catalog, c: &Candidate<'_>) -> Option<&'c crate::kinds::Labels> {
    match &c.target {
        crate::candidate::Target::Worker { worker_set, .. } => {
            catalog.worker_sets.get(*worker_set).map(|w| &w.labels)
        }
        crate::candidate::Target::Provider { name, .. } => {
            catalog.providers.get(*name).map(|p| &p.labels)
        }
    }
}

/// One eligibility check.
pub trait CandidateFilter: Sync {
    fn id(&self) -> FilterId;
    /// A load limit applies to a rule's own candidates, not to its fallback (which exists for
    /// when the fleet is busy).
    fn load_limit(&self) -> bool {
        false
    }
    /// Whether it can refuse anything under `f` for `req` (asked once per decision: a filter
    /// the rule does not configure is not asked about each candidate). A filter that is not
    /// configured must refuse nothing (tested for every registered one).
    fn configured(&self, _f: &Filter, _req: &Request<'_>) -> bool {
        true
    }
    /// What it reads besides the worker's metrics.
    fn needs(&self, _f: &Filter) -> Signals {
        Signals::NONE
    }
    /// Whether `c` is not eligible under `f`; when it is not, why, said to `why`.
    fn refuses(
        &self,
        f: &Filter,
        req: &Request<'_>,
        c: &Candidate<'_>,
        catalog: &Catalog,
        why: &mut Words,
    ) -> bool;
    /// Problems with `f` (at `at`, e.g. `spec.rules[0].filter`).
    fn problems(&self, _f: &Filter, _at: &str, _c: &mut Check<'_>) {}
}

/// Every filter, in the order they are tried.
pub static REGISTERED: &[&dyn CandidateFilter] = &[
    &worker_down::WorkerDown,
    &endpoint_subset::EndpointSubset,
    &exclude_external::ExcludeExternal,
    &labels::LabelsMatch,
    &same_locality::SameLocality,
    &max_queued::MaxQueued,
    &max_kv_cache_usage::MaxKvCacheUsage,
];

/// Marks the candidates `f` removes for `req` (`fallback`: only the filters that are no load
/// limits), with their words when `words` (Explain); returns what the locality preference
/// made of the survivors when `words` and the rule has one.
pub fn apply(
    catalog: &Catalog,
    f: &Filter,
    req: &Request<'_>,
    cands: &mut [Candidate<'_>],
    fallback: bool,
    words: bool,
) -> Option<String> {
    let mut why = Words::kept(words);
    // The filters that run, one bit each (no allocation per decision; at most 64 filters).
    let active: u64 = REGISTERED
        .iter()
        .enumerate()
        .filter(|(_, u)| !(fallback && u.load_limit()) && u.configured(f, req))
        .fold(0, |m, (i, _)| m | 1 << i);
    for c in cands.iter_mut().filter(|c| c.filtered.is_none()) {
        c.filtered = REGISTERED
            .iter()
            .enumerate()
            .filter(|(i, _)| active & 1 << i != 0)
            .map(|(_, u)| u)
            .find(|u| u.refuses(f, req, c, catalog, &mut why))
            .map(|u| Filtered {
                by: u.id(),
                text: why.take(),
            });
    }
    prefer_locality::apply(catalog, f, req, cands, words)
}

/// What the filters of `f` read.
pub fn needs(f: &Filter) -> Signals {
    REGISTERED
        .iter()
        .fold(prefer_locality::needs(f), |s, u| s.union(u.needs(f)))
}

/// Every problem of a rule's filter.
pub fn problems(f: &Filter, at: &str, c: &mut Check<'_>) {
    for u in REGISTERED {
        u.problems(f, at, c);
    }
    prefer_locality::problems(f, at, c);
}

/// Every filter id (for metrics and docs).
pub fn ids() -> impl Iterator<Item = FilterId> {
    REGISTERED
        .iter()
        .map(|u| u.id())
        .chain([prefer_locality::ID])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kinds::Filter;

    fn worker(waiting: u32, kv: f64, up: bool) -> Candidate<'static> {
        Candidate {
            load: waiting,
            ..crate::candidate::test_worker(|s| {
                s.waiting = waiting;
                s.kv_cache_usage = kv;
                s.up = up;
            })
        }
    }

    #[test]
    fn a_filter_that_is_not_configured_refuses_nothing() {
        use proptest::prelude::*;
        let levels = [
            crate::locality::Level::Cluster,
            crate::locality::Level::Region,
            crate::locality::Level::Zone,
        ];
        proptest!(|(
            max_queued in proptest::option::of(0u32..4),
            max_kv in proptest::option::of(0.0f64..1.0),
            label in any::<bool>(),
            exclude_external in any::<bool>(),
            level in proptest::option::of(0usize..3),
            subset in any::<bool>(),
            workers in proptest::collection::vec((0u32..6, 0.0f64..1.0, any::<bool>(), any::<bool>()), 0..6),
            providers in 0usize..3,
        )| {
            let f = Filter {
                max_queued,
                max_kv_cache_usage: max_kv,
                labels: if label { [("gpu".into(), "h100".into())].into() } else { Default::default() },
                exclude_external,
                same_locality: level.map(|l| levels[l]),
                ..Filter::default()
            };
            let endpoints = ["10.0.0.1:8000".to_owned()];
            let req = Request {
                endpoint_subset: if subset { &endpoints } else { &[] },
                ..Request::for_tests()
            };
            let mut cands: Vec<Candidate<'static>> = workers
                .iter()
                .map(|&(waiting, kv, up, listed)| {
                    let mut c = worker(waiting, kv, up);
                    if let crate::candidate::Target::Worker { state, .. } = &mut c.target {
                        state.address = Some(if listed { "10.0.0.1:8000" } else { "10.0.0.2:8000" });
                    }
                    c
                })
                .collect();
            cands.extend((0..providers).map(|_| Candidate {
                target: crate::candidate::Target::Provider { name: "p", endpoint: "https://p" },
                external: true,
                ..worker(0, 0.0, true)
            }));
            let cat = Catalog::default();
            for u in REGISTERED.iter().filter(|u| !u.configured(&f, &req)) {
                for c in &cands {
                    prop_assert!(
                        !u.refuses(&f, &req, c, &cat, &mut Words::kept(false)),
                        "{} refused {c:?} under {f:?} although not configured",
                        u.id().0
                    );
                }
            }
        });
    }

    #[test]
    fn filter_ids_are_unique() {
        assert!(REGISTERED.len() <= 64, "apply keeps one bit per filter");
        let all: Vec<FilterId> = ids().collect();
        let unique: std::collections::BTreeSet<FilterId> = all.iter().copied().collect();
        assert_eq!(unique.len(), all.len());
    }

    #[test]
    fn the_first_filter_that_refuses_names_itself_and_fallbacks_skip_load_limits() {
        let f = Filter {
            max_queued: Some(2),
            max_kv_cache_usage: Some(0.7),
            ..Filter::default()
        };
        let cat = Catalog::default();
        let mut cands = vec![
            worker(3, 0.9, true),
            worker(0, 0.9, true),
            worker(0, 0.1, false),
            worker(0, 0.1, true),
        ];
        apply(&cat, &f, &Request::for_tests(), &mut cands, false, true);
        let by: Vec<Option<&str>> = cands
            .iter()
            .map(|c| c.filtered.as_ref().map(|x| x.by.0))
            .collect();
        let words: Vec<&str> = cands
            .iter()
            .map(|c| c.filtered.as_ref().map_or("", |x| x.text.as_str()))
            .collect();
        assert_eq!(
            words,
            [
                "3 queued > maxQueued 2",
                "KV cache 90% > maxKvCacheUsage 70%",
                "worker is down",
                ""
            ]
        );
        let mut quiet = vec![worker(3, 0.9, true)];
        apply(&cat, &f, &Request::for_tests(), &mut quiet, false, false);
        assert_eq!(
            quiet[0].filtered,
            Some(Filtered {
                by: FilterId("max_queued"),
                text: String::new()
            }),
            "without words a refusal names its filter only"
        );
        assert_eq!(
            by,
            [
                Some("max_queued"),
                Some("max_kv_cache_usage"),
                Some("worker_down"),
                None
            ]
        );
        let mut fb = vec![worker(3, 0.9, true)];
        apply(&cat, &f, &Request::for_tests(), &mut fb, true, false);
        assert!(
            fb[0].filtered.is_none(),
            "load limits do not apply to fallbacks"
        );
    }

    #[test]
    fn an_out_of_range_cache_limit_is_a_problem_of_its_filter() {
        let f = Filter {
            max_kv_cache_usage: Some(1.5),
            ..Filter::default()
        };
        let mut out = Vec::new();
        problems(
            &f,
            "spec.rules[0].filter",
            &mut Check {
                kind: crate::Kind::Policy,
                name: "p",
                out: &mut out,
            },
        );
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].path, "spec.rules[0].filter.maxKvCacheUsage");
    }
}
