//! Golden cases made by vLLM's own code (`scripts/gen-vllm-fixtures.py`: vLLM's event classes,
//! encoder and hash functions, taken from its released wheels). Each batch must decode to what
//! vLLM itself decodes, and after it is applied, the index must answer every query with the
//! blocks each engine rank would hit - the generator's model of the engines' prefix caches, not
//! kvplane's code - and count the blocks those caches hold.

#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::path::PathBuf;

use kvplane_ingest::vllm::decode_batch;
use kvplane_state::{
    Command, Entry, IngestBatch, IngestItem, IngestPayload, KvEvent, Owner, POOL_KIND, PoolConfig,
    StateMachine, Tier,
};
use serde_json::Value;

fn case(name: &str) -> Value {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/vllm-events")
        .join(format!("{name}.json"));
    serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

fn u64s(v: &Value) -> Vec<u64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect()
}

fn string(v: &Value) -> Option<String> {
    v.as_str().map(str::to_owned)
}

/// The tier vLLM's fields name (`../shared/reference/vllm-kv-events.md`): REMOTE locality
/// first, then the medium; FS and OBJ were STORAGE's names for a while.
fn tier(ev: &Value) -> Tier {
    if ev["locality"].as_str() == Some("REMOTE") {
        return Tier::Remote;
    }
    match ev["medium"].as_str() {
        None | Some("GPU") => Tier::Gpu,
        Some("CPU") => Tier::Cpu,
        Some("STORAGE" | "FS" | "OBJ") => Tier::Storage,
        Some(other) => panic!("medium {other} is not one vLLM sends"),
    }
}

/// The salt of the request that stored a chain rides in its first block's extra keys (vLLM
/// adds it at token 0 only): the last string there that is not the LoRA name.
fn salt(ev: &Value) -> Option<String> {
    if !ev["parent_block_hash"].is_null() {
        return None;
    }
    let lora = ev["lora_name"].as_str();
    ev["extra_keys"]
        .get(0)?
        .as_array()?
        .iter()
        .rev()
        .filter_map(Value::as_str)
        .find(|s| Some(*s) != lora)
        .map(str::to_owned)
}

/// What an event vLLM decoded means to the state.
fn expected(ev: &Value) -> KvEvent {
    let group = ev["group_idx"].as_u64().unwrap_or(0) as u32;
    match ev["type"].as_str().unwrap() {
        "AllBlocksCleared" => KvEvent::Cleared,
        "BlockStored" => {
            let kind = ev["kv_cache_spec_kind"]
                .as_str()
                .unwrap_or("full_attention");
            if kind != "full_attention" {
                return KvEvent::OtherGroup { group };
            }
            KvEvent::Stored {
                block_hashes: u64s(&ev["block_hashes"]),
                parent_hash: ev["parent_block_hash"].as_u64(),
                token_ids: ev["token_ids"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|t| t.as_u64().unwrap() as u32)
                    .collect(),
                block_size: ev["block_size"].as_u64().unwrap() as u32,
                lora_name: string(&ev["lora_name"]),
                cache_salt: salt(ev),
                tier: tier(ev),
            }
        }
        "BlockRemoved" if group == 0 => KvEvent::Removed {
            block_hashes: u64s(&ev["block_hashes"]),
            tier: tier(ev),
        },
        "BlockRemoved" => KvEvent::RemovedFromGroup {
            block_hashes: u64s(&ev["block_hashes"]),
            tier: tier(ev),
            group,
        },
        other => panic!("event type {other} is not one vLLM sends"),
    }
}

struct Replica {
    sm: StateMachine,
    index: u64,
}

impl Replica {
    fn new(block_size: u32) -> Self {
        let mut r = Self {
            sm: StateMachine::new(),
            index: 0,
        };
        r.apply(Command::ConfigPut {
            owner: Some(Owner::Admin),
            kind: POOL_KIND.into(),
            name: "p".into(),
            value: PoolConfig {
                block_size,
                models: vec![],
                lora_adapters: Vec::new(),
            }
            .to_json(),
        });
        r
    }

    fn apply(&mut self, command: Command) {
        self.index += 1;
        self.sm
            .apply(&Entry {
                index: self.index,
                timestamp_ms: 0,
                command,
            })
            .unwrap();
    }

    /// Blocks hit per `worker/rank`, for one query.
    fn hits(&self, query: &Value) -> BTreeMap<String, u64> {
        let view = self.sm.handle().load();
        let pool = &view.pools["p"];
        let tokens: Vec<u32> = query["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap() as u32)
            .collect();
        let overlap = pool.index.overlaps_keyed(
            &tokens,
            query["lora_name"].as_str(),
            query["cache_salt"].as_str(),
        );
        let names: BTreeMap<u64, &str> = pool.workers.iter().map(|w| (w.id, &*w.name)).collect();
        overlap
            .by_rank()
            .into_iter()
            .map(|((id, rank), n)| (format!("{}/{rank}", names[&id]), u64::from(n)))
            .collect()
    }
}

/// Replays one case: every batch decoded and compared with vLLM's own decoding, applied, and
/// the index's hits, block count and drops compared with the case's after it.
fn replay(name: &str) {
    let case = case(name);
    let queries = case["queries"].as_array().unwrap();
    let mut replica = Replica::new(case["block_size"].as_u64().unwrap() as u32);
    for (i, batch) in case["batches"].as_array().unwrap().iter().enumerate() {
        let at = format!("{name}, batch {i}");
        let decoded = decode_batch(&unhex(batch["payload"].as_str().unwrap())).unwrap();
        assert_eq!(
            u64::from(decoded.batch.dp_rank),
            batch["dp_rank"].as_u64().unwrap(),
            "{at}"
        );
        let want: Vec<KvEvent> = batch["events"]
            .as_array()
            .unwrap()
            .iter()
            .map(expected)
            .collect();
        assert_eq!(decoded.batch.events, want, "{at}: decoded events");
        let seq = i as u64 + 1;
        replica.apply(Command::Ingest(IngestBatch {
            source: Default::default(),
            first_seq: seq,
            last_seq: seq,
            items: vec![IngestItem {
                seq,
                pool: "p".into(),
                worker: batch["worker"].as_str().unwrap().into(),
                // As the leader proposes it: hashed once, compact.
                payload: IngestPayload::Kv(decoded.batch.compact()),
            }],
        }));
        for (q, query) in queries.iter().enumerate() {
            let got = replica.hits(query);
            for (rank, hits) in batch["hits"].as_object().unwrap() {
                let want = hits[q].as_u64().unwrap();
                assert_eq!(
                    got.get(rank).copied().unwrap_or(0),
                    want,
                    "{at}: query {q} on {rank}"
                );
            }
        }
        assert_eq!(
            replica.sm.indexed_blocks(),
            batch["gpu_blocks"].as_u64().unwrap(),
            "{at}: blocks in the engines' GPU caches"
        );
        let view = replica.sm.handle().load();
        let dropped: BTreeMap<String, u64> = view
            .dropped
            .iter()
            .filter(|(_, n)| **n > 0)
            .map(|(r, n)| ((*r).to_owned(), *n))
            .collect();
        let want: BTreeMap<String, u64> = batch["dropped"]
            .as_object()
            .unwrap()
            .iter()
            .map(|(r, n)| (r.clone(), n.as_u64().unwrap()))
            .collect();
        assert_eq!(dropped, want, "{at}: dropped events");
    }
}

#[test]
fn vllm_0_33_map_events_index_what_the_engine_caches() {
    replay("0.33-map-events");
}

#[test]
fn vllm_0_33_map_shaped_batches_index_what_the_engine_caches() {
    replay("0.33-map-batch");
}

#[test]
fn vllm_0_22_positional_events_index_what_the_engine_caches() {
    replay("0.22-positional-events");
}

#[test]
fn vllm_byte_hashes_of_sha256_and_xxhash_index_what_the_engines_cache() {
    replay("0.33-byte-hashes");
}

#[test]
fn vllm_copies_in_other_tiers_and_offload_placeholders_leave_the_gpu_index_alone() {
    replay("0.33-tiers");
}

#[test]
fn vllm_sliding_window_group_removals_leave_full_attention_blocks_matched() {
    replay("0.33-hybrid-groups");
}

#[test]
fn vllm_report_full_re_stores_leave_with_their_one_eviction() {
    replay("0.33-report-full");
}

#[test]
fn vllm_partial_block_stores_are_dropped_and_counted_and_lose_nothing_else() {
    replay("0.33-partial-blocks");
}

#[test]
fn vllm_fleet_with_differing_hash_seeds_lora_salts_and_restarts_indexes_what_every_engine_caches() {
    replay("0.33-fleet");
}
