//! The bridge and the node ride out an engine restart and a NATS restart: nothing crashes,
//! nothing is silently lost, and kvplane's view follows what the engine really holds.

#![allow(clippy::unwrap_used)]

mod harness;

use std::time::Duration;

use harness::{Cluster, Engine, eventually, free_port};
use kvplane_proto::v1::{RouteRequest, route_response::Decision};
use serde_json::json;

fn prompt(tag: &str) -> serde_json::Value {
    let text: Vec<String> = (0..200).map(|i| format!("{tag}{i}")).collect();
    json!({"model": "sim-8b", "max_tokens": 2, "prompt": text.join(" ")})
}

/// (worker up, blocks matched, prompt blocks) for `body` on the only worker.
async fn probe(node: &harness::Node, body: &serde_json::Value) -> (bool, u32, u32) {
    let s = node.status().await;
    let up = s.workers.first().is_some_and(|w| w.up);
    let r = node
        .router()
        .await
        .explain(RouteRequest {
            body: serde_json::to_vec(body).unwrap(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let c = r.candidates.first().cloned().unwrap_or_default();
    let d = r.decision.unwrap_or_default();
    let _ = matches!(d.decision, Some(Decision::Endpoint(_)));
    (up, c.overlap_blocks, d.prompt_blocks)
}

async fn complete(url: &str, body: &serde_json::Value) {
    let r = reqwest::Client::new()
        .post(url)
        .json(body)
        .send()
        .await
        .unwrap();
    assert!(r.status().is_success());
}

async fn wait_indexed(node: &harness::Node, body: &serde_json::Value, what: &str) {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let (up, matched, blocks) = probe(node, body).await;
        if up && blocks > 0 && matched == blocks {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "timed out waiting for {what}: up {up}, matched {matched} of {blocks}; status {:?}",
            node.status().await
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_restart_and_a_nats_restart_lose_nothing() {
    let mut cluster = Cluster::start(1);
    let root = cluster.root.path().to_owned();
    let ports = [free_port(), free_port(), free_port()];
    let mut engine = Engine::start_on(&root.join("fleet"), &cluster.nats.url(), "engine-1", ports);
    let url = format!("{}/v1/completions", engine.http);

    complete(&url, &prompt("a")).await;
    wait_indexed(&cluster.nodes[0], &prompt("a"), "prompt a indexed").await;

    // The engine dies: the bridge announces it down and kvplane forgets its cache.
    engine.sim.kill();
    eventually("worker down", Duration::from_secs(30), || async {
        let s = cluster.nodes[0].status().await;
        s.workers
            .first()
            .is_some_and(|w| !w.up && w.indexed_blocks == 0)
            .then_some(())
    })
    .await;
    // It comes back empty on the same ports: the bridge resubscribes, the worker is up again,
    // and what it caches from now on is routable; what it lost is not.
    engine.sim.restart();
    eventually("worker up again", Duration::from_secs(30), || async {
        let s = cluster.nodes[0].status().await;
        s.workers.first().is_some_and(|w| w.up).then_some(())
    })
    .await;
    complete(&url, &prompt("b")).await;
    wait_indexed(
        &cluster.nodes[0],
        &prompt("b"),
        "prompt b indexed after the engine restart",
    )
    .await;
    let (_, matched_a, _) = probe(&cluster.nodes[0], &prompt("a")).await;
    assert_eq!(matched_a, 0, "the restarted engine does not hold prompt a");
    assert!(
        engine
            .bridge_metric("kvplane_bridge_engine_restarts_total")
            .await
            >= 1.0
    );

    // NATS dies while the engine keeps caching; both the bridge and the node reconnect.
    cluster.nats.kill();
    complete(&url, &prompt("c")).await;
    cluster.nats.restart();
    wait_indexed(
        &cluster.nodes[0],
        &prompt("c"),
        "prompt c indexed after the nats restart",
    )
    .await;
    assert_eq!(
        engine
            .bridge_metric("kvplane_bridge_lost_batches_total")
            .await,
        0.0
    );
    assert!(cluster.nodes[0].is_running());
    let s = cluster.nodes[0].status().await;
    assert_eq!(
        s.ingest
            .unwrap()
            .dropped
            .get("duplicate")
            .copied()
            .unwrap_or(0),
        0
    );
}
