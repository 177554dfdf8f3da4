//! The models' own tokenizers, loaded once and shared by every request.
//!
//! Two sources: the node config (`[[tokenizers]] model, dir`: loaded at start, a bad file is a
//! config error) and each InferenceWorkerSet's `tokenizer` directory (loaded in the background
//! as the catalog names it, see [`run_loader`], and by the policy sources, which refuse a worker
//! set whose files do not load: [`Tokenizers::check`]; one load serves both, and a directory
//! whose files change is loaded again). The request path only looks up what is loaded:
//! it never reads a file. A worker set whose files do not load is logged and counted
//! (`kvplane_tokenizer_load_failures_total`); its text requests are tokenized with the built-in
//! tokenizer until the files load, which only costs prefix hits.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime};

use kvplane_state::{StateHandle, View};
use kvplane_tokenize::{LoadError, ModelTokenizer};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// The modification times of a directory's tokenizer files.
type Stamp = [Option<SystemTime>; 3];

fn stamp(dir: &Path) -> Stamp {
    [
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
    ]
    .map(|f| {
        std::fs::metadata(dir.join(f))
            .and_then(|m| m.modified())
            .ok()
    })
}

/// A directory as last loaded: its files' stamp, and the tokenizer or why it did not load.
type Entry = (Stamp, Result<Arc<ModelTokenizer>, LoadError>);

#[derive(Debug, Default)]
struct Loaded {
    dirs: BTreeMap<PathBuf, Entry>,
    /// From the node config: model to directory.
    models: BTreeMap<String, PathBuf>,
}

/// Loaded tokenizers; cheap to share (`Arc`).
#[derive(Debug, Default)]
pub struct Tokenizers {
    inner: RwLock<Loaded>,
    failures: Counter,
    loaded: Gauge,
}

impl Tokenizers {
    /// Loads the node config's tokenizers (`(model, dir)`); the first that fails is the error.
    pub fn with_models(models: &[(String, PathBuf)]) -> Result<Self, LoadError> {
        let t = Self::default();
        {
            let mut g = t.write();
            for (model, dir) in models {
                let tok = ModelTokenizer::load(dir)?;
                g.dirs.insert(dir.clone(), (stamp(dir), Ok(Arc::new(tok))));
                g.models.insert(model.clone(), dir.clone());
            }
            t.loaded
                .set(i64::try_from(g.dirs.len()).unwrap_or(i64::MAX));
        }
        Ok(t)
    }

    pub fn register(&self, r: &mut Registry) {
        r.register(
            "kvplane_tokenizer_load_failures",
            "Tokenizer directories named by a worker set that did not load",
            self.failures.clone(),
        );
        r.register(
            "kvplane_tokenizers_loaded",
            "Model tokenizers loaded on this node",
            self.loaded.clone(),
        );
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Loaded> {
        self.inner.read().unwrap_or_else(|p| p.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Loaded> {
        self.inner.write().unwrap_or_else(|p| p.into_inner())
    }

    /// The tokenizer for requests naming `model`: the node config's, else that of a worker set
    /// serving the model (loaded already; never waits).
    pub fn for_model(&self, view: &View, model: &str) -> Option<Arc<ModelTokenizer>> {
        let g = self.read();
        if g.dirs.is_empty() {
            return None;
        }
        let dir = g.models.get(model).cloned().or_else(|| {
            view.catalog
                .worker_sets
                .values()
                .find(|s| s.serves(model) && s.tokenizer.is_some())
                .and_then(|s| s.tokenizer.as_deref().map(PathBuf::from))
        })?;
        g.dirs.get(&dir).and_then(|(_, r)| r.as_ref().ok()).cloned()
    }

    /// Whether the tokenizer in `dir` loads: loaded now if it was never tried or its files
    /// changed since (blocking: call off the request path), else as it last did.
    pub fn check(&self, dir: &Path) -> Result<(), LoadError> {
        let now = stamp(dir);
        if let Some((s, r)) = self.read().dirs.get(dir)
            && *s == now
        {
            return r.as_ref().map(drop).map_err(Clone::clone);
        }
        let result = match ModelTokenizer::load(dir) {
            Ok(t) => {
                tracing::info!(dir = %dir.display(), "model tokenizer loaded");
                Ok(Arc::new(t))
            }
            Err(e) => {
                tracing::error!(error = %e, "model tokenizer did not load");
                self.failures.inc();
                Err(e)
            }
        };
        let answer = result.as_ref().map(drop).map_err(Clone::clone);
        let mut g = self.write();
        g.dirs.insert(dir.to_owned(), (now, result));
        let ok = g.dirs.values().filter(|(_, r)| r.is_ok()).count();
        self.loaded.set(i64::try_from(ok).unwrap_or(i64::MAX));
        answer
    }
}

/// The tokenizer directories the catalog's worker sets name.
fn named(view: &View) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = view
        .catalog
        .worker_sets
        .values()
        .filter_map(|s| s.tokenizer.as_deref().map(PathBuf::from))
        .collect();
    dirs.sort();
    dirs.dedup();
    dirs
}

/// Loads the tokenizers the worker sets name as they appear or their files change (checked
/// every `every`), until `stop`.
pub async fn run_loader(
    tokenizers: Arc<Tokenizers>,
    state: StateHandle,
    every: Duration,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    loop {
        let dirs = named(&state.load());
        if !dirs.is_empty() {
            let t = tokenizers.clone();
            let _ = tokio::task::spawn_blocking(move || {
                for d in &dirs {
                    let _ = t.check(d);
                }
            })
            .await;
        }
        tokio::select! {
            _ = tokio::time::sleep(every) => {}
            _ = stop.changed() => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_directory_is_checked_once_and_again_when_its_files_change() {
        let fixture = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../tokenize/tests/fixtures/chatml-style/tokenizer.json");
        let dir = std::env::temp_dir().join(format!("kvplane-tok-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let t = Tokenizers::default();
        let missing = t.check(&dir).unwrap_err().to_string();
        assert!(missing.contains("tokenizer.json"), "{missing}");
        assert_eq!(t.failures.get(), 1);
        assert!(t.check(&dir).is_err());
        assert_eq!(
            t.failures.get(),
            1,
            "not loaded again while the files are the same"
        );
        std::fs::copy(fixture, dir.join("tokenizer.json")).unwrap();
        assert_eq!(t.check(&dir), Ok(()));
        assert_eq!(t.loaded.get(), 1);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
