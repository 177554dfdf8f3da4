//! The state machine is deterministic: the same stream gives the same digest and the same
//! answers, however it is cut into entries, and a snapshot restores both exactly. Its answers
//! are those of a reference model written here - a plain set per worker of the blocks it
//! holds, with vLLM's rules for parents, removals, clears and workers going down - after every
//! entry of random event streams in which every engine hashes with a seed of its own.

#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;

use kvplane_state::{
    Command, Entry, IngestBatch, IngestItem, IngestPayload, KvBatch, KvEvent, POOL_KIND,
    PoolConfig, StateMachine, Tier, WorkerMetrics,
};
use proptest::prelude::*;

const BS: u32 = 4;
const CHAINS: usize = 4;
const LEN: usize = 8;

/// Chains 0 and 1 share their first two blocks, like prompts with one system prompt.
fn chain_tokens(c: usize) -> Vec<u32> {
    (0..LEN)
        .flat_map(|i| {
            let owner = if i < 2 && c < 2 { 0 } else { c };
            (0..BS).map(move |t| (owner * 1000 + i * 10) as u32 + t)
        })
        .collect()
}

/// The block hashes worker `w`'s engine gives chain `c`: chained over the tokens from a seed.
/// Workers 0 and 1 share one seed (engines hashing alike, as with sha256_cbor); worker 2 has its
/// own, as vLLM's engines do when their hash seeds differ per process - the same content under
/// different hashes.
fn chain_hashes(w: usize, c: usize) -> Vec<u64> {
    let toks = chain_tokens(c);
    let seed = (w / 2) as u64;
    let mut h = 0xcbf2_9ce4_8422_2325u64 ^ seed.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    toks.chunks(BS as usize)
        .map(|block| {
            for t in block {
                h = (h ^ u64::from(*t)).wrapping_mul(0x100_0000_01b3);
            }
            h
        })
        .collect()
}

#[derive(Debug, Clone)]
enum Op {
    Store {
        w: usize,
        c: usize,
        start: usize,
        len: usize,
        tier: Tier,
    },
    Remove {
        w: usize,
        c: usize,
        pos: usize,
    },
    Clear {
        w: usize,
    },
    Metrics {
        w: usize,
        running: u32,
        waiting: u32,
    },
    Down {
        w: usize,
    },
    Up {
        w: usize,
    },
}

fn op() -> impl Strategy<Value = Op> {
    let w = 0..3usize;
    let c = 0..CHAINS;
    prop_oneof![
        6 => (w.clone(), c.clone(), 0..LEN, 1..4usize, prop_oneof![4 => Just(Tier::Gpu), 1 => Just(Tier::Cpu)])
            .prop_map(|(w, c, start, len, tier)| Op::Store { w, c, start, len, tier }),
        3 => (w.clone(), c, 0..LEN).prop_map(|(w, c, pos)| Op::Remove { w, c, pos }),
        1 => w.clone().prop_map(|w| Op::Clear { w }),
        2 => (w.clone(), 0..10u32, 0..10u32).prop_map(|(w, running, waiting)| Op::Metrics { w, running, waiting }),
        1 => w.clone().prop_map(|w| Op::Down { w }),
        1 => w.prop_map(|w| Op::Up { w }),
    ]
}

fn item(seq: u64, op: &Op) -> IngestItem {
    let (w, payload) = match op {
        Op::Store {
            w,
            c,
            start,
            len,
            tier,
        } => {
            let hashes = chain_hashes(*w, *c);
            let toks = chain_tokens(*c);
            let end = (start + len).min(LEN);
            let ev = KvEvent::Stored {
                block_hashes: hashes[*start..end].to_vec(),
                parent_hash: (*start > 0).then(|| hashes[start - 1]),
                token_ids: toks[start * BS as usize..end * BS as usize].to_vec(),
                block_size: BS,
                lora_name: None,
                cache_salt: None,
                tier: *tier,
            }
            // As the leader proposes it.
            .compact();
            (
                *w,
                IngestPayload::Kv(KvBatch {
                    dp_rank: 0,
                    events: vec![ev],
                }),
            )
        }
        Op::Remove { w, c, pos } => (
            *w,
            IngestPayload::Kv(KvBatch {
                dp_rank: 0,
                events: vec![KvEvent::Removed {
                    block_hashes: vec![chain_hashes(*w, *c)[*pos]],
                    tier: Tier::Gpu,
                }],
            }),
        ),
        Op::Clear { w } => (
            *w,
            IngestPayload::Kv(KvBatch {
                dp_rank: 0,
                events: vec![KvEvent::Cleared],
            }),
        ),
        Op::Metrics {
            w,
            running,
            waiting,
        } => (
            *w,
            IngestPayload::Metrics(WorkerMetrics {
                running: *running,
                waiting: *waiting,
                kv_cache_usage: f64::from(*running) / 10.0,
                prefix_cache_hit_rate: 0.5,
                ..Default::default()
            }),
        ),
        Op::Down { w } => (
            *w,
            IngestPayload::Worker {
                up: false,
                address: None,
            },
        ),
        Op::Up { w } => (
            *w,
            IngestPayload::Worker {
                up: true,
                address: Some(format!("http://w{w}")),
            },
        ),
    };
    IngestItem {
        seq,
        pool: "p".into(),
        worker: format!("w{w}"),
        payload,
    }
}

/// Turns ops into entries, cutting a new entry wherever `cuts` says.
fn entries(ops: &[Op], cuts: &[bool], first_index: u64) -> Vec<Entry> {
    let mut out = vec![Entry {
        index: first_index,
        timestamp_ms: 1,
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
    }];
    let mut items: Vec<IngestItem> = Vec::new();
    let flush = |items: &mut Vec<IngestItem>, out: &mut Vec<Entry>| {
        if items.is_empty() {
            return;
        }
        let index = out.last().map_or(first_index, |e| e.index) + 1;
        out.push(Entry {
            index,
            timestamp_ms: index * 7,
            command: Command::Ingest(IngestBatch {
                source: Default::default(),
                first_seq: items[0].seq,
                last_seq: items[items.len() - 1].seq,
                items: std::mem::take(items),
            }),
        });
    };
    for (i, op) in ops.iter().enumerate() {
        items.push(item(i as u64 + 1, op));
        if cuts.get(i).copied().unwrap_or(false) {
            flush(&mut items, &mut out);
        }
    }
    flush(&mut items, &mut out);
    out
}

fn answers(sm: &StateMachine) -> Vec<BTreeMap<(u64, u32), u32>> {
    let view = sm.handle().load();
    let pool = &view.pools["p"];
    (0..CHAINS)
        .map(|c| pool.index.overlaps(&chain_tokens(c), None).by_rank())
        .collect()
}

fn answers_if_pool(sm: &StateMachine) -> Vec<BTreeMap<(u64, u32), u32>> {
    if sm.handle().load().pools.contains_key("p") {
        answers(sm)
    } else {
        Vec::new()
    }
}

fn run(entries: &[Entry]) -> StateMachine {
    let mut sm = StateMachine::new();
    for e in entries {
        sm.apply(e).unwrap();
    }
    sm
}

/// What the prefix index should answer, kept the plainest way: per worker, the GPU blocks it
/// holds.
#[derive(Debug, Default)]
struct Model {
    /// By worker: up, and the GPU block hashes it holds (a repeated store is idempotent).
    workers: BTreeMap<usize, (bool, std::collections::BTreeSet<u64>)>,
}

impl Model {
    fn apply(&mut self, op: &Op) {
        let w = match op {
            Op::Store { w, .. }
            | Op::Remove { w, .. }
            | Op::Clear { w }
            | Op::Metrics { w, .. }
            | Op::Down { w }
            | Op::Up { w } => *w,
        };
        if !self.workers.contains_key(&w) && matches!(op, Op::Down { .. }) {
            return;
        }
        self.workers.entry(w).or_insert((true, Default::default()));
        let (up, blocks) = self.workers.get_mut(&w).unwrap();
        match op {
            Op::Down { .. } => {
                *up = false;
                blocks.clear();
            }
            Op::Up { .. } => *up = true,
            _ if !*up => {}
            Op::Metrics { .. } => {}
            Op::Clear { .. } => blocks.clear(),
            Op::Store {
                c,
                start,
                len,
                tier,
                ..
            } => {
                let hashes = chain_hashes(w, *c);
                // Only GPU blocks are in the index; a store needs its parent held.
                if *tier != Tier::Gpu || (*start > 0 && !blocks.contains(&hashes[start - 1])) {
                    return;
                }
                blocks.extend(&hashes[*start..(start + len).min(LEN)]);
            }
            Op::Remove { c, pos, .. } => {
                blocks.remove(&chain_hashes(w, *c)[*pos]);
            }
        }
    }

    /// Per chain: for each worker holding its first block, how many leading blocks it holds.
    fn answers(&self) -> Vec<BTreeMap<String, u32>> {
        (0..CHAINS)
            .map(|c| {
                self.workers
                    .iter()
                    .filter_map(|(w, (_, blocks))| {
                        let n = chain_hashes(*w, c)
                            .iter()
                            .take_while(|h| blocks.contains(h))
                            .count();
                        (n > 0).then(|| (format!("w{w}"), n as u32))
                    })
                    .collect()
            })
            .collect()
    }
}

/// The state's answers with worker names instead of ids (the model knows no ids).
fn named_answers(sm: &StateMachine) -> Vec<BTreeMap<String, u32>> {
    let view = sm.handle().load();
    let names: BTreeMap<u64, String> = view.pools["p"]
        .workers
        .iter()
        .map(|w| (w.id, w.name.to_string()))
        .collect();
    answers(sm)
        .into_iter()
        .map(|a| {
            a.into_iter()
                .filter(|(_, n)| *n > 0)
                .map(|((id, _), n)| (names[&id].clone(), n))
                .collect()
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// Engines hash the same content differently (each worker's hashes have their own seed),
    /// store, re-store, evict, clear, go down and come back; after every message each
    /// worker's match for each chain is the model's.
    #[test]
    fn the_index_answers_as_a_plain_map_of_blocks_per_worker_does(
        ops in prop::collection::vec(op(), 1..160),
    ) {
        // One entry per message, so the model can be compared after each.
        let cuts = vec![true; ops.len()];
        let es = entries(&ops, &cuts, 1);
        let mut sm = StateMachine::new();
        sm.apply(&es[0]).unwrap();
        let mut model = Model::default();
        for (e, op) in es[1..].iter().zip(&ops) {
            sm.apply(e).unwrap();
            model.apply(op);
            prop_assert_eq!(named_answers(&sm), model.answers(), "after {:?}", op);
        }
    }

    /// Apply keeps the digest's parts up to date instead of rehashing the state per entry; the
    /// digest readers see must be the one recomputed from the whole state.
    #[test]
    fn the_published_digest_is_the_one_recomputed_from_the_whole_state_after_every_entry(
        ops in prop::collection::vec(op(), 1..120),
        cuts in prop::collection::vec(any::<bool>(), 120),
    ) {
        let es = entries(&ops, &cuts, 1);
        let mut sm = StateMachine::new();
        for e in &es {
            sm.apply(e).unwrap();
            prop_assert_eq!(sm.handle().load().digest, sm.digest());
        }
    }

    #[test]
    fn batching_of_the_stream_does_not_change_digest_or_answers(
        ops in prop::collection::vec(op(), 1..120),
        cuts_a in prop::collection::vec(any::<bool>(), 120),
        cuts_b in prop::collection::vec(any::<bool>(), 120),
    ) {
        let a = run(&entries(&ops, &cuts_a, 1));
        let b = run(&entries(&ops, &cuts_b, 5));
        prop_assert_eq!(a.digest(), b.digest());
        prop_assert_eq!(answers(&a), answers(&b));
    }

    #[test]
    fn snapshot_round_trip_keeps_digest_and_answers(
        ops in prop::collection::vec(op(), 1..120),
        cuts in prop::collection::vec(any::<bool>(), 120),
        at in 0.0..1.0f64,
    ) {
        let es = entries(&ops, &cuts, 1);
        let k = ((es.len() as f64) * at) as usize;
        let mut original = StateMachine::new();
        for e in &es[..k] {
            original.apply(e).unwrap();
        }
        let mut restored = StateMachine::restore(&original.snapshot().unwrap()).unwrap();
        prop_assert_eq!(restored.digest(), original.digest());
        prop_assert_eq!(restored.applied_index(), original.applied_index());
        prop_assert_eq!(answers_if_pool(&restored), answers_if_pool(&original));
        for e in &es[k..] {
            original.apply(e).unwrap();
            restored.apply(e).unwrap();
        }
        prop_assert_eq!(restored.digest(), original.digest());
        prop_assert_eq!(answers(&restored), answers(&original));
    }
}

/// vLLM re-announces reused blocks (`kv_cache_report_mode="full"`) and evicts each block once:
/// a repeated store changes nothing, and one removal takes the block out of the index.
#[test]
fn a_repeated_store_is_idempotent_and_one_removal_takes_the_block_out() {
    let store = Op::Store {
        w: 0,
        c: 2,
        start: 0,
        len: 3,
        tier: Tier::Gpu,
    };
    let once = run(&entries(std::slice::from_ref(&store), &[true], 1));
    let remove = Op::Remove { w: 0, c: 2, pos: 2 };
    let es = entries(&[store.clone(), store, remove], &[true, true, true], 1);
    let mut sm = StateMachine::new();
    sm.apply(&es[0]).unwrap();
    sm.apply(&es[1]).unwrap();
    sm.apply(&es[2]).unwrap();
    let full = |sm: &StateMachine| answers(sm)[2].values().copied().max().unwrap_or(0);
    assert_eq!(full(&sm), 3);
    assert_eq!(
        answers(&sm),
        answers(&once),
        "the second store changed nothing"
    );
    assert_eq!(sm.indexed_blocks(), once.indexed_blocks());
    sm.apply(&es[3]).unwrap();
    assert_eq!(full(&sm), 2);
}

#[test]
fn replayed_stream_messages_are_applied_once() {
    let ops: Vec<Op> = (0..4)
        .map(|c| Op::Store {
            w: 1,
            c,
            start: 0,
            len: 3,
            tier: Tier::Gpu,
        })
        .collect();
    let es = entries(&ops, &[false; 4], 1);
    let mut sm = run(&es);
    let digest = sm.digest();
    // The same batch again (a restarted consumer re-reading): nothing changes but the counter.
    let again = Entry {
        index: 100,
        ..es[1].clone()
    };
    let applied = sm.apply(&again).unwrap();
    assert_eq!(sm.digest(), digest);
    assert_eq!(applied.kv_events, 0);
    assert_eq!(sm.handle().load().dropped.get("duplicate"), Some(&4));
}

#[test]
fn stores_without_their_parent_are_dropped_and_counted() {
    let op = Op::Store {
        w: 0,
        c: 3,
        start: 4,
        len: 2,
        tier: Tier::Gpu,
    };
    let sm = run(&entries(&[op], &[true], 1));
    assert_eq!(sm.indexed_blocks(), 0);
    assert_eq!(sm.handle().load().dropped.get("parent_missing"), Some(&1));
}

#[test]
fn out_of_order_entries_are_refused() {
    let es = entries(&[Op::Clear { w: 0 }], &[true], 1);
    let mut sm = run(&es);
    assert!(sm.apply(&es[0]).is_err());
}

/// Raft applies entries inside a tokio task. Hundreds of entries in one task poll used to
/// exhaust tokio's cooperative budget inside the old index's flush and spin forever.
#[test]
fn applying_many_entries_inside_one_async_task_completes() {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let applied = rt.block_on(async {
            let mut sm = StateMachine::new();
            let mut index = 0;
            let mut next = |command| {
                index += 1;
                Entry {
                    index,
                    timestamp_ms: 0,
                    command,
                }
            };
            sm.apply(&next(Command::ConfigPut {
                owner: Some(kvplane_state::Owner::Admin),
                kind: POOL_KIND.into(),
                name: "p".into(),
                value: PoolConfig {
                    block_size: BS,
                    models: Vec::new(),
                    lora_adapters: Vec::new(),
                }
                .to_json(),
            }))
            .unwrap();
            for seq in 1..=500u64 {
                let entry = next(Command::Ingest(IngestBatch {
                    source: Default::default(),
                    first_seq: seq,
                    last_seq: seq,
                    items: vec![IngestItem {
                        seq,
                        pool: "p".into(),
                        worker: "w".into(),
                        payload: IngestPayload::Kv(KvBatch {
                            dp_rank: 0,
                            events: vec![
                                KvEvent::Stored {
                                    block_hashes: vec![seq],
                                    parent_hash: None,
                                    token_ids: (0..BS).map(|t| seq as u32 * 10 + t).collect(),
                                    block_size: BS,
                                    lora_name: None,
                                    cache_salt: None,
                                    tier: Tier::Gpu,
                                }
                                .compact(),
                            ],
                        }),
                    }],
                }));
                sm.apply(&entry).unwrap();
            }
            sm.applied_index()
        });
        let _ = tx.send(applied);
    });
    let applied = rx
        .recv_timeout(std::time::Duration::from_secs(60))
        .expect("apply inside a tokio task did not finish");
    assert_eq!(applied, 501);
}

/// The smallest stream the reference model found on which dynamo-kv-router's compressed tree
/// (1.6.1, the index before this one) disagreed with it: w0 holds chain 0's blocks 0-2 and,
/// under the shared blocks 0-1, chain 1's block 2; w1 holds blocks 0-1; w0 loses block 0. w1
/// holds two blocks of either chain; the tree answered three.
#[test]
fn a_removed_shared_block_credits_no_one_with_a_longer_prefix() {
    let ops = [
        Op::Store {
            w: 0,
            c: 0,
            start: 0,
            len: 3,
            tier: Tier::Gpu,
        },
        Op::Store {
            w: 1,
            c: 0,
            start: 0,
            len: 2,
            tier: Tier::Gpu,
        },
        Op::Store {
            w: 0,
            c: 1,
            start: 2,
            len: 1,
            tier: Tier::Gpu,
        },
        Op::Remove { w: 0, c: 0, pos: 0 },
    ];
    let sm = run(&entries(&ops, &[true; 4], 1));
    let mut model = Model::default();
    for op in &ops {
        model.apply(op);
    }
    assert_eq!(named_answers(&sm), model.answers());
}

/// The prefix trees are live: a View held while later entries apply sees their blocks in its
/// lookups, and says so - its `index_through` rises past its `applied_index` to the entry that
/// wrote; a fresh View of a quiet state is exact.
#[test]
fn a_view_held_across_later_entries_reports_how_far_its_lookups_may_see() {
    let first = Op::Store {
        w: 0,
        c: 0,
        start: 0,
        len: 2,
        tier: Tier::Gpu,
    };
    let es = entries(&[first], &[true], 1);
    let mut sm = run(&es);
    let held = sm.handle().load();
    assert_eq!(held.index_through(), held.applied_index);
    let more = Op::Store {
        w: 1,
        c: 3,
        start: 0,
        len: 3,
        tier: Tier::Gpu,
    };
    let index = held.applied_index + 5;
    sm.apply(&Entry {
        index,
        timestamp_ms: 0,
        command: Command::Ingest(IngestBatch {
            source: Default::default(),
            first_seq: 50,
            last_seq: 50,
            items: vec![item(50, &more)],
        }),
    })
    .unwrap();
    let pool = held.pools.values().next().unwrap();
    let seen = pool.index.overlaps(&chain_tokens(3), None);
    assert_eq!(
        seen.best_blocks(),
        3,
        "the held View's tree is the live one"
    );
    assert_eq!(held.index_through(), index);
    let fresh = sm.handle().load();
    assert_eq!(fresh.applied_index, index);
    assert_eq!(fresh.index_through(), index);
}

/// vLLM's CPU offload events may be placeholders (block size 0, no tokens): kept in their tier,
/// they leave the GPU index as it was and are not counted as malformed.
#[test]
fn a_cpu_placeholder_store_without_tokens_leaves_the_gpu_index_alone() {
    let gpu = Op::Store {
        w: 0,
        c: 1,
        start: 0,
        len: 4,
        tier: Tier::Gpu,
    };
    let mut sm = run(&entries(&[gpu], &[true], 1));
    let before = answers(&sm);
    let placeholder = KvEvent::Stored {
        block_hashes: chain_hashes(0, 1)[..4].to_vec(),
        parent_hash: None,
        token_ids: Vec::new(),
        block_size: 0,
        lora_name: None,
        cache_salt: None,
        tier: Tier::Cpu,
    }
    .compact();
    send_kv(&mut sm, 90, placeholder);
    let view = sm.handle().load();
    assert!(view.dropped.is_empty(), "{:?}", view.dropped);
    assert_eq!(answers(&sm), before);
    assert_eq!(view.digest, sm.digest());
}

/// vLLM's block hash also covers multimodal keys, so one rank can hold the same tokens under
/// two engine hashes: it stays matched until the last of them is removed, and a state restored
/// from a snapshot answers as the live one does.
#[test]
fn a_rank_holding_one_content_under_two_engine_hashes_keeps_it_until_both_leave() {
    let stored = |hashes: Vec<u64>| {
        KvEvent::Stored {
            block_hashes: hashes,
            parent_hash: None,
            token_ids: chain_tokens(3)[..2 * BS as usize].to_vec(),
            block_size: BS,
            lora_name: None,
            cache_salt: None,
            tier: Tier::Gpu,
        }
        .compact()
    };
    let removed = |hashes: Vec<u64>| KvEvent::Removed {
        block_hashes: hashes,
        tier: Tier::Gpu,
    };
    let mut sm = run(&entries(&[Op::Clear { w: 0 }], &[true], 1));
    let mut seq = 100;
    let mut send = |sm: &mut StateMachine, ev: KvEvent| {
        seq += 1;
        send_kv(sm, seq, ev);
    };
    send(&mut sm, stored(vec![11, 12]));
    send(&mut sm, stored(vec![21, 22]));
    let matched = |sm: &StateMachine| answers(sm)[3].values().copied().max().unwrap_or(0);
    assert_eq!(matched(&sm), 2);
    send(&mut sm, removed(vec![12]));
    assert_eq!(matched(&sm), 2, "the second copy still holds block 1");
    let restored = StateMachine::restore(&sm.snapshot().unwrap()).unwrap();
    assert_eq!(answers(&restored), answers(&sm));
    send(&mut sm, removed(vec![22]));
    assert_eq!(matched(&sm), 1);
    let restored = StateMachine::restore(&sm.snapshot().unwrap()).unwrap();
    assert_eq!(answers(&restored), answers(&sm));
}

/// Applies stream message `seq`: one KV event of w0's rank 0, in an entry of its own.
fn send_kv(sm: &mut StateMachine, seq: u64, ev: KvEvent) {
    let index = sm.applied_index() + 1;
    sm.apply(&Entry {
        index,
        timestamp_ms: 0,
        command: Command::Ingest(IngestBatch {
            source: Default::default(),
            first_seq: seq,
            last_seq: seq,
            items: vec![IngestItem {
                seq,
                pool: "p".into(),
                worker: "w0".into(),
                payload: IngestPayload::Kv(KvBatch {
                    dp_rank: 0,
                    events: vec![ev],
                }),
            }],
        }),
    })
    .unwrap();
}

/// A hybrid model stores the same blocks in its full-attention group and in a sliding-window
/// group, and the sliding window drops them soon: its removals (vLLM's `group_idx` 1) leave the
/// full-attention blocks matched; a removal from the main group still takes them out.
#[test]
fn a_sliding_window_groups_removals_leave_the_full_attention_blocks_matched() {
    let mut sm = w0_holding_chain_3();
    let matched = |sm: &StateMachine| answers(sm)[3].values().copied().max().unwrap_or(0);
    assert_eq!(matched(&sm), 8);
    let hashes = chain_hashes(0, 3);
    send_kv(&mut sm, 50, KvEvent::OtherGroup { group: 1 });
    send_kv(
        &mut sm,
        51,
        KvEvent::RemovedFromGroup {
            block_hashes: hashes.clone(),
            tier: Tier::Gpu,
            group: 1,
        },
    );
    assert_eq!(
        matched(&sm),
        8,
        "the sliding window's removals touched group 0"
    );
    assert_eq!(
        sm.handle().load().dropped.get("non_primary_group"),
        Some(&1)
    );
    let restored = StateMachine::restore(&sm.snapshot().unwrap()).unwrap();
    assert_eq!(restored.digest(), sm.digest());
    send_kv(
        &mut sm,
        52,
        KvEvent::Removed {
            block_hashes: hashes[4..].to_vec(),
            tier: Tier::Gpu,
        },
    );
    assert_eq!(matched(&sm), 4);
    assert_eq!(sm.handle().load().digest, sm.digest());
}

/// The other way round: the sliding window is group 0 (vLLM leaves its `group_idx` out) and full
/// attention group 1; removals from group 1 take blocks out, removals from group 0 do not.
#[test]
fn when_the_sliding_window_is_group_0_removals_from_group_1_still_apply() {
    let mut sm = w0_holding_chain_3();
    let matched = |sm: &StateMachine| answers(sm)[3].values().copied().max().unwrap_or(0);
    let hashes = chain_hashes(0, 3);
    send_kv(&mut sm, 50, KvEvent::OtherGroup { group: 0 });
    send_kv(
        &mut sm,
        51,
        KvEvent::Removed {
            block_hashes: hashes.clone(),
            tier: Tier::Gpu,
        },
    );
    assert_eq!(matched(&sm), 8);
    send_kv(
        &mut sm,
        52,
        KvEvent::RemovedFromGroup {
            block_hashes: hashes[6..].to_vec(),
            tier: Tier::Gpu,
            group: 1,
        },
    );
    assert_eq!(matched(&sm), 6);
}

/// A state in which w0 holds all 8 blocks of chain 3.
fn w0_holding_chain_3() -> StateMachine {
    let store = Op::Store {
        w: 0,
        c: 3,
        start: 0,
        len: 8,
        tier: Tier::Gpu,
    };
    run(&entries(&[store], &[true], 1))
}
