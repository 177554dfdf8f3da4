//! What the state's integration tests share (each test file uses some of it).

#![allow(dead_code)]

use kvplane_state::{ApplyError, Command, Entry, POOL_KIND, PoolConfig, StateMachine};

/// Declares pool `name` (every model, no adapters).
pub fn pool(name: &str, block_size: u32) -> Command {
    Command::ConfigPut {
        owner: Some(kvplane_state::Owner::Admin),
        kind: POOL_KIND.into(),
        name: name.into(),
        value: PoolConfig {
            block_size,
            models: vec![],
            lora_adapters: Vec::new(),
        }
        .to_json(),
    }
}

/// Applies `command` as the next entry and returns why it was refused, if it was; the digest
/// readers see is checked against the one recomputed from the whole state after every change.
pub fn apply_checked(sm: &mut StateMachine, command: Command) -> Option<ApplyError> {
    let index = sm.applied_index() + 1;
    let rejected = sm
        .apply(&Entry {
            index,
            timestamp_ms: 0,
            command,
        })
        .expect("entries come in order")
        .rejected;
    assert_eq!(sm.handle().load().digest, sm.digest());
    rejected
}
