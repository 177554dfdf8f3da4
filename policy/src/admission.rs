//! Admission of objects that arrive one by one (a Kubernetes cluster holds them, and any of
//! them may be wrong): each object is accepted or refused on its own, and the catalog keeps
//! the last accepted version of a refused object, so a typo in an edit never takes a live pool
//! away. Objects that only fail because of a refused neighbour are refused too, naming it.

use std::collections::{BTreeMap, BTreeSet};

use crate::{Catalog, Kind, Object, ParseError};

/// One object as submitted: parsed, or why it cannot be taken.
#[derive(Debug, Clone, PartialEq)]
pub struct Submitted {
    pub kind: Kind,
    pub name: String,
    pub object: Result<Object, Refused>,
}

/// Why an object was refused (the text its status shows).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    /// It does not parse, does not validate, or does not fit the objects beside it.
    #[error("{0}")]
    Invalid(#[from] ParseError),
    /// Another config source owns an object of that kind and name.
    #[error("{kind}/{name} is owned by {owner}: change it there, or delete it there first")]
    Owned {
        kind: Kind,
        name: String,
        owner: String,
    },
}

/// What [`admit`] decided.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Admission {
    /// What the replicated catalog should become: consistent (no [`Catalog::problems`]).
    pub catalog: Catalog,
    /// Refused objects and why, by kind and name; every other submitted object is accepted.
    pub refused: BTreeMap<(Kind, String), Refused>,
}

/// Admits what can be admitted of `submitted`, starting from `current`: objects not submitted
/// are gone; an accepted object enters as submitted; a refused one keeps its `current`
/// version, unless that version no longer fits either.
pub fn admit(submitted: &[Submitted], current: &Catalog) -> Admission {
    let mut refused: BTreeMap<(Kind, String), Refused> = BTreeMap::new();
    for s in submitted {
        if let Err(e) = &s.object {
            refused.insert((s.kind, s.name.clone()), e.clone());
        }
    }
    // Refused objects whose current version cannot stay either.
    let mut dropped: BTreeSet<(Kind, String)> = BTreeSet::new();
    // Each round refuses or drops at least one more object, so this ends.
    for _ in 0..=2 * submitted.len() {
        let mut catalog = Catalog::default();
        for s in submitted {
            let key = (s.kind, s.name.clone());
            match (&s.object, refused.contains_key(&key)) {
                (Ok(o), false) => {
                    catalog.insert(o.clone());
                }
                _ if dropped.contains(&key) => {}
                _ => {
                    if let Some(old) = current.get(s.kind, &s.name) {
                        catalog.insert(old);
                    }
                }
            }
        }
        let problems = catalog.problems();
        if problems.is_empty() {
            return Admission { catalog, refused };
        }
        let mut progressed = false;
        for p in &problems {
            let key = (p.kind, p.name.clone());
            match refused.entry(key) {
                std::collections::btree_map::Entry::Occupied(e) => {
                    progressed |= dropped.insert(e.key().clone());
                }
                std::collections::btree_map::Entry::Vacant(e) => {
                    e.insert(ParseError::new(&p.path, &p.message).into());
                    progressed = true;
                }
            }
        }
        if !progressed {
            break;
        }
    }
    // Unreachable in practice (every problem names a submitted object); stay where we are.
    Admission {
        catalog: current.clone(),
        refused,
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::Spec;
    use crate::kinds::{InferencePoolSpec, InferenceWorkerSetSpec};

    fn worker_set(name: &str) -> Submitted {
        let spec: InferenceWorkerSetSpec =
            serde_json::from_str(r#"{"model":"m","blockSize":16}"#).unwrap();
        Submitted {
            kind: Kind::WorkerSet,
            name: name.into(),
            object: Ok(Object {
                name: name.into(),
                spec: Spec::WorkerSet(spec),
            }),
        }
    }

    fn pool(name: &str, sets: &[&str]) -> Submitted {
        Submitted {
            kind: Kind::Pool,
            name: name.into(),
            object: Ok(Object {
                name: name.into(),
                spec: Spec::Pool(InferencePoolSpec {
                    worker_sets: sets.iter().map(|s| (*s).to_owned()).collect(),
                    labels: Default::default(),
                }),
            }),
        }
    }

    #[test]
    fn a_broken_object_is_refused_and_the_rest_accepted() {
        let a = admit(
            &[
                worker_set("ws"),
                pool("good", &["ws"]),
                pool("bad", &["nope"]),
            ],
            &Catalog::default(),
        );
        assert_eq!(a.catalog.pools.keys().collect::<Vec<_>>(), ["good"]);
        assert_eq!(a.refused.len(), 1);
        assert!(
            a.refused[&(Kind::Pool, "bad".into())]
                .to_string()
                .contains("\"nope\" does not exist")
        );
    }

    #[test]
    fn a_broken_edit_keeps_the_accepted_version() {
        let before = admit(&[worker_set("ws"), pool("p", &["ws"])], &Catalog::default());
        assert!(before.refused.is_empty());
        let after = admit(
            &[worker_set("ws"), pool("p", &["ws", "missing"])],
            &before.catalog,
        );
        assert_eq!(after.catalog, before.catalog);
        assert!(after.refused.contains_key(&(Kind::Pool, "p".into())));
    }

    #[test]
    fn removing_what_others_need_refuses_them_and_drops_their_old_version() {
        let before = admit(&[worker_set("ws"), pool("p", &["ws"])], &Catalog::default());
        // The worker set is deleted; the pool still points at it: the pool cannot stay.
        let after = admit(&[pool("p", &["ws"])], &before.catalog);
        assert!(after.catalog.is_empty());
        assert!(after.refused.contains_key(&(Kind::Pool, "p".into())));
        assert!(after.catalog.problems().is_empty());
    }

    #[test]
    fn an_object_that_does_not_parse_is_refused_with_its_error() {
        let broken = Submitted {
            kind: Kind::Pool,
            name: "x".into(),
            object: Err(ParseError::new("spec.workerSets", "missing field").into()),
        };
        let a = admit(&[worker_set("ws"), broken], &Catalog::default());
        assert_eq!(
            a.refused[&(Kind::Pool, "x".into())].to_string(),
            "spec.workerSets: missing field"
        );
        assert_eq!(a.catalog.worker_sets.len(), 1);
    }
}
