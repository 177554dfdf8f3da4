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
    #[error("the certificate verifier cannot be built: {0}")]
    Verifier(#[from] rustls::server::VerifierBuilderError),
    #[error("servers are already checked")]
    CheckSet,
    #[error("{cert} with {key}: {source}")]
    KeyPair {
        cert: PathBuf,
        key: PathBuf,
        #[source]
        source: rustls::Error,
    },
}

/// Which servers a process accepts beyond the CA's signature and the host's name: the
/// identity its certificate must name (members accept only members).
pub type ServerCheck = Arc<dyn Fn(&Identity) -> bool + Send + Sync>;

/// The CA's check of a server's certificate, then `check` of the identity it names.
struct CheckedVerifier {
    webpki: Arc<rustls::client::WebPkiServerVerifier>,
    check: ServerCheck,
}

impl std::fmt::Debug for CheckedVerifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CheckedVerifier").finish_non_exhaustive()
    }
}

impl rustls::client::danger::ServerCertVerifier for CheckedVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &rustls::pki_types::ServerName<'_>,
        ocsp_response: &[u8],
        now: rustls::pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        let verified = self.webpki.verify_server_cert(
            end_entity,
            intermediates,
            server_name,
            ocsp_response,
            now,
        )?;
        match Identity::of_certificate(end_entity) {
            Some(id) if (self.check)(&id) => Ok(verified),
            Some(id) => Err(rustls::Error::General(format!(
                "the server at {server_name:?} is {id}, not a member"
            ))),
            None => Err(rustls::Error::General(format!(
                "the server at {server_name:?} names no identity"
            ))),
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.webpki.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.webpki.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.webpki.supported_verify_schemes()
    }
}

/// The configurations one version of the files gives.
#[derive(Debug)]
pub(crate) struct Configs {
    pub server: Arc<ServerConfig>,
    /// The same, offering HTTP/1.1 (the HTTP listeners: gateway, metrics and probes).
    pub http1_server: Arc<ServerConfig>,
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
    let roots = roots(ca)?;
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

/// The CA certificates in `path`, as roots.
fn roots(path: &Path) -> Result<Arc<RootCertStore>, TlsError> {
    let mut roots = RootCertStore::empty();
    for ca in certificates(path)? {
        roots.add(ca).map_err(|source| TlsError::Ca {
            path: path.to_owned(),
            source,
        })?;
    }
    Ok(Arc::new(roots))
}

impl Configs {
    /// The files of `s`; servers this process dials must also pass `check`, when given.
    pub(crate) fn load(s: &TlsSection, check: Option<&ServerCheck>) -> Result<Configs, TlsError> {
        let roots = roots(&s.ca)?;
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
        // The HTTP/1.1 listeners (a gateway's clients, scrapers, probes) ask for no client
        // certificate: they tell no caller apart.
        let mut http1_server = ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(key_pair)?
            .with_no_client_auth()
            .with_single_cert(chain.clone(), key.clone_key())
            .map_err(key_pair)?;
        http1_server.alpn_protocols = vec![b"http/1.1".to_vec()];
        server.alpn_protocols = vec![ALPN_H2.to_vec()];
        let builder = ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(key_pair)?;
        let builder = match check {
            None => builder.with_root_certificates(roots),
            Some(check) => {
                let webpki =
                    rustls::client::WebPkiServerVerifier::builder_with_provider(roots, provider())
                        .build()?;
                builder
                    .dangerous()
                    .with_custom_certificate_verifier(Arc::new(CheckedVerifier {
                        webpki,
                        check: check.clone(),
                    }))
            }
        };
        let mut client = builder
            .with_client_auth_cert(chain, key)
            .map_err(key_pair)?;
        client.alpn_protocols = vec![ALPN_H2.to_vec()];
        Ok(Configs {
            server: Arc::new(server),
            http1_server: Arc::new(http1_server),
            client: Arc::new(client),
            own,
        })
    }
}
