//! A node of its own is a one-member Raft cluster: what it acknowledged is in its fsynced log
//! before the answer, so `kill -9` loses neither a config write nor a quota grant, and
//! `kvplane cluster add` grows it into a cluster with no data migration.

#![allow(clippy::unwrap_used)]

mod harness;

use std::time::Duration;

use harness::{Cluster, NodeOptions, RaftOptions, kvplane_ok, prompt, publish, publish_chains};
use kvplane_ingest::ensure_stream;
use kvplane_proto::v1::{PutConfigRequest, RejectCode, RouteRequest, route_response::Decision};

/// The pools in `node`'s state, read from its exported state by the state crate itself.
async fn pools(node: &harness::Node) -> Vec<String> {
    let sm = harness::exported_state(node).await;
    sm.handle().load().pools.keys().cloned().collect()
}

fn put_pool(name: &str) -> PutConfigRequest {
    PutConfigRequest {
        kind: "pool".into(),
        name: name.into(),
        value: br#"{"block_size":16,"models":["other"]}"#.to_vec(),
    }
}

/// One of acme's requests: 100 prompt tokens, at most 100 output.
fn acme_request() -> RouteRequest {
    RouteRequest {
        tenant: "acme".into(),
        model: "m".into(),
        token_ids: prompt(1).into_iter().cycle().take(100).collect(),
        max_output_tokens: 100,
        ..Default::default()
    }
}

/// Tokens the client reserves per request: 100 prompt tokens and at most 100 output.
const PER_REQUEST: u64 = 200;

/// Sends acme's requests to `node` until one is refused as over its limit (at most `max`);
/// returns how many were admitted, counted here.
async fn admit_until_refused(node: &harness::Node, max: u64) -> u64 {
    let mut router = node.router().await;
    let req = acme_request();
    let (mut admitted, mut waits) = (0, 0);
    while admitted < max {
        let r = router.route(req.clone()).await.unwrap().into_inner();
        match r.decision {
            Some(Decision::Endpoint(_)) => admitted += 1,
            Some(Decision::Rejection(j)) if j.code == i32::from(RejectCode::RateLimited) => {
                if j.reason.contains("reached") {
                    break;
                }
                // No grant yet (a node just started): it fails closed; ask again.
                assert!(j.reason.contains("fails closed"), "{}", j.reason);
                waits += 1;
                assert!(waits < 100, "no grant after {waits} tries: {}", j.reason);
            }
            other => panic!("{other:?}"),
        }
    }
    admitted
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acknowledged_config_write_and_quota_grant_survive_kill_9() {
    // acme: 2,000 tokens per 50-minute window, granted 1,000 at a time.
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("policies.yaml"),
        "apiVersion: kvplane.io/v1alpha1\nkind: InferenceWorkerSet\nmetadata: {name: gpu}\nspec: {model: m, blockSize: 16}\n---\napiVersion: kvplane.io/v1alpha1\nkind: InferencePolicy\nmetadata: {name: tenants}\nspec:\n  limits:\n    - {tenant: acme, tokensPerMinute: 40, burst: 1000, windowSeconds: 3000}\n",
    )
    .unwrap();
    let o = NodeOptions {
        policy_dir: Some(dir.path().to_owned()),
        ..Default::default()
    };
    let mut cluster = Cluster::start_with(1, &o);
    let js = cluster.nats.jetstream().await;
    ensure_stream(&js, "KVPLANE").await.unwrap();
    publish(
        &js,
        kvplane_ingest::worker_subject("gpu", "w0"),
        br#"{"status":"up","address":"http://w0:8000"}"#.to_vec(),
    )
    .await;
    let node = &mut cluster.nodes[0];
    harness::eventually("the worker is up", Duration::from_secs(20), || async {
        node.status()
            .await
            .workers
            .iter()
            .any(|w| w.up)
            .then_some(())
    })
    .await;

    // Two requests (400 tokens) from the first grant of 1,000 (not yet low enough to ask for
    // more); then a config write. Both acknowledged, then SIGKILL at once: no snapshot is
    // taken in between.
    let mut router = node.router().await;
    let req = acme_request();
    for _ in 0..2 {
        let r = router.route(req.clone()).await.unwrap().into_inner();
        assert!(matches!(r.decision, Some(Decision::Endpoint(_))), "{r:?}");
    }
    let held = node.status().await.quota[0].held_tokens;
    assert_eq!(held, 1_000);
    let written = node
        .admin()
        .await
        .put_config(put_pool("extra"))
        .await
        .unwrap()
        .into_inner()
        .index;
    node.kill();
    node.restart();
    assert!(
        !node.log().contains("state restored from snapshot"),
        "the restart replays the log, not a snapshot"
    );
    // Ready means the restarted leader has applied an entry of its own term, so everything
    // acknowledged before the kill: the status that follows must show the write.
    harness::eventually(
        "the restarted node is ready",
        Duration::from_secs(20),
        || async { (node.readyz().await.0 == 200).then_some(()) },
    )
    .await;

    let s = node.status().await;
    assert!(s.config_index >= written, "{s:?}");
    assert!(pools(node).await.contains(&"extra".to_owned()));

    // The 1,000 granted before the kill are not granted again, nor spent again: 600 of them
    // were never spent, but no one knows that any more, so the window has the 1,000 that were
    // never granted left, and no more (before, the restarted node spent the 1,000 it held
    // again, then the rest: 2,400 admitted of 2,000).
    let after = admit_until_refused(node, 20).await;
    let q = node.status().await.quota;
    assert_eq!(
        after, 5,
        "admitted 2 before the kill and {after} after it: {q:?}"
    );
    assert!((2 + after) * PER_REQUEST <= 2_000);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standalone_node_grown_to_three_members_keeps_its_digest_and_its_config() {
    let addrs: Vec<String> = (0..3)
        .map(|_| format!("127.0.0.1:{}", harness::free_port()))
        .collect();
    let one = NodeOptions {
        grpc_listen: addrs[0].clone(),
        ..Default::default()
    };
    let mut cluster = Cluster::start_with(1, &one);
    let js = cluster.nats.jetstream().await;
    ensure_stream(&js, "KVPLANE").await.unwrap();
    let last = publish_chains(&js, 0, 20).await;
    cluster.nodes[0]
        .admin()
        .await
        .put_config(put_pool("extra"))
        .await
        .unwrap();
    let before = cluster.all_agree(&[0], last).await;

    // Two empty members, then `kvplane cluster add` on the node for each.
    let peers: Vec<(u64, String)> = addrs
        .iter()
        .enumerate()
        .map(|(i, a)| (i as u64 + 1, a.clone()))
        .collect();
    for (i, addr) in addrs.iter().enumerate().skip(1) {
        let o = NodeOptions {
            grpc_listen: addr.clone(),
            raft: Some(RaftOptions {
                id: i as u64 + 1,
                peers: peers.clone(),
                bootstrap: false,
                ..Default::default()
            }),
            ..Default::default()
        };
        cluster.add_node(&format!("kvplane-{i}"), &o);
        let out = kvplane_ok(&[
            "cluster",
            "add",
            "--addr",
            &cluster.nodes[0].endpoint(),
            "--id",
            &(i + 1).to_string(),
            "--member-addr",
            addr,
        ]);
        assert!(out.contains(&format!("member       {}", i + 1)), "{out}");
    }
    let grown = cluster.all_agree(&[0, 1, 2], last).await;
    assert_eq!(grown, before, "the same state, digest for digest");
    for n in &cluster.nodes {
        assert!(pools(n).await.contains(&"extra".to_owned()), "{}", n.name);
    }
    let status = kvplane_ok(&["cluster", "status", "--addr", &cluster.nodes[2].endpoint()]);
    assert_eq!(
        status.lines().filter(|l| l.ends_with("voter")).count(),
        3,
        "{status}"
    );

    // And it goes on as a cluster: new events reach every member.
    let last = publish_chains(&js, 20, 30).await;
    cluster.all_agree(&[0, 1, 2], last).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_of_its_own_stays_ready_as_its_own_quorum() {
    let cluster = Cluster::start(1);
    let node = &cluster.nodes[0];
    // Past the readiness lease (two election timeouts, 2 s): a leader with no follower to
    // acknowledge it is still its own quorum. The time passing is what is under test.
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    assert_eq!(node.readyz().await, (200, "ready".to_owned()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_recorded_at_a_wildcard_address_refuses_to_grow() {
    let one = NodeOptions {
        grpc_listen: format!("0.0.0.0:{}", harness::free_port()),
        ..Default::default()
    };
    let cluster = Cluster::start_with(1, &one);
    let node = &cluster.nodes[0];
    harness::eventually("the node ready", Duration::from_secs(20), || async {
        (node.readyz().await.0 == 200).then_some(())
    })
    .await;
    let err = node
        .admin()
        .await
        .add_member(kvplane_proto::v1::AddMemberRequest {
            id: 2,
            addr: "127.0.0.1:1".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::FailedPrecondition, "{err}");
    assert!(err.message().contains("set raft.advertise_addr"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adding_a_node_that_is_a_cluster_of_its_own_is_refused_and_it_keeps_its_state() {
    // Two standalone nodes, each a one-member cluster with its own config.
    let cluster = Cluster::start_with(2, &NodeOptions::default());
    let (a, b) = (&cluster.nodes[0], &cluster.nodes[1]);
    for n in [a, b] {
        harness::eventually("the node ready", Duration::from_secs(20), || async {
            (n.readyz().await.0 == 200).then_some(())
        })
        .await;
    }
    b.admin()
        .await
        .put_config(put_pool("b-only"))
        .await
        .unwrap();
    let err = a
        .admin()
        .await
        .add_member(kvplane_proto::v1::AddMemberRequest {
            id: 2,
            addr: b.grpc.to_string(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::FailedPrecondition, "{err}");
    assert!(
        err.message().contains("already is a cluster of its own"),
        "{err}"
    );
    // Neither side changed: a still alone, b still its own cluster with its pool.
    let members = a
        .admin()
        .await
        .cluster_status(kvplane_proto::v1::StatusRequest::default())
        .await
        .unwrap();
    assert_eq!(members.into_inner().members.len(), 1);
    let theirs = b.cluster_status().await;
    assert_eq!(theirs.members.iter().map(|m| m.id).collect::<Vec<_>>(), [1]);
    assert_eq!(theirs.leader, 1);
    assert!(pools(b).await.contains(&"b-only".to_owned()));
}
