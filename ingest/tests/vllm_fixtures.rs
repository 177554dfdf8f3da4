//! Golden tests: vLLM's own batches decode to exactly what vLLM encoded, and applied to the
//! state they give the prefix overlaps vLLM's fixtures expect.

#![allow(clippy::unwrap_used)]

use std::path::PathBuf;

use kvplane_ingest::vllm::decode_batch;
use kvplane_state::{
    Command, Entry, IngestBatch, IngestItem, IngestPayload, KvEvent, POOL_KIND, PoolConfig,
    StateMachine, Tier,
};
use serde_json::Value;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/vllm-kv-events")
        .join(name)
}

fn load(version: &str) -> (Vec<u8>, Vec<u8>, Value) {
    let b1 = std::fs::read(fixture(&format!("vllm-{version}.batch1.msgpack"))).unwrap();
    let b2 = std::fs::read(fixture(&format!("vllm-{version}.batch2.msgpack"))).unwrap();
    let exp: Value = serde_json::from_slice(
        &std::fs::read(fixture(&format!("vllm-{version}.expected.json"))).unwrap(),
    )
    .unwrap();
    (b1, b2, exp)
}

fn u64s(v: &Value) -> Vec<u64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect()
}

fn u32s(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn tier_of(medium: &Value) -> Tier {
    match medium.as_str() {
        None | Some("GPU") => Tier::Gpu,
        Some("CPU") => Tier::Cpu,
        Some(other) => panic!("unexpected medium {other}"),
    }
}

fn expected_events(list: &Value) -> Vec<KvEvent> {
    list.as_array()
        .unwrap()
        .iter()
        .map(|e| match e["type"].as_str().unwrap() {
            "BlockStored" => KvEvent::Stored {
                block_hashes: u64s(&e["block_hashes"]),
                parent_hash: e["parent_block_hash"].as_u64(),
                token_ids: u32s(&e["token_ids"]),
                block_size: e["block_size"].as_u64().unwrap() as u32,
                lora_name: e["lora_name"].as_str().map(str::to_owned),
                cache_salt: None,
                tier: tier_of(&e["medium"]),
            },
            "BlockRemoved" => KvEvent::Removed {
                block_hashes: u64s(&e["block_hashes"]),
                tier: tier_of(&e["medium"]),
            },
            "AllBlocksCleared" => KvEvent::Cleared,
            other => panic!("unexpected type {other}"),
        })
        .collect()
}

fn check_decoding(version: &str) {
    let (b1, b2, exp) = load(version);
    let d1 = decode_batch(&b1).unwrap();
    let d2 = decode_batch(&b2).unwrap();
    assert!(d1.skipped.is_empty() && d2.skipped.is_empty());
    let dp = exp["data_parallel_rank"].as_u64().unwrap() as u32;
    assert_eq!(d1.batch.dp_rank, dp);
    assert_eq!(d2.batch.dp_rank, dp);
    assert_eq!(d1.batch.events, expected_events(&exp["batch1_events"]));
    assert_eq!(d2.batch.events, expected_events(&exp["batch2_events"]));
}

#[test]
fn vllm_0_33_map_events_decode_exactly() {
    check_decoding("0.33");
}

#[test]
fn vllm_0_22_positional_events_decode_exactly() {
    check_decoding("0.22");
}

struct Applier {
    sm: StateMachine,
    index: u64,
    seq: u64,
}

impl Applier {
    fn new(block_size: u32) -> Self {
        let mut a = Self {
            sm: StateMachine::new(),
            index: 0,
            seq: 0,
        };
        a.command(Command::ConfigPut {
            owner: Some(kvplane_state::Owner::Admin),
            kind: POOL_KIND.into(),
            name: "p".into(),
            value: PoolConfig {
                block_size,
                models: vec![],
                lora_adapters: Vec::new(),
            }
            .to_json(),
        });
        a
    }

    fn command(&mut self, command: Command) {
        self.index += 1;
        self.sm
            .apply(&Entry {
                index: self.index,
                timestamp_ms: 0,
                command,
            })
            .unwrap();
    }

    fn ingest(&mut self, worker: &str, payload: &[u8]) {
        self.seq += 1;
        // As the leader proposes it: hashed once, compact.
        let batch = decode_batch(payload).unwrap().batch.compact();
        self.command(Command::Ingest(IngestBatch {
            source: Default::default(),
            first_seq: self.seq,
            last_seq: self.seq,
            items: vec![IngestItem {
                seq: self.seq,
                pool: "p".into(),
                worker: worker.into(),
                payload: IngestPayload::Kv(batch),
            }],
        }));
    }

    fn overlap(&self, worker: &str, tokens: &[u32]) -> u32 {
        let view = self.sm.handle().load();
        let pool = &view.pools["p"];
        let id = pool.workers.iter().find(|w| &*w.name == worker).unwrap().id;
        pool.index.overlaps(tokens, None).best_for(id).0
    }
}

fn check_overlaps(version: &str) {
    let (b1, b2, exp) = load(version);
    let mut a = Applier::new(exp["block_size"].as_u64().unwrap() as u32);
    a.ingest("w", &b1);
    let want = &exp["expected_overlap_after_batch1_blocks"];
    assert_eq!(
        a.overlap("w", &u32s(&exp["query_prompt_A"])),
        want["prompt_A"].as_u64().unwrap() as u32
    );
    assert_eq!(
        a.overlap("w", &u32s(&exp["query_prompt_B"])),
        want["prompt_B"].as_u64().unwrap() as u32
    );
    // The CPU copies are tracked but never indexed; the GPU copies of those blocks were removed.
    assert_eq!(a.sm.indexed_blocks(), 7);
    a.ingest("w", &b2);
    assert_eq!(a.overlap("w", &u32s(&exp["query_prompt_A"])), 0);
    assert_eq!(a.overlap("w", &u32s(&exp["query_prompt_B"])), 0);
    assert_eq!(a.sm.indexed_blocks(), 0);
}

#[test]
fn vllm_0_33_batches_give_the_expected_overlaps() {
    check_overlaps("0.33");
}

#[test]
fn vllm_0_22_batches_give_the_expected_overlaps() {
    check_overlaps("0.22");
}

#[test]
fn fixture_batches_gpu_stores_for_other_block_sizes_are_dropped_and_counted() {
    let (b1, _, exp) = load("0.33");
    let mut a = Applier::new(32);
    a.ingest("w", &b1);
    assert_eq!(a.sm.indexed_blocks(), 0);
    assert_eq!(a.overlap("w", &u32s(&exp["query_prompt_A"])), 0);
    let view = a.sm.handle().load();
    // The two GPU stores are dropped; the CPU store is kept in its tier (never indexed, so its
    // block size does not matter: offload placeholders carry 0); the removal finds nothing.
    assert_eq!(view.dropped.get("block_size_mismatch"), Some(&2));
}
