//! Many clusters, one state: another cluster's engines publish to that cluster's own NATS, and
//! the leader consumes its stream as an ingest source of its own (`[[ingest.clusters]]`) with
//! its own position in the replicated state. Real nats-servers (one per cluster) and a real
//! node; the link to the other cluster runs through a relay the test cuts and heals.

#![allow(clippy::unwrap_used)]

mod harness;

use std::time::Duration;

use harness::link::Link;
use harness::{
    Cluster, Nats, NodeOptions, chain, eventually, exported_state, prompt, publish, words,
};
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

/// A one-node cluster that reads cluster B's stream (source `cluster-b`) through a link.
async fn reading_b_through_a_link(b_nats: &Nats) -> (Link, Cluster) {
    let link = Link::start(b_nats.port).await;
    let o = NodeOptions {
        extra_toml: format!(
            "[[ingest.clusters]]\nname = \"cluster-b\"\nnats_url = \"nats://127.0.0.1:{}\"\n",
            link.port
        ),
        ..Default::default()
    };
    (link, Cluster::start_with(1, &o))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_clusters_stream_is_a_source_of_its_own_and_a_cut_link_delays_only_its_events() {
    // Cluster B: its own NATS, reached through a link the test can cut.
    let b_nats = Nats::start();
    let (link, cluster) = reading_b_through_a_link(&b_nats).await;
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

/// A message the server hands to the leader's consumer while the link to B drops every byte
/// (the connection stays open) is lost in delivery: the consumer has no acks, and the server
/// counts it delivered. When the link is cut and healed, the client reconnects and nothing
/// shows the gap until a later message - maybe never. The leader sees its position behind the
/// stream's end with nothing arriving (`[ingest] stall_after_ms`), starts consuming again from
/// its position and applies the message, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_lost_in_delivery_on_a_failing_link_is_read_again_from_the_position() {
    use futures::StreamExt;
    let b_nats = Nats::start();
    let (link, cluster) = reading_b_through_a_link(&b_nats).await;
    let node = &cluster.nodes[0];
    let b = b_nats.jetstream().await;
    let stream = ensure_stream(&b, "KVPLANE").await.unwrap();
    stored(&b, "b0", 1).await;
    eventually(
        "b0's first chain indexed",
        Duration::from_secs(30),
        || async { (cached(node, 1).await == ("b0".to_owned(), 3)).then_some(()) },
    )
    .await;

    // The link swallows; the server delivers the next message into it.
    link.swallow();
    let lost = stored(&b, "b0", 2).await;
    eventually(
        "B's server to count the message delivered",
        Duration::from_secs(10),
        || async {
            let infos: Vec<_> = stream.consumers().collect().await;
            infos
                .into_iter()
                .flatten()
                .any(|c| c.delivered.stream_sequence >= lost)
                .then_some(())
        },
    )
    .await;
    link.cut();
    link.heal();
    let healed = std::time::Instant::now();

    eventually(
        "the lost message applied",
        Duration::from_secs(15),
        || async { (cached(node, 2).await == ("b0".to_owned(), 3)).then_some(()) },
    )
    .await;
    eprintln!(
        "the lost message applied {} ms after the heal",
        healed.elapsed().as_millis()
    );
    assert_eq!(
        exported_state(node)
            .await
            .position(&Source::named("cluster-b")),
        lost
    );
    let m = node.metrics().await;
    assert!(
        m.contains(r#"kvplane_ingest_messages_total{kind="kv"} 2"#),
        "{m}"
    );
    assert!(
        m.contains(r#"kvplane_ingest_consumer_stalls_total{source="cluster-b"} 1"#),
        "{m}"
    );
}

/// Worker sets `gpu-a`, `gpu-b`, `gpu-c` (model m, each labelled with its cluster, all slow to
/// prefill: 2,000 tokens/s) behind one public model `m`.
const THREE_CLUSTERS: &str = "apiVersion: kvplane.io/v1alpha1
kind: InferenceWorkerSet
metadata: {name: gpu-a}
spec: {model: m, prefillTokensPerSecond: 2000, labels: {kvplane.io/cluster: a}}
---
apiVersion: kvplane.io/v1alpha1
kind: InferenceWorkerSet
metadata: {name: gpu-b}
spec: {model: m, prefillTokensPerSecond: 2000, labels: {kvplane.io/cluster: b}}
---
apiVersion: kvplane.io/v1alpha1
kind: InferenceWorkerSet
metadata: {name: gpu-c}
spec: {model: m, prefillTokensPerSecond: 2000, labels: {kvplane.io/cluster: c}}
---
apiVersion: kvplane.io/v1alpha1
kind: InferencePool
metadata: {name: all}
spec: {workerSets: [gpu-a, gpu-b, gpu-c]}
---
apiVersion: kvplane.io/v1alpha1
kind: GatewayBackend
metadata: {name: m}
spec: {publicModel: m, backends: [{pool: all}]}
";

/// The same three clusters with real processes at the edge: a simulated engine and its bridge
/// in each cluster (publishing to that cluster's NATS), and a gateway in each that asks only
/// its own cluster's replica (A's a voter, B's and C's their learner). The engines say what
/// they served (each its own request count, besides the gateway's header), not kvplane:
/// - a chat whose 1,200-word system prompt C's engine caches, sent to B's gateway, is served by
///   C's engine from its cache (the prefill saved is worth the 100 ms); one whose 30-word system
///   prompt C's engine caches goes to B's own engine;
/// - a prompt cached nowhere stays in each gateway's own cluster, and in B for a gateway of B's
///   that asks A's replica (`--cluster b`);
/// - B's gateway's usage reports are settled on B's learner, where its requests were routed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateways_in_three_clusters_reach_another_clusters_engine_only_when_its_cache_is_worth_the_link()
 {
    use serde_json::json;
    let t = three_clusters(&THREE_CLUSTERS.replace(": m,", ": sim-8b,")).await;
    let cluster = &t.cluster;
    let dir = tempfile::tempdir().unwrap();
    let urls = [cluster.nats.url(), t.nats.0.url(), t.nats.1.url()];
    let engines: Vec<harness::Engine> = ["a", "b", "c"]
        .iter()
        .zip(&urls)
        .map(|(x, url)| {
            harness::Engine::start_with(
                dir.path(),
                url,
                &format!("{x}0"),
                &harness::EngineOptions {
                    pool: format!("gpu-{x}"),
                    ..Default::default()
                },
            )
        })
        .collect();
    for i in [t.leader, B, C] {
        harness::wait_workers_up(&cluster.nodes[i], 3).await;
    }
    let gateway_procs: Vec<_> = [t.leader, B, C]
        .iter()
        .zip(["a", "b", "c"])
        .map(|(&i, x)| {
            harness::gateway(
                &cluster.nodes[i].endpoint(),
                dir.path().join(format!("gateway-{x}.log")),
            )
        })
        .collect();
    let gateways: Vec<String> = gateway_procs
        .iter()
        .map(|g| format!("http://{}/v1/chat/completions", g.field("http")))
        .collect();
    let chat = |system: &str, q: &str| {
        json!({"model": "sim-8b", "max_tokens": 4, "messages": [
            {"role": "system", "content": system}, {"role": "user", "content": q}]})
    };
    let http = reqwest::Client::new();
    let send = |url: &str, body: &serde_json::Value| {
        let req = http.post(url).header("x-tenant", "t1").json(body);
        let engines = &engines;
        async move {
            let served = || {
                futures::future::join_all(
                    engines
                        .iter()
                        .map(|e| e.metric("vllm:request_success_total")),
                )
            };
            let before = served().await;
            let r = req.send().await.unwrap();
            assert!(r.status().is_success(), "{}", r.status());
            let worker = r.headers()["x-kvplane-worker"].to_str().unwrap().to_owned();
            r.bytes().await.unwrap();
            // The engine that served it says so itself: the one the gateway's header names.
            let by = eventually("an engine to count it", Duration::from_secs(10), || async {
                let after = served().await;
                let up: Vec<usize> = (0..3).filter(|&i| after[i] > before[i]).collect();
                (up.len() == 1).then(|| up[0])
            })
            .await;
            assert_eq!(worker, ["gpu-a/a0", "gpu-b/b0", "gpu-c/c0"][by]);
            worker
        }
    };
    let explained = |node: usize, body: &serde_json::Value| {
        let request = kvplane_proto::v1::RouteRequest {
            body: serde_json::to_vec(body).unwrap(),
            ..Default::default()
        };
        decided_for(&cluster.nodes[node], request)
    };
    let c_engine = format!("{}/v1/chat/completions", engines[2].http);

    // C's engine caches a long system prompt (warmed directly); B's learner learns it.
    let long = words("long-", 1200);
    send_direct(&http, &c_engine, &chat(&long, "first question")).await;
    let second = chat(&long, "a second question");
    eventually(
        "B's learner to know C's cache",
        Duration::from_secs(30),
        || async {
            let (w, matched) = explained(B, &second).await;
            (w == "gpu-c/c0" && matched >= 70).then_some(())
        },
    )
    .await;
    let hits = engines[2].metric("vllm:prefix_cache_hits_total").await;
    assert_eq!(send(&gateways[1], &second).await, "gpu-c/c0");
    let served = engines[2].metric("vllm:prefix_cache_hits_total").await - hits;
    assert!(
        served >= 1120.0,
        "C's engine served {served} tokens from its cache"
    );

    // A short one cached there too: known in B, not worth the link.
    let short = words("short-", 30);
    send_direct(&http, &c_engine, &chat(&short, "first question")).await;
    let again = chat(&short, "a second question");
    eventually(
        "C's learner to know it",
        Duration::from_secs(30),
        || async {
            let (w, matched) = explained(C, &again).await;
            (w == "gpu-c/c0" && matched >= 1).then_some(())
        },
    )
    .await;
    cluster.all_agree(&[0, 1, 2, B, C], 0).await;
    assert_eq!(send(&gateways[1], &again).await, "gpu-b/b0");

    // Cached nowhere: each gateway's own cluster.
    for (g, worker) in gateways.iter().zip(["gpu-a/a0", "gpu-b/b0", "gpu-c/c0"]) {
        let fresh = chat(&words(&format!("fresh-{worker}-"), 40), "a question");
        assert_eq!(&send(g, &fresh).await, worker);
    }

    // A gateway of B's that fails over to A's replica says where it runs: decided as from B.
    let b_at_a = harness::gateway_with(
        &cluster.nodes[t.leader].endpoint(),
        &["--cluster".to_owned(), "b".to_owned()],
        dir.path().join("gateway-b-at-a.log"),
    );
    let fresh = chat(&words("fresh-b-at-a-", 40), "a question");
    let url = format!("http://{}/v1/chat/completions", b_at_a.field("http"));
    assert_eq!(send(&url, &fresh).await, "gpu-b/b0");

    // B's gateway reported its three requests to B's learner, which routed them.
    eventually(
        "B's reports settled on B's learner",
        Duration::from_secs(10),
        || async {
            let m = cluster.nodes[B].metrics().await;
            m.contains(r#"kvplane_usage_reports_total{outcome="known"} 3"#)
                .then_some(())
        },
    )
    .await;
}

/// A replica in cluster b told nothing of the link to cluster c (`measure_rtt`, no figures)
/// measures it from its gateway's first-token reports and c's engine's own TTFT histogram:
/// c's engine is reached only through a link that holds each byte 40 ms each way (the bridge
/// announces the link's address), so the gateway sees each first token 80 ms after the engine
/// does - the reference is the delay the test puts on the link, not anything kvplane computes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_measures_the_round_trip_to_another_clusters_engine_behind_a_delayed_link() {
    use serde_json::json;
    let one_way = Duration::from_millis(40);
    let policies = tempfile::tempdir().unwrap();
    std::fs::write(
        policies.path().join("fleet.yaml"),
        concat!(
            "apiVersion: kvplane.io/v1alpha1\nkind: InferenceWorkerSet\nmetadata: {name: near}\n",
            "spec: {model: sim-8b, blockSize: 16, labels: {kvplane.io/cluster: b}}\n---\n",
            "apiVersion: kvplane.io/v1alpha1\nkind: InferenceWorkerSet\nmetadata: {name: far}\n",
            "spec: {model: sim-8b, blockSize: 16, labels: {kvplane.io/cluster: c}}\n---\n",
            "apiVersion: kvplane.io/v1alpha1\nkind: GatewayBackend\nmetadata: {name: to-c}\n",
            "spec: {publicModel: to-c, backends: [{workerSet: far}]}\n",
        ),
    )
    .unwrap();
    let cluster = Cluster::start_with(
        1,
        &NodeOptions {
            policy_dir: Some(policies.path().to_owned()),
            extra_toml: "[locality]\ncluster = \"b\"\nmeasure_rtt = true\n".into(),
            ..Default::default()
        },
    );
    let node = &cluster.nodes[0];
    let dir = tempfile::tempdir().unwrap();
    let far_http = harness::free_port();
    let link = Link::start_delayed(far_http, one_way).await;
    let _near = harness::Engine::start_for(
        dir.path(),
        &cluster.nats.url(),
        "near",
        "b0",
        [0, 0, 0],
        &[],
    );
    let _far = harness::Engine::start_with(
        dir.path(),
        &cluster.nats.url(),
        "c0",
        &harness::EngineOptions {
            pool: "far".into(),
            ports: [far_http, 0, 0],
            bridge_args: vec![
                "--announce-address".into(),
                format!("http://127.0.0.1:{}", link.port),
            ],
            ..Default::default()
        },
    );
    harness::wait_workers_up(node, 2).await;
    let far_network = || async {
        let x = node
            .router()
            .await
            .explain(kvplane_proto::v1::RouteRequest {
                body: serde_json::to_vec(&json!({"model": "sim-8b", "prompt": "a b c"})).unwrap(),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        x.candidates
            .iter()
            .find(|c| c.endpoint.as_ref().unwrap().pool == "far")
            .unwrap()
            .network_ms
    };
    assert_eq!(far_network().await, 0.0, "told nothing, nothing added");

    // Streamed chats for c's engine through b's gateway: each first token is reported.
    let gateway = harness::gateway(&node.endpoint(), dir.path().join("gateway.log"));
    let url = format!("http://{}/v1/chat/completions", gateway.field("http"));
    let http = reqwest::Client::new();
    let measured = || async {
        harness::metric_value(&node.metrics().await, "kvplane_locality_measured_rtt_ms")
    };
    let mut sent = 0;
    while measured().await == 0.0 {
        assert!(sent < 60, "no round trip measured after {sent} requests");
        let body = json!({"model": "to-c", "max_tokens": 2, "stream": true,
            "messages": [{"role": "user", "content": words(&format!("q{sent}-"), 20)}]});
        let r = http.post(&url).json(&body).send().await.unwrap();
        assert!(r.status().is_success(), "{}", r.status());
        assert_eq!(r.headers()["x-kvplane-worker"], "far/c0");
        r.bytes().await.unwrap();
        sent += 1;
    }
    let rtt = measured().await;
    eprintln!("measured {rtt:.1} ms for an 80 ms link after {sent} requests");
    assert!(
        (70.0..=110.0).contains(&rtt),
        "measured {rtt} ms for an 80 ms link after {sent} requests"
    );
    // Decisions use it from then on.
    assert!(
        (far_network().await - rtt).abs() < 1e-6,
        "{} vs {rtt}",
        far_network().await
    );
}

/// Sends a chat straight to an engine (not through kvplane), as a warm-up.
async fn send_direct(http: &reqwest::Client, url: &str, body: &serde_json::Value) {
    let r = http.post(url).json(body).send().await.unwrap();
    assert!(r.status().is_success(), "{}", r.status());
}

/// Replicas `B` and `C` of [`three_clusters`]: the learners of clusters B and C.
const B: usize = 3;
const C: usize = 4;

/// Three clusters on loopback (see the test below): A's three voters, a learner in each of B
/// and C, each cluster its own nats-server with a `KVPLANE` stream.
struct ThreeClusters {
    cluster: Cluster,
    leader: usize,
    /// JetStream of A's, B's and C's NATS, reached directly (as their own engines' bridges do).
    js: [async_nats::jetstream::Context; 3],
    /// B's and C's nats-servers.
    nats: (Nats, Nats),
    /// The leader's links to B's and C's NATS.
    to_nats: (Link, Link),
    /// Each learner's links (into it, and out of it to A), B's first.
    links: Vec<(Link, Link)>,
    _dirs: (tempfile::TempDir, tempfile::TempDir),
}

/// Starts [`ThreeClusters`] with `policy` (YAML policy objects) on every replica; every link
/// between clusters delays each byte 10 ms each way.
async fn three_clusters(policy: &str) -> ThreeClusters {
    let one_way = Duration::from_millis(10);
    let policies = tempfile::tempdir().unwrap();
    std::fs::write(policies.path().join("fleet.yaml"), policy).unwrap();
    let (b_nats, c_nats) = (Nats::start(), Nats::start());
    let to_nats = (
        Link::start_delayed(b_nats.port, one_way).await,
        Link::start_delayed(c_nats.port, one_way).await,
    );
    let o = NodeOptions {
        policy_dir: Some(policies.path().to_owned()),
        extra_toml: format!(
            "[locality]\ncluster = \"a\"\ndefault_rtt_ms = 100\n\n[[ingest.clusters]]\nname = \"cluster-b\"\nnats_url = \"nats://127.0.0.1:{}\"\n\n[[ingest.clusters]]\nname = \"cluster-c\"\nnats_url = \"nats://127.0.0.1:{}\"\n",
            to_nats.0.port, to_nats.1.port
        ),
        ..Default::default()
    };
    let (js_b, js_c) = (b_nats.jetstream().await, c_nats.jetstream().await);
    for js in [&js_b, &js_c] {
        ensure_stream(js, "KVPLANE").await.unwrap();
    }
    let (mut cluster, js_a) = harness::started(&o).await;
    let leader = eventually("a leader", Duration::from_secs(20), || {
        cluster.leader(&[0, 1, 2])
    })
    .await;
    let follower = (leader + 1) % 3;
    let voters: Vec<u64> = (0..3).map(|i| cluster.nodes[i].raft_id.unwrap()).collect();

    // A learner in each of B and C, reached and reaching A only through delayed links.
    let mut links = Vec::new();
    let root = tempfile::tempdir().unwrap();
    for (id, name, nats) in [(4u64, "b", &b_nats), (5, "c", &c_nats)] {
        let base = NodeOptions {
            policy_dir: Some(policies.path().to_owned()),
            extra_toml: format!("[locality]\ncluster = \"{name}\"\ndefault_rtt_ms = 100\n"),
            ..Default::default()
        };
        let (lo, inbound, outbound) =
            harness::remote_learner(id, cluster.nodes[follower].grpc.port(), one_way, base).await;
        let node = harness::Node::start(
            &format!("learner-{name}"),
            &root.path().join(name),
            &nats.url(),
            &lo,
        );
        node.block(voters.clone()).await;
        cluster.nodes.push(node);
        links.push((inbound, outbound));
    }
    ThreeClusters {
        cluster,
        leader,
        js: [js_a, js_b, js_c],
        nats: (b_nats, c_nats),
        to_nats,
        links,
        _dirs: (policies, root),
    }
}

/// Where a request for model m with `tokens` goes on `node` (Explain: nothing recorded), and
/// the blocks matched there.
async fn decided(node: &harness::Node, tokens: &[u32]) -> (String, u32) {
    decided_for(
        node,
        kvplane_proto::v1::RouteRequest {
            model: "m".into(),
            token_ids: tokens.to_vec(),
            ..Default::default()
        },
    )
    .await
}

/// Where `request` goes on `node` (Explain), as `pool/worker`, and the blocks matched there.
async fn decided_for(
    node: &harness::Node,
    request: kvplane_proto::v1::RouteRequest,
) -> (String, u32) {
    use kvplane_proto::v1::route_response::Decision;
    let mut c = kvplane_proto::v1::router_client::RouterClient::connect(node.endpoint())
        .await
        .unwrap();
    let r = c
        .explain(request)
        .await
        .unwrap()
        .into_inner()
        .decision
        .unwrap_or_default();
    match r.decision {
        Some(Decision::Endpoint(e)) => (format!("{}/{}", e.pool, e.worker_id), r.matched_blocks),
        other => (format!("{other:?}"), 0),
    }
}

/// `n` tokens of prompt `i`.
fn long_prompt(i: u64, n: u32) -> Vec<u32> {
    (0..n).map(|t| i as u32 * 100_000 + t).collect()
}

/// Three clusters on loopback, each with its own nats-server and engines: A holds the three
/// voters, B and C one learner each (`[locality]` its own cluster, 100 ms to the others;
/// `relay_through_join`). Every path between clusters runs through a link that delays each
/// byte 10 ms each way: the leader reading B's and C's streams, each learner's relay into A,
/// and A's replication to each learner (whose direct calls to A's members are cut, as pod
/// names of A do not resolve in B or C).
///
/// - A prefix cached on an engine in C is known to B's learner and routed to from B when the
///   prefill it saves (4,096 tokens, about 2 s) is worth the 100 ms; a short prefix cached
///   there (48 tokens: 24 ms of prefill, 48 ms with what it would delay after it) is not: B's
///   own engine.
/// - B cut off (its stream, its relay and A's replication to it): B's learner goes on routing
///   from the state it holds, and B's engine's event waits in B's stream.
///
/// Prints the events' lag from C's stream to B's learner and Route's latency on B's learner
/// and on a voter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_clusters_share_one_index_route_by_locality_and_a_cut_cluster_routes_on() {
    use std::time::Instant;
    let t = three_clusters(THREE_CLUSTERS).await;
    let (cluster, leader, links) = (&t.cluster, t.leader, &t.links);
    let [js_a, js_b, js_c] = &t.js;
    let (to_b_nats, _) = &t.to_nats;
    let (b, c) = (B, C);

    // Engines: a0 in A, b0 in B, c0 in C. c0 caches a long prompt and a short one.
    let up = |set: &str, w: &str| {
        (
            kvplane_ingest::worker_subject(set, w),
            format!(r#"{{"status":"up","address":"http://{w}:8000"}}"#).into_bytes(),
        )
    };
    for (js, (subject, body)) in [
        (&js_a, up("gpu-a", "a0")),
        (&js_b, up("gpu-b", "b0")),
        (&js_c, up("gpu-c", "c0")),
    ] {
        publish(js, subject, body).await;
    }
    let long = long_prompt(1, 4096);
    let short = long_prompt(2, 48);
    let published = Instant::now();
    publish(js_c, kv_subject("gpu-c", "c0"), chain(&long, 7)).await;
    publish(js_c, kv_subject("gpu-c", "c0"), chain(&short, 8)).await;
    eventually(
        "c0's prefixes known to B's learner",
        Duration::from_secs(60),
        || async {
            (decided(&cluster.nodes[b], &long).await == ("gpu-c/c0".to_owned(), 256)).then_some(())
        },
    )
    .await;
    let lag = published.elapsed();
    // B's own engine known to B's learner (B's stream is read apart from C's): a prompt
    // cached nowhere stays in B.
    eventually(
        "b0 known to B's learner",
        Duration::from_secs(30),
        || async {
            (decided(&cluster.nodes[b], &long_prompt(4, 48)).await.0 == "gpu-b/b0").then_some(())
        },
    )
    .await;
    // Worth the link: the long prefix goes to C. Not worth it: the short one stays in B.
    assert_eq!(decided(&cluster.nodes[b], &short).await.0, "gpu-b/b0");
    // Asked in C itself, both are local.
    eventually(
        "C's learner knows c0's prefixes",
        Duration::from_secs(30),
        || async {
            (decided(&cluster.nodes[c], &short).await == ("gpu-c/c0".to_owned(), 3)).then_some(())
        },
    )
    .await;

    // B cut off: its stream, its relay into A and A's replication to it.
    let (b_in, b_out) = &links[0];
    to_b_nats.cut();
    b_in.cut();
    b_out.cut();
    let b_short = long_prompt(3, 48);
    let b_last = publish(js_b, kv_subject("gpu-b", "b0"), chain(&b_short, 9)).await;
    // B's learner routes from what it holds: C's long prefix, B's own engine for the rest.
    assert_eq!(decided(&cluster.nodes[b], &long).await.0, "gpu-c/c0");
    assert_eq!(
        decided(&cluster.nodes[b], &b_short).await,
        ("gpu-b/b0".to_owned(), 0)
    );
    // Healed: the leader reads B's waiting event, once; B's learner catches up and knows it;
    // all five replicas agree on one digest.
    to_b_nats.heal();
    b_in.heal();
    b_out.heal();
    eventually(
        "the leader's position in B's stream at its end",
        Duration::from_secs(30),
        || async {
            let state = exported_state(&cluster.nodes[leader]).await;
            (state.position(&Source::named("cluster-b")) == b_last).then_some(())
        },
    )
    .await;
    eventually(
        "B's learner knows b0's prefix",
        Duration::from_secs(30),
        || async {
            (decided(&cluster.nodes[b], &b_short).await == ("gpu-b/b0".to_owned(), 3)).then_some(())
        },
    )
    .await;
    cluster.all_agree(&[0, 1, 2, b, c], 0).await;
    // Each KV message of B's and C's engines consumed once (none from A's).
    let m = cluster.nodes[leader].metrics().await;
    assert!(
        m.contains(r#"kvplane_ingest_messages_total{kind="kv"} 3"#),
        "{m}"
    );
    // Route's latency on B's learner and on a voter, same run (local reads), last: the routed
    // requests are never reported, so they stay queued on the engines they went to.
    let latency = |node: usize| {
        let endpoint = cluster.nodes[node].endpoint();
        let prompt = short.clone();
        async move {
            let mut r = kvplane_proto::v1::router_client::RouterClient::connect(endpoint)
                .await
                .unwrap();
            let mut took = Vec::new();
            for i in 0..200 {
                let started = Instant::now();
                r.route(kvplane_proto::v1::RouteRequest {
                    request_id: format!("lat-{node}-{i}"),
                    model: "m".into(),
                    token_ids: prompt.clone(),
                    ..Default::default()
                })
                .await
                .unwrap();
                took.push(started.elapsed().as_secs_f64() * 1e6);
            }
            took.sort_by(f64::total_cmp);
            (took[100], took[197])
        }
    };
    let on_learner = latency(b).await;
    let on_voter = latency(leader).await;
    eprintln!(
        "events from C's stream known to B's learner after {} ms (10 ms each way on every link); Route p50/p99 on B's learner {:.0}/{:.0} us, on the leader {:.0}/{:.0} us",
        lag.as_millis(),
        on_learner.0,
        on_learner.1,
        on_voter.0,
        on_voter.1
    );
}
