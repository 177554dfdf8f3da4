//! The listener and the dialer with certificates from a real CA (rcgen) through rustls: who a
//! caller is, who is refused at the handshake, and rotated files used without a restart.

#![allow(clippy::unwrap_used)]

use std::time::Duration;

use kvplane_tls::dev_ca::DevCa;
use kvplane_tls::{Conn, Dialer, Identity, Tls, TlsMetrics, TlsSection, incoming};
use rustls::pki_types::ServerName;
use tokio::net::{TcpListener, TcpStream};
use tokio_stream::StreamExt;
use tonic::transport::server::Connected;

const MEMBER: &str = "spiffe://kvplane.test/ns/kvplane/sa/member";
const GATEWAY: &str = "spiffe://kvplane.test/ns/a/sa/gateway";

fn tls(s: &TlsSection) -> Tls {
    Tls::load(s, TlsMetrics::default()).expect("the files load")
}

/// A TLS listener on loopback with a certificate naming `MEMBER` from `ca`.
async fn server(
    ca: &DevCa,
    dir: &std::path::Path,
) -> (
    String,
    tokio_stream::wrappers::ReceiverStream<std::io::Result<Conn>>,
    Tls,
) {
    let section = ca
        .write(&dir.join("server"), MEMBER, &["127.0.0.1"])
        .unwrap();
    let tls = tls(&section);
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    (addr, incoming(l, Some(tls.clone())), tls)
}

/// A handshake as a client with `tls`'s files; the connection the server accepted, if any.
async fn shake(
    addr: &str,
    client: rustls::ClientConfig,
    accepted: &mut tokio_stream::wrappers::ReceiverStream<std::io::Result<Conn>>,
) -> (Result<(), std::io::Error>, Option<Conn>) {
    let tcp = TcpStream::connect(addr).await.unwrap();
    let name = ServerName::try_from("127.0.0.1").unwrap();
    let shook = tokio_rustls::TlsConnector::from(std::sync::Arc::new(client))
        .connect(name, tcp)
        .await;
    // A client's handshake can finish before the server refuses its certificate: write and
    // read once so the server's verdict reaches the client.
    let shook = match shook {
        Ok(mut s) => {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            let _ = s.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n").await;
            let mut b = [0u8; 1];
            match tokio::time::timeout(Duration::from_millis(300), s.read(&mut b)).await {
                Ok(Err(e)) => Err(e),
                _ => Ok(()),
            }
        }
        Err(e) => Err(e),
    };
    let conn = tokio::time::timeout(Duration::from_millis(500), accepted.next())
        .await
        .ok()
        .flatten()
        .and_then(Result::ok);
    (shook, conn)
}

#[tokio::test]
async fn a_caller_is_named_by_its_certificates_uri_else_its_dns_name() {
    let dir = tempfile::tempdir().unwrap();
    let ca = DevCa::new("kvplane test ca").unwrap();
    let (addr, mut accepted, server) = server(&ca, dir.path()).await;
    assert_eq!(server.own_identity(), Some(Identity(MEMBER.into())));

    let by_uri = tls(&ca.write(&dir.path().join("gw"), GATEWAY, &[]).unwrap());
    let (shook, conn) = shake(&addr, (*by_uri.client_config()).clone(), &mut accepted).await;
    shook.unwrap();
    let peer = conn.expect("accepted").connect_info();
    assert!(peer.tls);
    assert_eq!(peer.identity, Some(Identity(GATEWAY.into())));

    let by_dns = tls(&ca
        .write(&dir.path().join("op"), "operator.kvplane.test", &[])
        .unwrap());
    let (_, conn) = shake(&addr, (*by_dns.client_config()).clone(), &mut accepted).await;
    assert_eq!(
        conn.expect("accepted").connect_info().identity,
        Some(Identity("operator.kvplane.test".into()))
    );
}

#[tokio::test]
async fn a_caller_without_a_certificate_is_let_in_without_an_identity() {
    let dir = tempfile::tempdir().unwrap();
    let ca = DevCa::new("kvplane test ca").unwrap();
    let (addr, mut accepted, server) = server(&ca, dir.path()).await;
    let roots = {
        let mut r = rustls::RootCertStore::empty();
        use rustls::pki_types::pem::PemObject;
        let ca_pem = std::fs::read(dir.path().join("server/ca.crt")).unwrap();
        r.add(rustls::pki_types::CertificateDer::from_pem_slice(&ca_pem).unwrap())
            .unwrap();
        r
    };
    let anonymous = rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    let (shook, conn) = shake(&addr, anonymous, &mut accepted).await;
    shook.unwrap();
    let peer = conn.expect("accepted").connect_info();
    assert!(peer.tls);
    assert_eq!(peer.identity, None);
    drop(server);
}

#[tokio::test]
async fn a_certificate_from_another_ca_is_refused_at_the_handshake_and_counted() {
    let dir = tempfile::tempdir().unwrap();
    let ca = DevCa::new("kvplane test ca").unwrap();
    let other = DevCa::new("someone else's ca").unwrap();
    let section = ca
        .write(&dir.path().join("server"), MEMBER, &["127.0.0.1"])
        .unwrap();
    let metrics = TlsMetrics::default();
    let server = Tls::load(&section, metrics.clone()).unwrap();
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let mut accepted = incoming(l, Some(server));

    // Its own certificate names a member, but another CA signed it; and it trusts the other
    // CA, so it also refuses the server.
    let mut intruder_files = other
        .write(&dir.path().join("intruder"), MEMBER, &[])
        .unwrap();
    let (shook, conn) = shake(
        &addr,
        (*tls(&intruder_files).client_config()).clone(),
        &mut accepted,
    )
    .await;
    assert!(shook.is_err(), "the intruder's handshake must fail");
    assert!(conn.is_none(), "nothing accepted");

    // Trusting our CA but holding the other CA's certificate: the server refuses it.
    intruder_files.ca = section.ca.clone();
    let (shook, conn) = shake(
        &addr,
        (*tls(&intruder_files).client_config()).clone(),
        &mut accepted,
    )
    .await;
    assert!(shook.is_err(), "the server must refuse the certificate");
    assert!(conn.is_none(), "nothing accepted");

    let mut r = prometheus_client::registry::Registry::default();
    metrics.register(&mut r);
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &r).unwrap();
    let failures: u64 = text
        .lines()
        .find_map(|l| l.strip_prefix("kvplane_tls_handshake_failures_total "))
        .and_then(|v| v.trim().parse().ok())
        .expect("the failure counter");
    assert_eq!(failures, 2, "{text}");
}

#[tokio::test]
async fn a_certificate_rotated_on_disk_names_new_connections_without_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let ca = DevCa::new("kvplane test ca").unwrap();
    let (addr, mut accepted, _server) = server(&ca, dir.path()).await;
    let client_dir = dir.path().join("gw");
    let mut section = ca.write(&client_dir, GATEWAY, &[]).unwrap();
    section.reload_ms = 20;
    let client = tls(&section);
    let watching = client.watch();
    let (_, conn) = shake(&addr, (*client.client_config()).clone(), &mut accepted).await;
    assert_eq!(
        conn.unwrap().connect_info().identity,
        Some(Identity(GATEWAY.into()))
    );

    // cert-manager renews: a new key and certificate, here naming another identity so the
    // server can tell which one it was shown.
    let renewed = "spiffe://kvplane.test/ns/a/sa/gateway-renewed";
    ca.write(&client_dir, renewed, &[]).unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while client.own_identity() != Some(Identity(renewed.into())) {
        assert!(tokio::time::Instant::now() < deadline, "not reloaded");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let (_, conn) = shake(&addr, (*client.client_config()).clone(), &mut accepted).await;
    assert_eq!(
        conn.unwrap().connect_info().identity,
        Some(Identity(renewed.into()))
    );

    // A half-written renewal (a key that is not PEM) keeps the last good files.
    std::fs::write(&section.key, "not a key").unwrap();
    assert!(client.reload().is_err());
    assert_eq!(client.own_identity(), Some(Identity(renewed.into())));
    watching.abort();
}

#[tokio::test]
async fn grpc_over_tls_through_the_dialer_and_a_plaintext_dialer_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let ca = DevCa::new("kvplane test ca").unwrap();
    let section = ca
        .write(&dir.path().join("server"), MEMBER, &["127.0.0.1"])
        .unwrap();
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let (_reporter, health) = tonic_health::server::health_reporter();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(health)
            .serve_with_incoming(incoming(l, Some(tls(&section)))),
    );
    let gw = tls(&ca.write(&dir.path().join("gw"), GATEWAY, &[]).unwrap());
    let dialer = Dialer::new(Some(gw));
    assert_eq!(dialer.url(&addr), format!("https://{addr}"));
    let check = |ch| async move {
        tonic_health::pb::health_client::HealthClient::new(ch)
            .check(tonic_health::pb::HealthCheckRequest::default())
            .await
    };
    let answer = check(dialer.connect(&addr).await.unwrap()).await.unwrap();
    assert_eq!(answer.into_inner().status, 1, "serving");
    let lazy = check(dialer.channel(&addr).unwrap()).await.unwrap();
    assert_eq!(lazy.into_inner().status, 1, "serving");

    // A client that speaks plaintext to the TLS port gets no answer.
    let plain = Dialer::plain();
    let refused = match plain.connect(&addr).await {
        Ok(ch) => check(ch).await.is_err(),
        Err(_) => true,
    };
    assert!(refused);
}

#[tokio::test]
async fn a_member_dials_only_servers_whose_certificate_names_a_member() {
    let dir = tempfile::tempdir().unwrap();
    let ca = DevCa::new("kvplane test ca").unwrap();
    // Two servers on loopback with certificates of the same CA for the same host: one a
    // member's, one a gateway's that also serves (say a sidecar's).
    let serve = |name: &str, identity: &str| {
        let section = ca
            .write(&dir.path().join(name), identity, &["127.0.0.1"])
            .unwrap();
        let tls = tls(&section);
        async move {
            let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = l.local_addr().unwrap().to_string();
            let (_reporter, health) = tonic_health::server::health_reporter();
            tokio::spawn(
                tonic::transport::Server::builder()
                    .add_service(health)
                    .serve_with_incoming(incoming(l, Some(tls))),
            );
            addr
        }
    };
    let member = serve("member-server", MEMBER).await;
    let impostor = serve("impostor", GATEWAY).await;
    let own = tls(&ca
        .write(&dir.path().join("me"), MEMBER, &["127.0.0.1"])
        .unwrap());
    own.check_servers(std::sync::Arc::new(|id: &Identity| id.0 == MEMBER))
        .unwrap();
    let dialer = Dialer::new(Some(own.clone()));
    let check = |addr: String| {
        let dialer = dialer.clone();
        async move {
            let ch = dialer.connect(&addr).await.map_err(|e| format!("{e:?}"))?;
            tonic_health::pb::health_client::HealthClient::new(ch)
                .check(tonic_health::pb::HealthCheckRequest::default())
                .await
                .map_err(|e| e.to_string())
        }
    };
    assert!(check(member).await.is_ok());
    let refused = check(impostor).await.unwrap_err();
    assert!(refused.contains("not a member"), "{refused}");
    // The check is kept across a reload, and set only once.
    own.reload().unwrap();
    assert!(
        own.check_servers(std::sync::Arc::new(|_: &Identity| true))
            .is_err()
    );
}
