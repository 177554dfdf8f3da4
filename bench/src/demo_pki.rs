//! The demo's certificates: one development CA and a certificate per role, so the demo runs
//! with TLS everywhere kvplane speaks it - members' gRPC and Raft (mutual), their HTTP ports,
//! the gateways' listeners and their calls to kvplane, NATS (mutual) - and with the access
//! checks on.

use std::path::{Path, PathBuf};

use anyhow::Context;
use kvplane_tls::dev_ca::DevCa;
use kvplane_tls::{Dialer, Tls, TlsMetrics, TlsSection};

/// The members' identity (one certificate, as a StatefulSet's pods share one).
const MEMBER: &str = "spiffe://kvplane.demo/ns/kvplane/sa/kvplane";
/// The operator: the demo's own status calls.
const OPERATOR: &str = "spiffe://kvplane.demo/ns/ops/sa/operator";
/// The gateways: allowed to route for every tenant by an `AccessPolicy`.
const GATEWAY: &str = "spiffe://kvplane.demo/ns/gateways/sa/gateway";
const BRIDGE: &str = "spiffe://kvplane.demo/ns/fleet/sa/bridge";
const NATS: &str = "spiffe://kvplane.demo/ns/nats/sa/nats";
/// What a server certificate of the demo serves.
const LOOPBACK: &[&str] = &["127.0.0.1", "localhost"];

/// The directories (`ca.crt`, `tls.crt`, `tls.key` each) under `dir`.
pub(crate) struct DemoPki {
    dir: PathBuf,
}

impl DemoPki {
    /// A new CA and every role's certificate under `dir`.
    pub(crate) fn new(dir: &Path) -> anyhow::Result<Self> {
        let ca = DevCa::new("kvplane demo ca")?;
        for (name, identity, hosts) in [
            ("member", MEMBER, LOOPBACK),
            ("operator", OPERATOR, &[][..]),
            ("gateway", GATEWAY, LOOPBACK),
            ("bridge", BRIDGE, &[][..]),
            ("nats", NATS, LOOPBACK),
        ] {
            ca.write(&dir.join(name), identity, hosts)?;
        }
        Ok(Self {
            dir: dir.to_owned(),
        })
    }

    fn file(&self, role: &str, name: &str) -> PathBuf {
        self.dir.join(role).join(name)
    }

    /// A member's `[tls]`, `[access]` and `[nats]` sections.
    pub(crate) fn member_toml(&self) -> String {
        let f = |name| self.file("member", name);
        format!(
            "\n[tls]\nca = {:?}\ncert = {:?}\nkey = {:?}\n\n[access]\nadmins = [{OPERATOR:?}]\n\n[nats]\nca = {:?}\ncert = {:?}\nkey = {:?}\n",
            f("ca.crt"),
            f("tls.crt"),
            f("tls.key"),
            f("ca.crt"),
            f("tls.crt"),
            f("tls.key"),
        )
    }

    /// The `AccessPolicy` letting the gateways route for every tenant.
    pub(crate) fn access_policy_yaml() -> String {
        format!(
            "apiVersion: kvplane.io/v1alpha1\nkind: AccessPolicy\nmetadata: {{name: gateways}}\nspec: {{identities: [{GATEWAY:?}], rights: [route], tenants: ['*']}}\n"
        )
    }

    /// nats-server speaking only TLS, asking each client for a certificate from the CA.
    pub(crate) fn nats_conf(&self) -> String {
        format!(
            "tls {{\n  cert_file: {:?}\n  key_file: {:?}\n  ca_file: {:?}\n  verify: true\n}}\n",
            self.file("nats", "tls.crt"),
            self.file("nats", "tls.key"),
            self.file("nats", "ca.crt"),
        )
    }

    /// A bridge's flags for NATS over mutual TLS.
    pub(crate) fn bridge_args(&self) -> Vec<String> {
        let f = |name| self.file("bridge", name).display().to_string();
        vec![
            "--nats-ca".into(),
            f("ca.crt"),
            "--nats-cert".into(),
            f("tls.crt"),
            "--nats-key".into(),
            f("tls.key"),
        ]
    }

    /// A gateway's flags: its certificate for calling kvplane and for serving its clients.
    pub(crate) fn gateway_args(&self) -> Vec<String> {
        let dir = self.dir.join("gateway").display().to_string();
        vec![
            "--tls-dir".into(),
            dir.clone(),
            "--listen-tls-dir".into(),
            dir,
        ]
    }

    /// The operator's dialer: the demo's status calls.
    pub(crate) fn operator(&self) -> anyhow::Result<Dialer> {
        let tls = Tls::load(
            &TlsSection::in_dir(self.dir.join("operator")),
            TlsMetrics::default(),
        )
        .context("the demo's operator certificate")?;
        Ok(Dialer::new(Some(tls)))
    }

    /// An HTTP client trusting the CA: the demo's requests to the gateways.
    pub(crate) fn http_client(&self) -> anyhow::Result<reqwest::Client> {
        let pem = std::fs::read(self.file("gateway", "ca.crt"))?;
        Ok(reqwest::Client::builder()
            .use_rustls_tls()
            .add_root_certificate(reqwest::Certificate::from_pem(&pem)?)
            .build()?)
    }
}
