//! One process per data directory: `DATA_DIR/LOCK`, locked exclusively (an OS file lock, so a
//! killed process never leaves it held) for as long as the node runs. A second node on the same
//! directory refuses to start, touching nothing.

use std::fs::{File, OpenOptions, TryLockError};
use std::io::{Read, Seek, Write};
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum DataDirError {
    #[error("data directory {dir}: {source}")]
    Io {
        dir: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("data directory {dir} is in use by another kvplane process{holder}")]
    InUse { dir: PathBuf, holder: String },
}

/// Holds the lock until dropped.
#[derive(Debug)]
pub struct DataDirLock {
    _file: File,
}

impl DataDirLock {
    /// Creates `dir` if needed and locks it.
    pub fn acquire(dir: &Path) -> Result<Self, DataDirError> {
        let io = |source| DataDirError::Io {
            dir: dir.to_owned(),
            source,
        };
        std::fs::create_dir_all(dir).map_err(io)?;
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(dir.join("LOCK"))
            .map_err(io)?;
        match file.try_lock() {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) => {
                let mut pid = String::new();
                let _ = file.read_to_string(&mut pid);
                let pid = pid.trim();
                return Err(DataDirError::InUse {
                    dir: dir.to_owned(),
                    holder: if pid.is_empty() {
                        String::new()
                    } else {
                        format!(" (pid {pid})")
                    },
                });
            }
            Err(TryLockError::Error(e)) => return Err(io(e)),
        }
        file.set_len(0).map_err(io)?;
        file.rewind().map_err(io)?;
        writeln!(file, "{}", std::process::id()).map_err(io)?;
        file.sync_all().map_err(io)?;
        Ok(Self { _file: file })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn a_second_lock_on_a_directory_in_use_is_refused_and_the_first_released_on_drop() {
        let dir = tempfile::tempdir().unwrap();
        let first = DataDirLock::acquire(dir.path()).unwrap();
        let err = DataDirLock::acquire(dir.path()).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("is in use by another kvplane process"),
            "{msg}"
        );
        assert!(
            msg.contains(&format!("pid {}", std::process::id())),
            "{msg}"
        );
        drop(first);
        DataDirLock::acquire(dir.path()).unwrap();
    }
}
