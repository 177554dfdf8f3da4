//! TLS and identities with real processes and certificates from a real CA (rcgen through
//! rustls): who may route for which tenant, who may write config or call Raft, and a member
//! whose certificate another CA signed.

#![allow(clippy::unwrap_used)]

mod harness;

use std::path::Path;
use std::time::Duration;

use harness::pki::{MEMBER, NodeTls, OPERATOR, Pki};
use harness::{Cluster, Engine, NodeOptions, RaftOptions, eventually};
use kvplane_proto::v1::route_response::Decision;
use kvplane_proto::v1::{PutConfigRequest, RouteRequest, StatusRequest};

const GATEWAY_A: &str = "spiffe://kvplane.test/ns/cluster-a/sa/gateway";
const GATEWAY_B: &str = "spiffe://kvplane.test/ns/cluster-b/sa/gateway";
const CONFIG_WRITER: &str = "spiffe://kvplane.test/ns/ops/sa/config-writer";

fn put_pool(name: &str) -> PutConfigRequest {
    PutConfigRequest {
        kind: "pool".into(),
        name: name.into(),
        value: br#"{"block_size":16,"models":["other"]}"#.to_vec(),
    }
}

/// A worker set listing one engine at `engine`, and cluster A's gateways allowed to route for
/// tenant acme only.
fn policies(dir: &Path, engine: &str) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(
        dir.join("fleet.yaml"),
        format!(
            "apiVersion: kvplane.io/v1alpha1\nkind: InferenceWorkerSet\nmetadata: {{name: gpu}}\nspec:\n  model: sim-8b\n  endpoints:\n  - {{worker: w0, address: '{engine}'}}\n---\napiVersion: kvplane.io/v1alpha1\nkind: AccessPolicy\nmetadata: {{name: cluster-a}}\nspec:\n  identities: ['spiffe://kvplane.test/ns/cluster-a/*']\n  rights: [route]\n  tenants: [acme]\n---\napiVersion: kvplane.io/v1alpha1\nkind: AccessPolicy\nmetadata: {{name: cluster-b}}\nspec:\n  identities: ['{GATEWAY_B}']\n  rights: [route]\n  tenants: [beta]\n---\napiVersion: kvplane.io/v1alpha1\nkind: AccessPolicy\nmetadata: {{name: config-writers}}\nspec:\n  identities: ['{CONFIG_WRITER}']\n  rights: [config]\n"
        ),
    )
    .unwrap();
}

/// The value of `name`'s series whose labels contain `labels`.
fn labelled(metrics: &str, name: &str, labels: &str) -> f64 {
    metrics
        .lines()
        .filter(|l| l.starts_with(&format!("{name}{{")) && l.contains(labels))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

fn request(tenant: &str) -> RouteRequest {
    RouteRequest {
        tenant: tenant.into(),
        model: "sim-8b".into(),
        token_ids: (0..64).collect(),
        max_output_tokens: 16,
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_routes_only_for_its_tenants_and_every_refusal_is_counted() {
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::new(&dir.path().join("pki"), "kvplane test ca");
    let engine = Engine::sim(&dir.path().join("fleet"), "w0", [0; 3], &[]);
    let policy_dir = dir.path().join("policies");
    policies(&policy_dir, &format!("http://{}", engine.field("http")));
    let cluster = Cluster::start_with(
        1,
        &NodeOptions {
            policy_dir: Some(policy_dir),
            pools: vec![],
            tls: Some(NodeTls {
                dir: pki.issue("member", MEMBER),
                members: vec![],
                admins: vec![OPERATOR.into()],
                client: Some(pki.issue_client("operator", OPERATOR)),
            }),
            ..Default::default()
        },
    );
    let node = &cluster.nodes[0];
    harness::wait_workers_up(node, 1).await;

    // Cluster A's gateway, over gRPC with its own certificate.
    let gw_dir = pki.issue_client("gateway-a", GATEWAY_A);
    let gw = harness::pki::dialer(&gw_dir);
    let mut router = kvplane_proto::v1::router_client::RouterClient::new(
        gw.connect(&node.grpc.to_string()).await.unwrap(),
    );
    let ok = router.route(request("acme")).await.unwrap().into_inner();
    assert!(matches!(ok.decision, Some(Decision::Endpoint(_))), "{ok:?}");
    let denied = router.route(request("beta")).await.unwrap_err();
    assert_eq!(denied.code(), tonic::Code::PermissionDenied, "{denied:?}");
    assert!(
        denied.message().contains(GATEWAY_A) && denied.message().contains("\"beta\""),
        "names the identity and the tenant asked for: {}",
        denied.message()
    );
    assert!(
        !denied.message().contains("acme"),
        "says nothing of other tenants: {}",
        denied.message()
    );
    // The tenant may also come from the backend's tenant header: the same check.
    let mut by_header = request("");
    by_header.headers.insert("x-tenant".into(), "beta".into());
    let denied = router.route(by_header).await.unwrap_err();
    assert_eq!(denied.code(), tonic::Code::PermissionDenied);
    // A usage report giving back another tenant's quota: refused by its ticket's charges.
    let report = kvplane_proto::v1::UsageReport {
        request_id: "r-beta".into(),
        ticket: Some(kvplane_proto::v1::Ticket {
            routed_by: 0,
            incarnation: 0,
            charges: vec![kvplane_proto::v1::QuotaCharge {
                tenant: "beta".into(),
                tokens: 100,
                ..Default::default()
            }],
        }),
        ..Default::default()
    };
    let settled = router.report_usage(report).await.unwrap_err();
    assert_eq!(settled.code(), tonic::Code::PermissionDenied);
    // Cluster B's gateway (tenant beta) can neither report the usage of a request A routed for
    // acme, nor take its request id over; the refusals do not name acme. A then reports it.
    let mut b = kvplane_proto::v1::router_client::RouterClient::new(
        harness::pki::dialer(&pki.issue_client("gateway-b", GATEWAY_B))
            .connect(&node.grpc.to_string())
            .await
            .unwrap(),
    );
    let mut shared = request("acme");
    shared.request_id = "a-1".into();
    let routed = router.route(shared.clone()).await.unwrap().into_inner();
    assert!(matches!(routed.decision, Some(Decision::Endpoint(_))));
    let report = kvplane_proto::v1::UsageReport {
        request_id: "a-1".into(),
        prompt_tokens: 64,
        completion_tokens: 4,
        ..Default::default()
    };
    let stolen = b.report_usage(report.clone()).await.unwrap_err();
    assert_eq!(stolen.code(), tonic::Code::PermissionDenied);
    assert!(!stolen.message().contains("acme"), "{stolen:?}");
    shared.tenant = "beta".into();
    let taken = b.route(shared).await.unwrap_err();
    assert_eq!(taken.code(), tonic::Code::PermissionDenied, "{taken:?}");
    let settled = router.report_usage(report).await.unwrap().into_inner();
    assert!(settled.known, "A's own report settles its request");
    let explain = router.explain(request("acme")).await.unwrap_err();
    assert_eq!(explain.code(), tonic::Code::PermissionDenied);
    assert!(
        explain.message().contains("lacks the read right"),
        "{explain:?}"
    );

    // Through the reference gateway with that certificate: acme is served by the engine,
    // beta is refused in OpenAI's shape.
    let gateway = harness::gateway_with(
        &node.grpc.to_string(),
        &[
            "--tls-dir".into(),
            gw_dir.display().to_string(),
            "--tenant-header".into(),
            "x-tenant".into(),
        ],
        dir.path().join("gateway.log"),
    );
    let url = format!("http://{}/v1/completions", gateway.field("http"));
    let http = reqwest::Client::new();
    let ask = |tenant: &'static str| {
        http.post(&url)
            .header("x-tenant", tenant)
            .json(&serde_json::json!({"model": "sim-8b", "prompt": "hello there", "max_tokens": 4}))
            .send()
    };
    let served = ask("acme").await.unwrap();
    assert_eq!(served.status(), 200, "{}", served.text().await.unwrap());
    let refused = ask("beta").await.unwrap();
    assert_eq!(refused.status(), 403);
    let body: serde_json::Value = refused.json().await.unwrap();
    assert_eq!(body["error"]["code"], "permission_denied", "{body}");
    assert_eq!(body["error"]["type"], "permission_error", "{body}");

    let m = node.metrics().await;
    let tenant_refusals = labelled(
        &m,
        "kvplane_access_denied_total",
        &format!("identity=\"{GATEWAY_A}\",right=\"route_tenant\""),
    );
    assert_eq!(
        tenant_refusals, 4.0,
        "two routes and a report over gRPC, one route through the gateway:\n{m}"
    );
    assert_eq!(
        labelled(
            &m,
            "kvplane_access_denied_total",
            &format!("identity=\"{GATEWAY_A}\",right=\"read\"")
        ),
        1.0
    );
    assert_eq!(
        labelled(
            &m,
            "kvplane_access_denied_total",
            &format!("identity=\"{GATEWAY_B}\",right=\"route_tenant\"")
        ),
        2.0,
        "B's report and route about A's request"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn config_membership_and_raft_calls_need_their_rights() {
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::new(&dir.path().join("pki"), "kvplane test ca");
    let policy_dir = dir.path().join("policies");
    policies(&policy_dir, "http://127.0.0.1:9");
    let tls = NodeTls {
        dir: pki.issue("member", MEMBER),
        members: vec![],
        admins: vec![OPERATOR.into()],
        client: None,
    };
    let cluster = Cluster::start_with(
        1,
        &NodeOptions {
            policy_dir: Some(policy_dir),
            pools: vec![],
            tls: Some(tls.clone()),
            ..Default::default()
        },
    );
    let node = &cluster.nodes[0];
    let addr = node.grpc.to_string();
    let admin = |d: kvplane_tls::Dialer| {
        let addr = addr.clone();
        async move { kvplane_proto::v1::admin_client::AdminClient::new(d.connect(&addr).await.unwrap()) }
    };

    // The policy directory is in the state (the operator may read it).
    let op = harness::pki::dialer(&pki.issue_client("operator", OPERATOR));
    eventually(
        "the access policies apply",
        Duration::from_secs(20),
        || async {
            let s = admin(op.clone())
                .await
                .status(StatusRequest::default())
                .await
                .ok()?;
            (s.into_inner().policy_objects.get("AccessPolicy") == Some(&3)).then_some(())
        },
    )
    .await;

    // No certificate: only health checks.
    let anonymous = tls.dialer();
    let health =
        tonic_health::pb::health_client::HealthClient::new(anonymous.connect(&addr).await.unwrap())
            .check(tonic_health::pb::HealthCheckRequest::default())
            .await;
    assert!(health.is_ok(), "{health:?}");
    let refused = admin(anonymous.clone())
        .await
        .put_config(put_pool("extra"))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::PermissionDenied);
    assert_eq!(
        refused.message(),
        "anonymous lacks the config right (no AccessPolicy grants it)"
    );
    let status = admin(anonymous)
        .await
        .status(StatusRequest::default())
        .await;
    assert_eq!(status.unwrap_err().code(), tonic::Code::PermissionDenied);

    // Plaintext reaches nothing.
    let plain = kvplane_tls::Dialer::plain();
    let plain_call = match plain.connect(&addr).await {
        Ok(ch) => kvplane_proto::v1::admin_client::AdminClient::new(ch)
            .put_config(put_pool("extra"))
            .await
            .map(|_| ()),
        Err(e) => Err(tonic::Status::unavailable(e.to_string())),
    };
    assert!(plain_call.is_err());

    // A gateway of the same CA: route only.
    let gw = harness::pki::dialer(&pki.issue_client("gateway-a", GATEWAY_A));
    let mut c = admin(gw.clone()).await;
    for (call, right) in [
        (c.put_config(put_pool("extra")).await.map(|_| ()), "config"),
        (
            c.add_member(kvplane_proto::v1::AddMemberRequest {
                id: 9,
                addr: "127.0.0.1:9".into(),
                ..Default::default()
            })
            .await
            .map(|_| ()),
            "membership",
        ),
        (c.status(StatusRequest::default()).await.map(|_| ()), "read"),
    ] {
        let e = call.unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied, "{right}: {e:?}");
        assert!(
            e.message()
                .starts_with(&format!("{GATEWAY_A} lacks the {right} right")),
            "{e:?}"
        );
    }
    // Raft RPCs: members only, refused before the message is read.
    let raft = kvplane_proto::v1::raft_client::RaftClient::new(gw.connect(&addr).await.unwrap())
        .append_entries(kvplane_proto::v1::RaftPayload {
            relay: false,
            data: vec![1, 2, 3],
        })
        .await
        .unwrap_err();
    assert_eq!(raft.code(), tonic::Code::PermissionDenied);
    assert!(
        raft.message().contains("lacks the member right"),
        "{raft:?}"
    );

    // The config right writes config, but no AccessPolicy: it cannot grant itself more.
    let writer = harness::pki::dialer(&pki.issue_client("config-writer", CONFIG_WRITER));
    let mut w = admin(writer).await;
    w.put_config(put_pool("by-writer")).await.unwrap();
    let grant_self = w
        .put_config(PutConfigRequest {
            kind: "AccessPolicy".into(),
            name: "me".into(),
            value: format!(
                r#"{{"identities":["{CONFIG_WRITER}"],"rights":["membership","read"]}}"#
            )
            .into_bytes(),
        })
        .await
        .unwrap_err();
    assert_eq!(grant_self.code(), tonic::Code::PermissionDenied);
    assert!(
        grant_self.message().contains("may not write AccessPolicy"),
        "{grant_self:?}"
    );

    // The operator writes config.
    admin(op).await.put_config(put_pool("extra")).await.unwrap();

    let m = node.metrics().await;
    assert_eq!(
        labelled(
            &m,
            "kvplane_access_denied_total",
            "identity=\"anonymous\",right=\"config\""
        ),
        1.0,
        "{m}"
    );
    assert_eq!(
        labelled(
            &m,
            "kvplane_access_denied_total",
            &format!("identity=\"{GATEWAY_A}\",right=\"member\"")
        ),
        1.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_whose_certificate_another_ca_signed_receives_no_entries() {
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::new(&dir.path().join("pki"), "kvplane test ca");
    // The intruder holds our CA's certificate (so it can check ours) and a certificate naming
    // the members' identity, signed by a CA of its own.
    let other = Pki::new(&dir.path().join("other"), "someone else's ca");
    let intruder_dir = other.issue("member", MEMBER);
    pki.trust_in(&intruder_dir);
    let peers: Vec<(u64, String)> = (1..=3)
        .map(|i| (i, format!("127.0.0.1:{}", harness::free_port())))
        .collect();
    let member_dir = pki.issue("member", MEMBER);
    let operator = pki.issue_client("operator", OPERATOR);
    // The test asks the intruder too: with our operator's certificate, checking the intruder's.
    let operator_to_intruder = pki.issue_client("operator-to-intruder", OPERATOR);
    other.trust_in(&operator_to_intruder);
    let mut cluster = Cluster::start_on(harness::Nats::start(), 0, &NodeOptions::default());
    for (i, (id, addr)) in peers.iter().enumerate() {
        let o = NodeOptions {
            grpc_listen: addr.clone(),
            raft: Some(RaftOptions {
                id: *id,
                peers: peers.clone(),
                bootstrap: i == 0,
                ..Default::default()
            }),
            tls: Some(NodeTls {
                dir: if *id == 3 {
                    intruder_dir.clone()
                } else {
                    member_dir.clone()
                },
                members: vec![],
                admins: vec![OPERATOR.into()],
                client: Some(if *id == 3 {
                    operator_to_intruder.clone()
                } else {
                    operator.clone()
                }),
            }),
            ..Default::default()
        };
        cluster.add_node(&format!("kvplane-{i}"), &o);
    }
    // Members 1 and 2 are a quorum of three: they elect a leader and commit a write.
    let written = eventually("a write is committed", Duration::from_secs(30), || async {
        let mut c = cluster.nodes[0].admin().await;
        c.put_config(put_pool("extra"))
            .await
            .ok()
            .map(|r| r.into_inner().index)
    })
    .await;
    eventually("member 2 applies it", Duration::from_secs(20), || async {
        (cluster.nodes[1].status().await.applied_index >= written).then_some(())
    })
    .await;
    // The leader has tried to reach member 3, and each side refused the other's certificate.
    eventually(
        "the intruder refused a handshake",
        Duration::from_secs(20),
        || async {
            let m = cluster.nodes[2].metrics().await;
            (harness::metric_value(&m, "kvplane_tls_handshake_failures_total") >= 1.0).then_some(())
        },
    )
    .await;
    let s = cluster.nodes[2].status().await;
    assert_eq!(s.applied_index, 0, "no entry reached the intruder: {s:?}");
    // Nor can it ask to join: a member refuses its certificate at the handshake, counted.
    let failures = || async {
        harness::metric_value(
            &cluster.nodes[0].metrics().await,
            "kvplane_tls_handshake_failures_total",
        )
    };
    let before = failures().await;
    let intruder = harness::pki::dialer(&intruder_dir);
    let asked = match intruder.connect(&peers[0].1).await {
        Ok(ch) => kvplane_proto::v1::admin_client::AdminClient::new(ch)
            .add_member(kvplane_proto::v1::AddMemberRequest {
                id: 3,
                addr: peers[2].1.clone(),
                ..Default::default()
            })
            .await
            .map(|_| ()),
        Err(e) => Err(tonic::Status::unavailable(e.to_string())),
    };
    // With TLS 1.3 the client may finish first and see the member's alert (UnknownCA) or
    // only the connection closing: what counts is the member's own count of refusals.
    assert!(asked.is_err(), "{asked:?}");
    assert!(
        failures().await > before,
        "the member refused this very handshake"
    );
    let s = cluster.nodes[2].status().await;
    assert_eq!(s.applied_index, 0, "{s:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_renewed_on_disk_is_served_to_new_connections_without_a_restart() {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, ServerName};
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::new(&dir.path().join("pki"), "kvplane test ca");
    let member_dir = pki.issue("member", MEMBER);
    let cluster = Cluster::start_with(
        1,
        &NodeOptions {
            tls: Some(NodeTls {
                dir: member_dir.clone(),
                members: vec![],
                admins: vec![OPERATOR.into()],
                client: Some(pki.issue_client("operator", OPERATOR)),
            }),
            ..Default::default()
        },
    );
    let node = &cluster.nodes[0];
    let ca = CertificateDer::from_pem_file(member_dir.join("ca.crt")).unwrap();
    // The certificate the node presents to a new connection.
    let served = || async {
        let mut roots = rustls::RootCertStore::empty();
        roots.add(ca.clone()).unwrap();
        let config = rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
        let tcp = tokio::net::TcpStream::connect(node.grpc).await.unwrap();
        let s = tokio_rustls::TlsConnector::from(std::sync::Arc::new(config))
            .connect(ServerName::try_from("127.0.0.1").unwrap(), tcp)
            .await
            .unwrap();
        s.get_ref().1.peer_certificates().unwrap()[0].to_vec()
    };
    let on_disk = || {
        CertificateDer::from_pem_file(member_dir.join("tls.crt"))
            .unwrap()
            .to_vec()
    };
    assert_eq!(served().await, on_disk());

    // cert-manager renews: a new key and certificate in the same files.
    pki.issue("member", MEMBER);
    let renewed = on_disk();
    eventually(
        "the node serves the renewed certificate",
        Duration::from_secs(20),
        || async { (served().await == renewed).then_some(()) },
    )
    .await;
    let m = node.metrics().await;
    assert!(
        labelled(&m, "kvplane_tls_reloads_total", "outcome=\"loaded\"") >= 1.0,
        "{m}"
    );
    // And it goes on serving the operator, over a new connection.
    assert!(node.status().await.applied_index >= 1);
}
