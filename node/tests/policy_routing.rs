//! Route through policies on a real node: a policy directory, engines announced over NATS, and
//! the answers gateways get (endpoint, rewritten body, provider fallback, rejections).

#![allow(clippy::unwrap_used)]

mod harness;

use harness::{Cluster, NodeOptions, chain, prompt, publish};
use kvplane_ingest::{ensure_stream, kv_subject, metrics_subject, worker_subject};
use kvplane_proto::v1::{RejectCode, RouteRequest, route_response::Decision};

const EXAMPLES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/policies");

fn request(model: &str, tags: &[&str]) -> RouteRequest {
    RouteRequest {
        model: model.into(),
        tags: tags.iter().map(|t| (*t).to_owned()).collect(),
        token_ids: prompt(7),
        body: format!(r#"{{"model":"{model}","prompt":"hello","max_tokens":8}}"#).into_bytes(),
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routes_follow_the_policies_in_the_replicated_state() {
    let cluster = Cluster::start_with(
        1,
        &NodeOptions {
            policy_dir: Some(EXAMPLES.into()),
            ..Default::default()
        },
    );
    let js = cluster.nats.jetstream().await;
    ensure_stream(&js, "KVPLANE").await.unwrap();
    for (ws, w) in [
        ("large-a100", "a0"),
        ("large-a100", "a1"),
        ("small-l4", "l0"),
    ] {
        publish(
            &js,
            worker_subject(ws, w),
            format!(r#"{{"status":"up","address":"http://{w}:8000"}}"#).into_bytes(),
        )
        .await;
    }
    // a0 caches the whole 48-token prompt: no prefill beats the small model's faster one.
    let last = publish(&js, kv_subject("large-a100", "a0"), chain(&prompt(7), 7)).await;
    let node = &cluster.nodes[0];
    node.wait_applied_seq(last).await;
    let mut router = node.router().await;

    let r = router
        .route(request("standard-model", &[]))
        .await
        .unwrap()
        .into_inner();
    match &r.decision {
        Some(Decision::Endpoint(e)) => {
            assert_eq!(
                (e.pool.as_str(), e.worker_id.as_str()),
                ("large-a100", "a0")
            );
            assert_eq!(e.address, "http://a0:8000");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(r.model, "llama-70b");
    assert_eq!(r.matched_blocks, 3);
    let body: serde_json::Value =
        serde_json::from_slice(r.rewritten_body.as_ref().unwrap()).unwrap();
    assert_eq!(body["model"], "llama-70b");
    assert_eq!(body["max_tokens"], 8);

    // Every large worker busy: chat bursts to the cloud provider, pii is refused.
    let mut last = 0;
    for w in ["a0", "a1"] {
        last = publish(
            &js,
            metrics_subject("large-a100", w),
            br#"{"num_requests_running":4,"num_requests_waiting":5,"kv_cache_usage_perc":0.9,"prefix_cache_hit_rate":0.5}"#.to_vec(),
        )
        .await;
    }
    node.wait_applied_seq(last).await;
    let r = router
        .route(request("chat", &[]))
        .await
        .unwrap()
        .into_inner();
    match &r.decision {
        Some(Decision::Endpoint(e)) => {
            assert_eq!(e.provider, "cloud");
            assert_eq!(e.address, "https://api.provider.example/v1");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(r.model, "gpt-4o-mini");
    let r = router
        .route(request("chat", &["pii"]))
        .await
        .unwrap()
        .into_inner();
    match &r.decision {
        Some(Decision::Rejection(j)) => {
            assert_eq!(j.code, i32::from(RejectCode::Policy));
            assert!(j.reason.contains("local workers only"), "{}", j.reason);
        }
        other => panic!("{other:?}"),
    }
    let r = router
        .route(request("nobody-serves-this", &[]))
        .await
        .unwrap()
        .into_inner();
    assert!(
        matches!(r.decision, Some(Decision::Rejection(j)) if j.code == i32::from(RejectCode::UnknownModel))
    );

    // Explain names the rule and why each candidate lost.
    let e = router
        .explain(request("chat", &["pii"]))
        .await
        .unwrap()
        .into_inner();
    assert!(
        e.steps.iter().any(|s| s.contains("pii-local/pii")),
        "{:?}",
        e.steps
    );
    assert!(
        e.candidates
            .iter()
            .any(|c| c.filtered_reason == "external providers are excluded")
    );
}
