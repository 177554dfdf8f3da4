//! One kvplane node end to end: vLLM batches published on NATS, decisions over gRPC, and a
//! node that comes back with the same state after SIGKILL or SIGTERM.

#![allow(clippy::unwrap_used)]

mod harness;

use std::time::Duration;

use harness::{Cluster, Nats, NodeOptions, eventually, publish};
use kvplane_ingest::vllm::encode_batch;
use kvplane_ingest::{ensure_stream, kv_subject, worker_subject};
use kvplane_proto::v1::{RouteRequest, route_response::Decision};
use kvplane_state::{KvBatch, KvEvent, Tier};
use serde_json::Value;

const FIXTURES: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../ingest/tests/fixtures/vllm-kv-events"
);

fn fixture(name: &str) -> Vec<u8> {
    std::fs::read(format!("{FIXTURES}/{name}")).unwrap()
}

fn expected(version: &str) -> Value {
    serde_json::from_slice(&fixture(&format!("vllm-{version}.expected.json"))).unwrap()
}

fn tokens(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect()
}

/// A vLLM-format batch storing `tokens` as one chain of blocks from the root.
fn chain_batch(tokens: &[u32], block_size: u32, salt: u64) -> Vec<u8> {
    let n = tokens.len() / block_size as usize;
    let hashes: Vec<u64> = (0..n as u64)
        .map(|i| salt.wrapping_mul(1_000_003) + i + 1)
        .collect();
    let batch = KvBatch {
        dp_rank: 0,
        events: vec![KvEvent::Stored {
            block_hashes: hashes,
            parent_hash: None,
            token_ids: tokens[..n * block_size as usize].to_vec(),
            block_size,
            lora_name: None,
            cache_salt: None,
            tier: Tier::Gpu,
        }],
    };
    encode_batch(0.0, &batch)
}

#[derive(Debug, PartialEq)]
struct Answer {
    worker: String,
    address: String,
    dp_rank: u32,
    matched: u32,
}

async fn route(node: &harness::Node, tokens: &[u32]) -> Answer {
    let r = node
        .router()
        .await
        .route(RouteRequest {
            request_id: "r".into(),
            token_ids: tokens.to_vec(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    match r.decision {
        Some(Decision::Endpoint(e)) => Answer {
            worker: e.worker_id,
            address: e.address,
            dp_rank: e.dp_rank,
            matched: r.matched_blocks,
        },
        other => panic!("expected an endpoint, got {other:?}"),
    }
}

struct Prompts {
    a_b: Vec<u32>,
    b_a: Vec<u32>,
    c: Vec<u32>,
}

/// Publishes the fixtures for three workers; returns the last stream sequence.
async fn publish_fleet(js: &async_nats::jetstream::Context) -> (u64, Prompts) {
    let mut last = 0;
    for (w, port) in [("worker-a", 8001), ("worker-b", 8002), ("worker-c", 8003)] {
        let up = format!(r#"{{"status":"up","address":"http://127.0.0.1:{port}"}}"#);
        last = publish(js, worker_subject("default", w), up.into_bytes()).await;
    }
    // worker-a: vLLM 0.33's batch; worker-b: vLLM 0.22's (data-parallel rank 1).
    publish(
        js,
        kv_subject("default", "worker-a"),
        fixture("vllm-0.33.batch1.msgpack"),
    )
    .await;
    publish(
        js,
        kv_subject("default", "worker-b"),
        fixture("vllm-0.22.batch1.msgpack"),
    )
    .await;
    let c: Vec<u32> = (5_000..5_165).collect();
    last = last.max(
        publish(
            js,
            kv_subject("default", "worker-c"),
            chain_batch(&c, 16, 3),
        )
        .await,
    );
    (
        last,
        Prompts {
            a_b: tokens(&expected("0.33")["query_prompt_B"]),
            b_a: tokens(&expected("0.22")["query_prompt_A"]),
            c,
        },
    )
}

async fn answers(node: &harness::Node, p: &Prompts) -> Vec<Answer> {
    vec![
        route(node, &p.a_b).await,
        route(node, &p.b_a).await,
        route(node, &p.c).await,
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routes_to_the_worker_holding_the_prefix_and_recovers_after_sigkill_and_sigterm() {
    let o = NodeOptions {
        snapshot_every_entries: 2,
        ..Default::default()
    };
    let mut cluster = Cluster::start_with(1, &o);
    let js = cluster.nats.jetstream().await;
    ensure_stream(&js, "KVPLANE").await.unwrap();
    let (last, prompts) = publish_fleet(&js).await;
    let node = &mut cluster.nodes[0];
    let before = node.wait_applied_seq(last).await;

    let got = answers(node, &prompts).await;
    assert_eq!(
        got,
        vec![
            Answer {
                worker: "worker-a".into(),
                address: "http://127.0.0.1:8001".into(),
                dp_rank: 0,
                matched: 7
            },
            Answer {
                worker: "worker-b".into(),
                address: "http://127.0.0.1:8002".into(),
                dp_rank: 1,
                matched: 4
            },
            Answer {
                worker: "worker-c".into(),
                address: "http://127.0.0.1:8003".into(),
                dp_rank: 0,
                matched: 10
            },
        ]
    );
    assert_eq!(before.workers.len(), 3);
    assert_eq!(before.indexed_blocks, 7 + 7 + 10);

    // SIGKILL: the node restores its last snapshot and replays the rest of the stream.
    node.kill();
    node.restart();
    assert!(
        node.log().contains("state restored from snapshot"),
        "{}",
        node.log()
    );
    let after = node.wait_applied_seq(last).await;
    assert_eq!(after.state_digest, before.state_digest);
    assert_eq!(after.indexed_blocks, before.indexed_blocks);
    assert_eq!(answers(node, &prompts).await, got);

    // SIGTERM: a clean exit with a final snapshot, and a restart that needs no replay at all.
    assert!(node.terminate().success());
    node.restart();
    let at_start = node.status().await;
    assert_eq!(at_start.ingest.unwrap().applied_stream_sequence, last);
    assert_eq!(at_start.state_digest, before.state_digest);
    assert_eq!(answers(node, &prompts).await, got);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restarts_resume_exactly_after_the_last_applied_message() {
    let o = NodeOptions {
        snapshot_every_entries: 3,
        max_batch_messages: 7,
        ..Default::default()
    };
    let mut cluster = Cluster::start_with(1, &o);
    let js = cluster.nats.jetstream().await;
    ensure_stream(&js, "KVPLANE").await.unwrap();

    // 120 single-block stores, then removals of every even block. A lost store shows up as a
    // removal of an unknown block; a store applied twice leaves an even block behind.
    let store = |i: u32| {
        chain_batch(
            &(i * 16..i * 16 + 16).collect::<Vec<_>>(),
            16,
            u64::from(i) + 1_000,
        )
    };
    let remove = |i: u32| {
        encode_batch(
            0.0,
            &KvBatch {
                dp_rank: 0,
                events: vec![KvEvent::Removed {
                    block_hashes: vec![(u64::from(i) + 1_000) * 1_000_003 + 1],
                    tier: Tier::Gpu,
                }],
            },
        )
    };
    let mut last = 0;
    for round in 0..4u32 {
        for i in round * 30..(round + 1) * 30 {
            last = publish(&js, kv_subject("default", "w"), store(i)).await;
        }
        // Kill mid-stream, while the node is still consuming what was just published.
        cluster.nodes[0].kill();
        cluster.nodes[0].restart();
    }
    for i in (0..120).step_by(2) {
        last = publish(&js, kv_subject("default", "w"), remove(i)).await;
        if i == 60 {
            cluster.nodes[0].kill();
            cluster.nodes[0].restart();
        }
    }
    let s = cluster.nodes[0].wait_applied_seq(last).await;
    let ingest = s.ingest.unwrap();
    assert_eq!(s.indexed_blocks, 60);
    assert_eq!(
        ingest.dropped.get("remove_unknown").copied().unwrap_or(0),
        0
    );
    assert_eq!(ingest.dropped.get("duplicate").copied().unwrap_or(0), 0);

    // A node that read the same stream once, without interruption, has the same state.
    let fresh = cluster.add_node("fresh", &o);
    let f = fresh.wait_applied_seq(last).await;
    assert_eq!(f.state_digest, s.state_digest);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_counted_and_skipped_and_the_node_keeps_serving() {
    let o = NodeOptions {
        max_message_bytes: 64 * 1024,
        ..Default::default()
    };
    let mut cluster = Cluster::start_with(1, &o);
    let js = cluster.nats.jetstream().await;
    ensure_stream(&js, "KVPLANE").await.unwrap();
    let good_a: Vec<u32> = (100..164).collect();
    let good_b: Vec<u32> = (900..996).collect();

    publish(&js, kv_subject("default", "a"), chain_batch(&good_a, 16, 1)).await;
    // Truncated msgpack.
    let full = chain_batch(&good_b, 16, 2);
    publish(
        &js,
        kv_subject("default", "b"),
        full[..full.len() / 2].to_vec(),
    )
    .await;
    // Wrong block size for the pool.
    publish(&js, kv_subject("default", "b"), chain_batch(&good_b, 32, 3)).await;
    // An unknown event type next to a good store: the store is kept.
    let mut with_unknown = rmpv::decode::read_value(&mut &chain_batch(&good_b, 16, 4)[..]).unwrap();
    if let rmpv::Value::Array(items) = &mut with_unknown
        && let rmpv::Value::Array(events) = &mut items[1]
    {
        events.insert(
            0,
            rmpv::Value::Map(vec![(
                rmpv::Value::from("type"),
                rmpv::Value::from("BlockTeleported"),
            )]),
        );
    }
    let mut buf = Vec::new();
    rmpv::encode::write_value(&mut buf, &with_unknown).unwrap();
    publish(&js, kv_subject("default", "b"), buf).await;
    // Oversized payload.
    publish(&js, kv_subject("default", "b"), vec![0x90; 100 * 1024]).await;
    // Subjects outside the scheme.
    publish(&js, "kvplane.kv.default".into(), b"x".to_vec()).await;
    publish(&js, "kvplane.bogus.default.b".into(), b"x".to_vec()).await;
    // Unusable metrics, and a message for a pool nobody configured.
    publish(
        &js,
        "kvplane.metrics.default.b".into(),
        br#"{"num_requests_running":"many"}"#.to_vec(),
    )
    .await;
    let last = publish(&js, kv_subject("nopool", "z"), chain_batch(&good_a, 16, 5)).await;

    let node = &mut cluster.nodes[0];
    let s = node.wait_applied_seq(last).await;
    assert!(node.is_running());
    let ingest = s.ingest.unwrap();
    assert_eq!(ingest.rejected["undecodable"], 1);
    assert_eq!(ingest.rejected["oversized"], 1);
    assert_eq!(ingest.rejected["unknown_subject"], 2);
    assert_eq!(ingest.rejected["bad_metrics"], 1);
    assert_eq!(ingest.dropped["block_size_mismatch"], 1);
    assert_eq!(ingest.dropped["unknown_pool"], 1);
    let log = node.log();
    assert!(
        log.lines()
            .any(|l| l.contains("a pool the cluster does not know") && l.contains("nopool")),
        "the unknown pool is named in the log:\n{log}"
    );

    let metrics = node.metrics().await;
    for line in [
        r#"kvplane_ingest_rejected_messages_total{reason="oversized"} 1"#,
        r#"kvplane_ingest_skipped_events_total{reason="unknown_event_type"} 1"#,
        r#"kvplane_state_dropped_events_total{reason="block_size_mismatch"} 1"#,
    ] {
        assert!(metrics.contains(line), "missing {line} in\n{metrics}");
    }

    // Still serving: both good batches are routable.
    let a = route(node, &good_a).await;
    assert_eq!((a.worker.as_str(), a.matched), ("a", 4));
    let b = route(node, &good_b).await;
    assert_eq!((b.worker.as_str(), b.matched), ("b", 6));

    // And still ingesting.
    let more: Vec<u32> = (7_000..7_032).collect();
    let last = publish(&js, kv_subject("default", "c"), chain_batch(&more, 16, 6)).await;
    node.wait_applied_seq(last).await;
    let c = eventually("worker c routable", Duration::from_secs(5), || async {
        let c = route(node, &more).await;
        (c.worker == "c").then_some(c)
    })
    .await;
    assert_eq!(c.matched, 2);
}

#[test]
fn serve_refuses_a_bad_config_and_lists_every_problem() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.toml");
    std::fs::write(
        &path,
        "node_id = \"Not Valid\"\ngrpc_listen = \"nowhere\"\n[[pools]]\nname = \"p\"\nblock_size = 0\n",
    )
    .unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvplane"))
        .args(["serve", "--config"])
        .arg(&path)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    for needle in ["node_id", "grpc_listen", "pools[0].block_size"] {
        assert!(err.contains(needle), "{needle} missing from: {err}");
    }

    std::fs::write(&path, "node_idd = \"x\"\n").unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvplane"))
        .args(["serve", "--config"])
        .arg(&path)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown field"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_shows_every_candidate_and_stale_reads_are_refused() {
    let cluster = Cluster::start(1);
    let js = cluster.nats.jetstream().await;
    ensure_stream(&js, "KVPLANE").await.unwrap();
    let (last, prompts) = publish_fleet(&js).await;
    let node = &cluster.nodes[0];
    let s = node.wait_applied_seq(last).await;

    let x = node
        .router()
        .await
        .explain(RouteRequest {
            token_ids: prompts.c.clone(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(x.prompt_source, "token_ids");
    assert_eq!(x.candidates.len(), 3);
    let chosen: Vec<_> = x.candidates.iter().filter(|c| c.chosen).collect();
    assert_eq!(chosen.len(), 1);
    let c = chosen[0];
    assert_eq!(c.endpoint.as_ref().unwrap().worker_id, "worker-c");
    assert_eq!((c.overlap_blocks, c.uncached_blocks), (10, 0));
    // The prediction's parts add up (base 20 ms, prefill, load), the objective adds what the
    // prefill displaces, and the winner has the lowest.
    for k in &x.candidates {
        assert!((k.predicted_ttft_ms - (20.0 + k.prefill_cost + k.load_cost)).abs() < 1e-6);
        assert!((k.cost - (k.predicted_ttft_ms + k.prefill_cost)).abs() < 1e-6);
        assert!(k.cost >= c.cost);
    }
    assert!(!x.steps.is_empty());

    // Read-your-writes: a state older than asked for is refused, not silently served.
    let err = node
        .router()
        .await
        .route(RouteRequest {
            token_ids: prompts.c.clone(),
            min_applied_index: s.applied_index + 1_000,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::FailedPrecondition);
    assert!(
        err.message().contains("needs at least"),
        "{}",
        err.message()
    );

    // The command line prints the same decision.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvplane"))
        .args(["route", "--json", "--addr", &node.endpoint(), "--tokens"])
        .arg(
            prompts
                .c
                .iter()
                .map(u32::to_string)
                .collect::<Vec<_>>()
                .join(","),
        )
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["endpoint"]["worker_id"], "worker-c");
    assert_eq!(v["matched_blocks"], 10);
}

/// Every file under `dir` with its size and modification time.
fn tree(dir: &std::path::Path) -> Vec<(std::path::PathBuf, u64, std::time::SystemTime)> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let m = e.metadata().unwrap();
        if m.is_dir() {
            out.extend(tree(&e.path()));
        } else {
            out.push((e.path(), m.len(), m.modified().unwrap()));
        }
    }
    out.sort();
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_node_on_a_live_data_directory_exits_with_a_clear_error_and_touches_nothing() {
    let cluster = Cluster::start(1);
    let node = &cluster.nodes[0];
    node.status().await;
    let data = node.dir.join("data");
    // Frozen, the live node writes nothing itself while the second one tries (it keeps its lock).
    node.pause();
    let before = tree(&data);
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvplane"))
        .args(["serve", "--data-dir"])
        .arg(&data)
        .args([
            "--grpc-listen",
            "127.0.0.1:0",
            "--http-listen",
            "127.0.0.1:0",
            "--nats-url",
            &cluster.nats.url(),
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("is in use by another kvplane process (pid "),
        "{stderr}"
    );
    assert_eq!(
        tree(&data),
        before,
        "the live node's files are as they were"
    );
    node.resume();
    // The live node serves on.
    node.status().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_leader_is_not_ready_while_its_consumer_is_far_behind_the_stream() {
    // 1,500 messages wait in the stream before the node starts; it takes one per entry.
    let nats = Nats::start();
    let js = nats.jetstream().await;
    ensure_stream(&js, "KVPLANE").await.unwrap();
    let metrics =
        br#"{"num_requests_running":1,"num_requests_waiting":0,"kv_cache_usage_perc":0.5}"#;
    for _ in 0..1_500 {
        js.publish(
            "kvplane.metrics.default.w".to_owned(),
            metrics.to_vec().into(),
        )
        .await
        .unwrap();
    }
    let last = publish(&js, "kvplane.metrics.default.w".into(), metrics.to_vec()).await;
    let o = NodeOptions {
        max_batch_messages: 1,
        ready_max_pending_messages: 100,
        ..NodeOptions::default()
    };
    let cluster = Cluster::start_on(nats, 1, &o);
    let node = &cluster.nodes[0];
    let why = eventually(
        "not ready while behind",
        Duration::from_secs(30),
        || async {
            let (code, body) = node.readyz().await;
            (code == 503 && body.contains("messages behind the stream")).then_some(body)
        },
    )
    .await;
    assert!(why.contains("at most 100 for ready"), "{why}");
    node.wait_applied_seq(last).await;
    eventually("ready once caught up", Duration::from_secs(30), || async {
        (node.readyz().await.0 == 200).then_some(())
    })
    .await;
}
