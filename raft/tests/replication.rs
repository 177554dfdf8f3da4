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
    start_in(
        id,
        tempfile::tempdir().unwrap(),
        "127.0.0.1:0",
        default_config(),
    )
    .await
}

fn default_config() -> openraft::Config {
    openraft::Config {
        heartbeat_interval: 100,
        election_timeout_min: 400,
        election_timeout_max: 800,
        ..Default::default()
    }
}

/// A node keeping its log and snapshots in `dir`, serving Raft on `addr`.
async fn start_in(
    id: u64,
    dir: TempDir,
    addr: &str,
    config: openraft::Config,
) -> (TestNode, String) {
    let log = {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            match LogStore::open(&dir.path().join("raft-log.redb")) {
                Ok(l) => break l,
                // The previous instance's tasks are still letting go of the file.
                Err(_) if Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(20)).await
                }
                Err(e) => panic!("{e}"),
            }
        }
    };
    let rs = ReplicatedState::open(&dir.path().join("state")).unwrap();
    let state = rs.handle();
    let listener = tokio::net::TcpListener::bind(addr).await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
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
    let svc = RaftGrpc::new(raft.clone(), Default::default()).into_service();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(svc)
            .serve_with_incoming_shutdown(
                tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true)),
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

async fn wait_for<T>(what: &str, f: impl FnMut() -> Option<T>) -> T {
    kvplane_testkit::eventually_sync(what, Duration::from_secs(20), f).await
}

fn leader_of(nodes: &[&TestNode]) -> Option<u64> {
    nodes.iter().find_map(|n| {
        let m = n.raft.metrics().borrow_watched().clone();
        (m.current_leader == Some(n.id)).then_some(n.id)
    })
}

/// Declares pool "p" (block size 16).
fn pool() -> Command {
    Command::ConfigPut {
        owner: Some(kvplane_state::Owner::Admin),
        kind: POOL_KIND.into(),
        name: "p".into(),
        value: PoolConfig {
            block_size: 16,
            models: vec![],
            lora_adapters: Vec::new(),
        }
        .to_json(),
    }
}

fn store(seq: u64, worker: u64) -> Command {
    let tokens: Vec<u32> = (0..32).map(|t| (seq * 100 + t) as u32).collect();
    Command::Ingest(IngestBatch {
        source: Default::default(),
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
                    cache_salt: None,
                    tier: Tier::Gpu,
                }],
            }),
        }],
    })
}

/// Proposes on `raft`, retrying while a fresh leader is not yet able to accept writes.
async fn write(raft: &KvRaft, command: Command) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let p = Proposal {
            timestamp_ms: 1,
            command: command.clone().into(),
        };
        match raft.client_write(p).await {
            Ok(_) => return,
            Err(_) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(50)).await
            }
            Err(e) => panic!("write failed: {e}"),
        }
    }
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
    write(&l.raft, pool()).await;
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
    apply(pool());
    for seq in 1..=60 {
        apply(store(seq, seq % 3));
    }
    assert_eq!(nodes[0].state.load().digest, single.digest());
    for n in &mut nodes {
        n.raft.shutdown().await.unwrap();
        let _ = n.stop.take().unwrap().send(());
    }
}

async fn stop(n: &mut TestNode) {
    n.raft.shutdown().await.unwrap();
    let _ = n.stop.take().unwrap().send(());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_behind_a_compacted_log_catches_up_through_a_snapshot_and_restarts_from_it() {
    let config = openraft::Config {
        snapshot_policy: openraft::SnapshotPolicy::LogsSinceLast(20),
        max_in_snapshot_log_to_keep: 0,
        purge_batch_size: 1,
        ..default_config()
    };
    let mut nodes = Vec::new();
    let mut members = BTreeMap::new();
    let mut addrs = BTreeMap::new();
    for id in 1..=3 {
        let (n, addr) = start_in(
            id,
            tempfile::tempdir().unwrap(),
            "127.0.0.1:0",
            config.clone(),
        )
        .await;
        members.insert(id, BasicNode::new(addr.clone()));
        addrs.insert(id, addr);
        nodes.push(n);
    }
    nodes[0].raft.initialize(members).await.unwrap();
    let leader = wait_for("a leader", || leader_of(&nodes.iter().collect::<Vec<_>>())).await;
    let li = nodes.iter().position(|n| n.id == leader).unwrap();
    write(&nodes[li].raft, pool()).await;
    for seq in 1..=5 {
        write(&nodes[li].raft, store(seq, seq % 3)).await;
    }
    // A follower goes away; the leader moves on far enough to snapshot and purge its log.
    let fi = (li + 1) % 3;
    let follower_id = nodes[fi].id;
    stop(&mut nodes[fi]).await;
    for seq in 6..=70 {
        write(&nodes[li].raft, store(seq, seq % 3)).await;
    }
    wait_for("the leader to purge its log", || {
        let m = nodes[li].raft.metrics().borrow_watched().clone();
        m.purged.is_some_and(|p| p.index > 10).then_some(())
    })
    .await;

    // It comes back on its old address with its old files: the log it lacks is gone, so the
    // leader streams it a snapshot.
    let TestNode {
        _dir: dir, raft, ..
    } = nodes.remove(fi);
    drop(raft);
    let (back, _) = start_in(follower_id, dir, &addrs[&follower_id], config.clone()).await;
    nodes.insert(fi, back);
    let converged = |nodes: &[&TestNode]| {
        let views: Vec<_> = nodes.iter().map(|n| n.state.load()).collect();
        (views[0].indexed_blocks == 140
            && views
                .iter()
                .all(|v| v.digest == views[0].digest && v.applied_index == views[0].applied_index))
        .then_some(views[0].digest)
    };
    let digest = wait_for("the returning follower to converge", || {
        converged(&nodes.iter().collect::<Vec<_>>())
    })
    .await;
    let m = nodes[fi].raft.metrics().borrow_watched().clone();
    assert!(
        m.snapshot.is_some(),
        "the follower caught up through a snapshot"
    );

    // Restarted again, it starts from its own snapshot file.
    let mut again = nodes.remove(fi);
    stop(&mut again).await;
    let TestNode {
        _dir: dir, raft, ..
    } = again;
    drop(raft);
    let (back, _) = start_in(follower_id, dir, &addrs[&follower_id], config).await;
    assert!(
        back.state.load().indexed_blocks > 0,
        "state restored from the snapshot file at start"
    );
    nodes.insert(fi, back);
    assert_eq!(
        wait_for("convergence after restart", || converged(
            &nodes.iter().collect::<Vec<_>>()
        ))
        .await,
        digest
    );
    for n in &mut nodes {
        stop(n).await;
    }
}
