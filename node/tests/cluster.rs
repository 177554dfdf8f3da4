//! A three-node Raft cluster of real `kvplane serve` processes: KV events flow in once through
//! NATS, every replica holds the same state and answers Route, and killing the leader in the
//! middle of ingest neither loses nor repeats an event.

#![allow(clippy::unwrap_used)]

mod harness;

use std::time::{Duration, Instant};

use harness::{
    NodeOptions, chain, eventually, kvplane_ok, prompt, publish, publish_chains, routed_worker,
    started,
};
use kvplane_ingest::{kv_subject, worker_subject};
use kvplane_proto::v1::RouteRequest;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_replicas_ingest_once_agree_and_each_answer_route() {
    let (cluster, js) = started(&NodeOptions::default()).await;
    for w in 0..3u64 {
        publish(
            &js,
            worker_subject("default", &format!("w{w}")),
            br#"{"status":"up","address":"http://e"}"#.to_vec(),
        )
        .await;
    }
    let last = publish_chains(&js, 0, 30).await;
    cluster.all_agree(&[0, 1, 2], last).await;
    for node in &cluster.nodes {
        for i in [0u64, 7, 29] {
            let (w, matched) = routed_worker(node, &prompt(i)).await.unwrap();
            assert_eq!((w, matched), (format!("w{}", i % 3), 3));
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_leader_mid_ingest_loses_and_repeats_nothing() {
    let o = NodeOptions {
        max_batch_messages: 5,
        ..Default::default()
    };
    let (mut cluster, js) = started(&o).await;
    let mut last = publish(
        &js,
        worker_subject("default", "w0"),
        br#"{"status":"up"}"#.to_vec(),
    )
    .await;
    // Every replica knows the worker before the first kill: a survivor that had not applied its
    // announcement yet would rightly have nowhere to route.
    cluster.all_agree(&[0, 1, 2], last).await;
    let mut n = 0u64;
    let mut failovers = Vec::new();
    for _round in 0..5 {
        let leader = eventually("a leader", Duration::from_secs(20), || {
            cluster.leader(&[0, 1, 2])
        })
        .await;
        for _ in 0..40 {
            n += 1;
            last = publish(
                &js,
                kv_subject("default", &format!("w{}", n % 3)),
                chain(&prompt(n), n),
            )
            .await;
        }
        // Kill the leader while it is still consuming what was just published.
        cluster.nodes[leader].kill();
        let killed_at = Instant::now();
        let rest: Vec<usize> = (0..3).filter(|i| *i != leader).collect();
        let mut failed_routes = 0;
        let new_leader = loop {
            for &i in &rest {
                if routed_worker(&cluster.nodes[i], &prompt(1)).await.is_err() {
                    failed_routes += 1;
                }
            }
            if let Some(l) = cluster.leader(&rest).await {
                break l;
            }
            assert!(
                killed_at.elapsed() < Duration::from_secs(20),
                "no new leader"
            );
        };
        failovers.push(killed_at.elapsed());
        assert_ne!(new_leader, leader);
        assert_eq!(failed_routes, 0, "surviving replicas kept answering Route");
        cluster.all_agree(&rest, last).await;
        cluster.nodes[leader].restart();
    }
    let digest = cluster.all_agree(&[0, 1, 2], last).await;
    let s = cluster.nodes[0].status().await;
    assert_eq!(s.indexed_blocks, n * 3);
    let dropped = s.ingest.unwrap().dropped;
    assert_eq!(dropped.get("parent_missing").copied().unwrap_or(0), 0);
    // A one-member cluster reading the same stream once reaches the same state.
    let single = cluster.add_node("single", &NodeOptions::default());
    let one = single.wait_applied_seq(last).await;
    assert_eq!(one.state_digest, digest);
    eprintln!("time from leader kill to a new leader: {failovers:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cluster_grows_to_four_and_shrinks_to_three_while_serving() {
    let (mut cluster, js) = started(&NodeOptions::default()).await;
    let mut last = publish_chains(&js, 0, 20).await;
    cluster.all_agree(&[0, 1, 2], last).await;

    // Route traffic on the original members for the whole test.
    let endpoints: Vec<String> = cluster.nodes.iter().map(|n| n.endpoint()).collect();
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let traffic = tokio::spawn(async move {
        let (mut ok, mut failed) = (0u64, Vec::new());
        while !*stop_rx.borrow() {
            for (i, e) in endpoints.iter().enumerate() {
                let r = async {
                    let mut c = kvplane_proto::v1::router_client::RouterClient::connect(e.clone())
                        .await
                        .ok()?;
                    c.route(RouteRequest {
                        token_ids: prompt(3),
                        ..Default::default()
                    })
                    .await
                    .ok()
                }
                .await;
                match r {
                    Some(_) => ok += 1,
                    None => failed.push(i),
                }
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        (ok, failed)
    });

    // A fourth node starts empty and joins: learner, catch-up, voter.
    let addr4 = format!("127.0.0.1:{}", harness::free_port());
    let mut peers: Vec<(u64, String)> = cluster
        .nodes
        .iter()
        .enumerate()
        .map(|(i, n)| (i as u64 + 1, n.grpc.to_string()))
        .collect();
    peers.push((4, addr4.clone()));
    let o4 = NodeOptions {
        grpc_listen: addr4.clone(),
        raft: Some(harness::RaftOptions {
            id: 4,
            peers,
            bootstrap: false,
            ..Default::default()
        }),
        ..Default::default()
    };
    cluster.add_node("kvplane-3", &o4);
    let any = cluster.nodes[0].endpoint();
    let out = kvplane_ok(&[
        "cluster",
        "add",
        "--addr",
        &any,
        "--id",
        "4",
        "--member-addr",
        &addr4,
    ]);
    assert!(out.contains("member       4"), "{out}");
    last = publish_chains(&js, 20, 30).await;
    cluster.all_agree(&[0, 1, 2, 3], last).await;

    // Node 2 leaves, then stops; the other three go on.
    let out = kvplane_ok(&["cluster", "remove", "--addr", &any, "--id", "2"]);
    assert!(!out.contains("member       2 "), "{out}");
    cluster.nodes[1].kill();
    last = publish_chains(&js, 30, 40).await;
    let _ = stop_tx.send(true);
    let (ok, failed) = traffic.await.unwrap();
    cluster.all_agree(&[0, 2, 3], last).await;
    let status = kvplane_ok(&["cluster", "status", "--addr", &cluster.nodes[3].endpoint()]);
    let voters = status.lines().filter(|l| l.ends_with("voter")).count();
    assert_eq!(voters, 3, "{status}");
    // Route never failed on a live member (node 2 is only counted until it was stopped).
    assert!(ok > 0);
    assert!(
        failed.iter().all(|i| *i == 1),
        "failed routes on live members: {failed:?}"
    );
}

/// A member whose volume was lost comes back empty at the same address under a new id (a
/// StatefulSet pod with a new volume): it joins, its old id leaves the membership, and it
/// holds the same state as the others.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_back_with_an_empty_volume_joins_under_a_new_id_and_its_old_id_leaves() {
    let (mut cluster, js) = started(&NodeOptions::default()).await;
    let mut last = publish_chains(&js, 0, 10).await;
    cluster.all_agree(&[0, 1, 2], last).await;
    let addr = cluster.nodes[2].grpc.to_string();
    cluster.nodes[2].kill();
    std::fs::remove_dir_all(&cluster.nodes[2].dir).unwrap();
    last = publish_chains(&js, 10, 20).await;

    let o = NodeOptions {
        grpc_listen: addr.clone(),
        raft: Some(harness::RaftOptions {
            id: 13,
            peers: vec![(13, addr.clone())],
            join: vec![cluster.nodes[0].grpc.to_string()],
            ..Default::default()
        }),
        ..Default::default()
    };
    cluster.add_node("kvplane-2-again", &o);
    let any = cluster.nodes[0].endpoint();
    let status = eventually(
        "the new incarnation to replace the old one",
        Duration::from_secs(30),
        || async {
            let s = kvplane_ok(&["cluster", "status", "--addr", &any]);
            let members: Vec<&str> = s.lines().filter(|l| l.starts_with("member")).collect();
            (members.len() == 3
                && members.iter().all(|l| l.ends_with("voter"))
                && members.iter().any(|l| l.contains(" 13 "))
                && !members.iter().any(|l| l.contains(" 3 ")))
            .then_some(s)
        },
    )
    .await;
    assert!(status.contains(&addr), "{status}");
    last = last.max(publish_chains(&js, 20, 30).await);
    cluster.all_agree(&[0, 1, 3], last).await;
}

/// A learner set under `[raft.kubernetes]`, as a StatefulSet in another cluster runs it: pods
/// `kvplane-b-0` and `kvplane-b-1` ask the members they are given (`join`) under their own
/// published names (`advertise_addr`), each with an id chosen on its volume - not `ordinal + 1`,
/// which the members' own pods hold - and ordinal 0 starts no cluster of its own. Both
/// replicate and agree with the voters; b-0 restarted keeps its id and its place. Scaled down
/// to one pod (its own cluster's API server says so, a fake one here that b-0 reads through its
/// kubeconfig; the voters cannot read it), b-1 leaves the membership, asked by b-0 through the
/// members it joined.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_learner_set_under_kubernetes_joins_under_ids_and_names_of_its_own_and_leaves_when_scaled_down()
 {
    let (mut cluster, js) = started(&NodeOptions::default()).await;
    let mut last = publish_chains(&js, 0, 10).await;
    let replicas = std::sync::Arc::new(std::sync::atomic::AtomicI32::new(2));
    let kubeconfig = statefulset_api(cluster.root.path(), replicas.clone()).await;
    // Each pod on a loopback address of its own, named by its ordinal, all on one port (as a
    // StatefulSet's pods are).
    let mut addrs = Vec::new();
    let port = harness::free_port();
    for ordinal in 0..2u64 {
        let addr = format!("127.0.{ordinal}.1:{port}");
        addrs.push(addr.clone());
        let o = NodeOptions {
            grpc_listen: addr,
            raft: Some(harness::RaftOptions {
                join: vec![cluster.nodes[1].grpc.to_string()],
                learner: true,
                kubernetes: Some(format!(
                    "pod_name = \"kvplane-b-{ordinal}\"\nservice = \"kvplane-peers\"\nnamespace = \"b\"\nadvertise_addr = \"127.0.{{ordinal}}.1:{{port}}\"\nmembership_check_ms = 200\n"
                )),
                ..Default::default()
            }),
            env: vec![("KUBECONFIG".into(), kubeconfig.display().to_string())],
            ..Default::default()
        };
        cluster.add_node(&format!("kvplane-b-{ordinal}"), &o);
    }
    async fn members(node: &harness::Node) -> Option<Vec<kvplane_proto::v1::Member>> {
        node.admin()
            .await
            .cluster_status(kvplane_proto::v1::StatusRequest::default())
            .await
            .ok()
            .map(|r| r.into_inner().members)
    }
    let learners = eventually("both pods learners", Duration::from_secs(30), || async {
        let m = members(&cluster.nodes[0]).await?;
        let l: Vec<(u64, String)> = addrs
            .iter()
            .filter_map(|a| {
                m.iter()
                    .find(|x| x.addr == *a && !x.voter)
                    .map(|x| (x.id, x.addr.clone()))
            })
            .collect();
        (l.len() == 2).then_some(l)
    })
    .await;
    for (ordinal, (id, _)) in learners.iter().enumerate() {
        assert!(
            *id > 1_000_000 && id % 1000 == ordinal as u64 + 1,
            "an id of its volume's, not {}: {id}",
            ordinal + 1
        );
    }
    last = last.max(publish_chains(&js, 10, 20).await);
    cluster.all_agree(&[0, 1, 2, 3, 4], last).await;

    // Restarted, b-0 keeps its id and its place, and starts nothing of its own.
    cluster.nodes[3].kill();
    cluster.nodes[3].restart();
    last = last.max(publish_chains(&js, 20, 30).await);
    cluster.all_agree(&[0, 1, 2, 3, 4], last).await;
    let m = members(&cluster.nodes[0]).await.unwrap();
    assert_eq!(m.len(), 5, "{m:?}");
    assert_eq!(m.iter().filter(|x| x.voter).count(), 3, "{m:?}");
    let s = cluster.nodes[3].cluster_status().await;
    assert_eq!(s.node, learners[0].0);

    // Scaled down to one pod: Kubernetes deletes b-1, and b-0 has it leave.
    replicas.store(1, std::sync::atomic::Ordering::SeqCst);
    cluster.nodes[4].kill();
    let m = eventually("b-1 removed", Duration::from_secs(30), || async {
        let m = members(&cluster.nodes[0]).await?;
        (!m.iter().any(|x| x.id == learners[1].0)).then_some(m)
    })
    .await;
    assert_eq!(m.len(), 4, "{m:?}");
    assert!(m.iter().any(|x| x.id == learners[0].0 && !x.voter), "{m:?}");
    // Such an ask never removes a voter, relayed or not.
    let voter = cluster.nodes[0].raft_id.unwrap();
    let refused = cluster.nodes[3]
        .admin()
        .await
        .remove_member(kvplane_proto::v1::RemoveMemberRequest {
            id: voter,
            relay: true,
            learner_only: true,
        })
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::FailedPrecondition, "{refused}");
    assert!(
        refused
            .message()
            .contains(&format!("member {voter} is a voter")),
        "{refused}"
    );
    last = last.max(publish_chains(&js, 30, 40).await);
    cluster.all_agree(&[0, 1, 2, 3], last).await;
}

/// A Kubernetes API server that answers one request, StatefulSet `kvplane-b` in namespace `b`
/// scaled to `replicas`, and a kubeconfig naming it (written in `dir`).
async fn statefulset_api(
    dir: &std::path::Path,
    replicas: std::sync::Arc<std::sync::atomic::AtomicI32>,
) -> std::path::PathBuf {
    let app = axum::Router::new().route(
        "/apis/apps/v1/namespaces/b/statefulsets/kvplane-b",
        axum::routing::get(move || {
            let n = replicas.load(std::sync::atomic::Ordering::SeqCst);
            async move {
                axum::Json(serde_json::json!({
                    "apiVersion": "apps/v1", "kind": "StatefulSet",
                    "metadata": {"name": "kvplane-b", "namespace": "b"},
                    "spec": {"replicas": n, "serviceName": "kvplane-peers",
                        "selector": {"matchLabels": {"app": "kvplane"}},
                        "template": {"metadata": {"labels": {"app": "kvplane"}}}}
                }))
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move { axum::serve(listener, app).await });
    let path = dir.join("kubeconfig");
    std::fs::write(
        &path,
        format!(
            "apiVersion: v1\nkind: Config\nclusters: [{{name: b, cluster: {{server: \"http://127.0.0.1:{port}\"}}}}]\nusers: [{{name: b, user: {{}}}}]\ncontexts: [{{name: b, context: {{cluster: b, user: b, namespace: b}}}}]\ncurrent-context: b\n"
        ),
    )
    .unwrap();
    path
}

/// A learner (`[raft] learner = true`, added through `join`): it applies the same entries as
/// the voters and answers Route from its own state, it stays a learner, and it never counts
/// toward a quorum - cut off, with one voter gone, the two voters left still commit (as four
/// voters they could not) - it catches up when healed, and with every voter gone it still
/// routes from what it holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_learner_replicates_and_routes_but_never_counts_toward_a_quorum() {
    let (mut cluster, js) = started(&NodeOptions::default()).await;
    let mut last = publish_chains(&js, 0, 10).await;
    let addr = format!("127.0.0.1:{}", harness::free_port());
    let o = NodeOptions {
        grpc_listen: addr.clone(),
        raft: Some(harness::RaftOptions {
            id: 4,
            peers: vec![(4, addr.clone())],
            join: vec![cluster.nodes[0].grpc.to_string()],
            learner: true,
            ..Default::default()
        }),
        ..Default::default()
    };
    cluster.add_node("learner", &o);
    let any = cluster.nodes[0].endpoint();
    eventually(
        "the learner in the membership",
        Duration::from_secs(30),
        || async {
            let s = kvplane_ok(&["cluster", "status", "--addr", &any]);
            s.lines()
                .any(|l| l.starts_with("member") && l.contains(" 4 ") && l.ends_with("learner"))
                .then_some(())
        },
    )
    .await;
    last = last.max(publish_chains(&js, 10, 20).await);
    cluster.all_agree(&[0, 1, 2, 3], last).await;
    for i in [3u64, 17] {
        let (w, matched) = routed_worker(&cluster.nodes[3], &prompt(i)).await.unwrap();
        assert_eq!((w, matched), (format!("w{}", i % 3), 3));
    }
    let s = kvplane_ok(&["cluster", "status", "--addr", &cluster.nodes[3].endpoint()]);
    let voters = s.lines().filter(|l| l.ends_with(" voter")).count();
    assert_eq!(voters, 3, "it asked once and stays a learner:\n{s}");
    // A voter is not made a learner by asking: it is refused, and stays a voter.
    let voter = cluster.nodes[1].grpc.to_string();
    let id = cluster.nodes[1].raft_id.unwrap().to_string();
    let out = std::process::Command::new(harness::process::kvplane_binary())
        .args([
            "cluster",
            "add",
            "--addr",
            &any,
            "--id",
            &id,
            "--member-addr",
            &voter,
        ])
        .arg("--learner")
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && said.contains(&format!("member {id} is a voter")),
        "{said}"
    );

    // The learner cut off and a voter gone: two voters of three still commit (two of four
    // would not); healed, the learner catches up.
    cluster.isolate(3).await;
    let gone = cluster.leader(&[0, 1, 2]).await.map_or(2, |l| (l + 1) % 3);
    cluster.nodes[gone].kill();
    let left: Vec<usize> = (0..3).filter(|i| *i != gone).collect();
    last = last.max(publish_chains(&js, 20, 30).await);
    cluster.all_agree(&left, last).await;
    cluster.heal().await;
    cluster.all_agree(&[left[0], left[1], 3], last).await;

    // Every voter gone: the learner routes from the state it holds.
    for i in &left {
        cluster.nodes[*i].kill();
    }
    for i in [3u64, 17, 25] {
        let (w, matched) = routed_worker(&cluster.nodes[3], &prompt(i)).await.unwrap();
        assert_eq!((w, matched), (format!("w{}", i % 3), 3));
    }
}

/// A learner that cannot reach the members at their recorded addresses - as one in another
/// cluster cannot resolve cluster A's pod names; here the fault layer cuts every call it makes
/// to a member by id - joins, writes and reads linearizably through the one address it can
/// reach (`relay_through_join`: a cuttable link to a follower, which passes each ask on to its
/// leader). The same write from a learner that does not relay fails; with the link cut the
/// relaying learner's write fails within its forward timeout; healed, it writes again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_learner_that_cannot_reach_the_leader_joins_writes_and_reads_through_a_relay() {
    use kvplane_proto::v1::{PutConfigRequest, ReadConsistency, StatusRequest};
    let (mut cluster, js) = started(&NodeOptions::default()).await;
    let last = publish_chains(&js, 0, 10).await;
    cluster.all_agree(&[0, 1, 2], last).await;
    let leader = cluster.leader(&[0, 1, 2]).await.unwrap();
    let follower = (leader + 1) % 3;
    let link = kvplane_testkit::link::Link::start(cluster.nodes[follower].grpc.port()).await;
    let voters: Vec<u64> = (0..3).map(|i| cluster.nodes[i].raft_id.unwrap()).collect();
    let learner = |id: u64, relay: bool| {
        let addr = format!("127.0.0.1:{}", harness::free_port());
        NodeOptions {
            grpc_listen: addr.clone(),
            raft: Some(harness::RaftOptions {
                id,
                peers: vec![(id, addr)],
                join: vec![format!("127.0.0.1:{}", link.port)],
                learner: true,
                relay_through_join: relay,
                ..Default::default()
            }),
            ..Default::default()
        }
    };
    cluster.add_node("relaying", &learner(4, true));
    cluster.nodes[3].block(voters.clone()).await;
    let pool = |name: &str| PutConfigRequest {
        kind: "pool".into(),
        name: name.into(),
        value: br#"{"block_size":16,"models":["m"]}"#.to_vec(),
    };
    // Joined through the relay, and caught up.
    cluster.all_agree(&[0, 1, 2, 3], last).await;
    let mut admin = cluster.nodes[3].admin().await;
    let written = admin
        .put_config(pool("relayed"))
        .await
        .unwrap()
        .into_inner()
        .index;
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
    assert!(
        s.applied_index >= written && s.config_index == written,
        "{s:?}"
    );
    let on_leader = cluster.nodes[leader].status().await;
    assert_eq!(
        on_leader.config_index, written,
        "the leader holds the write"
    );

    // A report of a request the leader routed (a gateway that failed over between Route and
    // ReportUsage) sent to the learner: handed to the relay, which forwards it to the leader,
    // where it is known.
    let routed = cluster.nodes[leader]
        .router()
        .await
        .route(kvplane_proto::v1::RouteRequest {
            request_id: "via-relay".into(),
            token_ids: prompt(3),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let report = kvplane_proto::v1::UsageReport {
        request_id: "via-relay".into(),
        routed_by: routed.routed_by,
        prompt_tokens: 48,
        completion_tokens: 4,
        observed_ttft_ms: 30.0,
        ..Default::default()
    };
    let ack = cluster.nodes[3]
        .router()
        .await
        .report_usage(report.clone())
        .await
        .unwrap()
        .into_inner();
    assert!(ack.known, "the leader knew the request: {ack:?}");

    // The link cut: no other way to the leader, so the write fails, within its timeout.
    link.cut();
    let started_at = Instant::now();
    let err = admin.put_config(pool("cut")).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unavailable, "{err}");
    assert!(err.message().contains("relay"), "{err}");
    assert!(started_at.elapsed() < Duration::from_secs(6));
    link.heal();
    let again = admin.put_config(pool("healed")).await.unwrap().into_inner();
    assert!(again.index > written);

    // A learner that does not relay, cut off the same way, cannot write.
    let plain = learner(5, false);
    let plain_addr = plain.grpc_listen.clone();
    let direct = cluster.nodes[follower].grpc.to_string();
    let plain = NodeOptions {
        raft: plain.raft.map(|r| harness::RaftOptions {
            join: vec![direct],
            ..r
        }),
        ..plain
    };
    cluster.add_node("plain", &plain);
    let any = cluster.nodes[leader].endpoint();
    eventually(
        "the plain learner joined",
        Duration::from_secs(30),
        || async {
            kvplane_ok(&["cluster", "status", "--addr", &any])
                .contains(&plain_addr)
                .then_some(())
        },
    )
    .await;
    cluster.nodes[4].block(voters).await;
    let err = cluster.nodes[4]
        .admin()
        .await
        .put_config(pool("plain"))
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unavailable, "{err}");
    assert!(
        err.message().contains("cut off by fault injection"),
        "{err}"
    );
    // Nor hand a report on: a request the leader routed, reported to it, is not forwarded,
    // and the leader does not learn of the report through it.
    let routed = cluster.nodes[leader]
        .router()
        .await
        .route(kvplane_proto::v1::RouteRequest {
            request_id: "not-via-relay".into(),
            token_ids: prompt(4),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let ack = cluster.nodes[4]
        .router()
        .await
        .report_usage(kvplane_proto::v1::UsageReport {
            request_id: "not-via-relay".into(),
            routed_by: routed.routed_by,
            ..report
        })
        .await
        .unwrap()
        .into_inner();
    assert!(!ack.known, "{ack:?}");
    let m = cluster.nodes[4].metrics().await;
    assert!(
        m.contains(r#"kvplane_usage_reports_total{outcome="not_forwarded"} 1"#),
        "{m}"
    );
}

/// A relayed write whose answer is lost on the way back (the link is cut once the leader has
/// applied it, while the answer is still held by the link's delay) is reported with its outcome
/// unknown, and is never sent again: healed at once, the link would let a retry through, and
/// the next write is the entry right after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relayed_write_whose_answer_is_lost_is_reported_unknown_and_never_sent_again() {
    use kvplane_proto::v1::PutConfigRequest;
    let (mut cluster, _js) = started(&NodeOptions::default()).await;
    let leader = cluster.leader(&[0, 1, 2]).await.unwrap();
    let follower = (leader + 1) % 3;
    let link = kvplane_testkit::link::Link::start_delayed(
        cluster.nodes[follower].grpc.port(),
        Duration::from_millis(400),
    )
    .await;
    let addr = format!("127.0.0.1:{}", harness::free_port());
    let o = NodeOptions {
        grpc_listen: addr.clone(),
        raft: Some(harness::RaftOptions {
            id: 4,
            peers: vec![(4, addr)],
            join: vec![format!("127.0.0.1:{}", link.port)],
            learner: true,
            relay_through_join: true,
            ..Default::default()
        }),
        ..Default::default()
    };
    cluster.add_node("relaying", &o);
    let voters: Vec<u64> = (0..3).map(|i| cluster.nodes[i].raft_id.unwrap()).collect();
    cluster.nodes[3].block(voters).await;
    let any = cluster.nodes[leader].endpoint();
    eventually("the learner joined", Duration::from_secs(30), || async {
        kvplane_ok(&["cluster", "status", "--addr", &any])
            .lines()
            .any(|l| l.contains(" 4 ") && l.ends_with("learner"))
            .then_some(())
    })
    .await;
    let before = cluster.nodes[leader].status().await.config_index;
    let mut admin = cluster.nodes[3].admin().await;
    let write = tokio::spawn(async move {
        admin
            .put_config(PutConfigRequest {
                kind: "pool".into(),
                name: "once".into(),
                value: br#"{"block_size":16,"models":["m"]}"#.to_vec(),
            })
            .await
    });
    let written = eventually(
        "the leader applied the write",
        Duration::from_secs(10),
        || async {
            let i = cluster.nodes[leader].status().await.config_index;
            (i > before).then_some(i)
        },
    )
    .await;
    link.cut();
    link.heal();
    let err = write.await.unwrap().unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unavailable, "{err}");
    assert!(err.message().contains("outcome is unknown"), "{err}");
    // A retry would have been applied well within this: the link passes writes again.
    let probe = cluster.nodes[3]
        .admin()
        .await
        .put_config(PutConfigRequest {
            kind: "pool".into(),
            name: "after".into(),
            value: br#"{"block_size":16,"models":["m"]}"#.to_vec(),
        })
        .await
        .unwrap()
        .into_inner()
        .index;
    // Nothing else writes to this cluster: the probe is the next entry after the write.
    assert_eq!(probe, written + 1, "the lost write was sent again");
}
