//! The digest covers the prefix index as it is, not only the block facts it is built from: a
//! replica whose index lost a write (the writer thread gone with a batch, a restore that
//! rebuilt less) reports another digest than its peers although its block count (counted from
//! the facts) and stream position agree.

use crate::{
    Command, Entry, IngestBatch, IngestItem, IngestPayload, KvBatch, KvEvent, POOL_KIND,
    PoolConfig, StateMachine, Tier,
};

const BS: u32 = 4;

fn apply(sm: &mut StateMachine, command: Command) {
    let index = sm.applied_index() + 1;
    let applied = sm
        .apply(&Entry {
            index,
            timestamp_ms: 0,
            command,
        })
        .expect("entries come in order");
    assert!(applied.rejected.is_none(), "{:?}", applied.rejected);
}

fn pool() -> Command {
    Command::ConfigPut {
        owner: Some(crate::Owner::Admin),
        kind: POOL_KIND.into(),
        name: "p".into(),
        value: PoolConfig {
            block_size: BS,
            models: vec![],
            lora_adapters: Vec::new(),
        }
        .to_json(),
    }
}

/// Stream message `seq`: `worker` stores an 8-block chain of `salt`'s tokens.
fn store(seq: u64, worker: &str, salt: u32) -> Command {
    let tokens: Vec<u32> = (0..8 * BS).map(|t| t + salt * 1000).collect();
    Command::Ingest(IngestBatch {
        source: Default::default(),
        first_seq: seq,
        last_seq: seq,
        items: vec![IngestItem {
            seq,
            pool: "p".into(),
            worker: worker.into(),
            payload: IngestPayload::Kv(KvBatch {
                dp_rank: 0,
                events: vec![KvEvent::Stored {
                    block_hashes: (0..8).map(|b| u64::from(salt) * 100 + b).collect(),
                    parent_hash: None,
                    token_ids: tokens,
                    block_size: BS,
                    lora_name: None,
                    cache_salt: None,
                    tier: Tier::Gpu,
                }],
            }),
        }],
    })
}

/// Two replicas that applied the same three entries.
fn replicas() -> (StateMachine, StateMachine) {
    let build = || {
        let mut sm = StateMachine::new();
        apply(&mut sm, pool());
        apply(&mut sm, store(1, "w0", 1));
        apply(&mut sm, store(2, "w1", 2));
        sm
    };
    let (a, b) = (build(), build());
    assert_eq!(a.digest(), b.digest());
    assert_eq!(a.handle().load().digest, b.handle().load().digest);
    (a, b)
}

#[test]
fn a_replica_whose_index_lost_a_write_reports_another_digest_although_its_block_count_agrees() {
    let (mut a, mut b) = replicas();
    assert!(a.pools["p"].index.lose_a_hold());
    // The next entry, the same on both, publishes.
    apply(&mut a, store(3, "w0", 3));
    apply(&mut b, store(3, "w0", 3));
    assert_eq!(a.indexed_blocks(), b.indexed_blocks());
    assert_eq!(a.last_stream_seq(), b.last_stream_seq());
    assert_ne!(a.pools["p"].index.len(), b.pools["p"].index.len());
    assert_ne!(a.handle().load().digest, b.handle().load().digest);
    assert_ne!(a.digest(), b.digest());
    // What the damaged replica publishes is still what it holds.
    assert_eq!(a.handle().load().digest, a.digest());
    // Its snapshot rebuilds the index from the facts: the restore's check refuses it.
    let err = StateMachine::restore(&a.snapshot().unwrap()).unwrap_err();
    assert!(
        matches!(err, crate::SnapshotError::DigestMismatch { .. }),
        "{err}"
    );
    assert_eq!(
        StateMachine::restore(&b.snapshot().unwrap())
            .unwrap()
            .digest(),
        b.digest()
    );
}

#[test]
fn an_index_changed_behind_its_content_hash_fails_the_recount() {
    let (mut a, mut b) = replicas();
    assert!(a.pools["p"].index.corrupt_a_hold());
    apply(&mut a, store(3, "w0", 3));
    apply(&mut b, store(3, "w0", 3));
    // The kept digest cannot see it; the recount from the maps does.
    assert_eq!(a.handle().load().digest, b.handle().load().digest);
    assert_ne!(a.handle().load().digest, a.digest());
    assert_ne!(a.digest(), b.digest());
}

#[test]
fn snapshots_of_older_digest_formats_restore_to_the_digest_of_today() {
    let (a, _) = replicas();
    for (version, old) in [
        (4u32, a.snapshot_in_format_4().unwrap()),
        (5, a.snapshot_in_format_5().unwrap()),
    ] {
        let restored = StateMachine::restore(&old).unwrap();
        assert_eq!(restored.digest(), a.digest(), "format {version}");
        assert_eq!(
            restored.handle().load().digest,
            a.digest(),
            "format {version}"
        );
        // Its recorded digest is its format's: checked as such, and another one is refused.
        let mut bad = a.snapshot().unwrap();
        bad[8..12].copy_from_slice(&version.to_le_bytes());
        let n = bad.len() - 8;
        let sum = xxhash_rust::xxh3::xxh3_64(&bad[..n]);
        bad[n..].copy_from_slice(&sum.to_le_bytes());
        assert!(
            matches!(
                StateMachine::restore(&bad),
                Err(crate::SnapshotError::DigestMismatch { .. })
            ),
            "format {version}"
        );
    }
}

#[test]
fn a_snapshot_block_no_apply_leaves_is_refused_by_name() {
    let (a, _) = replicas();
    // In no tier; off the GPU with a sequence hash: refused, naming the block.
    for damage in [
        (|h: &mut crate::blocks::Held| h.tiers = 0) as fn(&mut crate::blocks::Held),
        |h| h.tiers = 1 << Tier::Cpu.slot(),
    ] {
        let err = StateMachine::restore(&a.snapshot_with_a_block(damage).unwrap()).unwrap_err();
        assert!(
            matches!(err, crate::SnapshotError::BadBlock { .. }),
            "{err}"
        );
    }
    // Off the GPU without one: a block as apply leaves it, refused only by the digest check.
    let moved = |h: &mut crate::blocks::Held| {
        h.tiers = 1 << Tier::Cpu.slot();
        h.seq = 0;
    };
    let err = StateMachine::restore(&a.snapshot_with_a_block(moved).unwrap()).unwrap_err();
    assert!(
        matches!(err, crate::SnapshotError::DigestMismatch { .. }),
        "{err}"
    );
}
