//! What the state's integration tests share (each test file uses some of it).

#![allow(dead_code)]

use kvplane_state::{
    Applied, ApplyError, Command, Entry, IngestBatch, IngestItem, IngestPayload, KvBatch, KvEvent,
    POOL_KIND, PoolConfig, StateMachine, Tier,
};

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

/// Applies `command` as the next entry, proposed at `timestamp_ms`; the digest readers see is
/// checked as [`apply_checked`] does.
pub fn apply_at(sm: &mut StateMachine, timestamp_ms: u64, command: Command) -> Applied {
    let index = sm.applied_index() + 1;
    let out = sm
        .apply(&Entry {
            index,
            timestamp_ms,
            command,
        })
        .expect("entries come in order");
    assert_eq!(sm.handle().load().digest, sm.digest());
    out
}

/// The stream's next message, from `pool`/`worker`.
pub fn message(sm: &StateMachine, pool: &str, worker: &str, payload: IngestPayload) -> Command {
    let seq = sm.handle().load().last_stream_seq + 1;
    Command::Ingest(IngestBatch {
        source: Default::default(),
        first_seq: seq,
        last_seq: seq,
        items: vec![IngestItem {
            seq,
            pool: pool.into(),
            worker: worker.into(),
            payload,
        }],
    })
}

/// A KV batch storing two blocks of four tokens (hashes 11 and 12).
pub fn two_blocks() -> IngestPayload {
    IngestPayload::Kv(KvBatch {
        dp_rank: 0,
        events: vec![KvEvent::Stored {
            block_hashes: vec![11, 12],
            parent_hash: None,
            token_ids: (0..8).collect(),
            block_size: 4,
            lora_name: None,
            cache_salt: None,
            tier: Tier::Gpu,
        }],
    })
}
