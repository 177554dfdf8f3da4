//! How the subcommands reach a node: plaintext, or TLS with a client certificate.

use std::path::PathBuf;

use anyhow::Context as _;
use kvplane_tls::{Dialer, Tls, TlsMetrics, TlsSection};
use tonic::transport::Channel;

/// The client certificate a subcommand presents.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct TlsArgs {
    /// A directory with `ca.crt`, `tls.crt` and `tls.key` (a cert-manager secret's layout):
    /// connect over TLS, named by this certificate. Without it: plaintext.
    #[arg(long, env = "KVPLANE_TLS_DIR", value_name = "DIR")]
    pub tls_dir: Option<PathBuf>,
}

impl TlsArgs {
    /// The files, read now (a long-running process calls [`Tls::watch`] to follow renewals).
    pub fn load(&self) -> anyhow::Result<Option<Tls>> {
        let Some(dir) = &self.tls_dir else {
            return Ok(None);
        };
        let tls = Tls::load(&TlsSection::in_dir(dir), TlsMetrics::default())
            .with_context(|| format!("cannot use the TLS files in {}", dir.display()))?;
        Ok(Some(tls))
    }

    pub fn dialer(&self) -> anyhow::Result<Dialer> {
        Ok(Dialer::new(self.load()?))
    }

    /// A channel to `addr`, connected now.
    pub async fn connect(&self, addr: &str) -> anyhow::Result<Channel> {
        self.dialer()?
            .connect(addr)
            .await
            .with_context(|| format!("cannot connect to {addr}"))
    }
}
