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
#[derive(Debug, Clone, Default)]
pub struct Documents {
    pub objects: Vec<(Source, Object)>,
    pub problems: Vec<Located>,
}

impl Documents {
    /// Reads every `*.yaml` / `*.yml` file under `paths` (directories recursively, files as
    /// given), in sorted order: the one place this crate touches the file system.
    pub fn read(paths: &[std::path::PathBuf]) -> std::io::Result<Documents> {
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
        let mut docs = Documents::default();
        for f in all {
            let text = std::fs::read_to_string(&f).map_err(|e| {
                std::io::Error::new(e.kind(), format!("cannot read {}: {e}", f.display()))
            })?;
            docs.add_file(&f.display().to_string(), &text);
        }
        Ok(docs)
    }

    /// Adds every document of one file's `text`.
    pub fn add_file(&mut self, file: &str, text: &str) {
        for (i, de) in serde_yaml_ng::Deserializer::from_str(text).enumerate() {
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
