//! A simulated fleet through real processes: engines -> ZMQ -> bridges -> NATS -> kvplane ->
//! gateway. Decisions are checked against the engines' own metrics, not kvplane's word alone.

#![allow(clippy::unwrap_used)]

mod harness;

use std::time::Duration;

use harness::{Cluster, Engine, EngineOptions, NodeOptions, eventually, wait_workers_up, words};
use kvplane_proto::v1::{RouteRequest, route_response::Decision};
use serde_json::json;

/// Blocks kvplane holds for this prompt on its best worker, and that worker (Explain: the
/// decision without a queue entry or a reservation).
async fn routed(node: &harness::Node, body: &serde_json::Value) -> (String, u32, u32) {
    let r = node
        .router()
        .await
        .explain(RouteRequest {
            request_id: "probe".into(),
            body: serde_json::to_vec(body).unwrap(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .decision
        .unwrap();
    match r.decision {
        Some(Decision::Endpoint(e)) => (e.worker_id, r.matched_blocks, r.prompt_blocks),
        other => panic!("{other:?}"),
    }
}

async fn complete(url: &str, body: &serde_json::Value) -> reqwest::Response {
    complete_with(&reqwest::Client::new(), url, body).await
}

async fn complete_with(
    client: &reqwest::Client,
    url: &str,
    body: &serde_json::Value,
) -> reqwest::Response {
    let r = client
        .post(url)
        .header("x-tenant", "t1")
        .json(body)
        .send()
        .await
        .unwrap();
    assert!(r.status().is_success(), "{}", r.status());
    r
}

/// Warms `engine` (worker `worker`) directly with a chat whose system prompt is 1,200 words,
/// waits until kvplane would send a second question under it there, and returns that chat.
async fn cached_on(node: &harness::Node, engine: &Engine, worker: &str) -> serde_json::Value {
    let system = words(&format!("sys-{worker}-"), 1200);
    let chat = |q: &str| {
        json!({"model": "sim-8b", "max_tokens": 4, "messages": [
            {"role": "system", "content": system}, {"role": "user", "content": q}]})
    };
    complete(
        &format!("{}/v1/chat/completions", engine.http),
        &chat("first question"),
    )
    .await;
    let second = chat("a second, different question");
    eventually(
        &format!("kvplane to index {worker}'s blocks"),
        Duration::from_secs(20),
        || async {
            let (w, matched, _) = routed(node, &second).await;
            (w == worker && matched >= 70).then_some(())
        },
    )
    .await;
    second
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_whose_engine_is_gone_goes_to_the_next_alternative() {
    let cluster = Cluster::start_with(
        1,
        &NodeOptions {
            pool_models: vec!["sim-8b".into()],
            ..Default::default()
        },
    );
    let root = cluster.root.path().to_owned();
    // Bridges that scrape once, at their start: kvplane keeps an engine that died up, as it
    // does until a bridge notices, so the request is sent where nothing answers.
    let once = EngineOptions {
        scrape_ms: 600_000,
        ..EngineOptions::default()
    };
    let mut engines: Vec<Engine> = (1..=2)
        .map(|i| {
            Engine::start_with(
                &root.join("fleet"),
                &cluster.nats.url(),
                &format!("engine-{i}"),
                &once,
            )
        })
        .collect();
    let node = &cluster.nodes[0];
    wait_workers_up(node, 2).await;
    let gateway = harness::gateway(&node.endpoint(), root.join("gateway.log"));
    let gw = format!("http://{}/v1/chat/completions", gateway.field("http"));
    // engine-1 caches a long system prompt, so kvplane picks it for that prompt...
    let second = cached_on(node, &engines[0], "engine-1").await;
    // ...then its engine process is gone (its bridge still says it is up).
    engines[0].sim.kill();
    let r = complete(&gw, &second).await;
    assert_eq!(r.headers()["x-kvplane-worker"], "default/engine-2");
    let metrics = harness::http_get(&format!("http://{}/metrics", gateway.field("http"))).await;
    assert_eq!(
        harness::metric_value(&metrics, "kvplane_gateway_upstream_retries_total"),
        1.0,
        "{metrics}"
    );
    // Its report says engine-2 served it: engine-1's prediction learns nothing from the time
    // engine-2 took (no prediction error is observed for it).
    let known = |m: &str| {
        m.lines()
            .find(|l| l.starts_with(r#"kvplane_usage_reports_total{outcome="known"}"#))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    eventually("the request's report", Duration::from_secs(10), || async {
        (known(&node.metrics().await) >= 1.0).then_some(())
    })
    .await;
    // Scraped again: a report is counted just before its effect on the predictor.
    let m = node.metrics().await;
    assert!(
        m.lines()
            .any(|l| l == "kvplane_ttft_prediction_ratio_count 0"),
        "no prediction error observed: {m}"
    );
    // The control: a request its chosen engine serves (engine-2 caches its prompt) is observed.
    let third = cached_on(node, &engines[1], "engine-2").await;
    let r = complete(&gw, &third).await;
    assert_eq!(r.headers()["x-kvplane-worker"], "default/engine-2");
    eventually(
        "its prediction error observed",
        Duration::from_secs(10),
        || async {
            let m = node.metrics().await;
            m.lines()
                .any(|l| l == "kvplane_ttft_prediction_ratio_count 1")
                .then_some(())
        },
    )
    .await;
}

/// With TLS everywhere the gateway and the node speak it: the node's gRPC and HTTP ports, the
/// gateway's listener and its calls, which an `AccessPolicy` grants `route`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_sends_a_prefix_to_the_engine_that_holds_it() {
    let pki_dir = tempfile::tempdir().unwrap();
    let pki = harness::pki::Pki::new(pki_dir.path(), "kvplane test ca");
    let gateway_id = "spiffe://kvplane.test/ns/edge/sa/gateway";
    let gateway_dir = pki.issue("gateway", gateway_id);
    let (cluster, engines) = harness::node_with_engines_under(
        3,
        &NodeOptions {
            pool_models: vec!["sim-8b".into()],
            tls: Some(harness::pki::NodeTls {
                dir: pki.issue("member", harness::pki::MEMBER),
                members: vec![],
                admins: vec![harness::pki::OPERATOR.into()],
                client: Some(pki.issue_client("operator", harness::pki::OPERATOR)),
            }),
            ..Default::default()
        },
    )
    .await;
    let root = cluster.root.path().to_owned();
    let node = &cluster.nodes[0];
    node.admin()
        .await
        .put_config(kvplane_proto::v1::PutConfigRequest {
            kind: "AccessPolicy".into(),
            name: "gateways".into(),
            value: format!(
                r#"{{"identities":["{gateway_id}"],"rights":["route"],"tenants":["*"]}}"#
            )
            .into_bytes(),
        })
        .await
        .unwrap();
    // A dead replica first: the gateway fails over to the live one.
    let tls_args = |dir: &std::path::Path| {
        let d = dir.display().to_string();
        vec!["--tls-dir".into(), d.clone(), "--listen-tls-dir".into(), d]
    };
    let gateway = harness::gateway_with(
        &format!(
            "https://127.0.0.1:{},{}",
            harness::free_port(),
            node.endpoint()
        ),
        &tls_args(&gateway_dir),
        root.join("gateway.log"),
    );
    let gw = format!("https://{}/v1/chat/completions", gateway.field("http"));
    let client = harness::fleet::http_client(Some(&gateway_dir.join("ca.crt")));
    let complete = |url: &str, body: &serde_json::Value| {
        let (client, url, body) = (client.clone(), url.to_owned(), body.clone());
        async move { complete_with(&client, &url, &body).await }
    };

    // Warm engine-2 directly with a long system prompt.
    let second = cached_on(node, &engines[1], "engine-2").await;

    let hits_before: Vec<f64> = futures::future::join_all(
        engines
            .iter()
            .map(|e| e.metric("vllm:prefix_cache_hits_total")),
    )
    .await;
    let r = complete(&gw, &second).await;
    assert_eq!(r.headers()["x-kvplane-worker"], "default/engine-2");
    let body: serde_json::Value = r.json().await.unwrap();
    assert!(
        body["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
            >= 1120
    );
    let hits_after: Vec<f64> = futures::future::join_all(
        engines
            .iter()
            .map(|e| e.metric("vllm:prefix_cache_hits_total")),
    )
    .await;
    // The engine itself says it served the prompt from its cache; the others saw nothing.
    assert!(
        hits_after[1] - hits_before[1] >= 1120.0,
        "{hits_before:?} -> {hits_after:?}"
    );
    assert_eq!(hits_after[0], hits_before[0]);
    assert_eq!(hits_after[2], hits_before[2]);

    // The gateway reported the usage back to kvplane.
    eventually("usage reported", Duration::from_secs(10), || async {
        let m = node.metrics().await;
        m.contains(r#"kvplane_usage_reports_total{outcome="known"} 1"#)
            .then_some(())
    })
    .await;
    // A streamed answer is reported at its first chunk too (the request stops counting as
    // waiting there), then whole; an answer in one piece only whole.
    let mut streamed = second.clone();
    streamed["messages"][1]["content"] = json!("a third question, streamed");
    streamed["stream"] = json!(true);
    let text = complete(&gw, &streamed).await.text().await.unwrap();
    assert!(text.contains("data: [DONE]"), "{text}");
    eventually(
        "first token and usage reported",
        Duration::from_secs(10),
        || async {
            let m = node.metrics().await;
            (m.contains(r#"kvplane_usage_reports_total{outcome="first_token"} 1"#)
                && m.contains(r#"kvplane_usage_reports_total{outcome="known"} 2"#))
            .then_some(())
        },
    )
    .await;
    assert!(
        node.metrics()
            .await
            .contains(r#"kvplane_usage_reports_total{outcome="unknown"} 0"#),
        "every report found its request"
    );

    // A model nobody serves is refused with kvplane's reason.
    let mut other = second.clone();
    other["model"] = json!("no-such-model");
    let r = client.post(&gw).json(&other).send().await.unwrap();
    assert_eq!(r.status(), 404);
    let err: serde_json::Value = r.json().await.unwrap();
    assert!(
        err["error"]["message"]
            .as_str()
            .unwrap()
            .contains("no backend publishes and no worker set serves model"),
        "{err}"
    );
    let gm = client
        .get(format!("https://{}/metrics", gateway.field("http")))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        harness::metric_value(&gm, "kvplane_gateway_replica_failovers_total") >= 1.0,
        "{gm}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bridge_fills_dropped_and_missed_batches_from_replay() {
    let mut cluster = Cluster::start(1);
    let root = cluster.root.path().to_owned();
    let mut engine = Engine::start(&root.join("fleet"), &cluster.nats.url(), "engine-1");
    let node = &mut cluster.nodes[0];
    wait_workers_up(node, 1).await;
    let url = format!("{}/v1/completions", engine.http);
    let prompt = |i: usize| json!({"model": "sim-8b", "max_tokens": 2, "prompt": words(&format!("p{i}w"), 200)});

    // The engine drops its next three batches on the PUB socket (they stay in its replay buffer).
    reqwest::Client::new()
        .post(format!("{}/sim/drop_next_batches", engine.http))
        .json(&json!({"count": 3}))
        .send()
        .await
        .unwrap();
    for i in 0..5 {
        complete(&url, &prompt(i)).await;
    }
    for i in 0..5 {
        let p = prompt(i);
        eventually(
            &format!("prompt {i} indexed"),
            Duration::from_secs(20),
            || async {
                let (_, matched, blocks) = routed(node, &p).await;
                (matched == blocks && blocks > 0).then_some(())
            },
        )
        .await;
    }
    assert!(engine.bridge_metric("kvplane_bridge_gaps_total").await >= 1.0);
    assert!(
        engine
            .bridge_metric("kvplane_bridge_replayed_batches_total")
            .await
            >= 3.0
    );
    assert_eq!(
        engine
            .bridge_metric("kvplane_bridge_lost_batches_total")
            .await,
        0.0
    );

    // The bridge dies; the engine keeps publishing; a new bridge picks up where the old one
    // stopped (the last Kv-Seq in the stream) and recovers the batches it missed.
    engine.bridge.kill();
    for i in 5..8 {
        complete(&url, &prompt(i)).await;
    }
    engine.bridge.restart();
    complete(&url, &prompt(8)).await;
    for i in 5..9 {
        let p = prompt(i);
        let bridge_log = engine.bridge.current_log();
        eventually(
            &format!("prompt {i} indexed after the bridge restart; bridge log:\n{bridge_log}"),
            Duration::from_secs(20),
            || async {
                let (_, matched, blocks) = routed(node, &p).await;
                (matched == blocks && blocks > 0).then_some(())
            },
        )
        .await;
    }
    assert!(
        engine
            .bridge_metric("kvplane_bridge_replayed_batches_total")
            .await
            >= 1.0
    );
    assert_eq!(
        engine
            .bridge_metric("kvplane_bridge_lost_batches_total")
            .await,
        0.0
    );
    let s = node.status().await;
    let dropped: u64 = s.ingest.unwrap().dropped.values().sum();
    assert_eq!(dropped, 0, "nothing applied twice or out of order");
}

/// With the model's own tokenizer files (Hugging Face `tokenizer.json` and a ChatML template)
/// on the engines and named by the InferenceWorkerSet, `/v1/chat/completions` requests that
/// share a system prompt go to the engine holding it, and kvplane counts exactly the prompt
/// tokens the engine counts. Requests naming a LoRA adapter, or carrying a `cache_salt`, match
/// only blocks the engines cached under the same adapter or salt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_requests_sharing_a_system_prompt_reach_its_engine_through_the_models_tokenizer() {
    let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tokenize/tests/fixtures/chatml-style")
        .canonicalize()
        .unwrap();
    let policies = tempfile::tempdir().unwrap();
    std::fs::write(
        policies.path().join("fleet.yaml"),
        format!(
            "apiVersion: kvplane.io/v1alpha1\nkind: InferenceWorkerSet\nmetadata: {{name: chatml}}\nspec: {{model: chatml-style, blockSize: 16, loraAdapters: [chatml-lora], tokenizer: {:?}}}\n",
            fixture.display().to_string()
        ),
    )
    .unwrap();
    let cluster = Cluster::start_with(
        1,
        &NodeOptions {
            policy_dir: Some(policies.path().to_owned()),
            ..Default::default()
        },
    );
    let root = cluster.root.path().to_owned();
    let sim_args = [
        "--model".to_owned(),
        "chatml-style".to_owned(),
        "--tokenizer".to_owned(),
        fixture.display().to_string(),
    ];
    let engines: Vec<Engine> = (1..=3)
        .map(|i| {
            Engine::start_for(
                &root.join("fleet"),
                &cluster.nats.url(),
                "chatml",
                &format!("engine-{i}"),
                [0, 0, 0],
                &sim_args,
            )
        })
        .collect();
    let node = &cluster.nodes[0];
    wait_workers_up(node, 3).await;
    let gateway = harness::gateway(&node.endpoint(), root.join("gateway.log"));
    let system = "You are a helpful assistant. Routing a request to the engine that already holds \
                  its system prompt avoids recomputing thousands of tokens. "
        .repeat(12);
    let chat = |q: &str| {
        json!({"model": "chatml-style", "max_tokens": 4, "messages": [
            {"role": "system", "content": system}, {"role": "user", "content": q}]})
    };
    let first = complete(
        &format!("{}/v1/chat/completions", engines[1].http),
        &chat("What is the capital of France?"),
    )
    .await;
    let first: serde_json::Value = first.json().await.unwrap();
    let second = chat("And of Germany? Größe, 東京 🚀");
    let (worker, matched, prompt_blocks) = eventually(
        "kvplane to index engine-2's blocks of the system prompt",
        Duration::from_secs(20),
        || async {
            let (w, matched, blocks) = routed(node, &second).await;
            (w == "engine-2" && matched >= 20).then_some((w, matched, blocks))
        },
    )
    .await;
    assert_eq!(worker, "engine-2");

    let r = complete(
        &format!("http://{}/v1/chat/completions", gateway.field("http")),
        &second,
    )
    .await;
    assert_eq!(r.headers()["x-kvplane-worker"], "chatml/engine-2");
    let body: serde_json::Value = r.json().await.unwrap();
    let usage = &body["usage"];
    let cached = usage["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(
        cached >= u64::from(matched) * 16,
        "{usage} vs {matched} blocks"
    );
    // kvplane's prompt is the engine's, token for token: the same block count.
    let prompt_tokens = usage["prompt_tokens"].as_u64().unwrap();
    assert_eq!(u64::from(prompt_blocks), prompt_tokens / 16, "{usage}");
    assert!(
        first["usage"]["prompt_tokens"].as_u64().unwrap() > 200,
        "{first}"
    );

    // The same prompt under a LoRA adapter, cached on engine-3 only.
    let with = |model: &str, salt: Option<&str>| {
        let mut b = chat("Another question");
        b["model"] = json!(model);
        if let Some(s) = salt {
            b["cache_salt"] = json!(s);
        }
        b
    };
    complete(
        &format!("{}/v1/chat/completions", engines[2].http),
        &with("chatml-lora", None),
    )
    .await;
    let adapter = eventually(
        "the adapter's blocks indexed",
        Duration::from_secs(20),
        || async {
            let (w, matched, _) = routed(node, &with("chatml-lora", None)).await;
            (w == "engine-3" && matched >= 20).then_some(matched)
        },
    )
    .await;
    assert!(adapter >= 20);
    let (w, _, _) = routed(node, &with("chatml-style", None)).await;
    assert_eq!(
        w, "engine-2",
        "the base model's blocks are engine-2's, not the adapter's"
    );
    // Under a salt: engine-1 caches the prompt for "alice"; "bob" matches nothing.
    complete(
        &format!("{}/v1/chat/completions", engines[0].http),
        &with("chatml-style", Some("alice")),
    )
    .await;
    eventually(
        "alice's salted blocks indexed",
        Duration::from_secs(20),
        || async {
            let (w, matched, _) = routed(node, &with("chatml-style", Some("alice"))).await;
            (w == "engine-1" && matched >= 20).then_some(())
        },
    )
    .await;
    let (_, bob, _) = routed(node, &with("chatml-style", Some("bob"))).await;
    assert_eq!(bob, 0, "another salt matches none of alice's blocks");
}

/// An engine whose `/metrics` has no vLLM gauge before its first request (NVIDIA Dynamo's mocker
/// is one) is announced up from its health endpoint, so its first request can reach it; the
/// bridge says at warning level that its scrapes keep failing, and once the gauges appear the
/// metrics flow.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_without_gauges_before_its_first_request_is_announced_from_its_health() {
    let cluster = Cluster::start_with(
        1,
        &NodeOptions {
            pool_models: vec!["sim-8b".into()],
            ..Default::default()
        },
    );
    let root = cluster.root.path().to_owned();
    let engine = Engine::start_with(
        &root.join("fleet"),
        &cluster.nats.url(),
        "lazy",
        &EngineOptions {
            sim_args: vec!["--gauges-after-first-request".into()],
            ..EngineOptions::default()
        },
    );
    let node = &cluster.nodes[0];
    let text = harness::http_get(&format!("{}/metrics", engine.http)).await;
    assert!(!text.contains("vllm:num_requests_running"), "{text}");
    wait_workers_up(node, 1).await;
    eventually("the bridge to warn", Duration::from_secs(10), || async {
        std::fs::read_to_string(&engine.bridge.log)
            .unwrap()
            .contains("engine metrics scrape keeps failing")
            .then_some(())
    })
    .await;
    // Routed through kvplane, the first request reaches it; its gauges then exist and reach
    // the state.
    let (worker, _, _) = routed(node, &json!({"model": "sim-8b", "prompt": "hello there"})).await;
    assert_eq!(worker, "lazy");
    complete(
        &format!("{}/v1/completions", engine.http),
        &json!({"model": "sim-8b", "prompt": "hello there", "max_tokens": 2}),
    )
    .await;
    let text = harness::http_get(&format!("{}/metrics", engine.http)).await;
    assert!(text.contains("vllm:num_requests_running"), "{text}");
    eventually(
        "metrics from the engine",
        Duration::from_secs(10),
        || async {
            let s = node.status().await;
            s.workers
                .iter()
                .any(|w| w.worker_id == "lazy" && w.metrics_index > 0)
                .then_some(())
        },
    )
    .await;
}
