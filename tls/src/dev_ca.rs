//! A certificate authority for development and tests (`kvplane tls dev-certs`, the test fleet):
//! certificates naming an identity and the hosts they serve. Production certificates come from
//! cert-manager (`deploy/`).

use std::path::Path;

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, SanType,
};

use crate::TlsSection;

/// Why a development certificate could not be made or written.
#[derive(Debug, thiserror::Error)]
pub enum DevCaError {
    #[error("cannot make the certificate: {0}")]
    Generate(#[from] rcgen::Error),
    #[error("{path}: {source}")]
    Write {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// A self-signed CA that issues leaf certificates.
pub struct DevCa {
    issuer: CertifiedIssuer<'static, KeyPair>,
}

impl std::fmt::Debug for DevCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DevCa").finish_non_exhaustive()
    }
}

/// A leaf certificate and its key, PEM.
#[derive(Debug, Clone)]
pub struct Issued {
    pub cert: String,
    pub key: String,
}

impl DevCa {
    /// A new CA whose certificate's common name is `name`.
    pub fn new(name: &str) -> Result<DevCa, DevCaError> {
        let mut p = CertificateParams::new(Vec::<String>::new())?;
        p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        p.distinguished_name.push(DnType::CommonName, name);
        let issuer = CertifiedIssuer::self_signed(p, KeyPair::generate()?)?;
        Ok(DevCa { issuer })
    }

    pub fn ca_pem(&self) -> String {
        self.issuer.pem()
    }

    /// A certificate naming `identity` (a URI such as a SPIFFE id, or a DNS name): for clients
    /// and servers of `hosts` (DNS names or IP addresses), or, with no hosts, for clients only
    /// (it cannot pass for a server).
    pub fn issue(&self, identity: &str, hosts: &[&str]) -> Result<Issued, DevCaError> {
        let mut p = CertificateParams::new(Vec::<String>::new())?;
        p.distinguished_name.push(DnType::CommonName, identity);
        p.extended_key_usages = if hosts.is_empty() {
            vec![ExtendedKeyUsagePurpose::ClientAuth]
        } else {
            vec![
                ExtendedKeyUsagePurpose::ServerAuth,
                ExtendedKeyUsagePurpose::ClientAuth,
            ]
        };
        // The identity first: it is the name a caller is known by.
        p.subject_alt_names.push(if identity.contains("://") {
            SanType::URI(identity.try_into()?)
        } else {
            SanType::DnsName(identity.try_into()?)
        });
        for h in hosts {
            p.subject_alt_names.push(match h.parse() {
                Ok(ip) => SanType::IpAddress(ip),
                Err(_) => SanType::DnsName((*h).try_into()?),
            });
        }
        let key = KeyPair::generate()?;
        let cert = p.signed_by(&key, &self.issuer)?;
        Ok(Issued {
            cert: cert.pem(),
            key: key.serialize_pem(),
        })
    }

    /// Writes `ca.crt`, `tls.crt` and `tls.key` (a certificate from [`DevCa::issue`]) into
    /// `dir`, as cert-manager lays out a secret; the section that reads them.
    pub fn write(
        &self,
        dir: &Path,
        identity: &str,
        hosts: &[&str],
    ) -> Result<TlsSection, DevCaError> {
        let issued = self.issue(identity, hosts)?;
        let section = TlsSection::in_dir(dir);
        let write = |path: &Path, text: &str| {
            use std::io::Write as _;
            use std::os::unix::fs::OpenOptionsExt as _;
            // Readable by the owner only: one of these is a private key.
            std::fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o600)
                .open(path)
                .and_then(|mut f| f.write_all(text.as_bytes()))
                .map_err(|source| DevCaError::Write {
                    path: path.to_owned(),
                    source,
                })
        };
        std::fs::create_dir_all(dir).map_err(|source| DevCaError::Write {
            path: dir.to_owned(),
            source,
        })?;
        write(&section.ca, &self.ca_pem())?;
        write(&section.key, &issued.key)?;
        write(&section.cert, &issued.cert)?;
        Ok(section)
    }
}
