//! Apply hands the prefix index's writes to a thread of their own, many at a time, waits for
//! them at the entry's end and writes the rest itself. One entry of thousands of messages, two pools taking turns,
//! stores, removals, clears and re-stores of the same blocks: once the entry is applied, every
//! worker's match is what its messages say, in their order.

mod support;

use kvplane_state::{
    Command, Entry, IngestBatch, IngestItem, IngestPayload, KvBatch, KvEvent, StateMachine, Tier,
};

const BS: u32 = 4;
const BLOCKS: usize = 8;
const WORKERS: u64 = 300;

/// Worker `w`'s prompt: tokens no other worker's share.
fn tokens(w: u64) -> Vec<u32> {
    (0..BLOCKS as u32 * BS)
        .map(|t| w as u32 * 1000 + t)
        .collect()
}

/// The engine hashes of `w`'s blocks (any distinct numbers: the index keys by content).
fn hashes(w: u64) -> Vec<u64> {
    (0..BLOCKS as u64).map(|b| w * 100 + b + 1).collect()
}

fn pool_of(w: u64) -> &'static str {
    if w.is_multiple_of(2) { "a" } else { "b" }
}

fn store(w: u64) -> KvEvent {
    KvEvent::Stored {
        block_hashes: hashes(w),
        parent_hash: None,
        token_ids: tokens(w),
        block_size: BS,
        lora_name: None,
        cache_salt: None,
        tier: Tier::Gpu,
    }
}

/// What each worker's messages leave it holding, from the rules the messages follow (not from
/// the state machine): every worker stores its 8 blocks; every third removes its block 5;
/// every seventh clears, and of those the even ones store everything again.
fn expected(w: u64) -> u32 {
    match (
        w.is_multiple_of(7),
        w.is_multiple_of(2),
        w.is_multiple_of(3),
    ) {
        (true, true, _) => BLOCKS as u32,
        (true, false, _) => 0,
        (false, _, true) => 5,
        (false, _, false) => BLOCKS as u32,
    }
}

#[test]
fn one_entrys_writes_reach_the_index_in_their_order_however_many_they_are() {
    let mut messages = Vec::new();
    messages.extend((0..WORKERS).map(|w| (w, store(w))));
    messages.extend((0..WORKERS).filter(|w| w.is_multiple_of(3)).map(|w| {
        let block_hashes = vec![hashes(w)[5]];
        (
            w,
            KvEvent::Removed {
                block_hashes,
                tier: Tier::Gpu,
            },
        )
    }));
    messages.extend(
        (0..WORKERS)
            .filter(|w| w.is_multiple_of(7))
            .map(|w| (w, KvEvent::Cleared)),
    );
    messages.extend(
        (0..WORKERS)
            .filter(|w| w.is_multiple_of(14))
            .map(|w| (w, store(w))),
    );
    let items: Vec<IngestItem> = messages
        .into_iter()
        .enumerate()
        .map(|(i, (w, ev))| IngestItem {
            seq: i as u64 + 1,
            pool: pool_of(w).into(),
            worker: format!("w{w}"),
            payload: IngestPayload::Kv(KvBatch {
                dp_rank: 0,
                events: vec![ev],
            }),
        })
        .collect();
    let mut sm = StateMachine::new();
    for p in ["a", "b"] {
        assert!(support::apply_checked(&mut sm, support::pool(p, BS)).is_none());
    }
    let applied = sm
        .apply(&Entry {
            index: sm.applied_index() + 1,
            timestamp_ms: 1,
            command: Command::Ingest(IngestBatch {
                source: Default::default(),
                first_seq: 1,
                last_seq: items.len() as u64,
                items,
            }),
        })
        .unwrap();
    assert!(applied.dropped.is_empty(), "{:?}", applied.dropped);
    let view = sm.handle().load();
    for w in 0..WORKERS {
        let pool = &view.pools[pool_of(w)];
        let id = pool
            .workers
            .iter()
            .find(|x| *x.name == *format!("w{w}"))
            .map(|x| x.id)
            .unwrap();
        let got = pool.index.overlaps(&tokens(w), None).best_for(id).0;
        assert_eq!(got, expected(w), "worker w{w}");
    }
    // Blocks held: each worker's from the rules, in its own pool only.
    let held: u64 = (0..WORKERS).map(|w| u64::from(expected(w))).sum();
    let removed_sixth_and_seventh = (0..WORKERS)
        .filter(|w| w.is_multiple_of(3) && w % 7 != 0)
        .count() as u64
        * 2;
    // A worker that removed block 5 still holds blocks 6 and 7 (they match nothing: block 5
    // is gone), and they stay in the index.
    let indexed = (view.pools["a"].index.len() + view.pools["b"].index.len()) as u64;
    assert_eq!(indexed, held + removed_sixth_and_seventh);
}
