//! `cargo bench -p kvplane-api --bench tls`: what TLS and the access checks add to a decision.
//! In one run, over gRPC on loopback, interleaved: `Router.Route` on a plaintext port whose
//! caller is not checked, and on a TLS port (rustls, certificates from a development CA) whose
//! caller is named by its client certificate and checked (the method's right, then the
//! request's tenant against the `AccessPolicy` objects). Both on long-lived connections; then
//! the cost of a new connection (connect, handshake, first Route) on each: one client, so after
//! the first its TLS handshakes resume the session rustls keeps (as a gateway's reconnections
//! would). Prints one JSON object.
//!
//! Setup: worker set `gpu` (model `m`, block size 16) with 8 workers; each request a prompt of
//! its own (no cache hits), reported at once so queues stay empty. It checks as it goes: every
//! Route is routed on both ports, and on the TLS port a tenant the gateway holds no right for
//! is refused. `-- --small` runs a few requests: CI checks the output and those assertions,
//! never the timings.

#![allow(clippy::unwrap_used, clippy::print_stdout, clippy::panic)]

use std::time::Instant;

use kvplane_api::{Access, AccessLayer, AccessMetrics, RouterService};
use kvplane_proto::v1::router_client::RouterClient;
use kvplane_proto::v1::router_server::RouterServer;
use kvplane_proto::v1::{RouteRequest, UsageReport, route_response::Decision};
use kvplane_testkit::state::TestFleet;
use kvplane_tls::dev_ca::DevCa;
use kvplane_tls::{Dialer, Tls, TlsMetrics};
use serde_json::json;
use tonic::transport::Channel;

const MEMBER: &str = "spiffe://bench/member";
const GATEWAY: &str = "spiffe://bench/gateway";

const FLEET: &str = "apiVersion: kvplane.io/v1alpha1\nkind: InferenceWorkerSet\nmetadata: {name: gpu}\nspec: {model: m, blockSize: 16}\n---\napiVersion: kvplane.io/v1alpha1\nkind: AccessPolicy\nmetadata: {name: gateways}\nspec: {identities: ['spiffe://bench/gateway'], rights: [route], tenants: [acme]}\n";

fn stats(mut ns: Vec<u64>) -> serde_json::Value {
    ns.sort_unstable();
    let at = |p: f64| ns[((ns.len() - 1) as f64 * p).round() as usize] as f64 / 1000.0;
    json!({"calls": ns.len(), "p50_us": at(0.5), "p99_us": at(0.99)})
}

/// Serves `svc` behind the access layer on a loopback port (TLS with `tls`); its address.
async fn serve(svc: RouterService, access: Access, tls: Option<Tls>) -> String {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    tokio::spawn(
        tonic::transport::Server::builder()
            .layer(AccessLayer(access))
            .add_service(RouterServer::new(svc))
            .serve_with_incoming(kvplane_tls::incoming(l, tls)),
    );
    addr
}

fn request(n: u64, tenant: &str) -> RouteRequest {
    RouteRequest {
        request_id: format!("r{n}"),
        tenant: tenant.into(),
        model: "m".into(),
        token_ids: (0..256)
            .map(|i| (n.wrapping_mul(7919) + i) as u32 % 50_000)
            .collect(),
        max_output_tokens: 16,
        ..Default::default()
    }
}

/// One Route, timed, then reported (not timed).
async fn route(c: &mut RouterClient<Channel>, n: u64) -> u64 {
    let t = Instant::now();
    let r = c.route(request(n, "acme")).await.unwrap().into_inner();
    let ns = t.elapsed().as_nanos() as u64;
    assert!(matches!(r.decision, Some(Decision::Endpoint(_))), "{r:?}");
    c.report_usage(UsageReport {
        request_id: format!("r{n}"),
        prompt_tokens: 256,
        completion_tokens: 4,
        ..Default::default()
    })
    .await
    .unwrap();
    ns
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let small = std::env::args().any(|a| a == "--small");
    let (requests, connections) = if small { (50, 5) } else { (5_000, 200) };

    let mut f = TestFleet::with_yaml(FLEET);
    let workers: Vec<String> = (0..8).map(|i| format!("w{i}")).collect();
    f.up(
        "gpu",
        &workers.iter().map(String::as_str).collect::<Vec<_>>(),
    );
    let dir = tempfile::tempdir().unwrap();
    let ca = DevCa::new("bench ca").unwrap();
    let load = |name: &str, id: &str, hosts: &[&str]| {
        let s = ca.write(&dir.path().join(name), id, hosts).unwrap();
        Tls::load(&s, TlsMetrics::default()).unwrap()
    };
    let server_tls = load("member", MEMBER, &["127.0.0.1"]);
    let gateway_tls = load("gateway", GATEWAY, &[]);

    let open = Access::unchecked(f.sm.handle(), AccessMetrics::default());
    let checked = Access::new(
        true,
        vec![MEMBER.into()],
        Vec::new(),
        f.sm.handle(),
        AccessMetrics::default(),
    );
    let plain_addr = serve(f.service().with_access(open.clone()), open, None).await;
    let tls_addr = serve(
        f.service().with_access(checked.clone()),
        checked,
        Some(server_tls),
    )
    .await;
    let plain = Dialer::plain();
    let tls = Dialer::new(Some(gateway_tls));

    // Long-lived connections, interleaved so both see the same machine.
    let mut p = RouterClient::new(plain.connect(&plain_addr).await.unwrap());
    let mut t = RouterClient::new(tls.connect(&tls_addr).await.unwrap());
    let (mut plain_ns, mut tls_ns) = (Vec::new(), Vec::new());
    for n in 0..requests {
        plain_ns.push(route(&mut p, 2 * n).await);
        tls_ns.push(route(&mut t, 2 * n + 1).await);
    }
    let refused = t.route(request(999_999, "other")).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::PermissionDenied, "{refused:?}");

    // New connections: connect (and the TLS handshake), then the first Route.
    let (mut plain_connect, mut tls_connect) = (Vec::new(), Vec::new());
    for n in 0..connections {
        for (dialer, addr, out) in [
            (&plain, &plain_addr, &mut plain_connect),
            (&tls, &tls_addr, &mut tls_connect),
        ] {
            let start = Instant::now();
            let mut c = RouterClient::new(dialer.connect(addr).await.unwrap());
            let connected = start.elapsed().as_nanos() as u64;
            // The first Route's own time (its usage report is not counted).
            out.push(connected + route(&mut c, 1_000_000 + 2 * n).await);
        }
    }
    let (ps, ts) = (stats(plain_ns), stats(tls_ns));
    let ratio = ts["p50_us"].as_f64().unwrap() / ps["p50_us"].as_f64().unwrap();
    println!(
        "{}",
        serde_json::to_string_pretty(&json!({
            "route": {"plaintext": ps, "tls_and_access": ts, "tls_p50_to_plaintext": ratio},
            "new_connection_and_first_route": {"plaintext": stats(plain_connect), "tls": stats(tls_connect)},
            "workload": {"requests_per_port": requests, "connections_per_port": connections, "prompt_tokens": 256, "workers": 8},
        }))
        .unwrap()
    );
}
