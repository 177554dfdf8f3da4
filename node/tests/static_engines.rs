//! Engines a worker set lists at fixed addresses, with real processes: two simulated engines
//! with no bridge and one with its bridge, all three listed in the policy directory's worker
//! set. The node routes to all three from the start; the bridged one is the same worker as
//! its listed endpoint (one worker, its cache and load streaming); requests through the
//! reference gateway are served by engines kvplane never heard from over NATS.

#![allow(clippy::unwrap_used)]

mod harness;

use std::time::Duration;

use harness::{Cluster, Engine, EngineOptions, NodeOptions, eventually};

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
