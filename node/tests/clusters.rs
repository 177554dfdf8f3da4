//! Many clusters, one state: another cluster's engines publish to that cluster's own NATS, and
//! the leader consumes its stream as an ingest source of its own (`[[ingest.clusters]]`) with
//! its own position in the replicated state. Real nats-servers (one per cluster) and a real
//! node; the link to the other cluster runs through a relay the test cuts and heals.

#![allow(clippy::unwrap_used)]

mod harness;

use std::time::Duration;

use harness::link::Link;
use harness::{Cluster, Nats, NodeOptions, chain, eventually, exported_state, prompt, publish};
use kvplane_ingest::{ensure_stream, kv_subject};
use kvplane_state::Source;

/// Publishes chain `i` (prompt `i`, salt `i + 1`) as worker `worker`'s and returns its stream
/// sequence.
async fn stored(js: &async_nats::jetstream::Context, worker: &str, i: u64) -> u64 {
    publish(js, kv_subject("default", worker), chain(&prompt(i), i + 1)).await
}

/// Where prompt `i` goes on `node` now, and the blocks matched there (any worker, 0 blocks,
/// when nothing caches it; no worker before the first is known).
async fn cached(node: &harness::Node, i: u64) -> (String, u32) {
    harness::routed_worker(node, &prompt(i))
        .await
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_clusters_stream_is_a_source_of_its_own_and_a_cut_link_delays_only_its_events() {
    // Cluster B: its own NATS, reached through a link the test can cut.
    let b_nats = Nats::start();
    let link = Link::start(b_nats.port).await;
    let o = NodeOptions {
        extra_toml: format!(
            "[[ingest.clusters]]\nname = \"cluster-b\"\nnats_url = \"nats://127.0.0.1:{}\"\n",
            link.port
        ),
        ..Default::default()
    };
    let cluster = Cluster::start_with(1, &o);
    let node = &cluster.nodes[0];
    let (a, b) = (cluster.nats.jetstream().await, b_nats.jetstream().await);
    for js in [&a, &b] {
        ensure_stream(js, "KVPLANE").await.unwrap();
    }

    // Each cluster's engine caches a prompt; the node knows both.
    stored(&a, "a0", 1).await;
    stored(&b, "b0", 2).await;
    for (i, worker) in [(1, "a0"), (2, "b0")] {
        eventually(
            &format!("{worker}'s chain indexed"),
            Duration::from_secs(30),
            || async { (cached(node, i).await == (worker.to_owned(), 3)).then_some(()) },
        )
        .await;
    }

    // The link to B is cut: A's events still arrive; B's wait in B's stream.
    link.cut();
    let b_cut = stored(&b, "b0", 4).await;
    stored(&a, "a0", 3).await;
    eventually(
        "a0's next chain indexed",
        Duration::from_secs(30),
        || async { (cached(node, 3).await == ("a0".to_owned(), 3)).then_some(()) },
    )
    .await;
    assert_eq!(
        cached(node, 4).await.1,
        0,
        "b0's chain sent after the cut is not known yet"
    );
    let m = node.metrics().await;
    assert!(
        m.contains(r#"kvplane_ingest_source_last_consumed_sequence{source="cluster-b"} 1"#),
        "{m}"
    );
    // The cut shows as B's lag unknown; the node stays ready (its own stream is consumed).
    eventually("b's lag unknown", Duration::from_secs(30), || async {
        let m = node.metrics().await;
        m.contains(r#"kvplane_ingest_source_lag_messages{source="cluster-b"} -1"#)
            .then_some(())
    })
    .await;
    assert_eq!(node.readyz().await.0, 200);

    // Healed: B's waiting events arrive, once, and each source's position is its stream's end.
    link.heal();
    let b_last = stored(&b, "b0", 5).await;
    for i in [4, 5] {
        eventually(
            &format!("b0's chain {i} after the heal"),
            Duration::from_secs(30),
            || async { (cached(node, i).await == ("b0".to_owned(), 3)).then_some(()) },
        )
        .await;
    }
    assert_eq!((b_cut, b_last), (2, 3));
    let state = exported_state(node).await;
    assert_eq!(state.position(&Source::named("cluster-b")), 3);
    assert_eq!(state.position(&Source::stream()), 2);
    eventually("b's lag measured at 0", Duration::from_secs(30), || async {
        let m = node.metrics().await;
        m.contains(r#"kvplane_ingest_source_lag_messages{source="cluster-b"} 0"#)
            .then_some(())
    })
    .await;
    // Each of the five messages consumed once: none read again after the heal.
    let m = node.metrics().await;
    assert!(
        m.contains(r#"kvplane_ingest_messages_total{kind="kv"} 5"#),
        "{m}"
    );
}
