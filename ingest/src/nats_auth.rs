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
    /// Every problem with these settings, each setting named by `name` (a config key or a
    /// flag): pairs that go together, files that cannot be read.
    pub fn problems(&self, name: impl Fn(&'static str) -> String) -> Vec<String> {
        let mut p = Vec::new();
        if self.user.is_some() != self.password_file.is_some() {
            p.push(format!(
                "{} and {} go together",
                name("user"),
                name("password_file")
            ));
        }
        if self.user.as_deref() == Some("") {
            p.push(format!("{} must not be empty", name("user")));
        }
        if self.creds_file.is_some() && self.user.is_some() {
            p.push(format!(
                "{} or {}, not both",
                name("creds_file"),
                name("user")
            ));
        }
        if self.cert.is_some() != self.key.is_some() {
            p.push(format!("{} and {} go together", name("cert"), name("key")));
        }
        for (key, path) in [
            ("creds_file", &self.creds_file),
            ("password_file", &self.password_file),
            ("ca", &self.ca),
            ("cert", &self.cert),
            ("key", &self.key),
        ] {
            if let Some(path) = path
                && let Err(e) = std::fs::File::open(path)
            {
                p.push(format!("{} {}: {e}", name(key), path.display()));
            }
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
            // A client certificate is for TLS: never sent over plaintext by mistake.
            o = o
                .add_client_certificate(cert.clone(), key.clone())
                .require_tls(true);
        }
        Ok(o)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_problem_is_named_by_the_callers_own_names() {
        let a = NatsAuth {
            creds_file: Some("/nonexistent/node.creds".into()),
            user: Some(String::new()),
            password_file: None,
            ca: None,
            cert: Some("/nonexistent/tls.crt".into()),
            key: None,
        };
        let p = a.problems(|k| format!("nats.{k}"));
        for want in [
            "nats.user and nats.password_file go together",
            "nats.user must not be empty",
            "nats.creds_file or nats.user, not both",
            "nats.cert and nats.key go together",
            "nats.creds_file /nonexistent/node.creds: ",
            "nats.cert /nonexistent/tls.crt: ",
        ] {
            assert!(p.iter().any(|x| x.starts_with(want)), "{want}: {p:#?}");
        }
        assert!(NatsAuth::default().problems(|k| k.to_owned()).is_empty());
    }
}
