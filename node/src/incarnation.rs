//! This process's incarnation in the quota ledger: the ledger retires what a replica's earlier
//! process held when a batch of a later incarnation arrives, and ignores batches of earlier
//! ones. The wall clock alone would fail closed after it steps back (a restarted process would
//! look older than its predecessor and get no grants): the last incarnation is kept in
//! `DATA_DIR/incarnation`, and a new one is later than both it and the clock.

use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
#[error("quota incarnation file {path}: {source}")]
pub struct IncarnationError {
    path: PathBuf,
    #[source]
    source: std::io::Error,
}

/// The next incarnation (at least `now_ms`, and above the last one recorded), recorded durably
/// before it is returned.
pub fn next(data_dir: &Path, now_ms: u64) -> Result<u64, IncarnationError> {
    let path = data_dir.join("incarnation");
    let io = |source| IncarnationError {
        path: path.clone(),
        source,
    };
    let last = match std::fs::read_to_string(&path) {
        Ok(text) => {
            let last = text.trim().parse::<u64>().ok();
            if last.is_none() {
                tracing::warn!(path = %path.display(), "quota incarnation file unreadable; starting from the clock");
            }
            last
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => return Err(io(e)),
    };
    let next = last.map_or(now_ms, |l| now_ms.max(l.saturating_add(1)));
    std::fs::create_dir_all(data_dir).map_err(io)?;
    kvplane_raft::durable::replace(&path, format!("{next}\n").as_bytes()).map_err(io)?;
    Ok(next)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::next;

    #[test]
    fn a_restart_after_the_clock_stepped_back_is_still_a_later_incarnation() {
        let dir = tempfile::tempdir().unwrap();
        let first = next(dir.path(), 5_000).unwrap();
        assert_eq!(first, 5_000);
        // The clock went back an hour.
        let second = next(dir.path(), 5_000 - 3_600).unwrap();
        assert!(second > first, "{second} <= {first}");
        // And forward again: the clock wins once it is ahead.
        assert_eq!(next(dir.path(), 9_000).unwrap(), 9_000);
    }

    #[test]
    fn an_unreadable_record_starts_from_the_clock() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("incarnation"), "not a number").unwrap();
        assert_eq!(next(dir.path(), 7).unwrap(), 7);
    }
}
