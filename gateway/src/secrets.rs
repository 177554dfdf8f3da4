//! Providers' credentials, where the gateway finds them: a file per key under a directory laid
//! out as Kubernetes mounts a Secret (`<dir>/<secret name>/<key>`), else an environment
//! variable `KVPLANE_SECRET_<NAME>_<KEY>` (upper case, other characters `_`). Read on every
//! use, so a rotated Secret takes effect without a restart; never logged.

use std::path::PathBuf;

/// Where credentials are looked up.
#[derive(Debug, Clone, Default)]
pub struct Secrets {
    pub dir: Option<PathBuf>,
}

/// Why a provider's credential could not be had (names only: never the value).
#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    #[error("secret {name}/{key} is neither a file under {dir} nor in ${env}")]
    Missing {
        name: String,
        key: String,
        dir: String,
        env: String,
    },
    #[error("secret {name}/{key} at {path} cannot be read: {error}")]
    Unreadable {
        name: String,
        key: String,
        path: String,
        error: std::io::Error,
    },
}

/// The environment variable holding secret `name`'s `key`.
pub fn env_name(name: &str, key: &str) -> String {
    let up = |s: &str| -> String {
        s.chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() {
                    c.to_ascii_uppercase()
                } else {
                    '_'
                }
            })
            .collect()
    };
    format!("KVPLANE_SECRET_{}_{}", up(name), up(key))
}

impl Secrets {
    /// Secret `name`'s `key`, trailing line breaks trimmed.
    pub async fn get(&self, name: &str, key: &str) -> Result<String, SecretError> {
        self.get_with(name, key, |v| std::env::var(v).ok()).await
    }

    /// The same, with the environment read through `env`.
    async fn get_with(
        &self,
        name: &str,
        key: &str,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<String, SecretError> {
        // A path component is never taken from a name with separators in it.
        let plain = |s: &str| !s.is_empty() && !s.contains(['/', '\\']) && s != "..";
        if let Some(dir) = &self.dir
            && plain(name)
            && plain(key)
        {
            let path = dir.join(name).join(key);
            match tokio::fs::read_to_string(&path).await {
                Ok(v) => return Ok(v.trim_end_matches(['\r', '\n']).to_owned()),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(error) => {
                    return Err(SecretError::Unreadable {
                        name: name.to_owned(),
                        key: key.to_owned(),
                        path: path.display().to_string(),
                        error,
                    });
                }
            }
        }
        let var = env_name(name, key);
        env(&var).ok_or_else(|| SecretError::Missing {
            name: name.to_owned(),
            key: key.to_owned(),
            dir: self
                .dir
                .as_ref()
                .map_or_else(|| "(no directory)".to_owned(), |d| d.display().to_string()),
            env: var,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_secret_is_read_from_its_mounted_file_trimmed_and_a_missing_one_named_without_its_value()
     {
        let dir = std::env::temp_dir().join(format!("kvplane-secrets-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("cloud")).unwrap();
        std::fs::write(dir.join("cloud").join("token"), "sk-test\n").unwrap();
        let s = Secrets {
            dir: Some(dir.clone()),
        };
        assert_eq!(s.get("cloud", "token").await.unwrap(), "sk-test");
        let e = s.get("other", "api-key").await.unwrap_err().to_string();
        assert!(e.contains("other/api-key"), "{e}");
        assert!(e.contains("$KVPLANE_SECRET_OTHER_API_KEY"), "{e}");
        assert!(
            s.get("../cloud", "token").await.is_err(),
            "no path out of the directory"
        );
        std::fs::remove_dir_all(dir).unwrap();
    }
}
