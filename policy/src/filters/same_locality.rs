//! `filter.sameLocality`: only candidates at the asking gateway's cluster, region or zone.

use super::{CandidateFilter, Words};
use crate::candidate::{Candidate, FilterId};
use crate::catalog::Catalog;
use crate::kinds::Filter;
use crate::resolve::Request;

pub(super) struct SameLocality;

impl CandidateFilter for SameLocality {
    fn id(&self) -> FilterId {
        FilterId("same_locality")
    }

    fn configured(&self, f: &Filter, _req: &Request<'_>) -> bool {
        f.same_locality.is_some()
    }

    fn refuses(
        &self,
        f: &Filter,
        req: &Request<'_>,
        c: &Candidate<'_>,
        catalog: &Catalog,
        why: &mut Words,
    ) -> bool {
        let Some(level) = f.same_locality else {
            return false;
        };
        let there = super::labels_of(catalog, c)
            .and_then(|l| l.get(level.label()))
            .map(String::as_str);
        let Some(here) = req.origin.at(level) else {
            why.say(format_args!(
                "this replica's {} is not configured ([locality] {})",
                level.as_str(),
                level.as_str()
            ));
            return true;
        };
        match there {
            Some(t) if t == here => false,
            Some(t) => {
                why.say(format_args!(
                    "in {} {t}, not the asking gateway's {here}",
                    level.as_str()
                ));
                true
            }
            None => {
                why.say(format_args!(
                    "no {} label: its {} is unknown",
                    level.label(),
                    level.as_str()
                ));
                true
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::candidate::Target;
    use crate::locality::{CLUSTER_LABEL, Level, Origin};

    fn catalog() -> Catalog {
        let mut c = Catalog::default();
        for (name, cluster) in [
            ("here", Some("b")),
            ("there", Some("c")),
            ("unlabeled", None),
        ] {
            let yaml = format!(
                "apiVersion: kvplane.io/v1alpha1\nkind: InferenceWorkerSet\nmetadata: {{name: {name}}}\nspec:\n  model: m\n  labels: {{{}}}\n",
                cluster.map_or(String::new(), |c| format!("{CLUSTER_LABEL}: {c}"))
            );
            c.insert(crate::Object::from_yaml(serde_yaml_ng::from_str(&yaml).unwrap()).unwrap());
        }
        c
    }

    fn on(set: &'static str) -> Candidate<'static> {
        let mut c = crate::candidate::test_worker(|_| {});
        if let Target::Worker { worker_set, .. } = &mut c.target {
            *worker_set = set;
        }
        c
    }

    #[test]
    fn only_the_origins_cluster_passes_and_an_unknown_place_never_does() {
        let f = Filter {
            same_locality: Some(Level::Cluster),
            ..Filter::default()
        };
        let cat = catalog();
        let b = Origin {
            cluster: Some("b".into()),
            ..Origin::default()
        };
        let req = Request {
            origin: &b,
            ..Request::for_tests()
        };
        let said = |set: &'static str, req: &Request<'_>| {
            let mut why = Words::kept(true);
            let refused = SameLocality.refuses(&f, req, &on(set), &cat, &mut why);
            (refused, why.take())
        };
        assert_eq!(said("here", &req), (false, String::new()));
        assert_eq!(
            said("there", &req),
            (true, "in cluster c, not the asking gateway's b".into())
        );
        assert_eq!(
            said("unlabeled", &req),
            (
                true,
                "no kvplane.io/cluster label: its cluster is unknown".into()
            )
        );
        let nowhere = Request::for_tests();
        assert_eq!(
            said("here", &nowhere),
            (
                true,
                "this replica's cluster is not configured ([locality] cluster)".into()
            )
        );
        let no_filter = Filter::default();
        let mut why = Words::kept(false);
        assert!(!SameLocality.refuses(&no_filter, &req, &on("there"), &cat, &mut why));
    }
}
