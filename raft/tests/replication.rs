//! Three Raft replicas over real gRPC on loopback, each with its own redb log: they apply the
//! same entries to the same state, and keep doing so after the leader stops.

#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvplane_raft::{KvRaft, LogStore, Network, Proposal, RaftGrpc, ReplicatedState};
use kvplane_state::{
    Command, IngestBatch, IngestItem, IngestPayload, KvBatch, KvEvent, POOL_KIND, PoolConfig,
    StateHandle, StateMachine, Tier,
};
use openraft::BasicNode;
use openraft::async_runtime::WatchReceiver;
use tempfile::TempDir;
use tokio::sync::oneshot;

struct TestNode {
    id: u64,
    raft: KvRaft,
    state: StateHandle,
    stop: Option<oneshot::Sender<()>>,
    _dir: TempDir,
}

async fn start(id: u64) -> (TestNode, String) {
    let dir = tempfile::tempdir().unwrap();
    let log = LogStore::open(&dir.path().join("raft-log.redb")).unwrap();
    let rs = ReplicatedState::new(StateMachine::new());
    let state = rs.handle();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let config = openraft::Config {
        heartbeat_interval: 100,
        election_timeout_min: 400,
        election_timeout_max: 800,
        ..Default::default()
    };
    let raft = openraft::Raft::new(
        id,
        Arc::new(config.validate().unwrap()),
        Network::default(),
        log,
        rs,
    )
    .await
    .unwrap();
    let (tx, rx) = oneshot::channel::<()>();
    let svc = RaftGrpc::new(raft.clone()).into_service();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(svc)
            .serve_with_incoming_shutdown(
                tokio_stream::wrappers::TcpListenerStream::new(listener),
                async {
                    let _ = rx.await;
                },
            ),
    );
    (
        TestNode {
            id,
            raft,
            state,
            stop: Some(tx),
            _dir: dir,
        },
        addr,
    )
}

async fn wait_for<T>(what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn leader_of(nodes: &[&TestNode]) -> Option<u64> {
    nodes.iter().find_map(|n| {
        let m = n.raft.metrics().borrow_watched().clone();
        (m.current_leader == Some(n.id)).then_some(n.id)
    })
}

fn store(seq: u64, worker: u64) -> Command {
    let tokens: Vec<u32> = (0..32).map(|t| (seq * 100 + t) as u32).collect();
    Command::Ingest(IngestBatch {
        first_seq: seq,
        last_seq: seq,
        items: vec![IngestItem {
            seq,
            pool: "p".into(),
            worker: format!("w{worker}"),
            payload: IngestPayload::Kv(KvBatch {
                dp_rank: 0,
                events: vec![KvEvent::Stored {
                    block_hashes: vec![seq * 2, seq * 2 + 1],
                    parent_hash: None,
                    token_ids: tokens,
                    block_size: 16,
                    lora_name: None,
                    tier: Tier::Gpu,
                }],
            }),
        }],
    })
}

async fn write(raft: &KvRaft, command: Command) {
    raft.client_write(Proposal {
        timestamp_ms: 1,
        command,
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_replicas_apply_the_same_entries_and_outlive_their_leader() {
    let mut nodes = Vec::new();
    let mut members = BTreeMap::new();
    for id in 1..=3 {
        let (n, addr) = start(id).await;
        members.insert(id, BasicNode::new(addr));
        nodes.push(n);
    }
    nodes[0].raft.initialize(members).await.unwrap();
    let leader = wait_for("a leader", || leader_of(&nodes.iter().collect::<Vec<_>>())).await;
    let l = nodes.iter().find(|n| n.id == leader).unwrap();
    write(
        &l.raft,
        Command::ConfigPut {
            kind: POOL_KIND.into(),
            name: "p".into(),
            value: PoolConfig {
                block_size: 16,
                models: vec![],
            }
            .to_json(),
        },
    )
    .await;
    for seq in 1..=40 {
        write(&l.raft, store(seq, seq % 3)).await;
    }
    let converged = |nodes: &[&TestNode], blocks: u64| {
        let views: Vec<_> = nodes.iter().map(|n| n.state.load()).collect();
        let first = &views[0];
        (first.indexed_blocks == blocks
            && views
                .iter()
                .all(|v| v.digest == first.digest && v.applied_index == first.applied_index))
        .then_some(first.digest)
    };
    let all: Vec<&TestNode> = nodes.iter().collect();
    wait_for("three equal digests", || converged(&all, 80)).await;

    // The leader stops; the other two elect a new one and go on.
    let old = nodes.iter().position(|n| n.id == leader).unwrap();
    let mut gone = nodes.remove(old);
    gone.raft.shutdown().await.unwrap();
    let _ = gone.stop.take().unwrap().send(());
    let rest: Vec<&TestNode> = nodes.iter().collect();
    let new_leader = wait_for("a new leader", || leader_of(&rest)).await;
    assert_ne!(new_leader, leader);
    let nl = nodes.iter().find(|n| n.id == new_leader).unwrap();
    for seq in 41..=60 {
        write(&nl.raft, store(seq, seq % 3)).await;
    }
    let rest: Vec<&TestNode> = nodes.iter().collect();
    wait_for("two equal digests after the failover", || {
        converged(&rest, 120)
    })
    .await;
    // Applying the same commands on one machine gives the same digest.
    let mut single = StateMachine::new();
    let mut index = 0;
    let mut apply = |c: Command| {
        index += 1;
        single
            .apply(&kvplane_state::Entry {
                index,
                timestamp_ms: 1,
                command: c,
            })
            .unwrap();
    };
    apply(Command::ConfigPut {
        kind: POOL_KIND.into(),
        name: "p".into(),
        value: PoolConfig {
            block_size: 16,
            models: vec![],
        }
        .to_json(),
    });
    for seq in 1..=60 {
        apply(store(seq, seq % 3));
    }
    assert_eq!(nodes[0].state.load().digest, single.digest());
    for n in &mut nodes {
        n.raft.shutdown().await.unwrap();
        let _ = n.stop.take().unwrap().send(());
    }
}
