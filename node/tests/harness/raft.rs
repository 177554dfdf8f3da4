//! Helpers for Raft cluster tests: a stream of KV events, Route calls, agreement checks.

use std::time::Duration;

use kvplane_ingest::ensure_stream;
use kvplane_ingest::vllm::encode_batch;
use kvplane_proto::v1::{RouteRequest, route_response::Decision};
use kvplane_state::{KvBatch, KvEvent, Tier};

use super::{Cluster, Node, NodeOptions, eventually, publish};

/// Publishes KV chains `from..to` (worker `w{i % 3}` of pool `default`, salt `i + 1`) and
/// returns the last stream sequence.
pub async fn publish_chains(js: &async_nats::jetstream::Context, from: u64, to: u64) -> u64 {
    let mut last = 0;
    for i in from..to {
        last = publish(
            js,
            kvplane_ingest::kv_subject("default", &format!("w{}", i % 3)),
            chain(&prompt(i), i + 1),
        )
        .await;
    }
    last
}

pub fn chain(tokens: &[u32], salt: u64) -> Vec<u8> {
    let n = tokens.len() / 16;
    encode_batch(
        0.0,
        &KvBatch {
            dp_rank: 0,
            events: vec![KvEvent::Stored {
                block_hashes: (0..n as u64).map(|i| salt * 1_000 + i).collect(),
                parent_hash: None,
                token_ids: tokens[..n * 16].to_vec(),
                block_size: 16,
                lora_name: None,
                cache_salt: None,
                tier: Tier::Gpu,
            }],
        },
    )
}

pub fn prompt(i: u64) -> Vec<u32> {
    (0..48).map(|t| (i * 1_000 + t) as u32).collect()
}

/// The worker a request for `tokens` would go to on `node`, and the blocks it caches.
pub async fn routed_worker(node: &Node, tokens: &[u32]) -> Result<(String, u32), tonic::Status> {
    let mut c = kvplane_proto::v1::router_client::RouterClient::connect(node.endpoint())
        .await
        .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
    // Explain: where a request would go, without counting it in the worker's queue.
    let r = c
        .explain(RouteRequest {
            token_ids: tokens.to_vec(),
            ..Default::default()
        })
        .await?
        .into_inner()
        .decision
        .unwrap_or_default();
    match r.decision {
        Some(Decision::Endpoint(e)) => Ok((e.worker_id, r.matched_blocks)),
        other => Err(tonic::Status::internal(format!("{other:?}"))),
    }
}

/// Three Raft members with an elected leader, and a JetStream client with the stream created.
pub async fn started(o: &NodeOptions) -> (Cluster, async_nats::jetstream::Context) {
    let cluster = Cluster::start_raft(3, o);
    let js = cluster.nats.jetstream().await;
    ensure_stream(&js, "KVPLANE").await.unwrap();
    eventually("a leader", Duration::from_secs(20), || {
        cluster.leader(&[0, 1, 2])
    })
    .await;
    (cluster, js)
}

/// Three Raft members keeping the state in line with a policy file of worker set `gpu` (model
/// `m`) and an InferencePolicy `tenants` with `limits` (YAML list items), and worker `gpu/w0`
/// announced; returns once every replica knows both. On a timeout it says what each replica
/// holds and what the stream has.
pub async fn started_with_limits(
    limits: &str,
    env: Vec<(String, String)>,
) -> (Cluster, tempfile::TempDir) {
    started_with_limits_and(limits, env, String::new()).await
}

/// As [`started_with_limits`], with `extra_toml` appended to every node's config.
pub async fn started_with_limits_and(
    limits: &str,
    env: Vec<(String, String)>,
    extra_toml: String,
) -> (Cluster, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let policies = format!(
        "apiVersion: kvplane.io/v1alpha1\nkind: InferenceWorkerSet\nmetadata: {{name: gpu}}\nspec: {{model: m, blockSize: 16}}\n---\napiVersion: kvplane.io/v1alpha1\nkind: InferencePolicy\nmetadata: {{name: tenants}}\nspec:\n  limits:\n{limits}"
    );
    std::fs::write(dir.path().join("policies.yaml"), policies).unwrap();
    let o = NodeOptions {
        policy_dir: Some(dir.path().to_owned()),
        env,
        extra_toml,
        ..Default::default()
    };
    let (cluster, js) = started(&o).await;
    publish(
        &js,
        kvplane_ingest::worker_subject("gpu", "w0"),
        br#"{"status":"up","address":"http://w0:8000"}"#.to_vec(),
    )
    .await;
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let mut seen = String::new();
        let mut ready = true;
        for n in &cluster.nodes {
            let s = n.status().await;
            seen.push_str(&format!(
                "{} ({}): index {}, objects {:?}, workers {:?}, ingest {:?}\n",
                n.name, s.role, s.applied_index, s.policy_objects, s.workers, s.ingest
            ));
            ready &= s.policy_objects.get("InferencePolicy") == Some(&1)
                && s.workers.iter().any(|w| w.up);
        }
        if ready {
            return (cluster, dir);
        }
        if std::time::Instant::now() > deadline {
            let mut stream = js.get_stream("KVPLANE").await.unwrap();
            let state = stream.info().await.unwrap().state.clone();
            let logs: Vec<String> = cluster
                .nodes
                .iter()
                .map(|n| {
                    let log = n.log();
                    let tail: Vec<&str> = log
                        .lines()
                        .filter(|l| !l.contains("openraft"))
                        .rev()
                        .take(15)
                        .collect();
                    format!("{}:\n{}", n.name, tail.join("\n"))
                })
                .collect();
            panic!(
                "the replicas do not know the policies and the worker:\n{seen}stream: {state:?}\n{}",
                logs.join("\n")
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// `node`'s state, read from its exported state (Admin.ExportState) by the state crate itself.
pub async fn exported_state(node: &Node) -> kvplane_state::StateMachine {
    let mut stream = node
        .admin()
        .await
        .export_state(kvplane_proto::v1::ExportStateRequest {})
        .await
        .unwrap()
        .into_inner();
    let mut bytes = Vec::new();
    while let Some(chunk) = stream.message().await.unwrap() {
        bytes.extend_from_slice(&chunk.data);
    }
    kvplane_state::StateMachine::restore(&bytes).unwrap()
}

/// The options of a learner in another cluster: reached, and reaching a member (at `via`, a gRPC
/// port), only through links that delay every byte `one_way`, its join, writes and reads relayed
/// by that member; `base` gives the rest. With the links `(into it, out of it)`. Its direct
/// calls to the voters are the caller's to cut (`Node::block`).
pub async fn remote_learner(
    id: u64,
    via: u16,
    one_way: Duration,
    base: NodeOptions,
) -> (NodeOptions, super::link::Link, super::link::Link) {
    use super::link::Link;
    let port = super::free_port();
    let inbound = Link::start_delayed(port, one_way).await;
    let outbound = Link::start_delayed(via, one_way).await;
    let o = NodeOptions {
        grpc_listen: format!("127.0.0.1:{port}"),
        raft: Some(super::RaftOptions {
            id,
            peers: vec![(id, format!("127.0.0.1:{}", inbound.port))],
            join: vec![format!("127.0.0.1:{}", outbound.port)],
            learner: true,
            relay_through_join: true,
            ..Default::default()
        }),
        ..base
    };
    (o, inbound, outbound)
}
