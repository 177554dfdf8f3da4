//! Files replaced durably: written beside their place and fsynced, renamed over it, and the
//! directory fsynced, so a crash leaves the old file or the new one, never half of either.

use std::io::{self, Write};
use std::path::{Path, PathBuf};

/// Writes `bytes` to `<path>.<suffix>`, fsynced; [`commit`] makes it `path`.
pub fn stage(path: &Path, bytes: &[u8], suffix: &str) -> io::Result<PathBuf> {
    let mut staged = path.as_os_str().to_owned();
    staged.push(".");
    staged.push(suffix);
    let staged = PathBuf::from(staged);
    let mut f = std::fs::File::create(&staged)?;
    f.write_all(bytes)?;
    f.sync_all()?;
    Ok(staged)
}

/// Renames `staged` over `path` and fsyncs the directory.
pub fn commit(staged: &Path, path: &Path) -> io::Result<()> {
    std::fs::rename(staged, path)?;
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty());
    std::fs::File::open(dir.unwrap_or(Path::new(".")))?.sync_all()
}

/// Replaces `path` with `bytes`, durably.
pub fn replace(path: &Path, bytes: &[u8]) -> io::Result<()> {
    commit(&stage(path, bytes, "tmp")?, path)
}
