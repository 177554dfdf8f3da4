//! Certificates for a test fleet: one CA, and a directory per identity in cert-manager's layout
//! (`ca.crt`, `tls.crt`, `tls.key`), for `[tls]` sections and `--tls-dir` flags. Panics on
//! failure: it is for tests.

#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};

use kvplane_tls::dev_ca::DevCa;

/// The identity every member of a test cluster shares (as a StatefulSet's pods do).
pub const MEMBER: &str = "spiffe://kvplane.test/ns/kvplane/sa/kvplane";
/// The operator the tests configure as `[access] admins`.
pub const OPERATOR: &str = "spiffe://kvplane.test/ns/ops/sa/operator";

/// A CA and the directory its certificates are written under.
pub struct Pki {
    ca: DevCa,
    dir: PathBuf,
}

impl Pki {
    pub fn new(dir: &Path, name: &str) -> Self {
        Self {
            ca: DevCa::new(name).unwrap(),
            dir: dir.to_owned(),
        }
    }

    /// A directory holding a certificate for `identity`, serving loopback (`127.0.0.1`,
    /// `localhost`), named `name` under the PKI's directory.
    pub fn issue(&self, name: &str, identity: &str) -> PathBuf {
        let dir = self.dir.join(name);
        self.ca
            .write(&dir, identity, &["127.0.0.1", "localhost"])
            .unwrap();
        dir
    }

    /// A directory holding a client certificate for `identity` (it serves nothing).
    pub fn issue_client(&self, name: &str, identity: &str) -> PathBuf {
        let dir = self.dir.join(name);
        self.ca.write(&dir, identity, &[]).unwrap();
        dir
    }

    /// Writes this CA's certificate over `dir/ca.crt` (a certificate from another CA that
    /// trusts this one, say).
    pub fn trust_in(&self, dir: &Path) {
        std::fs::write(dir.join("ca.crt"), self.ca.ca_pem()).unwrap();
    }
}

/// A node's TLS settings in a test: its certificate directory, the `[access]` section, and
/// the client certificate the test's own clients (`Node::router`, `admin`, `status`) present.
#[derive(Debug, Clone)]
pub struct NodeTls {
    pub dir: PathBuf,
    pub members: Vec<String>,
    pub admins: Vec<String>,
    /// The test's clients: `None` connects without a certificate (anonymous).
    pub client: Option<PathBuf>,
}

impl NodeTls {
    /// The `[tls]` and `[access]` sections (files checked every 100 ms).
    pub fn toml(&self) -> String {
        let list = |v: &[String]| {
            v.iter()
                .map(|s| format!("{s:?}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        format!(
            "\n[tls]\nca = {:?}\ncert = {:?}\nkey = {:?}\nreload_ms = 100\n\n[access]\nmembers = [{}]\nadmins = [{}]\n",
            self.dir.join("ca.crt"),
            self.dir.join("tls.crt"),
            self.dir.join("tls.key"),
            list(&self.members),
            list(&self.admins),
        )
    }

    /// How the test's clients dial the node: with the `client` certificate, or trusting the
    /// node's CA without one.
    pub fn dialer(&self) -> kvplane_tls::Dialer {
        match &self.client {
            Some(dir) => dialer(dir),
            None => kvplane_tls::Dialer::anonymous(&self.dir.join("ca.crt")).unwrap(),
        }
    }
}

/// A dialer presenting the certificate in `dir` (cert-manager's layout).
pub fn dialer(dir: &Path) -> kvplane_tls::Dialer {
    use kvplane_tls::{Tls, TlsMetrics, TlsSection};
    let tls = Tls::load(&TlsSection::in_dir(dir), TlsMetrics::default()).unwrap();
    kvplane_tls::Dialer::new(Some(tls))
}
