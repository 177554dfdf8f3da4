//! Engines a worker set lists at fixed addresses, with real processes: two simulated engines
//! with no bridge and one with its bridge, all three listed in the policy directory's worker
//! set. The node routes to all three from the start; the bridged one is the same worker as
//! its listed endpoint (one worker, its cache and load streaming); requests through the
//! reference gateway are served by engines kvplane never heard from over NATS.

#![allow(clippy::unwrap_used)]

mod harness;

use std::time::Duration;

use harness::{Cluster, Engine, EngineOptions, Node, NodeOptions, eventually};
use kvplane_proto::v1::route_response::Decision;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listed_engines_serve_requests_with_or_without_a_bridge() {
    let dir = tempfile::tempdir().unwrap();
    let fleet = dir.path().join("fleet");
    let quiet = [
        Engine::sim(&fleet, "quiet-1", [0; 3], &[]),
        Engine::sim(&fleet, "quiet-2", [0; 3], &[]),
    ];
    let policies = dir.path().join("policies");
    std::fs::create_dir_all(&policies).unwrap();
    // The bridged engine needs NATS first: the cluster starts before it, with a worker set
    // listing the two quiet engines and the bridged one's address once it is known.
    let cluster = Cluster::start_with(
        1,
        &NodeOptions {
            policy_dir: Some(policies.clone()),
            pools: vec![],
            ..Default::default()
        },
    );
    let bridged = Engine::start_with(
        &fleet,
        &cluster.nats.url(),
        "bridged",
        &EngineOptions {
            pool: "ws".into(),
            ..Default::default()
        },
    );
    let endpoint =
        |worker: &str, http: String| format!("  - {{worker: {worker}, address: '{http}'}}\n");
    let listed = [
        endpoint("quiet-1", format!("http://{}", quiet[0].field("http"))),
        endpoint("quiet-2", format!("http://{}", quiet[1].field("http"))),
        endpoint("bridged", bridged.http.clone()),
    ]
    .concat();
    std::fs::write(
        policies.join("fleet.yaml"),
        format!(
            "apiVersion: kvplane.io/v1alpha1\nkind: InferenceWorkerSet\nmetadata: {{name: ws}}\nspec:\n  model: sim-8b\n  endpoints:\n{listed}"
        ),
    )
    .unwrap();
    let node = &cluster.nodes[0];
    let workers = eventually(
        "three listed workers, the bridged one streaming",
        Duration::from_secs(30),
        || async {
            let s = node.status().await;
            let rows: Vec<(String, bool, bool, String)> = s
                .workers
                .iter()
                .map(|w| (w.worker_id.clone(), w.up, w.streaming, w.found.clone()))
                .collect();
            (rows.len() == 3 && rows[0].2).then_some(rows)
        },
    )
    .await;
    let s = |v: &str| v.to_owned();
    assert_eq!(
        workers,
        [
            (s("bridged"), true, true, s("static")),
            (s("quiet-1"), true, false, s("static")),
            (s("quiet-2"), true, false, s("static")),
        ]
    );

    // The bridge serves its process's own series too.
    assert!(bridged.bridge_metric("process_resident_memory_bytes").await > 1e6);
    let gateway = harness::gateway(&node.endpoint(), dir.path().join("gateway.log"));
    let url = format!("http://{}/v1/completions", gateway.field("http"));
    let http = reqwest::Client::new();
    for i in 0..12 {
        let r = http
            .post(&url)
            .json(&serde_json::json!({"model": "sim-8b", "max_tokens": 2,
                "prompt": format!("request {i}: a prompt no engine has seen")}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
    }
    // Each quiet engine served requests: its own counter says so.
    for q in &quiet {
        let metrics = http
            .get(format!("http://{}/metrics", q.field("http")))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        let served: f64 = metrics
            .lines()
            .find(|l| l.starts_with("vllm:request_success_total"))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.0);
        assert!(served >= 1.0, "{metrics}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listed_engine_that_stops_answering_is_not_routed_to_until_it_answers_again() {
    let dir = tempfile::tempdir().unwrap();
    let fleet = dir.path().join("fleet");
    let engines = [
        Engine::sim(&fleet, "e-1", [0; 3], &[]),
        Engine::sim(&fleet, "e-2", [0; 3], &[]),
    ];
    let policies = dir.path().join("policies");
    std::fs::create_dir_all(&policies).unwrap();
    let listed: String = engines
        .iter()
        .enumerate()
        .map(|(i, e)| {
            format!(
                "  - {{worker: e-{}, address: 'http://{}'}}\n",
                i + 1,
                e.field("http")
            )
        })
        .collect();
    std::fs::write(
        policies.join("fleet.yaml"),
        format!(
            "apiVersion: kvplane.io/v1alpha1\nkind: InferenceWorkerSet\nmetadata: {{name: ws}}\nspec:\n  model: sim-8b\n  endpoints:\n{listed}"
        ),
    )
    .unwrap();
    let options = NodeOptions {
        policy_dir: Some(policies),
        pools: vec![],
        extra_toml: "[endpoint_health]\ninterval_ms = 200\ntimeout_ms = 300\nfailures = 2\n".into(),
        ..Default::default()
    };
    let mut cluster = Cluster::start_with(1, &options);
    let node = &cluster.nodes[0];
    let routable = || worker_states(node);
    let s = |v: &str| v.to_owned();
    eventually(
        "both listed engines routable",
        Duration::from_secs(30),
        || async { (routable().await == [(s("e-1"), true), (s("e-2"), true)]).then_some(()) },
    )
    .await;

    // e-1 stops answering (SIGSTOP: its port still accepts, nothing answers).
    assert!(engines[0].freeze(true));
    eventually("e-1 out of routing", Duration::from_secs(20), || async {
        (routable().await == [(s("e-1"), false), (s("e-2"), true)]).then_some(())
    })
    .await;
    let mut router = node.router().await;
    for i in 0..20 {
        let r = router
            .route(kvplane_proto::v1::RouteRequest {
                request_id: format!("r{i}"),
                model: "sim-8b".into(),
                token_ids: (0..64).map(|t| t + i * 64).collect(),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        let chosen = match &r.decision {
            Some(Decision::Endpoint(e)) => e.worker_id.as_str(),
            _ => "",
        };
        assert_eq!(chosen, "e-2", "{r:?}");
    }
    let metrics = node.metrics().await;
    let value = |name: &str| -> f64 {
        metrics
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.0)
    };
    assert!(
        value("kvplane_endpoint_health_checks_failed_total") >= 2.0,
        "{metrics}"
    );
    assert_eq!(
        value("kvplane_endpoint_health_changes_applied_total"),
        1.0,
        "{metrics}"
    );

    // Answering again, it is back at the next check.
    assert!(engines[0].freeze(false));
    eventually("e-1 routable again", Duration::from_secs(20), || async {
        (routable().await == [(s("e-1"), true), (s("e-2"), true)]).then_some(())
    })
    .await;

    // Out again, then the node restarted with the checks off (`interval_ms = 0`): nothing
    // checks any more, so the list is trusted - e-1 is routable though it still answers nothing.
    assert!(engines[0].freeze(true));
    eventually("e-1 out again", Duration::from_secs(20), || async {
        (routable().await == [(s("e-1"), false), (s("e-2"), true)]).then_some(())
    })
    .await;
    let node = &mut cluster.nodes[0];
    let off = NodeOptions {
        extra_toml: "[endpoint_health]\ninterval_ms = 0\n".into(),
        ..options
    };
    Node::write_config(&node.name, &node.dir, &cluster.nats.url(), &off);
    node.kill();
    node.restart();
    let node = &cluster.nodes[0];
    eventually(
        "e-1 routable with the checks off",
        Duration::from_secs(30),
        || async {
            (worker_states(node).await == [(s("e-1"), true), (s("e-2"), true)]).then_some(())
        },
    )
    .await;
    // By the leader's entry for it (not a restart's side effect).
    eventually(
        "the leader's word for it",
        Duration::from_secs(10),
        || async {
            node.log()
                .contains("health checks are off: listed engines they took out are routable again")
                .then_some(())
        },
    )
    .await;
    assert!(engines[0].freeze(false));
}

/// Each worker's name and whether the node routes to it.
async fn worker_states(node: &Node) -> Vec<(String, bool)> {
    node.status()
        .await
        .workers
        .iter()
        .map(|w| (w.worker_id.clone(), w.up))
        .collect()
}

/// An engine started with `--api-key` (vLLM's flag; Envoy plays that check here, as vLLM
/// answers it: `/v1/*` only with `Authorization: Bearer <key>`, 401 otherwise, `/health` and
/// `/metrics` open) behind a worker set's listed address: through the reference gateway a
/// client holding the key is answered, and the engine's own record shows the key, the client's
/// request id, trace context and tenant arrived with the request; a client without the key
/// gets the engine's 401.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clients_key_and_trace_headers_reach_an_engine_that_checks_its_api_key() {
    const KEY: &str = "engine-key-1";
    let dir = tempfile::tempdir().unwrap();
    let sim = Engine::sim(&dir.path().join("fleet"), "keyed", [0; 3], &[]);
    let (port, admin) = (harness::free_port(), harness::free_port());
    let (host, backend) = sim
        .field("http")
        .rsplit_once(':')
        .map(|(h, p)| (h.to_owned(), p.to_owned()))
        .unwrap();
    let log = dir.path().join("engine-access.log");
    let config = format!(
        r#"
admin: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {admin}}}}}}}
static_resources:
  listeners:
  - name: engine
    address: {{socket_address: {{address: 127.0.0.1, port_value: {port}}}}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: engine
          access_log:
          - name: envoy.access_loggers.file
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog
              path: {log}
              log_format: {{text_format_source: {{inline_string: "%REQ(:PATH)% %RESPONSE_CODE% auth=%REQ(AUTHORIZATION)% id=%REQ(X-REQUEST-ID)% trace=%REQ(TRACEPARENT)% tenant=%REQ(X-TENANT)%\n"}}}}
          route_config:
            virtual_hosts:
            - name: engine
              domains: ["*"]
              routes:
              - match:
                  prefix: /v1/
                  headers: [{{name: authorization, string_match: {{exact: "Bearer {KEY}"}}}}]
                route: {{cluster: sim, timeout: 60s}}
              - match: {{prefix: /v1/}}
                direct_response:
                  status: 401
                  body: {{inline_string: '{{"error":"Unauthorized"}}'}}
              - match: {{prefix: /}}
                route: {{cluster: sim, timeout: 60s}}
          http_filters:
          - name: envoy.filters.http.router
            typed_config: {{"@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router}}
  clusters:
  - name: sim
    type: STATIC
    connect_timeout: 5s
    load_assignment:
      cluster_name: sim
      endpoints: [{{lb_endpoints: [{{endpoint: {{address: {{socket_address: {{address: {host}, port_value: {backend}}}}}}}}}]}}]
"#,
        log = log.display(),
    );
    let mut envoy = harness::spawn_envoy(dir.path(), "engine-envoy", &config);
    let policies = dir.path().join("policies");
    std::fs::create_dir_all(&policies).unwrap();
    std::fs::write(
        policies.join("fleet.yaml"),
        format!(
            "apiVersion: kvplane.io/v1alpha1\nkind: InferenceWorkerSet\nmetadata: {{name: ws}}\nspec:\n  model: sim-8b\n  endpoints:\n  - {{worker: keyed, address: 'http://127.0.0.1:{port}'}}\n"
        ),
    )
    .unwrap();
    let cluster = Cluster::start_with(
        1,
        &NodeOptions {
            policy_dir: Some(policies),
            pools: vec![],
            ..Default::default()
        },
    );
    let gateway = harness::gateway(&cluster.nodes[0].endpoint(), dir.path().join("gateway.log"));
    let url = format!("http://{}/v1/chat/completions", gateway.field("http"));
    let body = serde_json::json!({"model": "sim-8b", "max_tokens": 2,
        "messages": [{"role": "user", "content": "hello"}]});
    let trace = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let http = reqwest::Client::new();
    let r = eventually(
        "the keyed engine answers",
        Duration::from_secs(30),
        || async {
            let r = http
                .post(&url)
                .bearer_auth(KEY)
                .header("x-request-id", "client-req-1")
                .header("traceparent", trace)
                .header("x-tenant", "acme")
                .json(&body)
                .send()
                .await
                .ok()?;
            r.status().is_success().then_some(r)
        },
    )
    .await;
    assert_eq!(r.headers()["x-kvplane-worker"], "ws/keyed");
    let answer: serde_json::Value = r.json().await.unwrap();
    assert_eq!(answer["object"], "chat.completion", "{answer}");
    let r = http.post(&url).json(&body).send().await.unwrap();
    assert_eq!(
        r.status().as_u16(),
        401,
        "the engine's refusal passes through"
    );
    // Envoy flushes its access log every second.
    let lines = eventually(
        "the engine's access log",
        Duration::from_secs(10),
        || async {
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            let lines: Vec<String> = text
                .lines()
                .filter(|l| l.starts_with("/v1/"))
                .map(str::to_owned)
                .collect();
            lines.iter().any(|l| l.contains(" 401 ")).then_some(lines)
        },
    )
    .await;
    let answered = lines
        .iter()
        .find(|l| l.contains(" 200 "))
        .unwrap_or_else(|| panic!("{lines:#?}"));
    for want in [
        format!("auth=Bearer {KEY} "),
        format!("trace={trace} "),
        "tenant=acme".to_owned(),
    ] {
        assert!(answered.contains(&want), "{want} in {answered}");
    }
    let id = harness::field(answered, "id");
    assert!(id.starts_with("client-req-1"), "{answered}");
    let refused = lines.iter().find(|l| l.contains(" 401 ")).unwrap();
    assert!(refused.contains("auth=- "), "{refused}");
    let _ = envoy.kill();
    let _ = envoy.wait();
}
