//! The policy sources' check of a worker set's `tokenizer` directory: its files must load on
//! this node before the object is accepted (a bad path is refused with its reason, like any
//! other invalid field). Results are kept until the files change, so a resync does not parse
//! a large `tokenizer.json` again.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::SystemTime;

use kvplane_policy::kinds::InferenceWorkerSetSpec;

type Stamp = [Option<SystemTime>; 3];
/// A directory's files as last seen, and whether they loaded.
type Seen = (Stamp, Result<(), String>);

#[derive(Debug, Default)]
pub struct TokenizerCheck {
    seen: Mutex<BTreeMap<PathBuf, Seen>>,
}

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

impl TokenizerCheck {
    /// Why `spec`'s tokenizer does not load here (`spec.tokenizer: ...`), if it names one.
    pub fn problem(&self, spec: &InferenceWorkerSetSpec) -> Option<String> {
        let dir = PathBuf::from(spec.tokenizer.as_deref()?);
        let now = stamp(&dir);
        let mut seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        let fresh = seen.get(&dir).is_some_and(|(s, _)| *s == now);
        if !fresh {
            let result = kvplane_tokenize::ModelTokenizer::load(&dir)
                .map(drop)
                .map_err(|e| e.to_string());
            seen.insert(dir.clone(), (now, result));
        }
        match &seen.get(&dir)?.1 {
            Ok(()) => None,
            Err(e) => Some(format!("spec.tokenizer: {e}")),
        }
    }
}
