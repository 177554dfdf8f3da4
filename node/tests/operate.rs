//! Operating a cluster: traces exported over OTLP continue the caller's trace, `/metrics`
//! parses as Prometheus text with per-tenant and Raft series, and `/readyz` follows the
//! replica's contact with the quorum.

#![allow(clippy::unwrap_used)]

mod harness;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use harness::{Cluster, eventually, prompt};
use kvplane_proto::v1::{RouteRequest, route_response::Decision};
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::trace::v1::Span;

/// Tenant acme's limit.
const LIMITS: &str = "    - {tenant: acme, tokensPerMinute: 600000, burst: 5000}\n";

/// A 3-node cluster with acme's limit and one live worker `gpu/w0`.
async fn started(env: Vec<(String, String)>) -> (Cluster, tempfile::TempDir) {
    harness::started_with_limits(LIMITS, env).await
}

fn acme_request(id: &str) -> RouteRequest {
    RouteRequest {
        request_id: id.into(),
        tenant: "acme".into(),
        model: "m".into(),
        token_ids: prompt(1),
        max_output_tokens: 16,
        ..Default::default()
    }
}

/// An OTLP/gRPC trace receiver keeping every span it is sent.
#[derive(Clone, Default)]
struct Collector(Arc<Mutex<Vec<Span>>>);

#[tonic::async_trait]
impl TraceService for Collector {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut spans = self.0.lock().unwrap();
        for r in request.into_inner().resource_spans {
            for s in r.scope_spans {
                spans.extend(s.spans);
            }
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

impl Collector {
    async fn start(self) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(TraceServiceServer::new(self))
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
        );
        format!("http://{addr}")
    }

    fn spans(&self) -> Vec<Span> {
        self.0.lock().unwrap().clone()
    }
}

fn attributes(s: &Span) -> BTreeMap<String, String> {
    s.attributes
        .iter()
        .map(|kv| {
            let v = match kv.value.as_ref().and_then(|v| v.value.as_ref()) {
                Some(Value::StringValue(s)) => s.clone(),
                Some(Value::IntValue(i)) => i.to_string(),
                Some(Value::DoubleValue(d)) => d.to_string(),
                Some(Value::BoolValue(b)) => b.to_string(),
                other => format!("{other:?}"),
            };
            (kv.key.clone(), v)
        })
        .collect()
}

const TRACE_ID: &str = "0af7651916cd43dd8448eb211c80319c";
const CALLER_SPAN: &str = "b7ad6b7169203331";

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_route_call_with_a_traceparent_continues_that_trace_with_the_decision_in_its_spans() {
    let collector = Collector::default();
    let endpoint = collector.clone().start().await;
    let env = vec![
        ("OTEL_EXPORTER_OTLP_ENDPOINT".to_owned(), endpoint),
        ("OTEL_BSP_SCHEDULE_DELAY".to_owned(), "100".to_owned()),
        ("OTEL_SERVICE_NAME".to_owned(), "kvplane-test".to_owned()),
    ];
    let (cluster, _dir) = started(env).await;
    let node = &cluster.nodes[1];
    let mut router = node.router().await;
    let mut call = tonic::Request::new(acme_request("traced-1"));
    call.metadata_mut().insert(
        "traceparent",
        format!("00-{TRACE_ID}-{CALLER_SPAN}-01").parse().unwrap(),
    );
    let r = router.route(call).await.unwrap().into_inner();
    assert!(matches!(r.decision, Some(Decision::Endpoint(_))), "{r:?}");

    let spans = eventually("the trace's spans", Duration::from_secs(20), || async {
        let ours: Vec<Span> = collector
            .spans()
            .into_iter()
            .filter(|s| hex(&s.trace_id) == TRACE_ID)
            .collect();
        let names: Vec<&str> = ours.iter().map(|s| s.name.as_str()).collect();
        ["route", "policy.evaluate", "index.lookup", "quota.admit"]
            .iter()
            .all(|n| names.contains(n))
            .then_some(ours)
    })
    .await;
    let by_name = |n: &str| spans.iter().find(|s| s.name == n).unwrap();
    let server = by_name("/kvplane.v1.Router/Route");
    assert_eq!(
        hex(&server.parent_span_id),
        CALLER_SPAN,
        "the caller's span is the parent"
    );
    let route = by_name("route");
    assert_eq!(route.parent_span_id, server.span_id);
    let a = attributes(route);
    for (k, v) in [
        ("tenant", "acme"),
        ("model", "m"),
        ("outcome", "routed"),
        ("pool", "gpu"),
        ("endpoint", "gpu/w0"),
        ("quota", "admitted"),
    ] {
        assert_eq!(a.get(k).map(String::as_str), Some(v), "{k} in {a:?}");
    }
    assert!(
        a.contains_key("matched_blocks") && a.contains_key("predicted_ttft_ms"),
        "{a:?}"
    );
    for child in ["policy.evaluate", "quota.admit"] {
        assert_eq!(by_name(child).parent_span_id, route.span_id, "{child}");
    }
    assert_eq!(
        attributes(by_name("quota.admit"))
            .get("outcome")
            .map(String::as_str),
        Some("admitted")
    );
    assert_eq!(
        by_name("index.lookup").parent_span_id,
        by_name("policy.evaluate").span_id
    );

    // Through the gateway: the caller's traceparent header reaches kvplane's Route.
    let gateway = harness::gateway(&node.endpoint(), cluster.root.path().join("gateway.log"));
    let http_trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let _ = reqwest::Client::new()
        .post(format!("http://{}/v1/completions", gateway.field("http")))
        .header("x-tenant", "acme")
        .header(
            "traceparent",
            format!("00-{http_trace}-00f067aa0ba902b7-01"),
        )
        .json(&serde_json::json!({"model": "m", "prompt": "hello there", "max_tokens": 4}))
        .send()
        .await
        .unwrap();
    let server = eventually(
        "the gateway's trace in kvplane",
        Duration::from_secs(20),
        || async {
            collector
                .spans()
                .into_iter()
                .find(|s| hex(&s.trace_id) == http_trace && s.name == "/kvplane.v1.Router/Route")
        },
    )
    .await;
    assert_eq!(hex(&server.parent_span_id), "00f067aa0ba902b7");

    // The leader's own work is traced too: the quota grant it proposed and applied, the
    // ingest batch of the worker's announcement.
    eventually("raft and ingest spans", Duration::from_secs(20), || async {
        let names: Vec<String> = collector.spans().into_iter().map(|s| s.name).collect();
        ["raft.propose", "raft.apply", "ingest.batch"]
            .iter()
            .all(|n| names.iter().any(|x| x == n))
            .then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_parse_as_prometheus_text_with_per_tenant_and_raft_series() {
    let (cluster, _dir) = started(Vec::new()).await;
    let node = &cluster.nodes[0];
    let mut router = node.router().await;
    for i in 0..5 {
        let r = router
            .route(acme_request(&format!("m-{i}")))
            .await
            .unwrap()
            .into_inner();
        assert!(matches!(r.decision, Some(Decision::Endpoint(_))), "{r:?}");
    }
    // One settled, one refused: their series exist only once they happen.
    router
        .report_usage(kvplane_proto::v1::UsageReport {
            request_id: "m-0".into(),
            prompt_tokens: 48,
            completion_tokens: 4,
            observed_ttft_ms: 20.0,
            ..Default::default()
        })
        .await
        .unwrap();
    let mut big = acme_request("too-big");
    big.max_output_tokens = 1_000_000;
    let r = router.route(big).await.unwrap().into_inner();
    assert!(matches!(r.decision, Some(Decision::Rejection(_))), "{r:?}");
    // The Raft gauges are sampled every second.
    let scrape = eventually("raft gauges", Duration::from_secs(10), || async {
        let text = node.metrics().await;
        let body = text
            .split_once("\r\n\r\n")
            .map_or(text.as_str(), |(_, b)| b);
        let lines = body.lines().map(|l| Ok(l.to_owned()));
        let scrape = prometheus_parse::Scrape::parse(lines).unwrap();
        scrape
            .samples
            .iter()
            .any(|s| s.metric == "kvplane_raft_applied_index" && value(s) > 0.0)
            .then_some(scrape)
    })
    .await;
    let find = |name: &str, label: Option<(&str, &str)>| {
        scrape
            .samples
            .iter()
            .find(|s| s.metric == name && label.is_none_or(|(k, v)| s.labels.get(k) == Some(v)))
    };
    let tenant = Some(("tenant", "acme"));
    assert_eq!(
        find("kvplane_quota_admitted_requests_total", tenant).map(value),
        Some(5.0)
    );
    assert_eq!(
        find("kvplane_quota_reserved_tokens_total", tenant).map(value),
        Some(5.0 * (48.0 + 16.0))
    );
    assert!(find("kvplane_quota_escrow_tokens", tenant).is_some());
    assert_eq!(
        find("kvplane_quota_settled_tokens_total", tenant).map(value),
        Some(52.0)
    );
    assert_eq!(
        find("kvplane_quota_rejected_requests_total", tenant).map(value),
        Some(1.0)
    );
    assert_eq!(
        find("kvplane_route_decisions_total", Some(("outcome", "routed"))).map(value),
        Some(5.0)
    );
    assert_eq!(
        find(
            "kvplane_route_decisions_total",
            Some(("outcome", "rate_limited"))
        )
        .map(value),
        Some(1.0)
    );
    assert!(find("kvplane_route_duration_seconds_count", None).is_some_and(|s| value(s) >= 5.0));
    assert!(find("kvplane_raft_role", Some(("role", "leader"))).is_some());
    assert_eq!(find("kvplane_raft_voters", None).map(value), Some(3.0));
    assert_eq!(find("kvplane_raft_ready", None).map(value), Some(1.0));
    assert!(find("kvplane_raft_term", None).is_some_and(|s| value(s) >= 1.0));
    // The log's writer counts what it fsynced and wrote.
    let fsyncs = find("kvplane_raft_log_fsyncs_total", None).map(value);
    let written = find("kvplane_raft_log_entries_written_total", None).map(value);
    assert!(
        fsyncs.is_some_and(|f| f >= 1.0) && written.is_some_and(|w| w >= 1.0),
        "fsyncs {fsyncs:?}, entries written {written:?}"
    );
    // The process's own series, and the build.
    assert!(find("process_resident_memory_bytes", None).is_some_and(|s| value(s) > 1e6));
    assert!(find("process_open_fds", None).is_some_and(|s| value(s) >= 3.0));
    assert!(find("process_cpu_seconds_total", None).is_some());
    assert_eq!(
        find(
            "kvplane_build_info",
            Some(("version", env!("CARGO_PKG_VERSION")))
        )
        .map(value),
        Some(1.0)
    );
    // `kvplane status` shows the tenant's window.
    let out = harness::kvplane_ok(&["status", "--addr", &node.endpoint()]);
    assert!(
        out.contains("tenant/model") && out.lines().any(|l| l.starts_with("acme ")),
        "{out}"
    );
    // Every node series the Grafana dashboard in deploy/ plots is one the node exports.
    let known: std::collections::BTreeSet<String> = scrape
        .samples
        .iter()
        .map(|s| s.metric.clone())
        .chain(
            scrape
                .docs
                .keys()
                .flat_map(|k| [k.clone(), format!("{k}_total")]),
        )
        .collect();
    let dashboard = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/grafana/kvplane.json"),
    )
    .unwrap();
    let dashboard: serde_json::Value = serde_json::from_str(&dashboard).unwrap();
    let mut plotted = Vec::new();
    for panel in dashboard["panels"].as_array().unwrap() {
        for t in panel["targets"].as_array().into_iter().flatten() {
            let expr = t["expr"].as_str().unwrap();
            plotted.extend(metric_names(expr));
        }
    }
    assert!(plotted.len() > 15, "{plotted:?}");
    for name in plotted
        .iter()
        .filter(|n| !n.starts_with("kvplane_gateway_"))
    {
        let base = name.strip_suffix("_bucket").unwrap_or(name);
        assert!(
            known.contains(base),
            "the dashboard plots {name}, which the node does not export"
        );
    }
    for name in [
        "kvplane_raft_committed_index",
        "kvplane_raft_snapshot_bytes",
        "kvplane_state_indexed_blocks",
        "kvplane_ingest_messages_total",
        "kvplane_ingest_rejected_messages_total",
    ] {
        assert!(find(name, None).is_some(), "{name} missing");
    }
}

/// The `kvplane_*` series named in a PromQL expression.
fn metric_names(expr: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = expr;
    while let Some(i) = rest.find("kvplane_") {
        let tail = &rest[i..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        out.push(tail[..end].to_owned());
        rest = &tail[end..];
    }
    out
}

fn value(s: &prometheus_parse::Sample) -> f64 {
    match s.value {
        prometheus_parse::Value::Counter(v)
        | prometheus_parse::Value::Gauge(v)
        | prometheus_parse::Value::Untyped(v) => v,
        _ => f64::NAN,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_goes_off_on_a_replica_cut_off_from_the_quorum_and_back_when_healed() {
    let (mut cluster, _dir) = started(Vec::new()).await;
    for n in &cluster.nodes {
        assert_eq!(n.readyz().await.0, 200);
        assert_eq!(
            reqwest::get(format!("http://{}/healthz", n.http))
                .await
                .unwrap()
                .status(),
            200
        );
    }
    let leader = cluster.leader(&[0, 1, 2]).await.unwrap();
    let cut = (leader + 1) % 3;
    cluster.isolate(cut).await;
    let why = eventually(
        "the cut replica not ready",
        Duration::from_secs(20),
        || async {
            let (code, body) = cluster.nodes[cut].readyz().await;
            (code == 503).then_some(body)
        },
    )
    .await;
    // With Pre-Vote it never starts an election and keeps the leader it knew: what makes it
    // not ready is that it has not heard from that leader.
    assert!(why.contains("no word from leader"), "{why}");
    for i in (0..3).filter(|i| *i != cut) {
        assert_eq!(
            cluster.nodes[i].readyz().await.0,
            200,
            "node {i} keeps a quorum"
        );
    }
    cluster.heal().await;
    eventually(
        "the healed replica ready",
        Duration::from_secs(20),
        || async { (cluster.nodes[cut].readyz().await.0 == 200).then_some(()) },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_names_an_unreachable_nats_and_comes_back_with_it() {
    let mut cluster = Cluster::start(1);
    let node = &cluster.nodes[0];
    eventually("the node ready", Duration::from_secs(20), || async {
        (node.readyz().await.0 == 200).then_some(())
    })
    .await;
    let url = cluster.nats.url();
    cluster.nats.kill();
    let node = &cluster.nodes[0];
    let why = eventually("the node not ready", Duration::from_secs(20), || async {
        let (code, body) = node.readyz().await;
        (code == 503).then_some(body)
    })
    .await;
    assert!(
        why.contains(&format!("nats at {url} is unreachable")),
        "{why}"
    );
    let log = node.log();
    assert!(
        log.lines()
            .any(|l| l.contains("nats unreachable") && l.contains(&url)),
        "{log}"
    );
    let connected = |log: &str| {
        log.lines()
            .filter(|l| l.contains("nats connected") && l.contains(&url))
            .count()
    };
    let before = connected(&log);
    cluster.nats.restart();
    let node = &cluster.nodes[0];
    eventually("the node ready again", Duration::from_secs(30), || async {
        (node.readyz().await.0 == 200).then_some(())
    })
    .await;
    // The reconnect is logged with the URL too.
    let log = node.log();
    assert!(connected(&log) > before, "{log}");
}
