//! How a node or a bridge proves who it is to NATS, and the TLS it speaks there. NATS's own
//! permissions then decide what it may publish: a bridge's user only its worker's subjects.

use std::path::PathBuf;

use serde::Deserialize;

/// Credentials and TLS for a NATS connection (`[nats]` in a node's config; a bridge's
/// `--nats-*` flags). Nothing set: an anonymous, plaintext connection.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct NatsAuth {
    /// A credentials file (a user JWT and its nkey seed, as `nsc` writes them).
    pub creds_file: Option<PathBuf>,
    /// A user name, with the password in `password_file`.
    pub user: Option<String>,
    pub password_file: Option<PathBuf>,
    /// The CA the server's certificate must come from: TLS is then required.
    pub ca: Option<PathBuf>,
    /// A client certificate and its key, for a server that verifies clients.
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
}

/// Why the NATS credentials cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum NatsAuthError {
    #[error("nats credentials file {path}: {source}")]
    Creds {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("nats password file {path}: {source}")]
    Password {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

impl NatsAuth {
    /// Every problem with these settings (`prefix` names where they come from).
    pub fn problems(&self, prefix: &str) -> Vec<String> {
        let mut p = Vec::new();
        if self.user.is_some() != self.password_file.is_some() {
            p.push(format!("{prefix}: user and password_file go together"));
        }
        if self.creds_file.is_some() && self.user.is_some() {
            p.push(format!("{prefix}: a creds_file or a user, not both"));
        }
        if self.cert.is_some() != self.key.is_some() {
            p.push(format!("{prefix}: cert and key go together"));
        }
        p
    }

    /// `o` with these credentials and TLS settings.
    pub async fn apply(
        &self,
        mut o: async_nats::ConnectOptions,
    ) -> Result<async_nats::ConnectOptions, NatsAuthError> {
        if let Some(path) = &self.creds_file {
            o = o
                .credentials_file(path)
                .await
                .map_err(|source| NatsAuthError::Creds {
                    path: path.clone(),
                    source,
                })?;
        }
        if let (Some(user), Some(path)) = (&self.user, &self.password_file) {
            let password =
                std::fs::read_to_string(path).map_err(|source| NatsAuthError::Password {
                    path: path.clone(),
                    source,
                })?;
            o = o.user_and_password(user.clone(), password.trim_end().to_owned());
        }
        if let Some(ca) = &self.ca {
            o = o.add_root_certificates(ca.clone()).require_tls(true);
        }
        if let (Some(cert), Some(key)) = (&self.cert, &self.key) {
            o = o.add_client_certificate(cert.clone(), key.clone());
        }
        Ok(o)
    }
}
