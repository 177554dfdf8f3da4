//! Policy objects from YAML text: every document of every file, every problem located by file,
//! document and field path.

use std::collections::BTreeMap;

use serde::Deserialize;

use crate::catalog::Catalog;
use crate::object::{Kind, Object};

/// Where an object came from.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Source {
    pub file: String,
    /// 1-based document number in the file.
    pub doc: usize,
}

/// One problem with a set of documents.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Located {
    pub source: Source,
    /// `Kind/name` when the document got that far.
    pub object: Option<String>,
    pub path: String,
    pub message: String,
}

impl std::fmt::Display for Located {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} (document {})", self.source.file, self.source.doc)?;
        if let Some(o) = &self.object {
            write!(f, " {o}")?;
        }
        if self.path.is_empty() {
            write!(f, ": {}", self.message)
        } else {
            write!(f, " {}: {}", self.path, self.message)
        }
    }
}

/// Parsed documents, not yet checked against each other.
#[derive(Debug, Clone)]
pub struct Documents {
    pub objects: Vec<(Source, Object)>,
    pub problems: Vec<Located>,
    /// FileBounds on what one file may hold.
    pub bounds: FileBounds,
}

impl Default for Documents {
    fn default() -> Self {
        Self::bounded(FileBounds::default())
    }
}

/// What one policy file may hold: its size, and the YAML nodes its documents expand to with
/// their aliases followed. A file over its size is a problem and none of its documents is
/// read; over its nodes, a problem at the document that went over, and the documents before
/// it are read (a node refuses a directory with any problem as a whole).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileBounds {
    pub file_bytes: usize,
    pub file_nodes: usize,
}

impl Default for FileBounds {
    fn default() -> Self {
        Self {
            file_bytes: 4 << 20,
            file_nodes: 1_000_000,
        }
    }
}

impl Documents {
    /// No documents yet; files over `bounds` will be problems.
    pub fn bounded(bounds: FileBounds) -> Self {
        Self {
            objects: Vec::new(),
            problems: Vec::new(),
            bounds,
        }
    }

    /// Reads every `*.yaml` / `*.yml` file under `paths` (directories recursively, files as
    /// given), in sorted order: the one place this crate touches the file system.
    pub fn read(paths: &[std::path::PathBuf]) -> std::io::Result<Documents> {
        Self::read_bounded(paths, FileBounds::default())
    }

    /// [`Documents::read`] with `bounds` on each file.
    pub fn read_bounded(
        paths: &[std::path::PathBuf],
        bounds: FileBounds,
    ) -> std::io::Result<Documents> {
        fn files(p: &std::path::Path, out: &mut Vec<std::path::PathBuf>) -> std::io::Result<()> {
            if p.is_file() {
                out.push(p.to_owned());
                return Ok(());
            }
            let mut here = Vec::new();
            for e in std::fs::read_dir(p)? {
                let e = e?.path();
                if e.is_dir() {
                    files(&e, &mut here)?;
                } else if e.extension().is_some_and(|x| x == "yaml" || x == "yml") {
                    here.push(e);
                }
            }
            here.sort();
            out.extend(here);
            Ok(())
        }
        let mut all = Vec::new();
        for p in paths {
            files(p, &mut all).map_err(|e| {
                std::io::Error::new(e.kind(), format!("cannot read {}: {e}", p.display()))
            })?;
        }
        let mut docs = Documents::bounded(bounds);
        for f in all {
            // One byte past the bound is enough to know the file is over it (read as bytes:
            // the cut may fall inside a character).
            let cap = u64::try_from(bounds.file_bytes).unwrap_or(u64::MAX);
            let mut bytes = Vec::new();
            std::fs::File::open(&f)
                .and_then(|file| {
                    std::io::Read::read_to_end(
                        &mut std::io::Read::take(file, cap.saturating_add(1)),
                        &mut bytes,
                    )
                })
                .map_err(|e| {
                    std::io::Error::new(e.kind(), format!("cannot read {}: {e}", f.display()))
                })?;
            if bytes.len() > bounds.file_bytes {
                docs.too_large(&f.display().to_string());
                continue;
            }
            let text = String::from_utf8(bytes).map_err(|e| {
                std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!("cannot read {}: {e}", f.display()),
                )
            })?;
            docs.add_file(&f.display().to_string(), &text);
        }
        Ok(docs)
    }

    fn too_large(&mut self, file: &str) {
        self.problems.push(Located {
            source: Source {
                file: file.to_owned(),
                doc: 1,
            },
            object: None,
            path: String::new(),
            message: format!(
                "the file is over the limit of {} bytes (a node's limits.policy_file_bytes)",
                self.bounds.file_bytes
            ),
        });
    }

    /// Adds every document of one file's `text`; a file over the bounds adds a problem and
    /// no document.
    pub fn add_file(&mut self, file: &str, text: &str) {
        if text.len() > self.bounds.file_bytes {
            self.too_large(file);
            return;
        }
        // Counted before anything is built: aliases cannot make a document larger than this.
        // The first document that fails (too large, or not YAML) ends the file.
        let seen = std::cell::Cell::new(0);
        let mut first_bad = None;
        for (i, de) in serde_yaml_ng::Deserializer::from_str(text).enumerate() {
            let budget = crate::expansion::Budget {
                seen: &seen,
                limit: self.bounds.file_nodes,
            };
            if let Err(e) = serde::de::DeserializeSeed::deserialize(budget, de) {
                first_bad = Some((i, e));
                break;
            }
        }
        let good = first_bad.as_ref().map_or(usize::MAX, |(i, _)| *i);
        for (i, de) in serde_yaml_ng::Deserializer::from_str(text)
            .enumerate()
            .take(good)
        {
            let source = Source {
                file: file.to_owned(),
                doc: i + 1,
            };
            let value = match serde_yaml_ng::Value::deserialize(de) {
                Ok(serde_yaml_ng::Value::Null) => continue,
                Ok(v) => v,
                Err(e) => {
                    self.problems.push(Located {
                        source,
                        object: None,
                        path: String::new(),
                        message: format!("not valid YAML: {e}"),
                    });
                    // The rest of the file cannot be trusted to split into documents.
                    break;
                }
            };
            let label = object_label(&value);
            match Object::from_yaml(value) {
                Ok(o) => self.objects.push((source, o)),
                Err(e) => self.problems.push(Located {
                    source,
                    object: label,
                    path: e.path,
                    message: e.message,
                }),
            }
        }
        if let Some((i, e)) = first_bad {
            self.problems.push(Located {
                source: Source {
                    file: file.to_owned(),
                    doc: i + 1,
                },
                object: None,
                path: String::new(),
                message: format!("not valid YAML: {e}"),
            });
        }
    }

    /// Checks the documents as one set: duplicate names, then the catalog's consistency.
    /// Returns the catalog and every problem (parse problems included), sorted.
    pub fn check(self) -> (Catalog, Vec<Located>) {
        let mut problems = self.problems;
        let mut seen: BTreeMap<(Kind, String), Source> = BTreeMap::new();
        let mut catalog = Catalog::default();
        for (source, o) in self.objects {
            let key = (o.kind(), o.name.clone());
            if let Some(first) = seen.get(&key) {
                problems.push(Located {
                    source,
                    object: Some(format!("{}/{}", key.0, key.1)),
                    path: "metadata.name".into(),
                    message: format!(
                        "defined twice (first in {} document {})",
                        first.file, first.doc
                    ),
                });
                continue;
            }
            seen.insert(key, source);
            catalog.insert(o);
        }
        for p in catalog.lint() {
            let source = seen
                .get(&(p.kind, p.name.clone()))
                .cloned()
                .unwrap_or(Source {
                    file: "?".into(),
                    doc: 0,
                });
            problems.push(Located {
                source,
                object: Some(format!("{}/{}", p.kind, p.name)),
                path: p.path,
                message: p.message,
            });
        }
        problems.sort();
        (catalog, problems)
    }
}

fn object_label(v: &serde_yaml_ng::Value) -> Option<String> {
    let kind = v.get("kind")?.as_str()?;
    let name = v.get("metadata")?.get("name")?.as_str()?;
    Some(format!("{kind}/{name}"))
}
