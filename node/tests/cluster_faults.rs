//! Faults a Raft cluster of real `kvplane serve` processes must survive: a follower cut off by
//! the network, a frozen (SIGSTOP) leader, a leader killed before its own disk took what its
//! followers committed, a member away while the log was compacted, disks that refuse log or
//! snapshot writes and a refused ingest proposal (failpoints), and members that join an
//! existing cluster on their own.

#![allow(clippy::unwrap_used)]

mod harness;

use std::time::{Duration, Instant};

use harness::{Cluster, Nats, Node, NodeOptions, RaftOptions, prompt, publish_chains};
use harness::{eventually, routed_worker, started};
use kvplane_ingest::ensure_stream;
use kvplane_proto::v1::{
    PutConfigRequest, ReadConsistency, RouteRequest, StatusRequest, route_response::Decision,
};

/// One entry per stream message, a snapshot every 20 entries, the log purged up to it.
fn snapshot_every_20_entries() -> NodeOptions {
    NodeOptions {
        max_batch_messages: 1,
        raft: Some(RaftOptions {
            compaction: Some((20, 0)),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn pool_object(block_size: u32, model: &str) -> Vec<u8> {
    format!(r#"{{"block_size":{block_size},"models":["{model}"]}}"#).into_bytes()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_off_follower_serves_stale_reads_refuses_writes_and_converges_after_heal() {
    let (mut cluster, js) = started(&NodeOptions::default()).await;
    let last = publish_chains(&js, 0, 10).await;
    cluster.all_agree(&[0, 1, 2], last).await;
    let leader = cluster.leader(&[0, 1, 2]).await.unwrap();
    let (cut, other) = {
        let f: Vec<usize> = (0..3).filter(|i| *i != leader).collect();
        (f[0], f[1])
    };
    cluster.isolate(cut).await;
    let before = cluster.nodes[cut].status().await.applied_index;

    // The majority goes on ingesting.
    let last = publish_chains(&js, 10, 20).await;
    cluster.all_agree(&[leader, other], last).await;
    let majority_index = cluster.nodes[other].status().await.applied_index;
    assert!(majority_index > before);

    // The cut-off follower still answers Route, from its older state, and says how old.
    let mut router = cluster.nodes[cut].router().await;
    let stale = router
        .route(RouteRequest {
            token_ids: prompt(3),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert!(matches!(stale.decision, Some(Decision::Endpoint(_))));
    assert_eq!(stale.applied_index, before);
    // Asking for a fresher state than it has is refused, not answered wrongly.
    let err = router
        .route(RouteRequest {
            token_ids: prompt(3),
            min_applied_index: majority_index,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::FailedPrecondition, "{err}");

    // Writes and linearizable reads there fail clearly and within the forward timeout.
    let started_at = Instant::now();
    let err = cluster.nodes[cut]
        .admin()
        .await
        .put_config(PutConfigRequest {
            kind: "pool".into(),
            name: "extra".into(),
            value: pool_object(16, "m"),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unavailable, "{err}");
    assert!(err.message().contains("no quorum reachable"), "{err}");
    assert!(started_at.elapsed() < Duration::from_secs(6));
    let err = router
        .route(RouteRequest {
            token_ids: prompt(3),
            linearizable: true,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unavailable, "{err}");

    // A follower on the majority side forwards a write to the leader and reads it back.
    let mut admin = cluster.nodes[other].admin().await;
    let written = admin
        .put_config(PutConfigRequest {
            kind: "pool".into(),
            name: "extra".into(),
            value: pool_object(16, "m"),
        })
        .await
        .unwrap()
        .into_inner()
        .index;
    assert!(written > majority_index);
    let s = admin
        .status(StatusRequest {
            consistency: Some(ReadConsistency {
                min_applied_index: written,
                linearizable: true,
            }),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(s.applied_index >= written && s.config_index == written);
    // An invalid object is committed and refused identically everywhere: a clear error.
    let err = admin
        .put_config(PutConfigRequest {
            kind: "pool".into(),
            name: "bad".into(),
            value: pool_object(0, "m"),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err}");
    assert!(err.message().contains("block_size"), "{err}");

    // Healed, the follower catches up to the same state, new pool included.
    cluster.heal().await;
    let last = publish_chains(&js, 20, 25).await;
    cluster.all_agree(&[0, 1, 2], last).await;
    let s = cluster.nodes[cut].status().await;
    assert!(s.config_index >= written, "{s:?}");
}

/// The leader's id and term as `node` reports them.
async fn leader_and_term(node: &Node) -> (u64, u64) {
    let s = node
        .admin()
        .await
        .cluster_status(StatusRequest::default())
        .await
        .unwrap()
        .into_inner();
    (s.leader, s.term)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_resumed_after_a_pause_does_not_unseat_a_healthy_leader() {
    let (cluster, js) = started(&NodeOptions::default()).await;
    let last = publish_chains(&js, 0, 5).await;
    cluster.all_agree(&[0, 1, 2], last).await;
    let leader = cluster.leader(&[0, 1, 2]).await.unwrap();
    let before = leader_and_term(&cluster.nodes[leader]).await;
    let follower = (leader + 1) % 3;
    cluster.nodes[follower].pause();
    // Several election timeouts (400-800 ms here) pass while it is frozen: its timer fires the
    // moment it resumes. What is under test is that time passing, not a race to wait out.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let rest: Vec<usize> = (0..3).filter(|i| *i != follower).collect();
    let last = publish_chains(&js, 5, 10).await;
    cluster.all_agree(&rest, last).await;
    cluster.nodes[follower].resume();
    // It catches up as a follower of the same leader, in the same term: with Pre-Vote its
    // election attempt asks first, and the others, hearing from their leader, refuse it.
    let last = publish_chains(&js, 10, 15).await;
    cluster.all_agree(&[0, 1, 2], last).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    for i in 0..3 {
        assert_eq!(
            leader_and_term(&cluster.nodes[i]).await,
            before,
            "node {i}: the leader and term of before the pause"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_leader_is_replaced_and_follows_after_it_resumes() {
    let (cluster, js) = started(&NodeOptions::default()).await;
    let last = publish_chains(&js, 0, 10).await;
    cluster.all_agree(&[0, 1, 2], last).await;
    let leader = cluster.leader(&[0, 1, 2]).await.unwrap();
    let rest: Vec<usize> = (0..3).filter(|i| *i != leader).collect();

    cluster.nodes[leader].pause();
    let paused_at = Instant::now();
    let new_leader = eventually("a new leader", Duration::from_secs(20), || {
        cluster.leader(&rest)
    })
    .await;
    eprintln!("new leader after SIGSTOP in {:?}", paused_at.elapsed());
    // Ingest resumes on the new leader; Route answers on both live members.
    let last = publish_chains(&js, 10, 20).await;
    cluster.all_agree(&rest, last).await;
    for &i in &rest {
        let (w, matched) = routed_worker(&cluster.nodes[i], &prompt(15)).await.unwrap();
        assert_eq!((w.as_str(), matched), ("w0", 3));
    }

    // Resumed, the old leader learns of the new term and catches up as a follower.
    cluster.nodes[leader].resume();
    let last = publish_chains(&js, 20, 25).await;
    cluster.all_agree(&[0, 1, 2], last).await;
    assert_eq!(cluster.leader(&[0, 1, 2]).await, Some(new_leader));
}

/// Writes pool `name` through `node`, retried until acknowledged (a minute at most); its index.
async fn put_pool_until_acknowledged(node: &Node, name: &str) -> u64 {
    eventually(
        "a write to be acknowledged",
        Duration::from_secs(60),
        || async {
            let mut admin = node.admin().await;
            let write = admin.put_config(PutConfigRequest {
                kind: "pool".into(),
                name: name.into(),
                value: pool_object(16, "m"),
            });
            match tokio::time::timeout(Duration::from_secs(5), write).await {
                Ok(Ok(r)) => Some(r.into_inner().index),
                _ => None,
            }
        },
    )
    .await
}

/// Found by the chaos runner (seed 1): a leader acknowledges a write once its followers' disks
/// hold it, its own may not yet. Killed then, it lost the entry; had it come back leading the
/// same term (openraft's leader restore), its next entries took the log ids of the committed
/// ones it lost, the followers took them for entries they had, and members applied different
/// entries at the same index. It must come back as a follower and learn what it lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_killed_before_its_own_disk_took_an_acknowledged_write_keeps_it_and_agrees() {
    // Followers wait 5-6 s for a leader that went silent: it is back long before.
    let o = NodeOptions {
        raft: Some(RaftOptions {
            election_timeout_ms: Some((5000, 6000)),
            ..Default::default()
        }),
        ..Default::default()
    };
    let (mut cluster, _js) = started(&o).await;
    let leader = cluster.leader(&[0, 1, 2]).await.unwrap();
    // The leader's disk takes 5 s over each round: what it appends next is acknowledged by the
    // followers' disks long before its own.
    cluster.nodes[leader]
        .failpoints("raft-log-write=sleep(5000)")
        .await;
    let acked = put_pool_until_acknowledged(&cluster.nodes[leader], "before-kill").await;
    let follower = (0..3).find(|i| *i != leader).unwrap();
    let led = leader_and_term(&cluster.nodes[follower]).await;
    cluster.nodes[leader].kill();
    cluster.nodes[leader].restart();
    // What the test is about: the kill took the acknowledged entry from the leader's log (its
    // round was still waiting on the slow disk), and the followers still follow it, in the
    // same term, when it is back.
    let log = cluster.nodes[leader].log();
    let kept = log
        .lines()
        .find(|l| l.contains("get_initial_state"))
        .and_then(|l| l.split("last_log_id: ").nth(1))
        .and_then(|id| {
            id.split_whitespace()
                .next()?
                .rsplit('.')
                .next()?
                .parse::<u64>()
                .ok()
        })
        .unwrap_or_else(|| panic!("no last log id at start in:\n{log}"));
    assert!(
        kept < acked,
        "the restarted leader's log holds {kept} >= {acked}"
    );
    assert_eq!(leader_and_term(&cluster.nodes[follower]).await, led);
    // Had it resumed leading, the followers (still following it) would take this write's entry
    // for the one they hold at the lost entry's log id.
    let after = put_pool_until_acknowledged(&cluster.nodes[leader], "after-restart").await;
    assert!(
        after > acked,
        "the write after the restart took index {after}, the acknowledged one before it {acked}"
    );

    // Every member holds both writes, at the same index and digest.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let mut seen = Vec::new();
        for n in &cluster.nodes {
            let s = n.status().await;
            let pools: Vec<String> = s
                .config_objects
                .iter()
                .filter(|o| o.kind == "pool")
                .map(|o| o.name.clone())
                .collect();
            seen.push((s.applied_index, s.state_digest, pools));
        }
        let agree = seen.iter().all(|s| s == &seen[0])
            && ["before-kill", "after-restart"]
                .iter()
                .all(|p| seen[0].2.iter().any(|n| n == p));
        if agree {
            assert!(seen[0].0 >= after, "{seen:?}");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "members (index, digest, pools) after 30 s: {seen:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_away_while_the_log_was_compacted_catches_up_through_a_snapshot() {
    let (mut cluster, js) = started(&snapshot_every_20_entries()).await;
    let last = publish_chains(&js, 0, 5).await;
    cluster.all_agree(&[0, 1, 2], last).await;
    let leader = cluster.leader(&[0, 1, 2]).await.unwrap();
    let away = (0..3).find(|i| *i != leader).unwrap();
    let away_applied = cluster.nodes[away].status().await.applied_index;
    cluster.nodes[away].kill();

    // One entry per message: well past two snapshots while the member is away.
    let last = publish_chains(&js, 5, 80).await;
    let rest: Vec<usize> = (0..3).filter(|i| *i != away).collect();
    cluster.all_agree(&rest, last).await;
    let purged = eventually(
        "the leader to purge its log",
        Duration::from_secs(20),
        || async {
            let mut admin = cluster.nodes[leader].admin().await;
            let s = admin
                .cluster_status(StatusRequest::default())
                .await
                .ok()?
                .into_inner();
            (s.purged_index > away_applied + 1).then_some(s.purged_index)
        },
    )
    .await;

    cluster.nodes[away].restart();
    cluster.all_agree(&[0, 1, 2], last).await;
    assert!(
        cluster.nodes[away]
            .log()
            .contains("installed a snapshot from the leader"),
        "the member caught up from before purged index {purged}:\n{}",
        cluster.nodes[away].log()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_whose_log_writes_fail_exits_with_an_error_and_catches_up_when_started_again() {
    let (mut cluster, js) = started(&NodeOptions::default()).await;
    let last = publish_chains(&js, 0, 5).await;
    cluster.all_agree(&[0, 1, 2], last).await;
    let leader = cluster.leader(&[0, 1, 2]).await.unwrap();
    let failing = (0..3).find(|i| *i != leader).unwrap();
    cluster.nodes[failing]
        .failpoints("raft-log-write=return")
        .await;

    // Its next append fails: the process ends on its own, with an error, while the other
    // two go on.
    let last = publish_chains(&js, 5, 15).await;
    let exit = harness::eventually_sync(
        "the member whose disk failed to exit",
        Duration::from_secs(30),
        || cluster.nodes[failing].exited(),
    )
    .await;
    assert!(!exit.success(), "exit {exit}");
    let log = cluster.nodes[failing].log();
    assert!(
        log.contains("injected write failure") && log.contains("the raft component stopped"),
        "{log}"
    );
    let rest: Vec<usize> = (0..3).filter(|i| *i != failing).collect();
    cluster.all_agree(&rest, last).await;

    // Started again on its data (its failpoints are gone with the process), it catches up.
    cluster.nodes[failing].restart();
    let last = publish_chains(&js, 15, 20).await;
    cluster.all_agree(&[0, 1, 2], last).await;
}

/// Found by the chaos runner: the leader's stream consumer ended on a proposal refused as "not
/// the leader" while the member went on leading, and nothing consumed the stream until the next
/// election. The refusal forced once (a failpoint): the consumer is started again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_whose_consumer_ends_while_it_leads_consumes_the_stream_again() {
    let (cluster, js) = started(&NodeOptions::default()).await;
    let last = publish_chains(&js, 0, 5).await;
    cluster.all_agree(&[0, 1, 2], last).await;
    let leader = cluster.leader(&[0, 1, 2]).await.unwrap();
    let (_, term) = leader_and_term(&cluster.nodes[leader]).await;
    cluster.nodes[leader]
        .failpoints("raft-ingest-propose=1*return")
        .await;

    let last = publish_chains(&js, 5, 15).await;
    cluster.all_agree(&[0, 1, 2], last).await;
    // The same member led throughout, in the same term: its consumer came back on its own.
    assert_eq!(
        leader_and_term(&cluster.nodes[leader]).await,
        (cluster.nodes[leader].raft_id.unwrap(), term)
    );
    let log = cluster.nodes[leader].log();
    assert!(
        log.contains("ingest ended while this member leads; starting it again"),
        "{log}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_whose_snapshot_writes_fail_keep_serving_and_their_log_until_one_succeeds() {
    let (mut cluster, js) = started(&snapshot_every_20_entries()).await;
    let leader = cluster.leader(&[0, 1, 2]).await.unwrap();
    let purged = |i: usize| {
        let node = &cluster.nodes[i];
        async move {
            let mut admin = node.admin().await;
            admin
                .cluster_status(StatusRequest::default())
                .await
                .unwrap()
                .into_inner()
                .purged_index
        }
    };
    let failing = |spec: &'static str| {
        let nodes = &cluster.nodes;
        async move {
            for n in nodes {
                n.failpoints(spec).await;
            }
        }
    };

    // No snapshot yet, and none can be written: well past two thresholds, every member
    // serves, keeps its whole log, and counts the refused builds.
    failing("raft-snapshot-write=return").await;
    let last = publish_chains(&js, 0, 60).await;
    cluster.all_agree(&[0, 1, 2], last).await;
    for i in 0..3 {
        assert_eq!(purged(i).await, 0, "member {i} purged without a snapshot");
        let refused = harness::metric_value(
            &cluster.nodes[i].metrics().await,
            "kvplane_raft_snapshot_failures_total",
        );
        // Refused, then tried again at the next threshold.
        assert!(refused >= 2.0, "member {i} refused {refused} builds");
    }

    // Healed, the next build is written and the log purged past it.
    failing("").await;
    let last = publish_chains(&js, 60, 90).await;
    cluster.all_agree(&[0, 1, 2], last).await;
    let first = eventually("a first snapshot", Duration::from_secs(20), || async {
        let p = purged(leader).await;
        (p > 0).then_some(p)
    })
    .await;

    // Failing again: the snapshot there is kept, nothing more purged (past a threshold, so
    // that a build begun before the failpoint was set has ended).
    failing("raft-snapshot-write=return").await;
    let last = publish_chains(&js, 90, 120).await;
    cluster.all_agree(&[0, 1, 2], last).await;
    let kept = purged(leader).await;
    assert!(kept >= first, "purged back from {first} to {kept}");
    let last = publish_chains(&js, 120, 180).await;
    cluster.all_agree(&[0, 1, 2], last).await;
    assert_eq!(
        purged(leader).await,
        kept,
        "nothing purged without a snapshot"
    );
    failing("").await;
    let last = publish_chains(&js, 180, 210).await;
    cluster.all_agree(&[0, 1, 2], last).await;
    eventually("the log purged again", Duration::from_secs(20), || async {
        (purged(leader).await > kept).then_some(())
    })
    .await;
    for n in &mut cluster.nodes {
        assert!(n.is_running(), "{} stopped", n.name);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_started_with_join_addresses_form_one_cluster() {
    let nats = Nats::start();
    let root = tempfile::tempdir().unwrap();
    let addrs: Vec<String> = (0..3)
        .map(|_| format!("127.0.0.1:{}", harness::free_port()))
        .collect();
    let nodes: Vec<Node> = (0..3)
        .map(|i| {
            let name = format!("kvplane-{i}");
            let raft = if i == 0 {
                // Like StatefulSet ordinal 0: a new one-member cluster.
                RaftOptions {
                    id: 1,
                    peers: vec![(1, addrs[0].clone())],
                    bootstrap: true,
                    ..Default::default()
                }
            } else {
                // Like ordinal i: ask the lower ordinals for membership.
                RaftOptions {
                    id: i as u64 + 1,
                    peers: vec![(i as u64 + 1, addrs[i].clone())],
                    join: addrs[..i].to_vec(),
                    ..Default::default()
                }
            };
            let o = NodeOptions {
                grpc_listen: addrs[i].clone(),
                raft: Some(raft),
                ..Default::default()
            };
            Node::start(&name, &root.path().join(&name), &nats.url(), &o)
        })
        .collect();
    let cluster = Cluster { nats, nodes, root };
    let js = cluster.nats.jetstream().await;
    ensure_stream(&js, "KVPLANE").await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let mut admin = cluster.nodes[2].admin().await;
        let s = admin.cluster_status(StatusRequest::default()).await;
        if s.as_ref()
            .is_ok_and(|s| s.get_ref().members.iter().filter(|m| m.voter).count() == 3)
        {
            break;
        }
        if Instant::now() > deadline {
            let logs: Vec<String> = cluster
                .nodes
                .iter()
                .map(|n| format!("{}:\n{}", n.name, n.log()))
                .collect();
            panic!("no three voters: {s:?}\n{}", logs.join("\n"));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let last = publish_chains(&js, 0, 10).await;
    cluster.all_agree(&[0, 1, 2], last).await;
}
