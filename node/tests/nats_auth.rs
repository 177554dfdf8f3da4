//! NATS credentials with a real nats-server that authenticates users and enforces their
//! permissions: the node connects as its user, a bridge as a user that may publish only its own
//! worker's subjects, and that user cannot publish for another worker; no user, no connection.

#![allow(clippy::unwrap_used)]

mod harness;

use std::path::{Path, PathBuf};
use std::time::Duration;

use harness::{Cluster, Engine, EngineOptions, Nats, NodeOptions, eventually};

/// The node's user may do anything; `bridge-w1` may publish only worker `w1` of pool `gpu`'s
/// subjects (and the JetStream API calls a bridge makes), and hear only its own replies.
fn server_config() -> String {
    let w1 = [
        "kvplane.kv.gpu.w1",
        "kvplane.kv.gpu.w1.>",
        "kvplane.metrics.gpu.w1",
        "kvplane.worker.gpu.w1",
        "$JS.API.STREAM.INFO.KVPLANE",
        "$JS.API.STREAM.MSG.GET.KVPLANE",
    ]
    .map(|s| format!("{s:?}"))
    .join(", ");
    format!(
        "accounts {{\n  KV {{\n    jetstream: enabled\n    users: [\n      {{user: node, password: node-secret}}\n      {{user: bridge-w1, password: w1-secret, permissions: {{publish: {{allow: [{w1}]}}, subscribe: {{allow: [\"_INBOX.kvplane.gpu.w1.>\"]}}}}}}\n    ]\n  }}\n}}\nno_auth_user: \"\"\n"
    )
}

/// One node on `nats`, connecting as user `node` (with `nats_extra`, more `[nats]` keys), its
/// policy directory declaring worker set `gpu`, once ready; and the file holding the password
/// of worker w1's bridge.
async fn ready_node(dir: &Path, nats: Nats, nats_extra: String) -> (Cluster, PathBuf) {
    let secret = |name: &str, value: &str| {
        let p = dir.join(name);
        std::fs::write(&p, format!("{value}\n")).unwrap();
        p
    };
    let node_password = secret("node.password", "node-secret");
    let w1_password = secret("w1.password", "w1-secret");
    let policies = dir.join("policies");
    std::fs::create_dir_all(&policies).unwrap();
    std::fs::write(
        policies.join("fleet.yaml"),
        "apiVersion: kvplane.io/v1alpha1\nkind: InferenceWorkerSet\nmetadata: {name: gpu}\nspec: {model: sim-8b, blockSize: 16}\n",
    )
    .unwrap();
    let cluster = Cluster::start_on(
        nats,
        1,
        &NodeOptions {
            policy_dir: Some(policies),
            pools: vec![],
            extra_toml: format!(
                "[nats]\nuser = \"node\"\npassword_file = {node_password:?}\n{nats_extra}"
            ),
            ..Default::default()
        },
    );
    let node = &cluster.nodes[0];
    eventually("the node is ready", Duration::from_secs(30), || async {
        (node.readyz().await.0 == 200).then_some(())
    })
    .await;
    (cluster, w1_password)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bridge_publishes_only_its_own_workers_subjects_and_the_node_connects_as_its_user() {
    let dir = tempfile::tempdir().unwrap();
    let (cluster, w1_password) = ready_node(
        dir.path(),
        Nats::start_configured(&server_config()),
        String::new(),
    )
    .await;
    let node = &cluster.nodes[0];

    // Worker w1's bridge, as its own user: its engine comes up and its cache is indexed.
    let w1 = Engine::start_with(
        &dir.path().join("fleet"),
        &cluster.nats.url(),
        "w1",
        &EngineOptions {
            pool: "gpu".into(),
            bridge_args: vec![
                "--nats-user".into(),
                "bridge-w1".into(),
                "--nats-password-file".into(),
                w1_password.display().to_string(),
            ],
            ..Default::default()
        },
    );
    harness::wait_workers_up(node, 1).await;
    let status = node.status().await;
    assert_eq!(status.workers[0].worker_id, "w1");

    // The user hears replies only under its own worker's inbox prefix: with the default
    // `_INBOX.` its own publish gets no acknowledgement (waited for 1 s, not 5).
    let elsewhere = async_nats::ConnectOptions::new()
        .user_and_password("bridge-w1".into(), "w1-secret".into())
        .connect(cluster.nats.url())
        .await
        .unwrap();
    let mut js = async_nats::jetstream::new(elsewhere);
    js.set_timeout(Duration::from_secs(1));
    let unheard = js
        .publish(kvplane_ingest::worker_subject("gpu", "w1"), "{}".into())
        .await;
    let unheard = match unheard {
        Err(e) => e.to_string(),
        Ok(ack) => ack
            .await
            .map(|a| format!("{a:?}"))
            .unwrap_or_else(|e| e.to_string()),
    };
    assert!(unheard.contains("timed out"), "{unheard}");

    // The same user publishing for worker w2 is refused by the server: nothing arrives.
    let as_w1 = async_nats::ConnectOptions::new()
        .user_and_password("bridge-w1".into(), "w1-secret".into())
        .custom_inbox_prefix(kvplane_ingest::bridge_inbox_prefix("gpu", "w1"))
        .connect(cluster.nats.url())
        .await
        .unwrap();
    let mut js = async_nats::jetstream::new(as_w1);
    // A refused publish gets no acknowledgement: waited for 1 s, not the default 5 s.
    js.set_timeout(Duration::from_secs(1));
    let forged = js
        .publish(
            kvplane_ingest::worker_subject("gpu", "w2"),
            br#"{"status":"up","address":"http://evil:8000"}"#.to_vec().into(),
        )
        .await;
    let refused = match forged {
        Err(e) => e.to_string(),
        Ok(ack) => match ack.await {
            Err(e) => e.to_string(),
            Ok(a) => panic!("the server stored a forged announcement: {a:?}"),
        },
    };
    assert!(!refused.is_empty());
    // Its own subject still goes through, with the acknowledgement it is owed.
    js.publish(
        kvplane_ingest::worker_subject("gpu", "w1"),
        br#"{"status":"up","address":"http://w1-again:8000"}"#
            .to_vec()
            .into(),
    )
    .await
    .unwrap()
    .await
    .unwrap();
    eventually(
        "w1's own announcement applies",
        Duration::from_secs(20),
        || async {
            let s = node.status().await;
            s.workers
                .iter()
                .any(|w| w.worker_id == "w1" && w.address == "http://w1-again:8000")
                .then_some(())
        },
    )
    .await;
    let s = node.status().await;
    assert!(
        s.workers.iter().all(|w| w.worker_id != "w2"),
        "no forged worker: {:?}",
        s.workers
    );

    // Without a user, or with a wrong password, no connection at all.
    for o in [
        async_nats::ConnectOptions::new(),
        async_nats::ConnectOptions::new().user_and_password("node".into(), "wrong".into()),
    ] {
        let c = tokio::time::timeout(Duration::from_secs(2), o.connect(cluster.nats.url())).await;
        assert!(
            !matches!(c, Ok(Ok(_))),
            "nats-server accepted a connection without its user's password"
        );
    }
    drop(w1);
}

/// nats-server speaking only TLS, asking every client for a certificate from the test CA, and
/// users as above.
fn tls_server_config(certs: &std::path::Path) -> String {
    format!(
        "tls {{\n  cert_file: {:?}\n  key_file: {:?}\n  ca_file: {:?}\n  verify: true\n  timeout: 2\n}}\n{}",
        certs.join("tls.crt"),
        certs.join("tls.key"),
        certs.join("ca.crt"),
        server_config()
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_node_and_a_bridge_reach_nats_over_mutual_tls_and_a_client_without_a_certificate_is_refused()
 {
    let dir = tempfile::tempdir().unwrap();
    let pki = harness::pki::Pki::new(&dir.path().join("pki"), "kvplane test ca");
    let server = pki.issue("nats", "spiffe://kvplane.test/ns/nats/sa/nats");
    let node_cert = pki.issue_client("node", harness::pki::MEMBER);
    let bridge_cert = pki.issue_client("bridge", "spiffe://kvplane.test/ns/fleet/sa/bridge-w1");
    let (cluster, w1_password) = ready_node(
        dir.path(),
        Nats::start_configured(&tls_server_config(&server)),
        format!(
            "ca = {:?}\ncert = {:?}\nkey = {:?}\n",
            node_cert.join("ca.crt"),
            node_cert.join("tls.crt"),
            node_cert.join("tls.key"),
        ),
    )
    .await;
    let node = &cluster.nodes[0];

    // Worker w1's bridge over TLS with its own certificate and user: its engine is indexed.
    let w1 = Engine::start_with(
        &dir.path().join("fleet"),
        &cluster.nats.url(),
        "w1",
        &EngineOptions {
            pool: "gpu".into(),
            bridge_args: vec![
                "--nats-user".into(),
                "bridge-w1".into(),
                "--nats-password-file".into(),
                w1_password.display().to_string(),
                "--nats-ca".into(),
                bridge_cert.join("ca.crt").display().to_string(),
                "--nats-cert".into(),
                bridge_cert.join("tls.crt").display().to_string(),
                "--nats-key".into(),
                bridge_cert.join("tls.key").display().to_string(),
            ],
            ..Default::default()
        },
    );
    harness::wait_workers_up(node, 1).await;
    assert_eq!(node.status().await.workers[0].worker_id, "w1");

    // The right user without a client certificate (trusting the CA or not) gets no connection.
    let ca = std::fs::read_to_string(node_cert.join("ca.crt")).unwrap();
    let ca_file = dir.path().join("ca-only.crt");
    std::fs::write(&ca_file, ca).unwrap();
    // Refused at once (an error, not a wait): the server asks for the certificate.
    let no_certificate = async_nats::ConnectOptions::new()
        .user_and_password("node".into(), "node-secret".into())
        .add_root_certificates(ca_file.clone())
        .require_tls(true);
    let c = tokio::time::timeout(
        Duration::from_secs(10),
        no_certificate.connect(cluster.nats.url()),
    )
    .await;
    assert!(
        matches!(c, Ok(Err(_))),
        "nats-server did not refuse a connection without a certificate: {c:?}"
    );
    drop(w1);
}
