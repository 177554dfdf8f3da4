//! One process's TLS configurations, read again from their files when those change.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use arc_swap::ArcSwap;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use rustls::{ClientConfig, ServerConfig};

use crate::TlsSection;
use crate::identity::Identity;
use crate::material::{Configs, ServerCheck, TlsError};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Outcome {
    outcome: &'static str,
}

/// Counts of reloads and of handshakes that failed.
#[derive(Clone, Debug, Default)]
pub struct TlsMetrics {
    reloads: Family<Outcome, Counter>,
    handshake_failures: Counter,
}

impl TlsMetrics {
    pub fn register(&self, r: &mut Registry) {
        r.register(
            "kvplane_tls_reloads",
            "Times the TLS files changed and were read again, by outcome (loaded, or failed and the last good files kept)",
            self.reloads.clone(),
        );
        r.register(
            "kvplane_tls_handshake_failures",
            "Connections dropped because their TLS handshake failed or timed out",
            self.handshake_failures.clone(),
        );
    }

    pub(crate) fn handshake_failed(&self) {
        self.handshake_failures.inc();
    }
}

/// The current configurations of a `[tls]` section; cheap to clone.
#[derive(Clone, Debug)]
pub struct Tls {
    inner: Arc<Inner>,
}

struct Inner {
    section: TlsSection,
    current: ArcSwap<Configs>,
    metrics: TlsMetrics,
    /// The files' stamp taken before `load` read them: a change after it is seen by `watch`.
    loaded: Stamp,
    /// What a server this process dials must also be (set once, before dialing).
    server_check: std::sync::OnceLock<ServerCheck>,
}

type Stamp = Vec<Option<(SystemTime, u64)>>;

impl std::fmt::Debug for Inner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tls")
            .field("section", &self.section)
            .field("checks_servers", &self.server_check.get().is_some())
            .finish_non_exhaustive()
    }
}

/// What identifies a version of the files: their modification times and lengths.
fn stamp(s: &TlsSection) -> Stamp {
    let one = |p: &Path| {
        std::fs::metadata(p)
            .ok()
            .and_then(|m| Some((m.modified().ok()?, m.len())))
    };
    vec![one(&s.ca), one(&s.cert), one(&s.key)]
}

impl Tls {
    /// Reads the files once; every problem is an error. Call [`Tls::watch`] to follow changes.
    pub fn load(section: &TlsSection, metrics: TlsMetrics) -> Result<Tls, TlsError> {
        let loaded = stamp(section);
        let configs = Configs::load(section, None)?;
        Ok(Tls {
            inner: Arc::new(Inner {
                section: section.clone(),
                current: ArcSwap::from_pointee(configs),
                metrics,
                loaded,
                server_check: std::sync::OnceLock::new(),
            }),
        })
    }

    /// From now on, a server this process dials must name an identity `check` accepts (a
    /// member dials only members), besides the CA's signature and the host's name. Once: a
    /// second check is refused, the first kept.
    pub fn check_servers(&self, check: ServerCheck) -> Result<(), TlsError> {
        if self.inner.server_check.set(check).is_err() {
            return Err(TlsError::CheckSet);
        }
        self.reload()
    }

    pub fn server_config(&self) -> Arc<ServerConfig> {
        self.inner.current.load().server.clone()
    }

    /// The server configuration of an HTTP/1.1 listener.
    pub fn http1_server_config(&self) -> Arc<ServerConfig> {
        self.inner.current.load().http1_server.clone()
    }

    pub fn client_config(&self) -> Arc<ClientConfig> {
        self.inner.current.load().client.clone()
    }

    /// The identity this process's own certificate names.
    pub fn own_identity(&self) -> Option<Identity> {
        self.inner.current.load().own.clone()
    }

    /// What its reloads and handshakes counted.
    pub fn metrics(&self) -> &TlsMetrics {
        &self.inner.metrics
    }

    pub(crate) fn handshake_timeout(&self) -> Duration {
        Duration::from_millis(self.inner.section.handshake_timeout_ms)
    }

    /// Reads the files again now; on a problem the configurations stay as they were.
    pub fn reload(&self) -> Result<(), TlsError> {
        let outcome = match Configs::load(&self.inner.section, self.inner.server_check.get()) {
            Ok(c) => {
                self.inner.current.store(Arc::new(c));
                Ok(())
            }
            Err(e) => Err(e),
        };
        let label = if outcome.is_ok() { "loaded" } else { "failed" };
        self.inner
            .metrics
            .reloads
            .get_or_create(&Outcome { outcome: label })
            .inc();
        outcome
    }

    /// Checks the files every `reload_ms` and reads them again when one changed (cert-manager
    /// swaps a mounted secret's files at once), until the returned task is aborted.
    pub fn watch(&self) -> tokio::task::JoinHandle<()> {
        let tls = self.clone();
        tokio::spawn(async move {
            let every = Duration::from_millis(tls.inner.section.reload_ms.max(10));
            // From the files `load` read: a renewal while the process was starting counts.
            let mut seen = tls.inner.loaded.clone();
            loop {
                tokio::time::sleep(every).await;
                let now = stamp(&tls.inner.section);
                if now == seen {
                    continue;
                }
                seen = now;
                match tls.reload() {
                    Ok(()) => tracing::info!(
                        cert = %tls.inner.section.cert.display(),
                        identity = ?tls.own_identity().map(|i| i.0),
                        "tls files changed: new connections use them"
                    ),
                    Err(e) => tracing::warn!(
                        error = %e,
                        "tls files changed but cannot be used: keeping the last good ones"
                    ),
                }
            }
        })
    }
}
