//! Config objects have owners: a source writes only what it owns (or what no one owns yet), a
//! write to another source's object is refused whole with the owner named and changes nothing,
//! a delete on behalf of the owner is the explicit act that removes it, and owners survive
//! a snapshot and count in the digest.

#![allow(clippy::unwrap_used)]

mod support;

use kvplane_state::{ApplyError, Command, ConfigKey, ConfigObject, Owner, StateMachine};

/// Applies `command` (see [`support::apply_checked`]).
fn apply(sm: &mut StateMachine, command: Command) -> Option<ApplyError> {
    support::apply_checked(sm, command)
}

fn pool(name: &str, block_size: u32) -> ConfigObject {
    ConfigObject {
        kind: "pool".into(),
        name: name.into(),
        value: format!(r#"{{"block_size":{block_size},"models":["m"]}}"#).into_bytes(),
    }
}

fn put(o: ConfigObject, owner: Option<Owner>) -> Command {
    Command::ConfigPut {
        kind: o.kind,
        name: o.name,
        value: o.value,
        owner,
    }
}

fn delete(name: &str, owner: Option<Owner>) -> Command {
    Command::ConfigDelete {
        kind: "pool".into(),
        name: name.into(),
        owner,
    }
}

#[test]
fn a_write_to_another_sources_object_is_refused_with_its_owner_named() {
    let mut sm = StateMachine::new();
    assert_eq!(
        apply(&mut sm, put(pool("a", 16), Some(Owner::Directory))),
        None
    );
    let before = sm.digest();
    let refused = apply(&mut sm, put(pool("a", 32), Some(Owner::Admin))).unwrap();
    assert_eq!(
        refused,
        ApplyError::Owned {
            kind: "pool".into(),
            name: "a".into(),
            owner: Owner::Directory,
            by: Owner::Admin,
        }
    );
    assert!(
        refused.to_string().contains("owned by directory"),
        "{refused}"
    );
    assert_eq!(sm.digest(), before, "nothing changed");
    assert_eq!(
        apply(&mut sm, delete("a", Some(Owner::Admin))),
        Some(ApplyError::Owned {
            kind: "pool".into(),
            name: "a".into(),
            owner: Owner::Directory,
            by: Owner::Admin,
        })
    );
    // The owner itself may change it.
    assert_eq!(
        apply(&mut sm, put(pool("a", 32), Some(Owner::Directory))),
        None
    );
    assert_eq!(sm.handle().load().pools["a"].config.block_size, 32);
}

#[test]
fn a_change_naming_one_foreign_object_is_refused_whole() {
    let mut sm = StateMachine::new();
    apply(&mut sm, put(pool("mine", 16), Some(Owner::Kubernetes)));
    apply(&mut sm, put(pool("theirs", 16), Some(Owner::Admin)));
    let before = sm.digest();
    let refused = apply(
        &mut sm,
        Command::ConfigApply {
            puts: vec![pool("mine", 32), pool("new", 16)],
            deletes: vec![ConfigKey {
                kind: "pool".into(),
                name: "theirs".into(),
            }],
            owner: Some(Owner::Kubernetes),
        },
    );
    assert!(
        matches!(refused, Some(ApplyError::Owned { ref name, owner: Owner::Admin, .. }) if name == "theirs"),
        "{refused:?}"
    );
    assert_eq!(sm.digest(), before);
    assert!(!sm.handle().load().pools.contains_key("new"));
}

#[test]
fn deleting_on_behalf_of_the_owner_removes_it_and_frees_the_name() {
    let mut sm = StateMachine::new();
    apply(&mut sm, put(pool("a", 16), Some(Owner::Node)));
    assert_eq!(apply(&mut sm, delete("a", Some(Owner::Node))), None);
    let view = sm.handle().load();
    assert!(!view.pools.contains_key("a"));
    assert_eq!(view.owner("pool", "a"), None);
    // Gone, the name is anyone's.
    assert_eq!(apply(&mut sm, put(pool("a", 16), Some(Owner::Admin))), None);
    assert_eq!(sm.handle().load().owner("pool", "a"), Some(Owner::Admin));
}

#[test]
fn an_object_from_before_owners_is_claimed_by_its_next_writer() {
    let mut sm = StateMachine::new();
    // An entry written before objects had owners.
    apply(&mut sm, put(pool("old", 16), None));
    assert_eq!(sm.handle().load().owner("pool", "old"), None);
    assert_eq!(
        apply(&mut sm, put(pool("old", 16), Some(Owner::Directory))),
        None
    );
    assert_eq!(
        sm.handle().load().owner("pool", "old"),
        Some(Owner::Directory)
    );
    assert!(apply(&mut sm, put(pool("old", 8), Some(Owner::Admin))).is_some());
}

#[test]
fn owners_survive_a_snapshot_and_count_in_the_digest() {
    let mut by_admin = StateMachine::new();
    apply(&mut by_admin, put(pool("a", 16), Some(Owner::Admin)));
    let mut by_node = StateMachine::new();
    apply(&mut by_node, put(pool("a", 16), Some(Owner::Node)));
    assert_ne!(
        by_admin.digest(),
        by_node.digest(),
        "same objects, other owners: another state"
    );
    let restored = StateMachine::restore(&by_node.snapshot().unwrap()).unwrap();
    assert_eq!(restored.digest(), by_node.digest());
    assert_eq!(
        restored.handle().load().owner("pool", "a"),
        Some(Owner::Node)
    );
    // An object a legacy entry wrote (no owner) is another state than an owned one.
    let mut legacy = StateMachine::new();
    apply(&mut legacy, put(pool("a", 16), None));
    assert_ne!(legacy.digest(), by_node.digest());
}

/// Deleting a pool takes its workers with it: the digest readers see drops them as the
/// recomputed one does (checked by `apply` after each step).
#[test]
fn deleting_a_pool_with_workers_drops_them_from_the_digest() {
    let mut sm = StateMachine::new();
    apply(&mut sm, put(pool("a", 4), Some(Owner::Admin)));
    apply(&mut sm, put(pool("b", 4), Some(Owner::Admin)));
    let items = ["a", "b"]
        .iter()
        .enumerate()
        .map(|(i, p)| kvplane_state::IngestItem {
            seq: i as u64 + 1,
            pool: (*p).into(),
            worker: "w".into(),
            payload: kvplane_state::IngestPayload::Worker {
                up: true,
                address: Some("10.0.0.1:8000".into()),
            },
        })
        .collect();
    apply(
        &mut sm,
        Command::Ingest(kvplane_state::IngestBatch {
            source: Default::default(),
            first_seq: 1,
            last_seq: 2,
            items,
        }),
    );
    assert_eq!(sm.handle().load().workers().count(), 2);
    assert_eq!(apply(&mut sm, delete("a", Some(Owner::Admin))), None);
    let view = sm.handle().load();
    assert_eq!(
        view.workers().map(|w| w.pool.as_str()).collect::<Vec<_>>(),
        ["b"]
    );
}
