//! kvplane through clients we did not write: the official OpenAI Python SDK against the
//! reference gateway (models, completions and chat, whole and streamed, usage, request ids,
//! each of the SDK's exception classes for each refusal), and grpcio's reflection and health
//! clients against a node. The Python side is installed by `scripts/install-test-python`.

#![allow(clippy::unwrap_used)]

mod harness;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use harness::NodeOptions;

const CLIENTS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/clients");

/// Runs `script` with `arg`; fails the test with its output unless every check passed.
fn run(script: &str, arg: &str) -> String {
    let out = Command::new(harness::test_python())
        .arg(Path::new(CLIENTS).join(script))
        .arg(arg)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{script}:\n{text}");
    text
}

/// Policies for the SDK's every case: public model `chat` on the engines' worker set, a rule
/// that refuses `x-data-class: secret`, tenant `tiny` limited to 10 tokens a minute, and model
/// `idle` whose worker set has no engine.
const POLICIES: &str = r#"apiVersion: kvplane.io/v1alpha1
kind: InferenceWorkerSet
metadata: {name: default}
spec: {model: sim-8b, blockSize: 16}
---
apiVersion: kvplane.io/v1alpha1
kind: InferenceWorkerSet
metadata: {name: idle}
spec: {model: idle, blockSize: 16}
---
apiVersion: kvplane.io/v1alpha1
kind: InferencePool
metadata: {name: all}
spec: {workerSets: [default]}
---
apiVersion: kvplane.io/v1alpha1
kind: GatewayBackend
metadata: {name: chat}
spec:
  publicModel: chat
  backends: [{pool: all}]
  policies: [guard]
  tagHeaders: [{header: x-data-class}]
---
apiVersion: kvplane.io/v1alpha1
kind: InferencePolicy
metadata: {name: guard}
spec:
  rules:
    - name: secret
      match: {tags: [secret]}
      candidates: {pools: [all]}
      filter: {labels: {clearance: top}}
      onEmpty: {action: Reject, reason: secret data is not served here}
  limits: [{tenant: tiny, tokensPerMinute: 10}]
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_sdk_and_grpcio_work_against_kvplane_as_against_any_server() {
    let policy_dir = tempfile::tempdir().unwrap();
    std::fs::write(policy_dir.path().join("fleet.yaml"), POLICIES).unwrap();
    let (cluster, _engines) = harness::node_with_engines_under(
        2,
        &NodeOptions {
            policy_dir: Some(policy_dir.path().to_owned()),
            ..Default::default()
        },
    )
    .await;
    let root = cluster.root.path().to_owned();
    let node = &cluster.nodes[0];
    let gateway = harness::gateway(&node.endpoint(), root.join("gateway.log"));
    let sdk = run(
        "openai_sdk.py",
        &format!("http://{}/v1", gateway.field("http")),
    );
    assert!(sdk.contains("openai sdk: all checks passed"), "{sdk}");
    // What the SDK does not reach: other paths and methods, a body over the limit, readiness.
    let base = format!("http://{}", gateway.field("http"));
    let client = reqwest::Client::new();
    // Answers by status (the SDK's run counted some 404s already).
    let answered = |metrics: &str, status: u16| -> u64 {
        let series = format!("kvplane_gateway_requests_total{{status=\"{status}\"}} ");
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(series.as_str()))
            .map_or(0, |v| v.trim().parse().unwrap())
    };
    let before = harness::http_get(&format!("{base}/metrics")).await;
    for (req, status, code) in [
        (client.get(format!("{base}/v1/nothing")), 404, "not_found"),
        (
            client.get(format!("{base}/v1/chat/completions")),
            405,
            "method_not_allowed",
        ),
        (
            client
                .post(format!("{base}/v1/chat/completions"))
                .header("content-type", "application/json")
                .body(vec![b' '; (16 << 20) + 1]),
            413,
            "request_too_large",
        ),
    ] {
        let r = req.header("x-request-id", "edge-1").send().await.unwrap();
        assert_eq!(r.status().as_u16(), status);
        assert_eq!(r.headers()["x-request-id"], "edge-1");
        let body: serde_json::Value = r.json().await.unwrap();
        assert_eq!(body["error"]["code"], code, "{body}");
    }
    // The node's gRPC health follows its readiness once a second: ready within that.
    harness::eventually("the gateway ready", Duration::from_secs(5), || async {
        let r = client.get(format!("{base}/readyz")).send().await.ok()?;
        (r.status().as_u16() == 200).then_some(())
    })
    .await;
    let metrics = harness::http_get(&format!("{base}/metrics")).await;
    for status in [404, 405, 413] {
        assert_eq!(
            answered(&metrics, status),
            answered(&before, status) + 1,
            "one more {status} counted:\n{metrics}"
        );
    }
    let grpc = run("grpcio_node.py", &node.grpc.to_string());
    assert!(grpc.contains("grpcio: all checks passed"), "{grpc}");
}

/// A gateway whose replica does not answer: `/readyz` says not ready with a `Retry-After`, a
/// request is a 503 in OpenAI's shape, and every request has its access line - text by
/// default, one JSON object with `KVPLANE_LOG_FORMAT=json`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_without_a_ready_replica_is_not_ready_and_logs_each_request() {
    let dir = tempfile::tempdir().unwrap();
    // Nothing listens there.
    let replica = format!("http://127.0.0.1:{}", harness::free_port());
    let text_log = dir.path().join("gateway.log");
    let text = harness::gateway(&replica, text_log.clone());
    let json_log = dir.path().join("gateway-json.log");
    let args: Vec<String> = [
        "gateway",
        "--listen",
        "127.0.0.1:0",
        "--replicas",
        replica.as_str(),
    ]
    .map(str::to_owned)
    .to_vec();
    let (mut json_child, json_ready) = harness::process::start(harness::process::Spec {
        program: &harness::process::kvplane_binary(),
        args: &args,
        env: &[
            ("RUST_LOG".to_owned(), "info".to_owned()),
            ("KVPLANE_LOG_FORMAT".to_owned(), "json".to_owned()),
        ],
        log: &json_log,
        ready: Some("kvplane-gateway ready"),
    })
    .unwrap();
    let client = reqwest::Client::new();
    for base in [
        format!("http://{}", text.field("http")),
        format!("http://{}", harness::field(&json_ready, "http")),
    ] {
        let r = client.get(format!("{base}/readyz")).send().await.unwrap();
        assert_eq!(r.status().as_u16(), 503);
        assert_eq!(r.headers()["retry-after"], "5");
        let body = r.text().await.unwrap();
        assert!(
            body.starts_with("not ready: no kvplane replica is ready"),
            "{body}"
        );
        let r = client
            .post(format!("{base}/v1/chat/completions"))
            .header("x-request-id", "logged-1")
            .json(
                &serde_json::json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
            )
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 503);
        let body: serde_json::Value = r.json().await.unwrap();
        assert_eq!(
            (&body["error"]["type"], &body["error"]["code"]),
            (
                &serde_json::json!("server_error"),
                &serde_json::json!("unavailable")
            ),
            "{body}"
        );
    }
    // The gateway serves its process's own series and its build.
    let metrics = harness::http_get(&format!("http://{}/metrics", text.field("http"))).await;
    assert!(
        harness::metric_value(&metrics, "process_resident_memory_bytes") > 1e6
            && metrics.contains(&format!(
                "kvplane_build_info{{version=\"{}\"}} 1",
                env!("CARGO_PKG_VERSION")
            )),
        "{metrics}"
    );
    let line = harness::eventually("the text access line", Duration::from_secs(5), || async {
        std::fs::read_to_string(&text_log)
            .unwrap_or_default()
            .lines()
            .find(|l| l.contains("kvplane::access") && l.contains(r#"request_id="logged-1""#))
            .map(str::to_owned)
    })
    .await;
    for field in [
        r#"method="POST""#,
        r#"path="/v1/chat/completions""#,
        "status=503",
    ] {
        assert!(line.contains(field), "{field} not in {line}");
    }
    let entry = harness::eventually("the JSON access line", Duration::from_secs(5), || async {
        std::fs::read_to_string(&json_log)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .find(|v| v["target"] == "kvplane::access" && v["request_id"] == "logged-1")
    })
    .await;
    assert_eq!(entry["method"], "POST", "{entry}");
    assert_eq!(entry["path"], "/v1/chat/completions", "{entry}");
    assert_eq!(entry["status"], 503, "{entry}");
    let _ = json_child.kill();
    let _ = json_child.wait();
}
