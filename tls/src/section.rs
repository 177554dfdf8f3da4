//! The `[tls]` section: where a process finds its CA, certificate and key.

use std::path::PathBuf;

use serde::Deserialize;

/// PEM files of one process's TLS identity (cert-manager writes them as `ca.crt`, `tls.crt`
/// and `tls.key`). Files are read again when they change, so a rotated certificate is used for
/// new connections without a restart.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsSection {
    /// The CA whose certificates this process trusts, both for servers it dials and callers.
    pub ca: PathBuf,
    /// This process's certificate chain (leaf first).
    pub cert: PathBuf,
    /// This process's private key (PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
    /// How often the files are checked for a change, in milliseconds.
    #[serde(default = "default_reload_ms")]
    pub reload_ms: u64,
    /// How long a caller may take to finish its handshake before it is dropped, in milliseconds.
    #[serde(default = "default_handshake_timeout_ms")]
    pub handshake_timeout_ms: u64,
}

fn default_reload_ms() -> u64 {
    5_000
}

fn default_handshake_timeout_ms() -> u64 {
    10_000
}

impl TlsSection {
    /// The section for the files `ca.crt`, `tls.crt` and `tls.key` in `dir` (a mounted secret).
    pub fn in_dir(dir: impl Into<PathBuf>) -> Self {
        let dir = dir.into();
        Self {
            ca: dir.join("ca.crt"),
            cert: dir.join("tls.crt"),
            key: dir.join("tls.key"),
            reload_ms: default_reload_ms(),
            handshake_timeout_ms: default_handshake_timeout_ms(),
        }
    }
}
