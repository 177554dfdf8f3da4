//! The request's endpoint subset (the endpoint picker protocol's subset hint): when it names
//! endpoints, only workers at one of them are candidates, and no provider is.

use super::{CandidateFilter, Words};
use crate::candidate::{Candidate, FilterId, Target};
use crate::catalog::Catalog;
use crate::kinds::Filter;
use crate::resolve::Request;

pub const ENDPOINT_SUBSET: FilterId = FilterId("endpoint_subset");

pub(super) struct EndpointSubset;

/// `host:port` of an address as workers announce it (`http://10.0.0.7:8000/`, or already
/// `10.0.0.7:8000`): what a proxy's endpoint list names.
pub fn host_port(address: &str) -> &str {
    let rest = address.split_once("://").map_or(address, |(_, rest)| rest);
    rest.split('/').next().unwrap_or(rest)
}

impl CandidateFilter for EndpointSubset {
    fn id(&self) -> FilterId {
        ENDPOINT_SUBSET
    }

    fn configured(&self, _f: &Filter, req: &Request<'_>) -> bool {
        !req.endpoint_subset.is_empty()
    }

    fn refuses(
        &self,
        _f: &Filter,
        req: &Request<'_>,
        c: &Candidate<'_>,
        _catalog: &Catalog,
        why: &mut Words,
    ) -> bool {
        if req.endpoint_subset.is_empty() {
            return false;
        }
        let refused = match &c.target {
            Target::Worker { state, .. } => !state.address.is_some_and(|a| {
                let at = host_port(a);
                req.endpoint_subset.iter().any(|e| e == at)
            }),
            Target::Provider { .. } => true,
        };
        if refused {
            why.say(format_args!("not in the request's endpoint subset"));
        }
        refused
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::candidate::test_worker;

    fn request(subset: &[String]) -> Request<'_> {
        Request {
            endpoint_subset: subset,
            ..Request::for_tests()
        }
    }

    #[test]
    fn host_port_strips_the_scheme_and_the_path() {
        assert_eq!(host_port("http://10.0.0.7:8000"), "10.0.0.7:8000");
        assert_eq!(host_port("https://10.0.0.7:8000/v1/"), "10.0.0.7:8000");
        assert_eq!(host_port("10.0.0.7:8000"), "10.0.0.7:8000");
        assert_eq!(host_port("[fd00::7]:8000"), "[fd00::7]:8000");
    }

    #[test]
    fn only_workers_at_a_listed_endpoint_pass_and_no_subset_passes_everyone() {
        let at = |address: &'static str| {
            test_worker(|s| {
                s.address = Some(address);
            })
        };
        let subset = vec!["10.0.0.7:8000".to_owned()];
        let mut why = Words::kept(true);
        let f = Filter::default();
        let cat = Catalog::default();
        let refuses = |c: &Candidate<'_>, s: &[String], why: &mut Words| {
            EndpointSubset.refuses(&f, &request(s), c, &cat, why)
        };
        assert!(!refuses(&at("http://10.0.0.7:8000"), &subset, &mut why));
        assert!(refuses(&at("http://10.0.0.8:8000"), &subset, &mut why));
        assert_eq!(why.take(), "not in the request's endpoint subset");
        assert!(!refuses(&at("http://10.0.0.8:8000"), &[], &mut why));
        let provider = Candidate {
            target: Target::Provider {
                name: "cloud",
                endpoint: "10.0.0.7:8000",
            },
            ..at("http://10.0.0.7:8000")
        };
        assert!(
            refuses(&provider, &subset, &mut why),
            "providers are never in a subset"
        );
    }
}
