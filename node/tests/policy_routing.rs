//! Route through policies on a real node: a policy directory, engines announced over NATS, and
//! the answers gateways get (endpoint, rewritten body, provider fallback, rejections).

#![allow(clippy::unwrap_used)]

mod harness;

use harness::{Cluster, InProcess, Nats, NodeOptions, chain, prompt, publish};
use kvplane_ingest::{ensure_stream, kv_subject, metrics_subject, worker_subject};
use kvplane_proto::v1::{RejectCode, RouteRequest, route_response::Decision};

const EXAMPLES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/policies");

/// Announces `workers` (worker set, worker) over NATS; returns the last stream sequence.
async fn workers_up(js: &async_nats::jetstream::Context, workers: &[(&str, &str)]) -> u64 {
    let mut last = 0;
    for (ws, w) in workers {
        last = publish(
            js,
            worker_subject(ws, w),
            format!(r#"{{"status":"up","address":"http://{w}:8000"}}"#).into_bytes(),
        )
        .await;
    }
    last
}

/// Two replicas under one policy directory holding worker set `gpu` (model `m`), its workers
/// `w0` and `w1` up on both; the directory lives as long as the returned guard.
async fn two_replicas_of_one_worker_set()
-> (Cluster, async_nats::jetstream::Context, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("fleet.yaml"),
        "apiVersion: kvplane.io/v1alpha1\nkind: InferenceWorkerSet\nmetadata: {name: gpu}\nspec: {model: m, blockSize: 16}\n",
    )
    .unwrap();
    let cluster = Cluster::start_with(
        2,
        &NodeOptions {
            policy_dir: Some(dir.path().to_owned()),
            ..Default::default()
        },
    );
    let js = cluster.nats.jetstream().await;
    ensure_stream(&js, "KVPLANE").await.unwrap();
    let last = workers_up(&js, &[("gpu", "w0"), ("gpu", "w1")]).await;
    for n in &cluster.nodes {
        n.wait_applied_seq(last).await;
    }
    (cluster, js, dir)
}

/// One node under `examples/policies`, and the stream.
async fn examples_node() -> (Cluster, async_nats::jetstream::Context) {
    let cluster = Cluster::start_with(
        1,
        &NodeOptions {
            policy_dir: Some(EXAMPLES.into()),
            ..Default::default()
        },
    );
    let js = cluster.nats.jetstream().await;
    ensure_stream(&js, "KVPLANE").await.unwrap();
    (cluster, js)
}

/// Both large workers report 5 waiting and a 90% full cache; returns the stream sequence.
async fn large_workers_busy(js: &async_nats::jetstream::Context) -> u64 {
    let mut last = 0;
    for w in ["a0", "a1"] {
        last = publish(
            js,
            metrics_subject("large-a100", w),
            br#"{"num_requests_running":4,"num_requests_waiting":5,"kv_cache_usage_perc":0.9,"prefix_cache_hit_rate":0.5}"#.to_vec(),
        )
        .await;
    }
    last
}

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
    // No process boundary is needed here: the node runs in this process, over a real NATS and
    // real redb files.
    let nats = Nats::start();
    let root = tempfile::tempdir().unwrap();
    let opts = NodeOptions {
        policy_dir: Some(EXAMPLES.into()),
        ..Default::default()
    };
    let node = InProcess::start("kvplane-0", root.path(), &nats.url(), &opts).await;
    let js = nats.jetstream().await;
    ensure_stream(&js, "KVPLANE").await.unwrap();
    workers_up(
        &js,
        &[
            ("large-a100", "a0"),
            ("large-a100", "a1"),
            ("small-l4", "l0"),
        ],
    )
    .await;
    // a0 caches the whole 48-token prompt: no prefill beats the small model's faster one.
    let last = publish(&js, kv_subject("large-a100", "a0"), chain(&prompt(7), 7)).await;
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
    let last = large_workers_busy(&js).await;
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
            .any(|c| c.filtered_by == "exclude_external")
    );
    node.stop().await;
}

fn explain_json(args: &[&str]) -> serde_json::Value {
    let out = harness::kvplane_ok(&[&["explain", "--json"], args].concat());
    serde_json::from_str(&out).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn offline_explain_decides_from_a_live_node_or_its_data_dir_with_other_policies() {
    let mut cluster = Cluster::start_with(
        1,
        &NodeOptions {
            policy_dir: Some(EXAMPLES.into()),
            ..Default::default()
        },
    );
    let js = cluster.nats.jetstream().await;
    ensure_stream(&js, "KVPLANE").await.unwrap();
    workers_up(&js, &[("large-a100", "a0"), ("small-l4", "l0")]).await;
    let last = publish(&js, kv_subject("large-a100", "a0"), chain(&prompt(7), 7)).await;
    cluster.nodes[0].wait_applied_seq(last).await;

    let dir = tempfile::tempdir().unwrap();
    let req = dir.path().join("request.json");
    std::fs::write(
        &req,
        serde_json::json!({
            "model": "standard-model",
            "token_ids": prompt(7),
            "body": {"model": "standard-model", "prompt": "hello", "max_tokens": 8},
        })
        .to_string(),
    )
    .unwrap();
    let req = req.to_str().unwrap();
    // Other policies: the public name backed by the small model only.
    let other = dir.path().join("policies");
    std::fs::create_dir(&other).unwrap();
    std::fs::copy(format!("{EXAMPLES}/fleet.yaml"), other.join("fleet.yaml")).unwrap();
    std::fs::write(
        other.join("alias.yaml"),
        "apiVersion: kvplane.io/v1alpha1\nkind: GatewayBackend\nmetadata:\n  name: standard\nspec:\n  publicModel: standard-model\n  backends:\n    - model: llama-8b\n",
    )
    .unwrap();
    let other = other.to_str().unwrap();

    let addr = format!("http://{}", cluster.nodes[0].grpc);
    let live = explain_json(&["--state", &addr, req]);
    assert_eq!(live["decision"]["endpoint"]["worker_id"], "a0", "{live}");
    assert_eq!(live["decision"]["model"], "llama-70b", "{live}");
    assert_eq!(live["decision"]["matched_blocks"], 3, "{live}");
    let what_if = explain_json(&["--state", &addr, "--policies", other, req]);
    assert_eq!(
        what_if["decision"]["endpoint"]["worker_id"], "l0",
        "{what_if}"
    );
    assert_eq!(what_if["decision"]["model"], "llama-8b", "{what_if}");
    assert!(
        what_if["steps"]
            .as_array()
            .unwrap()
            .iter()
            .any(|s| s.as_str().unwrap().contains("standard-model")),
        "{what_if}"
    );

    // The data directory of the stopped node holds the same state.
    assert!(cluster.nodes[0].terminate().success());
    let data = cluster.nodes[0]
        .dir
        .join("data")
        .to_str()
        .unwrap()
        .to_owned();
    let stopped = explain_json(&["--state", &data, req]);
    assert_eq!(stopped["decision"], live["decision"], "{stopped}");
    let what_if = explain_json(&["--state", &data, "--policies", other, req]);
    assert_eq!(
        what_if["decision"]["endpoint"]["worker_id"], "l0",
        "{what_if}"
    );

    // Not a data directory: said so.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvplane"))
        .args(["explain", "--state", dir.path().to_str().unwrap(), req])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("is not a kvplane data directory"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // Broken policies: every problem, and no decision.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvplane"))
        .args(["explain", "--state", &data, "--policies"])
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../examples/policies-broken"
        ))
        .arg(req)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("the policies have 12 problem(s)"),
        "{stderr}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_count_each_others_routed_requests_in_the_queue() {
    let (cluster, _js, _dir) = two_replicas_of_one_worker_set().await;
    // A long prompt: its first token is due seconds after it is routed.
    let long = RouteRequest {
        request_id: "long-1".into(),
        model: "m".into(),
        token_ids: (0..40_000).collect(),
        ..Default::default()
    };
    let r = cluster.nodes[0]
        .router()
        .await
        .route(long.clone())
        .await
        .unwrap()
        .into_inner();
    let Some(Decision::Endpoint(first)) = r.decision else {
        panic!("{r:?}")
    };
    // The other replica learns it over NATS and counts it in that worker's queue. (A prompt
    // of its own: the same one would rightly wait there for the cache it will find.)
    let long = RouteRequest {
        token_ids: (100_000..140_000).collect(),
        ..long
    };
    let mut other = cluster.nodes[1].router().await;
    let x = harness::eventually(
        "the other replica to count the routed request",
        std::time::Duration::from_secs(5),
        || {
            let mut other = other.clone();
            let req = RouteRequest {
                request_id: "long-2".into(),
                ..long.clone()
            };
            let worker = first.worker_id.clone();
            async move {
                let x = other.explain(req).await.unwrap().into_inner();
                x.candidates
                    .iter()
                    .any(|c| c.endpoint.as_ref().unwrap().worker_id == worker && c.waiting == 1)
                    .then_some(x)
            }
        },
    )
    .await;
    let chosen = x.candidates.iter().find(|c| c.chosen).unwrap();
    assert_ne!(chosen.endpoint.as_ref().unwrap().worker_id, first.worker_id);
    let r = other.route(long).await.unwrap().into_inner();
    let Some(Decision::Endpoint(second)) = r.decision else {
        panic!("{r:?}")
    };
    assert_ne!(
        second.worker_id, first.worker_id,
        "the replicas did not herd"
    );
}

/// A prompt routed by one replica, before any engine event says it is cached: the other
/// replica hears of it over NATS and sends a request sharing its prefix to the same worker,
/// counting the prefix cached there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefix_routed_by_one_replica_stays_with_its_worker_on_the_other() {
    let (cluster, _js, _dir) = two_replicas_of_one_worker_set().await;
    let prompt = |own: u32| -> Vec<u32> { (0..4_096).chain(own..own + 32).collect() };
    let r = cluster.nodes[0]
        .router()
        .await
        .route(RouteRequest {
            request_id: "first".into(),
            model: "m".into(),
            token_ids: prompt(50_000),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let Some(Decision::Endpoint(first)) = r.decision else {
        panic!("{r:?}")
    };
    let other = cluster.nodes[1].router().await;
    let x = harness::eventually(
        "the other replica to count the prefix cached where it went",
        std::time::Duration::from_secs(5),
        || {
            let mut other = other.clone();
            let req = RouteRequest {
                request_id: "second".into(),
                model: "m".into(),
                token_ids: prompt(60_000),
                ..Default::default()
            };
            async move {
                let x = other.explain(req).await.unwrap().into_inner();
                x.candidates
                    .iter()
                    .any(|c| c.overlap_blocks > 0)
                    .then_some(x)
            }
        },
    )
    .await;
    let chosen = x.candidates.iter().find(|c| c.chosen).unwrap();
    assert_eq!(chosen.endpoint.as_ref().unwrap().worker_id, first.worker_id);
    // 4,096 shared tokens: 256 blocks, known to the 16th.
    assert_eq!(chosen.overlap_blocks, 256);
}

/// Replicas tell each other what they routed outside the durable stream: a thousand routed
/// requests add no stream message and no log entry on either replica.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routed_requests_add_no_stream_message_and_no_log_entry() {
    let (cluster, js, _dir) = two_replicas_of_one_worker_set().await;
    let messages = |js: async_nats::jetstream::Context| async move {
        js.get_stream("KVPLANE")
            .await
            .unwrap()
            .info()
            .await
            .unwrap()
            .state
            .messages
    };
    let stream_before = messages(js.clone()).await;
    let mut applied_before = Vec::new();
    for n in &cluster.nodes {
        applied_before.push(n.status().await.applied_index);
    }
    route_alternately(&cluster, 1_000).await;
    // Every routed request was told to the other replica before the counts are compared.
    harness::eventually(
        "both replicas to publish their 1,000 routed notes",
        std::time::Duration::from_secs(10),
        || async {
            let mut published = 0.0;
            for n in &cluster.nodes {
                published += harness::metric_value(
                    &n.metrics().await,
                    "kvplane_routed_notes_published_total",
                );
            }
            (published >= 1_000.0).then_some(())
        },
    )
    .await;
    assert_eq!(messages(js.clone()).await, stream_before);
    for (n, before) in cluster.nodes.iter().zip(applied_before) {
        assert_eq!(n.status().await.applied_index, before);
    }
}

/// `n` Routes of one prompt, alternately on the cluster's two replicas, each one routed.
async fn route_alternately(cluster: &Cluster, n: usize) {
    let mut routers = Vec::new();
    for node in &cluster.nodes {
        routers.push(node.router().await);
    }
    for i in 0..n {
        let r = routers[i % 2]
            .route(RouteRequest {
                request_id: format!("r-{i}"),
                model: "m".into(),
                token_ids: (0..64).collect(),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        assert!(matches!(r.decision, Some(Decision::Endpoint(_))), "{r:?}");
    }
}

/// How late a replica learns of another's decision, measured on real processes over a real
/// nats-server, one Route at a time (not under load): the window in which two replicas may
/// take the same idle worker (the routing benchmark's `--share-ms`). Every note a replica
/// counted was timed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_hear_of_each_others_decisions_within_a_few_milliseconds() {
    let (cluster, _js, _dir) = two_replicas_of_one_worker_set().await;
    let n = 400;
    route_alternately(&cluster, n).await;
    const DELAY: &str = "kvplane_routed_note_delay_seconds";
    let texts = harness::eventually(
        "each replica to count and time the other's routed notes",
        std::time::Duration::from_secs(10),
        || async {
            let mut texts = Vec::new();
            for node in &cluster.nodes {
                texts.push(node.metrics().await);
            }
            texts
                .iter()
                .all(|t| {
                    let received = harness::metric_value(t, "kvplane_routed_notes_received_total");
                    received >= (n / 2) as f64
                        && harness::metric_value(t, &format!("{DELAY}_count")) == received
                })
                .then_some(texts)
        },
    )
    .await;
    for t in &texts {
        let b = harness::histogram_buckets(t, DELAY);
        let (p50, p99) = (
            harness::quantile_bound(&b, 0.5),
            harness::quantile_bound(&b, 0.99),
        );
        println!(
            "routed note delay: p50 <= {:.2} ms, p99 <= {:.2} ms over {} notes",
            p50 * 1e3,
            p99 * 1e3,
            harness::metric_value(t, &format!("{DELAY}_count"))
        );
        // Loose: two debug-build nodes, nats-server and the test share two cores.
        assert!(p50 <= 0.005, "median delay over 5 ms: {b:?}");
        assert!(p99 <= 0.05, "99th percentile delay over 50 ms: {b:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pii_from_a_header_or_the_tagger_stays_local_through_the_gateway() {
    let (cluster, js) = examples_node().await;
    workers_up(&js, &[("large-a100", "a0"), ("large-a100", "a1")]).await;
    // Every large worker busy: an untagged chat request would burst to the cloud provider.
    let last = large_workers_busy(&js).await;
    let node = &cluster.nodes[0];
    node.wait_applied_seq(last).await;
    let gateway = harness::gateway(&node.endpoint(), cluster.root.path().join("gateway.log"));
    let url = format!("http://{}/v1/chat/completions", gateway.field("http"));
    let chat = |content: &str| {
        serde_json::json!({"model": "chat", "max_tokens": 4,
            "messages": [{"role": "user", "content": content}]})
    };
    let http = reqwest::Client::new();
    // The header the chat backend maps to tags.
    let r = http
        .post(&url)
        .header("x-data-class", "pii")
        .json(&chat("summarize our meeting notes"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 403);
    let err: serde_json::Value = r.json().await.unwrap();
    assert!(
        err["error"]["message"]
            .as_str()
            .unwrap()
            .contains("local workers only"),
        "{err}"
    );
    // No header, but an e-mail address in the prompt: the PII tagger finds it.
    let r = http
        .post(&url)
        .json(&chat("write to jane.doe@example.com about the invoice"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 403);
    // Counted by source and by the filters that refused the candidates.
    let m = node.metrics().await;
    for series in [
        r#"kvplane_route_tags_total{source="header"} 1"#,
        r#"kvplane_route_tags_total{source="pii/email"} 1"#,
        r#"kvplane_route_filtered_candidates_total{filter="exclude_external"} 2"#,
        r#"kvplane_route_filtered_candidates_total{filter="max_queued"} 4"#,
    ] {
        assert!(m.contains(series), "{series} in\n{m}");
    }
    // Neither: the request goes out to the provider (whatever the provider then answers).
    let mut router = node.router().await;
    let r = router
        .route(RouteRequest {
            model: "chat".into(),
            body: serde_json::to_vec(&chat("summarize our meeting notes")).unwrap(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    match &r.decision {
        Some(Decision::Endpoint(e)) => assert_eq!(e.provider, "cloud"),
        other => panic!("{other:?}"),
    }
}
