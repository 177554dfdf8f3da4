//! Locality in the decision: a candidate in another cluster adds the round trip from the
//! asking gateway's cluster to its predicted TTFT, so a remote engine's cache wins when it saves
//! more than the link costs and loses when it does not; `filter.sameLocality` keeps a rule
//! (here: tagged `pii`) inside the gateway's cluster whatever is cached elsewhere, and refuses
//! when the replica does not know its own cluster; `filter.preferLocality` keeps to it until
//! its engine is predicted slower than a threshold.

#![allow(clippy::unwrap_used)]

mod support;

use std::sync::Arc;

use kvplane_api::predict::Predictor;
use kvplane_policy::Origin;
use support::{TestFleet, explain, report_first_token, request, route, target, tokens};

/// Worker set `near` in cluster b and `far` in cluster c, one engine each, both slow to
/// prefill (2,000 tokens/s: 4,096 uncached tokens take about two seconds); `far` caches the
/// prompt. A policy keeps `pii` requests in the asking gateway's cluster.
fn fleet(prompt: &[u32]) -> TestFleet {
    let mut f = TestFleet::with_yaml(concat!(
        "apiVersion: kvplane.io/v1alpha1\nkind: InferenceWorkerSet\nmetadata: {name: near}\n",
        "spec: {model: m, prefillTokensPerSecond: 2000, labels: {kvplane.io/cluster: b}}\n---\n",
        "apiVersion: kvplane.io/v1alpha1\nkind: InferenceWorkerSet\nmetadata: {name: far}\n",
        "spec: {model: m, prefillTokensPerSecond: 2000, labels: {kvplane.io/cluster: c}}\n---\n",
        "apiVersion: kvplane.io/v1alpha1\nkind: InferencePool\nmetadata: {name: all}\n",
        "spec: {workerSets: [near, far]}\n---\n",
        "apiVersion: kvplane.io/v1alpha1\nkind: GatewayBackend\nmetadata: {name: m}\n",
        "spec: {publicModel: m, backends: [{pool: all}], policies: [local-pii]}\n---\n",
        "apiVersion: kvplane.io/v1alpha1\nkind: InferencePolicy\nmetadata: {name: local-pii}\n",
        "spec:\n  rules:\n  - name: stay\n    match: {tags: [pii]}\n",
        "    filter: {sameLocality: Cluster}\n",
    ));
    f.up("near", &["n0"])
        .up("far", &["f0"])
        .caches("far", "f0", prompt, 16, None, None);
    f
}

/// Explain's word on the candidate of worker set `pool`.
fn candidate<'x>(
    x: &'x kvplane_proto::v1::ExplainResponse,
    pool: &str,
) -> &'x kvplane_proto::v1::CandidateExplanation {
    x.candidates
        .iter()
        .find(|c| c.endpoint.as_ref().unwrap().pool == pool)
        .unwrap()
}

fn in_cluster_b(rtt_to_c_ms: f64) -> Origin {
    Origin {
        cluster: Some("b".into()),
        rtt_ms: [("c".to_owned(), rtt_to_c_ms)].into(),
        ..Origin::default()
    }
}

#[test]
fn a_remote_cache_wins_when_it_saves_more_than_the_link_costs_and_loses_when_not() {
    let prompt = tokens(21, 4096);
    let f = fleet(&prompt);
    let cheap_link = f.service().with_origin(in_cluster_b(20.0));
    let r = route(&cheap_link, request("a", "m", &[], prompt.clone()));
    assert_eq!((target(&r).as_str(), r.matched_blocks), ("far/f0", 256));
    let x = explain(&cheap_link, request("x", "m", &[], prompt.clone()));
    let far = candidate(&x, "far");
    let near = candidate(&x, "near");
    assert_eq!((far.network_ms, near.network_ms), (20.0, 0.0));
    assert!(far.predicted_ttft_ms >= 20.0, "{far:?}");
    assert!(near.predicted_ttft_ms > 1500.0, "{near:?}");
    // A link slower than the whole prefill: the local engine.
    let slow_link = f.service().with_origin(in_cluster_b(10_000.0));
    let r = route(&slow_link, request("b", "m", &[], prompt.clone()));
    assert_eq!(target(&r), "near/n0");
    // Asked from cluster c itself, the cache is local.
    let from_c = f.service().with_origin(Origin {
        cluster: Some("c".into()),
        default_rtt_ms: 10_000.0,
        ..Origin::default()
    });
    assert_eq!(
        target(&route(&from_c, request("c", "m", &[], prompt))),
        "far/f0"
    );
}

/// The same two worker sets, every request under a rule that prefers the gateway's cluster
/// until its engine is predicted slower than `spill_ms`.
fn local_first(prompts: &[&[u32]], spill_ms: f64) -> TestFleet {
    let mut f = TestFleet::with_yaml(&format!(
        concat!(
            "apiVersion: kvplane.io/v1alpha1\nkind: InferenceWorkerSet\nmetadata: {{name: near}}\n",
            "spec: {{model: m, prefillTokensPerSecond: 2000, labels: {{kvplane.io/cluster: b}}}}\n---\n",
            "apiVersion: kvplane.io/v1alpha1\nkind: InferenceWorkerSet\nmetadata: {{name: far}}\n",
            "spec: {{model: m, prefillTokensPerSecond: 2000, labels: {{kvplane.io/cluster: c}}}}\n---\n",
            "apiVersion: kvplane.io/v1alpha1\nkind: InferencePolicy\nmetadata: {{name: local-first}}\n",
            "spec:\n  appliesToModels: [m]\n  rules:\n  - name: spill\n",
            "    filter: {{preferLocality: {{level: Cluster, spillAboveTtftMs: {}}}}}\n",
        ),
        spill_ms
    ));
    f.up("near", &["n0"]).up("far", &["f0"]);
    for p in prompts {
        f.caches("far", "f0", p, 16, None, None);
    }
    f
}

/// Local first: a remote cache that the objective alone would choose (see the test above) is
/// passed over while the local engine is predicted within the threshold, and taken once the
/// local engine's prediction (a longer prompt: about two seconds of prefill) exceeds it.
#[test]
fn local_first_spills_to_a_remote_cache_only_when_the_local_engine_is_predicted_slower_than_the_threshold()
 {
    let short = tokens(26, 1024);
    let long = tokens(27, 4096);
    let f = local_first(&[&short, &long], 1000.0);
    let s = f.service().with_origin(in_cluster_b(20.0));
    let x = explain(&s, request("xs", "m", &[], short.clone()));
    let near_short = candidate(&x, "near").predicted_ttft_ms;
    assert!(near_short <= 1000.0, "{near_short}");
    assert_eq!(candidate(&x, "far").filtered_by, "prefer_locality");
    assert_eq!(
        candidate(&x, "far").filtered_reason,
        format!(
            "not in the asking gateway's cluster b, where near/n0 is predicted {near_short:.0} ms (preferLocality spills above 1000 ms)"
        )
    );
    assert!(
        x.steps.iter().any(|s| s
            == &format!(
                "preferLocality: near/n0 in cluster b is predicted {near_short:.0} ms <= 1000 ms: keeping to cluster b"
            )),
        "{:?}",
        x.steps
    );
    assert_eq!(
        target(&route(&s, request("s", "m", &[], short.clone()))),
        "near/n0"
    );
    let x = explain(&s, request("xl", "m", &[], long.clone()));
    let near_long = candidate(&x, "near").predicted_ttft_ms;
    assert!(near_long > 1000.0, "{near_long}");
    assert_eq!(candidate(&x, "far").filtered_by, "");
    let r = route(&s, request("l", "m", &[], long.clone()));
    assert_eq!((target(&r).as_str(), r.matched_blocks), ("far/f0", 256));
    // A threshold above the long prompt's local prediction keeps that one home too; without
    // the preference the short one goes to the remote cache.
    let patient = local_first(&[&short, &long], near_long + 100.0);
    let s = patient.service().with_origin(in_cluster_b(20.0));
    assert_eq!(target(&route(&s, request("pl", "m", &[], long))), "near/n0");
    let plain = fleet(&short);
    let s = plain.service().with_origin(in_cluster_b(20.0));
    assert_eq!(target(&route(&s, request("ps", "m", &[], short))), "far/f0");
}

#[test]
fn a_pii_request_stays_in_the_gateways_cluster_and_an_unplaced_replica_refuses_it() {
    let prompt = tokens(22, 4096);
    let f = fleet(&prompt);
    let s = f.service().with_origin(in_cluster_b(20.0));
    let r = route(&s, request("p", "m", &["pii"], prompt.clone()));
    assert_eq!(
        target(&r),
        "near/n0",
        "the remote cache does not pull it out"
    );
    let x = explain(&s, request("px", "m", &["pii"], prompt.clone()));
    let far = candidate(&x, "far");
    assert_eq!(far.filtered_by, "same_locality");
    assert_eq!(
        far.filtered_reason,
        "in cluster c, not the asking gateway's b"
    );
    // A replica that does not know its cluster cannot keep the promise: it refuses.
    let unplaced = f.service();
    let r = route(&unplaced, request("u", "m", &["pii"], prompt));
    assert!(
        target(&r).starts_with("rejected(REJECT_CODE_POLICY)"),
        "{r:?}"
    );
}

/// A replica in cluster c (every other cluster 20 ms away) asked by a gateway that says it runs
/// in b - one that failed over to a replica of another cluster, say - decides as from b: the
/// cache in c costs b's round trip to c, the engine in b none, and a `pii` request stays in b.
#[test]
fn a_gateway_that_says_where_it_runs_is_decided_for_as_from_there() {
    let prompt = tokens(24, 4096);
    let f = fleet(&prompt);
    let in_c = f.service().with_origin(Origin {
        cluster: Some("c".into()),
        rtt_ms: [("b".to_owned(), 20.0)].into(),
        default_rtt_ms: 20.0,
        ..Origin::default()
    });
    let from_b = |id: &str, tags: &[&str]| {
        let mut r = request(id, "m", tags, prompt.clone());
        r.origin = Some(kvplane_proto::v1::Place {
            cluster: "b".into(),
            ..Default::default()
        });
        r
    };
    let x = explain(&in_c, from_b("x", &[]));
    let network = |pool: &str| {
        x.candidates
            .iter()
            .find(|c| c.endpoint.as_ref().unwrap().pool == pool)
            .unwrap()
            .network_ms
    };
    assert_eq!((network("far"), network("near")), (20.0, 0.0));
    assert!(
        x.steps
            .iter()
            .any(|s| s == "decided as from cluster b (where the gateway runs)"),
        "{:?}",
        x.steps
    );
    assert_eq!(target(&route(&in_c, from_b("r", &[]))), "far/f0");
    let r = route(&in_c, from_b("p", &["pii"]));
    assert_eq!(
        target(&r),
        "near/n0",
        "kept in the gateway's cluster, not the replica's"
    );
    // Without the gateway's word the same replica keeps it in c, its own cluster.
    let r = route(&in_c, request("q", "m", &["pii"], prompt.clone()));
    assert_eq!(target(&r), "far/f0");
}

#[test]
fn the_engines_time_is_learned_without_the_links() {
    let prompt = tokens(23, 4096);
    let f = fleet(&prompt);
    let predictor = Arc::new(Predictor::new(kvplane_api::predict::wall_clock()));
    let s = f
        .service()
        .with_origin(in_cluster_b(40.0))
        .with_predictor(predictor.clone());
    let r = route(&s, request("t", "m", &[], prompt));
    assert_eq!(target(&r), "far/f0");
    // The gateway saw exactly what was predicted for it, round trip included.
    report_first_token(&s, "t", r.predicted_ttft_ms);
    let (predicted, observed) = predictor.outcome("t").unwrap();
    assert!(
        (r.predicted_ttft_ms - predicted - 40.0).abs() < 1e-6,
        "{r:?}"
    );
    assert!(
        (observed - predicted).abs() < 1e-6,
        "the engine is judged on its own time: {predicted} vs {observed}"
    );
}

/// A gateway that saw the first token sooner than the round trip taken for the link: the
/// configured round trip is too long, the engine's own time unknown - counted, not learned.
#[test]
fn a_first_token_sooner_than_the_round_trip_is_counted_and_teaches_nothing() {
    let prompt = tokens(28, 4096);
    let f = fleet(&prompt);
    let metrics = Arc::new(kvplane_api::ApiMetrics::default());
    let predictor = Arc::new(Predictor::new(kvplane_api::predict::wall_clock()));
    let s = kvplane_api::RouterService::new(
        f.sm.handle(),
        kvplane_api::CostModel::default(),
        metrics.clone(),
    )
    .with_origin(in_cluster_b(40.0))
    .with_predictor(predictor.clone());
    let r = route(&s, request("soon", "m", &[], prompt.clone()));
    assert_eq!(target(&r), "far/f0");
    report_first_token(&s, "soon", 30.0);
    assert_eq!(metrics.reports_below_round_trip(), 1);
    assert_eq!(predictor.outcome("soon"), None, "nothing learned");
    // One that waited longer than the link is no such report.
    let r = route(&s, request("later", "m", &[], prompt));
    report_first_token(&s, "later", r.predicted_ttft_ms);
    assert_eq!(metrics.reports_below_round_trip(), 1);
    assert!(predictor.outcome("later").is_some());
}

/// With `measure_rtt` a replica in cluster b that was told nothing of the link to c learns it:
/// gateways observe c's engine's first tokens 300 ms after the engine's own histogram counts
/// them (the reference: the delay the test puts on every observation), and after a window of
/// reports the round trip measured is that delay. A 512-token cache in c (256 ms of prefill
/// saved) then loses to b's own engine; measured nothing, it wins.
#[test]
fn a_replica_told_nothing_of_a_link_measures_it_from_reported_ttfts() {
    use kvplane_api::rtt::{RttMeter, WINDOW_REPORTS};
    let link_ms = 300.0;
    let prompt = tokens(25, 512);
    for measure in [true, false] {
        let mut f = fleet(&prompt);
        let origin = Origin {
            cluster: Some("b".into()),
            measure_rtt: measure,
            ..Origin::default()
        };
        let mut s = f.service().with_origin(origin.clone());
        if measure {
            s = s.with_rtt_meter(Arc::new(RttMeter::new(origin)));
        }
        let mut histogram = (0.0, 0);
        // Requests kept to c's engine (the endpoint subset), each first token counted by the
        // engine, then observed by the gateway behind the link.
        for i in 0..=WINDOW_REPORTS {
            let id = format!("m{i}");
            let mut req = request(&id, "m", &[], prompt.clone());
            req.endpoint_subset = vec!["f0:8000".into()];
            assert_eq!(target(&route(&s, req)), "far/f0");
            #[allow(clippy::cast_precision_loss)]
            let engine_ms = 30.0 + (i * 7) as f64;
            histogram = (histogram.0 + engine_ms / 1000.0, histogram.1 + 1);
            f.sample(
                "far",
                "f0",
                kvplane_state::WorkerMetrics {
                    ttft_sum_s: histogram.0,
                    ttft_count: histogram.1,
                    ..Default::default()
                },
            );
            report_first_token(&s, &id, engine_ms + link_ms);
        }
        let x = explain(&s, request("x", "m", &[], prompt.clone()));
        let far = candidate(&x, "far");
        let r = route(&s, request("after", "m", &[], prompt.clone()));
        if measure {
            assert!((far.network_ms - link_ms).abs() < 1e-6, "{far:?}");
            assert_eq!(
                target(&r),
                "near/n0",
                "the measured link costs more than it saves"
            );
        } else {
            assert_eq!(far.network_ms, 0.0);
            assert_eq!(target(&r), "far/f0", "measured nothing, the cache wins");
        }
    }
}
