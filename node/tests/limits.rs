//! Stated bounds on the gRPC port of a real node: each oversized input is refused with the
//! bound's name, counted in `kvplane_limit_hits_total{limit}`, and the node goes on serving
//! the calls within the bounds.

#![allow(clippy::unwrap_used)]

mod harness;

use std::time::Duration;

use futures::StreamExt;
use harness::pki::Pki;
use harness::{Cluster, NodeOptions};
use kvplane_proto::v1::route_response::Decision;
use kvplane_proto::v1::{PutConfigRequest, RejectCode, RouteRequest, StatusRequest};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn hits(metrics: &str, limit: &str) -> f64 {
    let series = format!("kvplane_limit_hits_total{{limit=\"{limit}\"}} ");
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(&series)?.parse().ok())
        .unwrap_or_else(|| panic!("no series {series}"))
}

fn request(id: &str) -> RouteRequest {
    RouteRequest {
        request_id: id.into(),
        tenant: "acme".into(),
        model: "m".into(),
        token_ids: (0..64).collect(),
        max_output_tokens: 16,
        ..Default::default()
    }
}

/// The refusal's reason, for a request the pipeline refused as invalid.
fn invalid(r: &kvplane_proto::v1::RouteResponse) -> &str {
    match &r.decision {
        Some(Decision::Rejection(j)) if j.code == RejectCode::InvalidRequest as i32 => &j.reason,
        other => panic!("expected an invalid-request refusal, got {other:?}"),
    }
}

fn pool(name: &str, value: Vec<u8>) -> PutConfigRequest {
    PutConfigRequest {
        kind: "pool".into(),
        name: name.into(),
        value,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_oversized_input_on_the_grpc_port_is_refused_counted_and_nothing_else_is_lost() {
    let cluster = Cluster::start_with(
        1,
        &NodeOptions {
            extra_toml: "[limits]\ngrpc_message_bytes = 2097152\nbody_bytes = 1048576\ntoken_ids = 1024\ntags = 4\nconfig_object_bytes = 1024\n[http]\nheader_read_ms = 300\n".into(),
            ..Default::default()
        },
    );
    let node = &cluster.nodes[0];
    let mut router = node.router().await;
    let mut admin = node.admin().await;
    let before = router.route(request("ok-0")).await.unwrap().into_inner();
    assert!(
        !matches!(&before.decision, Some(Decision::Rejection(j)) if j.code == RejectCode::InvalidRequest as i32),
        "{before:?}"
    );

    // Too many tags: refused by the pipeline, named.
    let tags = RouteRequest {
        tags: (0..5).map(|i| format!("t{i}")).collect(),
        ..request("tags")
    };
    let r = router.route(tags).await.unwrap().into_inner();
    assert!(invalid(&r).contains("limits.tags"), "{r:?}");

    // A body over body_bytes but within the message size: refused by the pipeline, named.
    let body = RouteRequest {
        body: vec![b' '; (1 << 20) + 1],
        ..request("body")
    };
    let r = router.route(body).await.unwrap().into_inner();
    assert!(invalid(&r).contains("limits.body_bytes"), "{r:?}");

    // A message over grpc_message_bytes: refused before it is read.
    let huge = RouteRequest {
        body: vec![b' '; 3 << 20],
        ..request("huge")
    };
    let e = router.route(huge).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::OutOfRange, "{e}");
    assert!(e.message().contains("too large"), "{e}");

    // A config object over config_object_bytes: refused before it reaches the log.
    let applied = |s: kvplane_proto::v1::StatusResponse| s.applied_index;
    let at = applied(
        admin
            .status(StatusRequest::default())
            .await
            .unwrap()
            .into_inner(),
    );
    let big = format!(r#"{{"block_size":16,"models":["{}"]}}"#, "m".repeat(2000));
    let e = admin
        .put_config(pool("big", big.into_bytes()))
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e}");
    assert!(e.message().contains("limits.config_object_bytes"), "{e}");
    let after = applied(
        admin
            .status(StatusRequest::default())
            .await
            .unwrap()
            .into_inner(),
    );
    assert_eq!(after, at, "a refused object wrote nothing");

    // A usage report whose ticket names more charges than a ticket may: refused, named.
    let charges = (0..17)
        .map(|i| kvplane_proto::v1::QuotaCharge {
            tenant: format!("t{i}"),
            ..Default::default()
        })
        .collect();
    let e = router
        .report_usage(kvplane_proto::v1::UsageReport {
            request_id: "forged".into(),
            ticket: Some(kvplane_proto::v1::Ticket {
                charges,
                ..Default::default()
            }),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e}");
    assert!(e.message().contains("limits.ticket_charges"), "{e}");

    // An idle keep-alive connection on the HTTP port is closed after header_read_ms, and is
    // no client over a bound.
    let mut idle = tokio::net::TcpStream::connect(node.http).await.unwrap();
    idle.write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .unwrap();
    let mut answer = Vec::new();
    let closed = tokio::time::timeout(Duration::from_secs(10), idle.read_to_end(&mut answer)).await;
    assert!(closed.is_ok(), "the idle connection is still open");
    assert!(answer.starts_with(b"HTTP/1.1 200"), "{answer:?}");
    assert_eq!(hits(&node.metrics().await, "http_header_read_ms"), 0.0);

    // A client that starts a request on the HTTP port and never finishes its head is dropped.
    let mut slow = tokio::net::TcpStream::connect(node.http).await.unwrap();
    slow.write_all(b"GET /metrics HTTP/1.1\r\nhost: x\r\n")
        .await
        .unwrap();
    let mut rest = Vec::new();
    let closed = tokio::time::timeout(Duration::from_secs(10), slow.read_to_end(&mut rest)).await;
    assert!(closed.is_ok(), "the slow client's connection is still open");

    // Every refusal counted once under its bound's name.
    let m = node.metrics().await;
    for limit in [
        "tags",
        "body_bytes",
        "grpc_message_bytes",
        "config_object_bytes",
        "ticket_charges",
        "http_header_read_ms",
    ] {
        assert_eq!(hits(&m, limit), 1.0, "{limit}");
    }
    assert_eq!(hits(&m, "name_bytes"), 0.0);

    // The node goes on serving the same connection: a request within the bounds is decided as
    // the first was, and a small config object is written.
    let again = router.route(request("ok-1")).await.unwrap().into_inner();
    assert_eq!(
        again.decision.as_ref().map(std::mem::discriminant),
        before.decision.as_ref().map(std::mem::discriminant)
    );
    let w = admin
        .put_config(pool(
            "small",
            br#"{"block_size":16,"models":["x"]}"#.to_vec(),
        ))
        .await
        .unwrap()
        .into_inner();
    assert!(w.index > at, "{w:?}");
}

fn gateway_hits(metrics: &str, limit: &str) -> f64 {
    let series = format!("kvplane_gateway_limit_hits_total{{limit=\"{limit}\"}} ");
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(&series)?.parse().ok())
        .unwrap_or_else(|| panic!("no series {series}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_serves_clients_over_tls_and_refuses_too_many_headers_and_slow_bodies() {
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::new(&dir.path().join("pki"), "kvplane test ca");
    let certs = pki.issue("gateway", "spiffe://kvplane.test/ns/edge/sa/gateway");
    // No replica answers: what is bounded here is read before any Route.
    let gateway = harness::gateway_with(
        "http://127.0.0.1:1",
        &[
            "--listen-tls-dir".into(),
            certs.display().to_string(),
            "--max-headers".into(),
            "8".into(),
            "--body-read-ms".into(),
            "300".into(),
        ],
        dir.path().join("gateway.log"),
    );
    let port = gateway.field("http").rsplit(':').next().unwrap().to_owned();
    let base = format!("https://127.0.0.1:{port}");
    let client = harness::fleet::http_client(Some(&certs.join("ca.crt")));
    let health = client.get(format!("{base}/healthz")).send().await.unwrap();
    assert_eq!(health.status().as_u16(), 200);
    // Plaintext to the TLS listener gets no answer.
    let plain = reqwest::get(format!("http://127.0.0.1:{port}/healthz")).await;
    assert!(plain.is_err(), "{plain:?}");

    // Too many headers: 431, and the connection closed.
    let mut many = client.get(format!("{base}/healthz"));
    for i in 0..9 {
        many = many.header(format!("x-extra-{i}"), "1");
    }
    assert_eq!(many.send().await.unwrap().status().as_u16(), 431);

    // A body that starts and stalls: 408 once --body-read-ms has passed.
    let stalled = futures::stream::iter([Ok::<_, std::io::Error>(b"{\"model\": ".to_vec())])
        .chain(futures::stream::pending());
    let r = client
        .post(format!("{base}/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(reqwest::Body::wrap_stream(stalled))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 408);
    let body: serde_json::Value = r.json().await.unwrap();
    assert_eq!(body["error"]["code"], "request_timeout", "{body}");

    // Each counted under its bound; the gateway goes on serving.
    let m = client
        .get(format!("{base}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert_eq!(gateway_hits(&m, "http_headers"), 1.0);
    assert_eq!(gateway_hits(&m, "body_read_ms"), 1.0);
    assert_eq!(gateway_hits(&m, "body_bytes"), 0.0);
    let again = client.get(format!("{base}/healthz")).send().await.unwrap();
    assert_eq!(again.status().as_u16(), 200);
}

fn laughs() -> String {
    let mut doc = String::from("a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]\n");
    for i in 1..10 {
        let p = i - 1;
        let refs = vec![format!("*a{p}"); 10].join(", ");
        doc.push_str(&format!("a{i}: &a{i} [{refs}]\n"));
    }
    doc
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_policy_file_over_its_bounds_is_a_counted_problem_and_the_catalog_stays() {
    let policies = tempfile::tempdir().unwrap();
    std::fs::write(
        policies.path().join("fleet.yaml"),
        "apiVersion: kvplane.io/v1alpha1\nkind: InferenceWorkerSet\nmetadata: {name: gpu}\nspec: {model: sim-8b}\n",
    )
    .unwrap();
    let cluster = Cluster::start_with(
        1,
        &NodeOptions {
            policy_dir: Some(policies.path().to_owned()),
            pools: vec![],
            extra_toml: "[limits]\npolicy_file_bytes = 4096\npolicy_file_nodes = 10000\n".into(),
            ..Default::default()
        },
    );
    let node = &cluster.nodes[0];
    let models = || async {
        let mut r = node.router().await;
        let m = r
            .models(kvplane_proto::v1::ModelsRequest::default())
            .await
            .unwrap();
        m.into_inner()
            .models
            .into_iter()
            .map(|m| m.id)
            .collect::<Vec<_>>()
    };
    harness::eventually(
        "the worker set is applied",
        Duration::from_secs(20),
        || async { models().await.contains(&"sim-8b".to_owned()).then_some(()) },
    )
    .await;
    let metric = |m: &str, name: &str| harness::metric_value(m, name);
    // A document that expands without bound, then a file over the size bound: each read is
    // refused with the bound named, counted, and the catalog stays as it was.
    for (file, text, words) in [
        (
            "laughs.yaml",
            laughs(),
            "(a node's limits.policy_file_nodes)",
        ),
        (
            "big.yaml",
            format!("# {}\n", "é".repeat(2_500)),
            "over the limit of 4096 bytes (a node's limits.policy_file_bytes)",
        ),
    ] {
        let before = metric(
            &node.metrics().await,
            "kvplane_policy_source_invalid_reads_total",
        );
        std::fs::write(policies.path().join(file), text).unwrap();
        harness::eventually(
            "the read is refused, the bound named",
            Duration::from_secs(20),
            || async {
                let m = node.metrics().await;
                let log = std::fs::read_to_string(node.dir.join("node.1.log")).unwrap();
                (metric(&m, "kvplane_policy_source_invalid_reads_total") > before
                    && metric(&m, "kvplane_policy_source_problems") == 1.0
                    && log.contains(words))
                .then_some(())
            },
        )
        .await;
        assert_eq!(models().await, vec!["sim-8b".to_owned()]);
        std::fs::remove_file(policies.path().join(file)).unwrap();
    }
}
