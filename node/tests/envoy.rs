//! kvplane as the endpoint picker of a real Envoy (1.40, `scripts/install-envoy`), configured
//! by `examples/envoy/envoy.yaml` (only its ports changed): requests through Envoy reach the
//! engine that caches their prefix - the engines' own metrics say so - in the protocol's
//! full-duplex mode and with a buffered body; refusals come back as Envoy's answers; the
//! answers' usage reaches kvplane without any gateway code.

#![allow(clippy::unwrap_used)]

mod harness;

use std::path::PathBuf;
use std::process::Child;
use std::time::Duration;

use harness::{eventually, free_port, words};
use kvplane_proto::v1::{RouteRequest, route_response::Decision};
use serde_json::json;

const EXAMPLE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/envoy/envoy.yaml");

/// A running Envoy, killed on drop.
struct Envoy {
    child: Child,
    full_duplex: u16,
    buffered: u16,
    access_log: PathBuf,
}

impl Drop for Envoy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Envoy {
    /// The example's config with kvplane at `grpc`, the pool's round robin over `pool`
    /// (`host:port`, two) and free ports, started and ready.
    async fn start(grpc: std::net::SocketAddr, pool: [&str; 2], dir: &std::path::Path) -> Self {
        Self::start_changed(grpc, pool, dir, ("", "")).await
    }

    /// As [`Self::start`], with one more change to the example's text (`from` -> `to`).
    async fn start_changed(
        grpc: std::net::SocketAddr,
        pool: [&str; 2],
        dir: &std::path::Path,
        (from, to): (&str, &str),
    ) -> Self {
        let (admin, full_duplex, buffered) = (free_port(), free_port(), free_port());
        let socket = |a: &str| {
            let (host, port) = a.rsplit_once(':').unwrap();
            format!("address: {host}, port_value: {port}")
        };
        let mut config = std::fs::read_to_string(EXAMPLE).unwrap();
        if !from.is_empty() {
            assert_eq!(config.matches(from).count(), 1, "{from}");
            config = config.replace(from, to);
        }
        let config = config
            .replace("address: 127.0.0.1, port_value: 8001", &socket(pool[0]))
            .replace("address: 127.0.0.1, port_value: 8002", &socket(pool[1]))
            .replace("port_value: 9901", &format!("port_value: {admin}"))
            .replace("port_value: 10000", &format!("port_value: {full_duplex}"))
            .replace("port_value: 10001", &format!("port_value: {buffered}"))
            .replace("port_value: 7070", &format!("port_value: {}", grpc.port()))
            .replace(
                "path: /dev/stdout",
                &format!("path: {}", dir.join("access.log").display()),
            );
        let child = harness::spawn_envoy(dir, "envoy", &config);
        eventually("envoy ready", Duration::from_secs(30), || async move {
            let r = reqwest::get(format!("http://127.0.0.1:{admin}/ready")).await;
            r.is_ok_and(|r| r.status().is_success()).then_some(())
        })
        .await;
        Self {
            child,
            full_duplex,
            buffered,
            access_log: dir.join("access.log"),
        }
    }

    /// Both listeners' access log lines so far.
    fn access_log(&self) -> Vec<String> {
        std::fs::read_to_string(&self.access_log)
            .unwrap_or_default()
            .lines()
            .map(str::to_owned)
            .collect()
    }
}

type Health = tonic_health::pb::health_client::HealthClient<tonic::transport::Channel>;

/// Waits until the node's health for `service` is serving (or not, `serving`).
async fn health_becomes(health: &Health, service: &str, serving: bool) {
    eventually(service, Duration::from_secs(30), || {
        let mut h = health.clone();
        async move {
            let r = h
                .check(tonic_health::pb::HealthCheckRequest {
                    service: service.into(),
                })
                .await
                .ok()?
                .into_inner();
            let is =
                r.status == tonic_health::pb::health_check_response::ServingStatus::Serving as i32;
            (is == serving).then_some(())
        }
    })
    .await;
}

async fn post(url: &str, body: &serde_json::Value) -> reqwest::Response {
    reqwest::Client::new()
        .post(url)
        .json(body)
        .send()
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_sends_each_request_to_the_engine_kvplane_picks_and_kvplane_hears_its_usage() {
    let (mut cluster, engines) = harness::node_with_engines(3).await;
    let root = cluster.root.path().to_owned();
    let node = &cluster.nodes[0];
    // The health names a proxy checks, as the endpoint picker protocol names them.
    let channel = tonic::transport::Endpoint::from_shared(node.endpoint())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let health = tonic_health::pb::health_client::HealthClient::new(channel);
    for service in [
        "liveness",
        "readiness",
        "envoy.service.ext_proc.v3.ExternalProcessor",
    ] {
        health_becomes(&health, service, true).await;
    }
    let addr = |e: &harness::Engine| e.http.trim_start_matches("http://").to_owned();
    let envoy = Envoy::start(node.grpc, [&addr(&engines[0]), &addr(&engines[2])], &root).await;

    // engine-2 caches a long system prompt (warmed directly), and kvplane knows it.
    let system = words("sys", 1200);
    let chat = |q: &str, stream: bool| {
        json!({"model": "sim-8b", "max_tokens": 4, "stream": stream,
            "stream_options": {"include_usage": true},
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": q}]})
    };
    let warm = post(
        &format!("{}/v1/chat/completions", engines[1].http),
        &chat("first question", false),
    )
    .await;
    assert!(warm.status().is_success());
    let second = chat("a second, different question", false);
    // Explain: the decision without its side effects (no queue entry, no reservation).
    eventually("kvplane to index engine-2's blocks", Duration::from_secs(20), || async {
        let r = node
            .router()
            .await
            .explain(RouteRequest {
                request_id: "probe".into(),
                body: serde_json::to_vec(&second).unwrap(),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner()
            .decision
            .unwrap();
        matches!(r.decision, Some(Decision::Endpoint(e)) if e.worker_id == "engine-2" && r.matched_blocks >= 70)
            .then_some(())
    })
    .await;
    let hits = || {
        futures::future::join_all(
            engines
                .iter()
                .map(|e| e.metric("vllm:prefix_cache_hits_total")),
        )
    };

    for (listener, port) in [
        ("full duplex", envoy.full_duplex),
        ("buffered", envoy.buffered),
    ] {
        let before = hits().await;
        let r = post(
            &format!("http://127.0.0.1:{port}/v1/chat/completions"),
            &second,
        )
        .await;
        assert!(r.status().is_success(), "{listener}: {}", r.status());
        assert_eq!(
            r.headers()["x-kvplane-worker"],
            "default/engine-2",
            "{listener}"
        );
        let body: serde_json::Value = r.json().await.unwrap();
        assert!(
            body["usage"]["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap()
                >= 1120,
            "{listener}: {body}"
        );
        let after = hits().await;
        // The engine itself says it served the prompt from its cache; the others saw nothing.
        assert!(
            after[1] - before[1] >= 1120.0,
            "{listener}: {before:?} -> {after:?}"
        );
        assert_eq!((after[0], after[2]), (before[0], before[2]), "{listener}");
    }

    // Streamed through the protocol's mode: SSE passes through, and kvplane hears the first
    // token and the end from the picker alone.
    let r = post(
        &format!("http://127.0.0.1:{}/v1/chat/completions", envoy.full_duplex),
        &chat("a streamed question", true),
    )
    .await;
    assert!(r.status().is_success());
    let (text, _) = harness::sse_events(r).await;
    assert!(text.contains("\"usage\""), "{text}");
    eventually(
        "usage reported through the picker",
        Duration::from_secs(10),
        || async {
            let m = node.metrics().await;
            (m.contains(r#"kvplane_usage_reports_total{outcome="known"} 3"#)
                && m.contains(r#"kvplane_usage_reports_total{outcome="first_token"} 1"#))
            .then_some(())
        },
    )
    .await;
    let m = node.metrics().await;
    assert!(
        m.contains(r#"kvplane_picker_requests_total{outcome="routed"} 3"#),
        "{m}"
    );
    // Envoy's own record: it connected where kvplane's envoy.lb metadata said, engine-2 (the
    // buffered listener through its route for a pick, not the pool's round robin).
    let engine_2 = addr(&engines[1]);
    let want = |listener: &str| {
        format!("{listener} /v1/chat/completions 200 upstream={engine_2} picked={engine_2}")
    };
    // Envoy flushes its access log every second.
    eventually("envoy's access log", Duration::from_secs(10), || async {
        let lines = envoy.access_log();
        (lines.len() >= 3).then_some(())
    })
    .await;
    let lines = envoy.access_log();
    for (listener, n) in [("full_duplex", 2), ("buffered", 1)] {
        let want = want(listener);
        assert_eq!(
            lines.iter().filter(|l| l.starts_with(&want)).count(),
            n,
            "{listener}: {lines:#?}"
        );
    }

    // A refusal is Envoy's answer to the client: the status and kvplane's error body.
    let r = post(
        &format!("http://127.0.0.1:{}/v1/chat/completions", envoy.full_duplex),
        &json!({"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}),
    )
    .await;
    assert_eq!(r.status().as_u16(), 404);
    let body: serde_json::Value = r.json().await.unwrap();
    assert_eq!(body["error"]["code"], "model_not_found", "{body}");

    // Cut off from NATS the node is not ready: the health names proxies check follow it, and
    // liveness does not.
    drop(envoy);
    cluster.nats.kill();
    for (service, serving) in [
        ("readiness", false),
        ("envoy.service.ext_proc.v3.ExternalProcessor", false),
        ("liveness", true),
    ] {
        health_becomes(&health, service, serving).await;
    }
}

/// Requests answered by each engine so far (its own counter).
async fn served(engines: &[&harness::Proc]) -> Vec<f64> {
    let mut out = Vec::new();
    for e in engines {
        let text = harness::http_get(&format!("http://{}/metrics", e.field("http"))).await;
        out.push(harness::metric_value(&text, "vllm:request_success_total"));
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_kvplanes_answer_envoy_fails_closed_in_full_duplex_even_if_told_to_fail_open_and_open_to_the_pool_when_buffered()
 {
    let dir = tempfile::tempdir().unwrap();
    let nats = harness::Nats::start();
    let (a, b) = (
        harness::Engine::sim(&dir.path().join("a"), "a", [0, 0, 0], &[]),
        harness::Engine::sim(&dir.path().join("b"), "b", [0, 0, 0], &[]),
    );
    // A member that has not joined a cluster yet (the one it asks is not there): it serves
    // the picker with no state.
    let o = harness::NodeOptions {
        raft: Some(harness::RaftOptions {
            id: 1,
            join: vec![format!("127.0.0.1:{}", free_port())],
            ..Default::default()
        }),
        ..Default::default()
    };
    let mut node = harness::Node::start("n1", &dir.path().join("n1"), &nats.url(), &o);
    // The full-duplex listener asked to fail open, which Envoy does not do in that mode.
    let envoy = Envoy::start_changed(
        node.grpc,
        [&a.field("http"), &b.field("http")],
        dir.path(),
        ("failure_mode_allow: false", "failure_mode_allow: true"),
    )
    .await;
    let body = json!({"model": "sim-8b", "max_tokens": 2,
        "messages": [{"role": "user", "content": "hello"}]});
    let url = |port: u16| format!("http://127.0.0.1:{port}/v1/chat/completions");

    for kvplane in ["with no state", "gone"] {
        let before = served(&[&a, &b]).await;
        // Full duplex: Envoy's own 500 though failing open, and no engine saw the request.
        let r = post(&url(envoy.full_duplex), &body).await;
        assert_eq!(r.status().as_u16(), 500, "kvplane {kvplane}");
        assert_eq!(served(&[&a, &b]).await, before, "kvplane {kvplane}");
        // Buffered, failing open: an engine of the pool answers, whatever destination the
        // client named (nothing listens there) or the provider (no route to it): the listener
        // dropped both headers.
        let r = reqwest::Client::new()
            .post(url(envoy.buffered))
            .header(
                "x-gateway-destination-endpoint",
                format!("127.0.0.1:{}", free_port()),
            )
            .header("x-kvplane-provider", "cloud")
            .json(&body)
            .send()
            .await
            .unwrap();
        assert!(r.status().is_success(), "kvplane {kvplane}: {}", r.status());
        assert!(
            r.headers().get("x-kvplane-worker").is_none(),
            "kvplane {kvplane}: no pick"
        );
        let answer: serde_json::Value = r.json().await.unwrap();
        assert_eq!(answer["object"], "chat.completion", "{answer}");
        let after = served(&[&a, &b]).await;
        assert_eq!(
            after.iter().sum::<f64>() - before.iter().sum::<f64>(),
            1.0,
            "kvplane {kvplane}: {before:?} -> {after:?}"
        );
        if kvplane == "with no state" {
            // Both streams reached the node, which ended them for the proxy's failure mode.
            let m = node.metrics().await;
            assert!(
                m.contains(r#"kvplane_picker_requests_total{outcome="unavailable"} 2"#),
                "{m}"
            );
            node.kill();
        }
    }
    // Envoy's record of the buffered requests: the pool's engines, no pick.
    eventually("envoy's access log", Duration::from_secs(10), || async {
        let lines = envoy.access_log();
        (lines.iter().filter(|l| l.starts_with("buffered ")).count() >= 2).then_some(())
    })
    .await;
    let pool = [a.field("http"), b.field("http")];
    for line in envoy
        .access_log()
        .iter()
        .filter(|l| l.starts_with("buffered "))
    {
        let upstream = harness::field(line, "upstream");
        assert!(pool.contains(&upstream), "{line}");
        assert!(line.ends_with("picked=-"), "{line}");
    }
}

/// Where the proxy runs, as its operator configures it: `x-kvplane-cluster` in the ext_proc
/// stream's `initial_metadata` (the example's commented line). A node in cluster a whose
/// engines are in a, under a rule that keeps every request in the asking proxy's cluster:
/// through the listener that says nothing the request is served by a's engine kvplane picked;
/// through the one whose Envoy says it runs in b it is refused - Envoy sent the metadata.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_envoy_that_says_it_runs_in_another_cluster_is_decided_for_as_from_there() {
    let policies = tempfile::tempdir().unwrap();
    std::fs::write(
        policies.path().join("fleet.yaml"),
        concat!(
            "apiVersion: kvplane.io/v1alpha1\nkind: InferenceWorkerSet\nmetadata: {name: default}\n",
            "spec: {model: sim-8b, blockSize: 16, labels: {kvplane.io/cluster: a}}\n---\n",
            "apiVersion: kvplane.io/v1alpha1\nkind: InferencePolicy\nmetadata: {name: stay}\n",
            "spec:\n  appliesToModels: [sim-8b]\n  rules:\n  - name: home\n",
            "    filter: {sameLocality: Cluster}\n",
            "    onEmpty: {action: Reject, reason: kept in the asking proxy's cluster}\n",
        ),
    )
    .unwrap();
    let (cluster, engines) = harness::node_with_engines_under(
        2,
        &harness::NodeOptions {
            policy_dir: Some(policies.path().to_owned()),
            extra_toml: "[locality]\ncluster = \"a\"\n".into(),
            ..Default::default()
        },
    )
    .await;
    let node = &cluster.nodes[0];
    let addr = |e: &harness::Engine| e.http.trim_start_matches("http://").to_owned();
    let envoy = Envoy::start_changed(
        node.grpc,
        [&addr(&engines[0]), &addr(&engines[1])],
        cluster.root.path(),
        (
            "# initial_metadata: [{key: x-kvplane-cluster, value: b}]",
            "initial_metadata: [{key: x-kvplane-cluster, value: b}]",
        ),
    )
    .await;
    let body = json!({"model": "sim-8b", "max_tokens": 2,
        "messages": [{"role": "user", "content": "where am i"}]});
    let url = |port: u16| format!("http://127.0.0.1:{port}/v1/chat/completions");
    let r = post(&url(envoy.buffered), &body).await;
    assert!(r.status().is_success(), "{}", r.status());
    let worker = r.headers()["x-kvplane-worker"].to_str().unwrap().to_owned();
    assert!(worker.starts_with("default/engine-"), "{worker}");
    let r = post(&url(envoy.full_duplex), &body).await;
    assert_eq!(r.status().as_u16(), 403);
    let refusal: serde_json::Value = r.json().await.unwrap();
    assert_eq!(
        refusal["error"]["message"], "kept in the asking proxy's cluster",
        "{refusal}"
    );
}
