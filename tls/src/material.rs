//! The PEM files of a `[tls]` section made into rustls configurations.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, RootCertStore, ServerConfig};

use crate::TlsSection;
use crate::identity::Identity;

/// Why a process's TLS files could not be used.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{path}: {source}")]
    Pem {
        path: PathBuf,
        #[source]
        source: rustls::pki_types::pem::Error,
    },
    #[error("{path}: no certificate in the file")]
    NoCertificate { path: PathBuf },
    #[error("{path}: the CA certificate is not usable: {source}")]
    Ca {
        path: PathBuf,
        #[source]
        source: rustls::Error,
    },
    #[error("the client verifier cannot be built: {0}")]
    Verifier(#[from] rustls::server::VerifierBuilderError),
    #[error("{cert} with {key}: {source}")]
    KeyPair {
        cert: PathBuf,
        key: PathBuf,
        #[source]
        source: rustls::Error,
    },
}

/// The configurations one version of the files gives.
#[derive(Debug)]
pub(crate) struct Configs {
    pub server: Arc<ServerConfig>,
    pub client: Arc<ClientConfig>,
    /// The identity this process's own certificate names.
    pub own: Option<Identity>,
}

fn certificates(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let pem = |source| TlsError::Pem {
        path: path.to_owned(),
        source,
    };
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(pem)?
        .collect::<Result<Vec<_>, _>>()
        .map_err(pem)?;
    if certs.is_empty() {
        return Err(TlsError::NoCertificate {
            path: path.to_owned(),
        });
    }
    Ok(certs)
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// A client configuration trusting the CA in `ca` that presents no certificate.
pub(crate) fn anonymous_client(ca: &Path) -> Result<Arc<ClientConfig>, TlsError> {
    let mut roots = RootCertStore::empty();
    for c in certificates(ca)? {
        roots.add(c).map_err(|source| TlsError::Ca {
            path: ca.to_owned(),
            source,
        })?;
    }
    let mut client = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|source| TlsError::Ca {
            path: ca.to_owned(),
            source,
        })?
        .with_root_certificates(roots)
        .with_no_client_auth();
    client.alpn_protocols = vec![ALPN_H2.to_vec()];
    Ok(Arc::new(client))
}

/// HTTP/2 only: every kvplane gRPC connection.
const ALPN_H2: &[u8] = b"h2";

impl Configs {
    pub(crate) fn load(s: &TlsSection) -> Result<Configs, TlsError> {
        let mut roots = RootCertStore::empty();
        for ca in certificates(&s.ca)? {
            roots.add(ca).map_err(|source| TlsError::Ca {
                path: s.ca.clone(),
                source,
            })?;
        }
        let roots = Arc::new(roots);
        let chain = certificates(&s.cert)?;
        let key = PrivateKeyDer::from_pem_file(&s.key).map_err(|source| TlsError::Pem {
            path: s.key.clone(),
            source,
        })?;
        let key_pair = |source| TlsError::KeyPair {
            cert: s.cert.clone(),
            key: s.key.clone(),
            source,
        };
        let own = Identity::of_certificate(&chain[0]);
        // Callers without a certificate finish the handshake and are refused per call, with
        // the right they lack (health checks and reflection need none).
        let verifier = WebPkiClientVerifier::builder_with_provider(roots.clone(), provider())
            .allow_unauthenticated()
            .build()?;
        let mut server = ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(key_pair)?
            .with_client_cert_verifier(verifier)
            .with_single_cert(chain.clone(), key.clone_key())
            .map_err(key_pair)?;
        server.alpn_protocols = vec![ALPN_H2.to_vec()];
        let mut client = ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(key_pair)?
            .with_root_certificates(roots)
            .with_client_auth_cert(chain, key)
            .map_err(key_pair)?;
        client.alpn_protocols = vec![ALPN_H2.to_vec()];
        Ok(Configs {
            server: Arc::new(server),
            client: Arc::new(client),
            own,
        })
    }
}
