//! What the state's integration tests share.

use kvplane_state::{ApplyError, Command, Entry, StateMachine};

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
