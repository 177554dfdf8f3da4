//! Who a caller is: the name its certificate gives it.

use std::net::SocketAddr;

use x509_parser::extensions::GeneralName;
use x509_parser::prelude::{FromDer, X509Certificate};

/// A caller's identity: its certificate's first URI name (a SPIFFE id such as
/// `spiffe://cluster.local/ns/gw/sa/gateway`), else its first DNS name.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Identity(pub String);

impl std::fmt::Display for Identity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl Identity {
    /// The identity a DER certificate names, if it names one. DNS names are compared in lower
    /// case, and one spelled like a URI names nothing (it cannot pass for a SPIFFE id).
    pub fn of_certificate(der: &[u8]) -> Option<Identity> {
        let (_, cert) = X509Certificate::from_der(der).ok()?;
        let names = cert.subject_alternative_name().ok().flatten()?;
        let names = &names.value.general_names;
        let uri = names.iter().find_map(|n| match n {
            GeneralName::URI(u) => Some(*u),
            _ => None,
        });
        let dns = || {
            names.iter().find_map(|n| match n {
                GeneralName::DNSName(d) => Some(*d),
                _ => None,
            })
        };
        match uri {
            Some(u) => Some(Identity(u.to_owned())),
            None => dns()
                .filter(|d| !d.contains("://"))
                .map(|d| Identity(d.to_ascii_lowercase())),
        }
    }
}

/// What the listener knows of the other end of one connection; every request on it carries this
/// in its extensions.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Peer {
    pub remote: Option<SocketAddr>,
    /// Whether the connection is TLS (callers without TLS have no identity to check).
    pub tls: bool,
    /// The identity of the certificate the caller presented, verified against the CA.
    pub identity: Option<Identity>,
}
