//! Snapshots on disk: `DATA_DIR/snapshots/state-<index>.snap`, written to a temporary file,
//! fsynced, renamed into place, and the directory fsynced, so a crash leaves either the old
//! snapshot or the new one, never a torn file.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use kvplane_state::StateMachine;

#[derive(Debug, thiserror::Error)]
pub enum SnapshotStoreError {
    #[error("snapshot directory {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// The snapshot directory of a standalone node, under its data directory.
pub const SNAPSHOT_DIR: &str = "snapshots";

#[derive(Debug, Clone)]
pub struct SnapshotStore {
    dir: PathBuf,
    keep: usize,
}

impl SnapshotStore {
    pub fn open(data_dir: &Path, keep: usize) -> Result<Self, SnapshotStoreError> {
        let dir = data_dir.join(SNAPSHOT_DIR);
        fs::create_dir_all(&dir).map_err(|source| SnapshotStoreError::Io {
            path: dir.clone(),
            source,
        })?;
        Ok(Self {
            dir,
            keep: keep.max(1),
        })
    }

    fn io(&self, source: std::io::Error) -> SnapshotStoreError {
        SnapshotStoreError::Io {
            path: self.dir.clone(),
            source,
        }
    }

    /// Snapshot files, newest first.
    fn list(&self) -> Result<Vec<(u64, PathBuf)>, SnapshotStoreError> {
        let mut out = Vec::new();
        for entry in fs::read_dir(&self.dir).map_err(|e| self.io(e))? {
            let path = entry.map_err(|e| self.io(e))?.path();
            let index = path
                .file_name()
                .and_then(|n| n.to_str())
                .and_then(|n| n.strip_prefix("state-"))
                .and_then(|n| n.strip_suffix(".snap"))
                .and_then(|n| n.parse::<u64>().ok());
            if let Some(i) = index {
                out.push((i, path));
            }
        }
        out.sort_by_key(|b| std::cmp::Reverse(b.0));
        Ok(out)
    }

    /// Writes a snapshot of `sm` durably and prunes old ones. Returns its size in bytes.
    pub fn save(&self, sm: &StateMachine) -> Result<u64, SnapshotStoreError> {
        let bytes = sm.snapshot();
        let name = format!("state-{:020}.snap", sm.applied_index());
        let tmp = self.dir.join(format!("{name}.tmp"));
        let dst = self.dir.join(&name);
        {
            let mut f = fs::File::create(&tmp).map_err(|e| self.io(e))?;
            f.write_all(&bytes).map_err(|e| self.io(e))?;
            f.sync_all().map_err(|e| self.io(e))?;
        }
        fs::rename(&tmp, &dst).map_err(|e| self.io(e))?;
        fs::File::open(&self.dir)
            .and_then(|d| d.sync_all())
            .map_err(|e| self.io(e))?;
        for (_, old) in self.list()?.into_iter().skip(self.keep) {
            let _ = fs::remove_file(old);
        }
        Ok(bytes.len() as u64)
    }

    /// The newest snapshot that restores cleanly (damaged ones are reported and skipped),
    /// or a fresh state when there is none.
    pub fn load_latest(&self) -> Result<StateMachine, SnapshotStoreError> {
        for (index, path) in self.list()? {
            let bytes = match fs::read(&path) {
                Ok(b) => b,
                Err(e) => {
                    tracing::error!(path = %path.display(), error = %e, "cannot read snapshot; trying an older one");
                    continue;
                }
            };
            match StateMachine::restore(&bytes) {
                Ok(sm) => {
                    tracing::info!(
                        index,
                        bytes = bytes.len(),
                        digest = %sm.digest(),
                        "state restored from snapshot"
                    );
                    return Ok(sm);
                }
                Err(e) => {
                    tracing::error!(path = %path.display(), error = %e, "snapshot is unusable; trying an older one");
                }
            }
        }
        Ok(StateMachine::new())
    }
}

#[cfg(test)]
mod tests {
    use kvplane_state::{Command, Entry, POOL_KIND, PoolConfig, StateMachine};

    use super::SnapshotStore;

    fn state_at(index: u64) -> StateMachine {
        let mut sm = StateMachine::new();
        for i in 1..=index {
            sm.apply(&Entry {
                index: i,
                timestamp_ms: 0,
                command: Command::ConfigPut {
                    kind: POOL_KIND.into(),
                    name: format!("p{i}"),
                    value: PoolConfig {
                        block_size: 16,
                        models: vec![],
                        lora_adapters: Vec::new(),
                    }
                    .to_json(),
                },
            })
            .unwrap();
        }
        sm
    }

    #[test]
    fn a_damaged_newest_snapshot_falls_back_to_the_previous_one() {
        let dir = tempfile::tempdir().unwrap();
        let store = SnapshotStore::open(dir.path(), 2).unwrap();
        store.save(&state_at(2)).unwrap();
        store.save(&state_at(3)).unwrap();
        let newest = dir
            .path()
            .join("snapshots")
            .join(format!("state-{:020}.snap", 3));
        let mut bytes = std::fs::read(&newest).unwrap();
        let mid = bytes.len() / 2;
        bytes[mid] ^= 0xff;
        std::fs::write(&newest, bytes).unwrap();
        let sm = store.load_latest().unwrap();
        assert_eq!(sm.applied_index(), 2);
        assert_eq!(sm.digest(), state_at(2).digest());
    }

    #[test]
    fn only_the_newest_snapshots_are_kept() {
        let dir = tempfile::tempdir().unwrap();
        let store = SnapshotStore::open(dir.path(), 2).unwrap();
        for i in 1..=4 {
            store.save(&state_at(i)).unwrap();
        }
        let files = std::fs::read_dir(dir.path().join("snapshots"))
            .unwrap()
            .count();
        assert_eq!(files, 2);
        assert_eq!(store.load_latest().unwrap().applied_index(), 4);
    }
}
