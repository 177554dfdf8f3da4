//! `filter.preferLocality`: local first, spill to other places when local is slow. Unlike the
//! other filters it judges the candidates together, after them: while an eligible candidate
//! at the asking gateway's place is predicted to give its first token within the threshold,
//! every candidate elsewhere is dropped; otherwise all stay, and the objective (which adds the
//! link's round trip to a remote candidate's prediction) chooses among them.

use super::Words;
use crate::candidate::{Candidate, FilterId, Filtered, Signals, target_name};
use crate::catalog::{Catalog, Check};
use crate::kinds::Filter;
use crate::resolve::Request;

pub(super) const ID: FilterId = FilterId("prefer_locality");

/// The threshold is on the prediction.
pub(super) fn needs(f: &Filter) -> Signals {
    if f.prefer_locality.is_some() {
        Signals::ALL
    } else {
        Signals::NONE
    }
}

pub(super) fn problems(f: &Filter, at: &str, c: &mut Check<'_>) {
    let Some(p) = &f.prefer_locality else {
        return;
    };
    let ms = p.spill_above_ttft_ms;
    if !ms.is_finite() || ms <= 0.0 {
        c.fail(
            format!("{at}.preferLocality.spillAboveTtftMs"),
            format!("must be a finite number of milliseconds > 0, got {ms}"),
        );
    }
    if f.same_locality == Some(p.level) {
        c.fail(
            format!("{at}.preferLocality.level"),
            format!(
                "sameLocality already keeps to the {}: there is nowhere to spill to",
                p.level.as_str()
            ),
        );
    }
}

/// Drops the eligible candidates elsewhere while one at the origin's place is predicted
/// within the threshold. Returns the stage's words when `words` (Explain).
pub(super) fn apply(
    catalog: &Catalog,
    f: &Filter,
    req: &Request<'_>,
    cands: &mut [Candidate<'_>],
    words: bool,
) -> Option<String> {
    let p = f.prefer_locality.as_ref()?;
    let level = p.level.as_str();
    let limit = p.spill_above_ttft_ms;
    let Some(here) = req.origin.at(p.level) else {
        return words.then(|| {
            format!(
                "preferLocality: this replica's {level} is not configured ([locality] {level}): nothing preferred"
            )
        });
    };
    let is_here = |c: &Candidate<'_>| {
        super::labels_of(catalog, c)
            .and_then(|l| l.get(p.level.label()))
            .is_some_and(|t| t == here)
    };
    // A prediction that is no number (of either sign: `total_cmp` puts a negative NaN first)
    // is no evidence of a fast local candidate.
    let best = cands
        .iter()
        .filter(|c| c.filtered.is_none() && is_here(c) && !c.client_ttft_ms().is_nan())
        .min_by(|a, b| a.client_ttft_ms().total_cmp(&b.client_ttft_ms()));
    let Some(best) = best else {
        return words.then(|| {
            format!("preferLocality: no eligible candidate in {level} {here}: spilling elsewhere")
        });
    };
    let ms = best.client_ttft_ms();
    let name = if words {
        target_name(&best.target)
    } else {
        String::new()
    };
    if ms > limit {
        return words.then(|| {
            format!(
                "preferLocality: the fastest in {level} {here}, {name}, is predicted {ms:.0} ms > {limit} ms: spilling elsewhere"
            )
        });
    }
    let mut why = Words::kept(words);
    for c in cands.iter_mut() {
        if c.filtered.is_some() || is_here(c) {
            continue;
        }
        why.say(format_args!(
            "not in the asking gateway's {level} {here}, where {name} is predicted {ms:.0} ms (preferLocality spills above {limit} ms)"
        ));
        c.filtered = Some(Filtered {
            by: ID,
            text: why.take(),
        });
    }
    words.then(|| {
        format!(
            "preferLocality: {name} in {level} {here} is predicted {ms:.0} ms <= {limit} ms: keeping to {level} {here}"
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::candidate::Target;
    use crate::locality::{CLUSTER_LABEL, Level, Origin, Preference};

    /// Worker sets `b0`, `b1` in cluster b, `c0` in c, and `x` with no cluster label.
    fn catalog() -> Catalog {
        let mut c = Catalog::default();
        for (name, cluster) in [
            ("b0", Some("b")),
            ("b1", Some("b")),
            ("c0", Some("c")),
            ("x", None),
        ] {
            let yaml = format!(
                "apiVersion: kvplane.io/v1alpha1\nkind: InferenceWorkerSet\nmetadata: {{name: {name}}}\nspec:\n  model: m\n  labels: {{{}}}\n",
                cluster.map_or(String::new(), |c| format!("{CLUSTER_LABEL}: {c}"))
            );
            c.insert(crate::Object::from_yaml(serde_yaml_ng::from_str(&yaml).unwrap()).unwrap());
        }
        c
    }

    /// A worker of `set` predicted `ms` (the engine's part and, elsewhere, the link's), already
    /// filtered when `filtered`.
    fn on(
        set: &'static str,
        engine_ms: f64,
        network_ms: f64,
        filtered: bool,
    ) -> Candidate<'static> {
        let mut c = crate::candidate::test_worker(|_| {});
        if let Target::Worker { worker_set, .. } = &mut c.target {
            *worker_set = set;
        }
        c.prediction.ttft_ms = engine_ms;
        c.prediction.network_ms = network_ms;
        c.filtered = filtered.then(|| Filtered {
            by: FilterId("max_queued"),
            text: String::new(),
        });
        c
    }

    fn filter(ms: f64) -> Filter {
        Filter {
            prefer_locality: Some(Preference {
                level: Level::Cluster,
                spill_above_ttft_ms: ms,
            }),
            ..Filter::default()
        }
    }

    fn from_b() -> Origin {
        Origin {
            cluster: Some("b".into()),
            ..Origin::default()
        }
    }

    /// The rule as an operator states it, over (set, cluster, predicted ms, eligible):
    /// elsewhere is kept iff no eligible candidate in b is predicted within the threshold.
    fn kept_by_statement(cands: &[(&str, Option<&str>, f64, bool)], limit: f64) -> Vec<bool> {
        // (A NaN is not `<=` anything.)
        let local_fast = cands
            .iter()
            .any(|(_, cl, ms, ok)| *ok && *cl == Some("b") && *ms <= limit);
        cands
            .iter()
            .map(|(_, cl, _, ok)| *ok && (!local_fast || *cl == Some("b")))
            .collect()
    }

    #[test]
    fn elsewhere_stays_only_when_nothing_local_is_predicted_within_the_threshold() {
        let cat = catalog();
        let origin = from_b();
        let req = Request {
            origin: &origin,
            ..Request::for_tests()
        };
        let cluster = |s: &str| match s {
            "b0" | "b1" => Some("b"),
            "c0" => Some("c"),
            _ => None,
        };
        // Every combination of the local workers' predictions and eligibility around a 400 ms
        // threshold, with a remote and an unlabeled candidate that are faster than both.
        let local_ms = [100.0, 400.0, 401.0, 2000.0, f64::NAN, -f64::NAN];
        for b0_ms in local_ms {
            for b1_ms in local_ms {
                for (b0_ok, b1_ok) in [(true, true), (true, false), (false, true), (false, false)] {
                    let spec = [
                        ("b0", b0_ms, 0.0, b0_ok),
                        ("b1", b1_ms, 0.0, b1_ok),
                        ("c0", 10.0, 20.0, true),
                        ("x", 5.0, 0.0, true),
                    ];
                    let mut cands: Vec<Candidate<'static>> = spec
                        .iter()
                        .map(|(s, e, n, ok)| on(s, *e, *n, !ok))
                        .collect();
                    apply(&cat, &filter(400.0), &req, &mut cands, false);
                    let got: Vec<bool> = cands.iter().map(|c| c.filtered.is_none()).collect();
                    let stated: Vec<(&str, Option<&str>, f64, bool)> = spec
                        .iter()
                        .map(|(s, e, n, ok)| (*s, cluster(s), e + n, *ok))
                        .collect();
                    assert_eq!(got, kept_by_statement(&stated, 400.0), "{spec:?}");
                    for c in cands.iter().filter_map(|c| c.filtered.as_ref()) {
                        assert!(c.by == ID || c.by == FilterId("max_queued"));
                    }
                }
            }
        }
    }

    #[test]
    fn explain_says_which_local_candidate_kept_the_decision_home_or_why_it_spilled() {
        let cat = catalog();
        let origin = from_b();
        let req = Request {
            origin: &origin,
            ..Request::for_tests()
        };
        let mut home = vec![on("b0", 120.0, 0.0, false), on("c0", 10.0, 20.0, false)];
        let said = apply(&cat, &filter(400.0), &req, &mut home, true);
        assert_eq!(
            said.as_deref(),
            Some(
                "preferLocality: b0/w in cluster b is predicted 120 ms <= 400 ms: keeping to cluster b"
            )
        );
        assert_eq!(
            home[1].filtered.as_ref().map(|f| f.text.as_str()),
            Some(
                "not in the asking gateway's cluster b, where b0/w is predicted 120 ms (preferLocality spills above 400 ms)"
            )
        );
        let mut busy = vec![on("b0", 650.0, 0.0, false), on("c0", 10.0, 20.0, false)];
        let said = apply(&cat, &filter(400.0), &req, &mut busy, true);
        assert_eq!(
            said.as_deref(),
            Some(
                "preferLocality: the fastest in cluster b, b0/w, is predicted 650 ms > 400 ms: spilling elsewhere"
            )
        );
        assert!(busy.iter().all(|c| c.filtered.is_none()));
        let mut none_here = vec![on("b0", 10.0, 0.0, true), on("c0", 10.0, 20.0, false)];
        let said = apply(&cat, &filter(400.0), &req, &mut none_here, true);
        assert_eq!(
            said.as_deref(),
            Some("preferLocality: no eligible candidate in cluster b: spilling elsewhere")
        );
        assert!(none_here[1].filtered.is_none());
        // A replica that does not know its cluster prefers nothing.
        let mut nowhere = vec![on("b0", 10.0, 0.0, false), on("c0", 10.0, 20.0, false)];
        let said = apply(
            &cat,
            &filter(400.0),
            &Request::for_tests(),
            &mut nowhere,
            true,
        );
        assert_eq!(
            said.as_deref(),
            Some(
                "preferLocality: this replica's cluster is not configured ([locality] cluster): nothing preferred"
            )
        );
        assert!(nowhere.iter().all(|c| c.filtered.is_none()));
        // Without the field, nothing happens and nothing is said.
        let mut plain = vec![on("c0", 10.0, 20.0, false)];
        assert_eq!(
            apply(&cat, &Filter::default(), &req, &mut plain, true),
            None
        );
        assert!(plain[0].filtered.is_none());
    }

    #[test]
    fn a_threshold_that_is_no_time_and_a_preference_inside_the_boundary_are_problems() {
        let mut out = Vec::new();
        let mut check = Check {
            kind: crate::Kind::Policy,
            name: "p",
            out: &mut out,
        };
        for ms in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            problems(&filter(ms), "f", &mut check);
        }
        let inside = Filter {
            same_locality: Some(Level::Cluster),
            ..filter(400.0)
        };
        problems(&inside, "f", &mut check);
        let wider = Filter {
            same_locality: Some(Level::Region),
            ..filter(400.0)
        };
        problems(&wider, "f", &mut check);
        let paths: Vec<&str> = out.iter().map(|p| p.path.as_str()).collect();
        assert_eq!(
            paths,
            [
                "f.preferLocality.spillAboveTtftMs",
                "f.preferLocality.spillAboveTtftMs",
                "f.preferLocality.spillAboveTtftMs",
                "f.preferLocality.spillAboveTtftMs",
                "f.preferLocality.level",
            ]
        );
        assert_eq!(
            out[4].message,
            "sameLocality already keeps to the cluster: there is nowhere to spill to"
        );
    }
}
