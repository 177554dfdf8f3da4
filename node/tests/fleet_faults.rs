//! The bridge and the node ride out an engine restart and a NATS restart, and batches larger
//! than NATS takes: nothing crashes, nothing is silently lost, and kvplane's view follows what
//! the engine really holds.

#![allow(clippy::unwrap_used)]

mod harness;

use std::time::Duration;

use harness::{Cluster, Engine, EngineOptions, Nats, NodeOptions, eventually, free_port};
use kvplane_proto::v1::{RouteRequest, route_response::Decision};
use serde_json::json;

fn prompt(tag: &str) -> serde_json::Value {
    long_prompt(tag, 200)
}

fn long_prompt(tag: &str, words: usize) -> serde_json::Value {
    let text: Vec<String> = (0..words).map(|i| format!("{tag}{i}")).collect();
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

/// Engine `engine-1` started with `o`, its prompt `a` indexed.
async fn holding_prompt_a(cluster: &Cluster, o: &EngineOptions) -> Engine {
    let root = cluster.root.path().to_owned();
    let engine = Engine::start_with(&root.join("fleet"), &cluster.nats.url(), "engine-1", o);
    let url = format!("{}/v1/completions", engine.http);
    complete(&url, &prompt("a")).await;
    wait_indexed(&cluster.nodes[0], &prompt("a"), "prompt a indexed").await;
    engine
}

/// After a restart: every prompt the new engine served is indexed, prompt `a` of the old
/// engine is not, and the bridge counted the restart.
async fn holds_only_its_own_prompts(node: &harness::Node, engine: &Engine, fresh: &[&str]) {
    for tag in fresh {
        wait_indexed(
            node,
            &prompt(tag),
            &format!("prompt {tag} of the new engine indexed"),
        )
        .await;
    }
    let (_, matched_a, _) = probe(node, &prompt("a")).await;
    assert_eq!(matched_a, 0, "the new engine does not hold prompt a");
    assert!(
        engine
            .bridge_metric("kvplane_bridge_engine_restarts_total")
            .await
            >= 1.0
    );
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_restart_between_scrapes_clears_the_old_blocks_and_forwards_every_new_batch() {
    let cluster = Cluster::start(1);
    let ports = [free_port(), free_port(), free_port()];
    // The bridge scrapes once a minute: it learns of the restart from the engine's sockets, not
    // from failed scrapes.
    let o = EngineOptions {
        ports,
        scrape_ms: 60_000,
        ..EngineOptions::default()
    };
    let mut engine = holding_prompt_a(&cluster, &o).await;
    let url = format!("{}/v1/completions", engine.http);

    // kill -9 and straight back on the same ports; the new engine publishes more batches
    // than the old one did, possibly before the bridge has reconnected.
    engine.sim.kill();
    engine.sim.restart();
    let fresh = ["b", "c", "d", "e"];
    for tag in fresh {
        complete(&url, &prompt(tag)).await;
    }
    holds_only_its_own_prompts(&cluster.nodes[0], &engine, &fresh).await;
    assert!(
        engine
            .bridge_metric("kvplane_bridge_engine_disconnects_total")
            .await
            >= 1.0
    );
    assert_eq!(
        engine
            .bridge_metric("kvplane_bridge_lost_batches_total")
            .await,
        0.0,
        "the new engine's replay held every batch"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_over_the_nats_max_payload_goes_out_in_parts_and_the_bridge_goes_on() {
    let nats = Nats::start_configured("max_payload: 4096\n");
    let cluster = Cluster::start_on(nats, 1, &NodeOptions::default());
    let root = cluster.root.path().to_owned();
    let engine = Engine::start(&root.join("fleet"), &cluster.nats.url(), "engine-1");
    let url = format!("{}/v1/completions", engine.http);

    // One request's blocks arrive as one engine batch, several times the server's limit.
    let long = long_prompt("long", 3000);
    complete(&url, &long).await;
    wait_indexed(&cluster.nodes[0], &long, "the long prompt indexed").await;
    assert!(
        engine
            .bridge_metric("kvplane_bridge_split_batches_total")
            .await
            >= 1.0
    );
    // The batches after it are forwarded too.
    complete(&url, &prompt("after")).await;
    wait_indexed(
        &cluster.nodes[0],
        &prompt("after"),
        "the next prompt indexed",
    )
    .await;
    assert_eq!(
        engine
            .bridge_metric("kvplane_bridge_lost_batches_total")
            .await,
        0.0
    );
    let s = cluster.nodes[0].status().await;
    let ingest = s.ingest.unwrap();
    assert!(
        ingest.rejected.values().all(|n| *n == 0),
        "nothing rejected: {:?}",
        ingest.rejected
    );
}

/// The `Kv-Seq` of every message the stream holds on `subject`, in stream order.
async fn kv_seqs_on(cluster: &Cluster, subject: &str) -> Vec<u64> {
    let js = cluster.nats.jetstream().await;
    let mut stream = js.get_stream("KVPLANE").await.unwrap();
    let last = stream.info().await.unwrap().state.last_sequence;
    let mut seqs = Vec::new();
    for seq in 1..=last {
        if let Ok(m) = stream.get_raw_message(seq).await
            && m.subject.as_str() == subject
        {
            let kv_seq = m.headers.get("Kv-Seq").unwrap().as_str().parse().unwrap();
            seqs.push(kv_seq);
        }
    }
    seqs
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_data_parallel_ranks_of_one_worker_each_resume_from_their_own_batches() {
    let cluster = Cluster::start(1);
    let root = cluster.root.path().to_owned();
    let rank = |r: u32| EngineOptions {
        sim_args: vec!["--dp-rank".into(), r.to_string()],
        bridge_args: vec!["--dp-rank".into(), r.to_string()],
        ..EngineOptions::default()
    };
    let dir = root.join("fleet");
    let mut one = Engine::start_with(&dir.join("r1"), &cluster.nats.url(), "engine-1", &rank(1));
    let zero = Engine::start_with(&dir.join("r0"), &cluster.nats.url(), "engine-1", &rank(0));
    // Rank 1 publishes three batches, then rank 0 one: the worker's last message is rank 0's.
    for tag in ["a", "b", "c"] {
        complete(&format!("{}/v1/completions", one.http), &prompt(tag)).await;
        wait_indexed(&cluster.nodes[0], &prompt(tag), "a rank 1 prompt indexed").await;
    }
    complete(&format!("{}/v1/completions", zero.http), &prompt("z")).await;
    wait_indexed(&cluster.nodes[0], &prompt("z"), "the rank 0 prompt indexed").await;
    let rank1 = "kvplane.kv.default.engine-1.1";
    let before = kv_seqs_on(&cluster, rank1).await;
    assert!(
        before.len() >= 3,
        "rank 1's batches on its own subject: {before:?}"
    );

    // kill -9 rank 1's bridge: it resumes after its own last batch, not rank 0's.
    one.bridge.restart();
    complete(&format!("{}/v1/completions", one.http), &prompt("d")).await;
    wait_indexed(
        &cluster.nodes[0],
        &prompt("d"),
        "rank 1's next prompt indexed",
    )
    .await;
    // The engine numbers its batches 0, 1, 2...: each is in the stream once, none skipped.
    let after = kv_seqs_on(&cluster, rank1).await;
    let expected: Vec<u64> = (0..after.len() as u64).collect();
    assert_eq!(
        after, expected,
        "rank 1's batches ({before:?} before the restart)"
    );
    assert!(after.len() > before.len());
    let s = cluster.nodes[0].status().await;
    assert!(
        s.ingest.unwrap().rejected.values().all(|n| *n == 0),
        "no rank mismatch or other rejection"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_whose_bridge_is_killed_goes_down_when_its_lease_runs_out() {
    let o = NodeOptions {
        worker_lease_ms: 1_500,
        ..NodeOptions::default()
    };
    let cluster = Cluster::start_with(1, &o);
    let root = cluster.root.path().to_owned();
    let mut gone = Engine::start(&root.join("fleet"), &cluster.nats.url(), "engine-1");
    let alive = Engine::start(&root.join("fleet"), &cluster.nats.url(), "engine-2");
    complete(&format!("{}/v1/completions", gone.http), &prompt("a")).await;
    eventually(
        "engine-1's blocks indexed",
        Duration::from_secs(30),
        || async {
            let s = cluster.nodes[0].status().await;
            s.workers
                .iter()
                .any(|w| w.worker_id == "engine-1" && w.up && w.indexed_blocks > 0)
                .then_some(())
        },
    )
    .await;

    // kill -9 the bridge only: the engine still runs, but nothing speaks for it any more.
    gone.bridge.kill();
    let s = eventually(
        "engine-1 down by its lease",
        Duration::from_secs(30),
        || async {
            let s = cluster.nodes[0].status().await;
            s.workers
                .iter()
                .any(|w| w.worker_id == "engine-1" && !w.up && w.indexed_blocks == 0)
                .then_some(s)
        },
    )
    .await;
    let two = s
        .workers
        .iter()
        .find(|w| w.worker_id == "engine-2")
        .unwrap();
    assert!(
        two.up,
        "the worker whose bridge runs keeps its lease: {s:?}"
    );
    let metrics = cluster.nodes[0].metrics().await;
    assert!(
        harness::metric_value(&metrics, "kvplane_state_worker_leases_expired_total") >= 1.0,
        "counted"
    );
    drop(alive);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bridge_restarted_after_its_engine_restarted_clears_the_old_blocks_and_forwards_the_new_ones()
 {
    let cluster = Cluster::start(1);
    let ports = [free_port(), free_port(), free_port()];
    let o = EngineOptions {
        ports,
        ..EngineOptions::default()
    };
    let mut engine = holding_prompt_a(&cluster, &o).await;
    let url = format!("{}/v1/completions", engine.http);

    // Bridge and engine both go (a pod restart); the new engine serves more requests than the
    // old one did before the new bridge starts: its sequences pass the stream's last one.
    engine.bridge.kill();
    engine.sim.kill();
    engine.sim.restart();
    let fresh = ["b", "c", "d", "e"];
    for tag in fresh {
        complete(&url, &prompt(tag)).await;
    }
    engine.bridge.restart();
    holds_only_its_own_prompts(&cluster.nodes[0], &engine, &fresh).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_lost_on_a_full_queue_clear_the_worker_once_nats_is_back() {
    let mut cluster = Cluster::start(1);
    let o = EngineOptions {
        bridge_args: vec!["--max-pending".into(), "1".into()],
        ..EngineOptions::default()
    };
    let engine = holding_prompt_a(&cluster, &o).await;
    let url = format!("{}/v1/completions", engine.http);

    // NATS goes away while the engine caches more than the bridge may hold.
    cluster.nats.kill();
    for tag in ["b", "c", "d", "e"] {
        complete(&url, &prompt(tag)).await;
    }
    eventually("batches lost", Duration::from_secs(30), || async {
        (engine
            .bridge_metric("kvplane_bridge_lost_batches_total")
            .await
            >= 1.0)
            .then_some(())
    })
    .await;
    cluster.nats.restart();
    // What kvplane held from before the loss is no longer trusted: prompt a goes...
    eventually("prompt a cleared", Duration::from_secs(30), || async {
        let (_, matched_a, _) = probe(&cluster.nodes[0], &prompt("a")).await;
        (matched_a == 0).then_some(())
    })
    .await;
    // ...and what the engine caches from now on is indexed again.
    complete(&url, &prompt("f")).await;
    wait_indexed(
        &cluster.nodes[0],
        &prompt("f"),
        "prompt f indexed after nats is back",
    )
    .await;
}
