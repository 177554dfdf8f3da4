//! Blocks stored under a LoRA adapter or a cache salt match only requests under the same: a
//! salted chain's continuation (an event with a parent) inherits its salt, the salt is part of
//! the digest and of the snapshot, and it goes with its block. Stores as the leader proposes
//! them (compact, hashed once); entries from before compact entries apply as they did.

#![allow(clippy::unwrap_used)]

use kvplane_state::{
    Command, Entry, IngestBatch, IngestItem, IngestPayload, KvBatch, KvEvent, POOL_KIND,
    PoolConfig, StateMachine, Tier,
};

const BS: u32 = 4;

fn tokens() -> Vec<u32> {
    (0..16).collect()
}

/// A store as the leader proposes it.
fn stored(
    hashes: std::ops::Range<u64>,
    parent: Option<u64>,
    lora: Option<&str>,
    salt: Option<&str>,
) -> KvEvent {
    let compact = legacy(hashes, parent, lora, salt).compact();
    assert!(matches!(compact, KvEvent::StoredBlocks { .. }));
    compact
}

/// A store as entries from before compact entries hold it (token ids).
fn legacy(
    hashes: std::ops::Range<u64>,
    parent: Option<u64>,
    lora: Option<&str>,
    salt: Option<&str>,
) -> KvEvent {
    let t = tokens();
    let (a, b) = (hashes.start as usize, hashes.end as usize);
    KvEvent::Stored {
        block_hashes: hashes.collect(),
        parent_hash: parent,
        token_ids: t[a * BS as usize..b * BS as usize].to_vec(),
        block_size: BS,
        lora_name: lora.map(str::to_owned),
        cache_salt: salt.map(str::to_owned),
        tier: Tier::Gpu,
    }
}

struct Run {
    sm: StateMachine,
    seq: u64,
}

impl Run {
    fn new() -> Self {
        let mut sm = StateMachine::new();
        sm.apply(&Entry {
            index: 1,
            timestamp_ms: 0,
            command: Command::ConfigPut {
                owner: Some(kvplane_state::Owner::Admin),
                kind: POOL_KIND.into(),
                name: "p".into(),
                value: PoolConfig {
                    block_size: BS,
                    models: vec![],
                    lora_adapters: Vec::new(),
                }
                .to_json(),
            },
        })
        .unwrap();
        Self { sm, seq: 0 }
    }

    fn events(&mut self, worker: &str, events: Vec<KvEvent>) {
        self.seq += 1;
        let index = self.sm.applied_index() + 1;
        self.sm
            .apply(&Entry {
                index,
                timestamp_ms: 0,
                command: Command::Ingest(IngestBatch {
                    source: Default::default(),
                    first_seq: self.seq,
                    last_seq: self.seq,
                    items: vec![IngestItem {
                        seq: self.seq,
                        pool: "p".into(),
                        worker: worker.into(),
                        payload: IngestPayload::Kv(KvBatch { dp_rank: 0, events }),
                    }],
                }),
            })
            .unwrap();
    }
}

/// The longest match of any worker for the prompt under `lora` and `salt`.
fn matched(sm: &StateMachine, lora: Option<&str>, salt: Option<&str>) -> u32 {
    let view = sm.handle().load();
    view.pools["p"]
        .index
        .overlaps_keyed(&tokens(), lora, salt)
        .best_blocks()
}

#[test]
fn salted_and_adapter_blocks_match_only_requests_under_the_same() {
    let mut r = Run::new();
    // A salted chain stored in two events: the continuation names only its parent.
    r.events("w0", vec![stored(0..2, None, None, Some("alice"))]);
    r.events("w0", vec![stored(2..4, Some(1), None, None)]);
    r.events("w1", vec![stored(0..4, None, Some("adapter-a"), None)]);
    assert_eq!(matched(&r.sm, None, Some("alice")), 4);
    assert_eq!(matched(&r.sm, None, Some("bob")), 0);
    assert_eq!(matched(&r.sm, None, None), 0);
    assert_eq!(matched(&r.sm, Some("adapter-a"), None), 4);
    assert_eq!(matched(&r.sm, Some("adapter-b"), None), 0);

    // The salt is state: in the digest, and kept by a snapshot.
    let restored = StateMachine::restore(&r.sm.snapshot().unwrap()).unwrap();
    assert_eq!(restored.digest(), r.sm.digest());
    assert_eq!(matched(&restored, None, Some("alice")), 4);
    let mut unsalted = Run::new();
    unsalted.events("w0", vec![stored(0..2, None, None, None)]);
    unsalted.events("w0", vec![stored(2..4, Some(1), None, None)]);
    unsalted.events("w1", vec![stored(0..4, None, Some("adapter-a"), None)]);
    assert_ne!(unsalted.sm.digest(), r.sm.digest());

    // Removing the salted blocks takes their salts with them: the same digest as a state that
    // never had them.
    r.events(
        "w0",
        vec![KvEvent::Removed {
            block_hashes: vec![0, 1, 2, 3],
            tier: Tier::Gpu,
        }],
    );
    let mut never = Run::new();
    never.events("w0", vec![]);
    never.events("w0", vec![]);
    never.events("w1", vec![stored(0..4, None, Some("adapter-a"), None)]);
    never.events("w0", vec![]);
    assert_eq!(matched(&r.sm, None, Some("alice")), 0);
    assert_eq!(r.sm.digest(), never.sm.digest());
}

#[test]
fn entries_from_before_compact_entries_key_unsalted_chains_as_compact_ones_do() {
    // The same stores, one run in each form: the same state, to the digest.
    let mut old = Run::new();
    let mut new = Run::new();
    for (r, f) in [
        (&mut old, legacy as fn(_, _, _, _) -> KvEvent),
        (&mut new, stored),
    ] {
        r.events("w0", vec![f(0..2, None, None, None)]);
        r.events("w0", vec![f(2..4, Some(1), None, None)]);
        r.events("w1", vec![f(0..3, None, Some("adapter-a"), None)]);
    }
    assert_eq!(old.sm.digest(), new.sm.digest());
    assert_eq!(matched(&old.sm, None, None), 4);
    assert_eq!(matched(&old.sm, Some("adapter-a"), None), 3);
}

#[test]
fn a_salted_chain_from_before_compact_entries_matches_no_request_until_stored_again() {
    let mut r = Run::new();
    r.events("w0", vec![legacy(0..2, None, None, Some("alice"))]);
    r.events("w0", vec![legacy(2..4, Some(1), None, None)]);
    // Its salt was mixed into every block's key, requests mix it into the first only: it
    // under-matches (never a wrong match), and stays state a snapshot keeps.
    assert_eq!(matched(&r.sm, None, Some("alice")), 0);
    assert_eq!(matched(&r.sm, None, None), 0);
    let restored = StateMachine::restore(&r.sm.snapshot().unwrap()).unwrap();
    assert_eq!(restored.digest(), r.sm.digest());
    // The engine stores the chain again (compact): re-keyed, its per-block salts gone - the
    // state of a cluster that only ever had compact entries.
    r.events("w0", vec![stored(0..2, None, None, Some("alice"))]);
    r.events("w0", vec![stored(2..4, Some(1), None, None)]);
    assert_eq!(matched(&r.sm, None, Some("alice")), 4);
    let mut compact = Run::new();
    compact.events("w0", vec![]);
    compact.events("w0", vec![]);
    compact.events("w0", vec![stored(0..2, None, None, Some("alice"))]);
    compact.events("w0", vec![stored(2..4, Some(1), None, None)]);
    assert_eq!(r.sm.digest(), compact.sm.digest());
}

#[test]
fn a_compact_continuation_ignores_a_salt_of_its_own() {
    let mut r = Run::new();
    r.events("w0", vec![stored(0..2, None, None, Some("alice"))]);
    r.events("w0", vec![stored(2..4, Some(1), None, Some("mallory"))]);
    assert_eq!(matched(&r.sm, None, Some("alice")), 4);
    assert_eq!(matched(&r.sm, None, Some("mallory")), 0);
}
