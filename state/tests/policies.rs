//! Policy objects in the replicated state: a whole change applies at one index or not at all,
//! each worker set owns a prefix index, and a snapshot keeps the catalog.

#![allow(clippy::unwrap_used)]

mod support;

use kvplane_policy::{Catalog, Documents, Kind};
use kvplane_state::{Command, ConfigKey, ConfigObject, StateMachine};

fn examples() -> Catalog {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/policies");
    let docs = Documents::read(&[dir.into()]).unwrap();
    let (catalog, problems) = docs.check();
    assert!(problems.is_empty());
    catalog
}

/// Applies `command` (see [`support::apply_checked`]).
fn apply(sm: &mut StateMachine, command: Command) -> Option<String> {
    support::apply_checked(sm, command).map(|e| e.to_string())
}

fn all_of(c: &Catalog) -> Command {
    Command::ConfigApply {
        owner: Some(kvplane_state::Owner::Admin),
        puts: c.objects().iter().map(ConfigObject::policy).collect(),
        deletes: Vec::new(),
    }
}

#[test]
fn a_policy_set_takes_effect_at_one_index_with_an_index_per_worker_set() {
    let mut sm = StateMachine::new();
    assert_eq!(apply(&mut sm, all_of(&examples())), None);
    let view = sm.handle().load();
    assert_eq!(view.config_index, 1);
    assert_eq!(*view.catalog, examples());
    let pools: Vec<&String> = view.pools.keys().collect();
    assert_eq!(pools, ["large-a100", "small-l4"]);
    assert_eq!(view.pools["large-a100"].config.models, ["llama-70b"]);
}

#[test]
fn an_inconsistent_change_is_refused_whole_and_changes_nothing() {
    let mut sm = StateMachine::new();
    apply(&mut sm, all_of(&examples()));
    let before = sm.digest();
    // Deleting a worker set that pools still name, together with a valid put: neither happens.
    let mut changed = examples();
    changed.providers.get_mut("cloud").unwrap().expected_ttft_ms = 900.0;
    let cloud = changed
        .objects()
        .into_iter()
        .find(|o| o.name == "cloud")
        .unwrap();
    let refused = apply(
        &mut sm,
        Command::ConfigApply {
            owner: Some(kvplane_state::Owner::Admin),
            puts: vec![ConfigObject::policy(&cloud)],
            deletes: vec![ConfigKey {
                kind: Kind::WorkerSet.as_str().into(),
                name: "small-l4".into(),
            }],
        },
    )
    .unwrap();
    assert!(
        refused.contains("InferenceWorkerSet \"small-l4\" does not exist"),
        "{refused}"
    );
    assert_eq!(sm.digest(), before);
    assert_eq!(sm.handle().load().config_index, 1);
    // A single object that does not parse is refused with its field path.
    let refused = apply(
        &mut sm,
        Command::ConfigPut {
            owner: Some(kvplane_state::Owner::Admin),
            kind: "InferencePool".into(),
            name: "bad".into(),
            value: br#"{"workerSets":["large-a100"],"colour":"red"}"#.to_vec(),
        },
    )
    .unwrap();
    assert!(refused.contains("unknown field `colour`"), "{refused}");
}

#[test]
fn the_catalog_survives_a_snapshot() {
    let mut sm = StateMachine::new();
    apply(&mut sm, all_of(&examples()));
    let restored = StateMachine::restore(&sm.snapshot().unwrap()).unwrap();
    assert_eq!(restored.digest(), sm.digest());
    assert_eq!(*restored.handle().load().catalog, examples());
}

#[test]
fn a_diff_puts_what_changed_and_deletes_what_is_gone() {
    let old = examples();
    let mut new = examples();
    new.backends.remove("standard");
    new.policies.get_mut("burst-to-cloud").unwrap().rules[0]
        .filter
        .max_queued = Some(4);
    let (puts, deletes) = old.diff(&new);
    assert_eq!(
        puts.iter().map(|o| o.name.as_str()).collect::<Vec<_>>(),
        ["burst-to-cloud"]
    );
    assert_eq!(deletes, [(Kind::Backend, "standard".to_owned())]);
}
