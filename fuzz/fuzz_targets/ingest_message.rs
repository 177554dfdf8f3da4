//! One stream message as the leader's consumer reads it: the subject (first line of the input)
//! and the payload (the rest) through `kvplane_ingest::convert` (vLLM batches, metrics and
//! worker JSON), and an accepted item applied to a state holding that worker's pool. Nothing
//! may panic; a rejection (of the message, or of the entry by the state) is a value.
#![no_main]

use kvplane_state::{
    Command, Entry, IngestBatch, IngestPayload, KvEvent, Owner, POOL_KIND, PoolConfig, StateMachine,
};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let (subject, payload) = match data.iter().position(|b| *b == b'\n') {
        Some(i) => (&data[..i], &data[i + 1..]),
        None => (data, &[][..]),
    };
    let subject = String::from_utf8_lossy(subject);
    let Ok(c) = kvplane_ingest::convert(1 << 20, 1, &subject, payload) else {
        return;
    };
    // The pool's block size is the batch's own (vLLM's fixtures use 4 and 16): a mismatch would
    // stop every stored block before the index.
    let block_size = match &c.item.payload {
        IngestPayload::Kv(b) => b.events.iter().find_map(|e| match e {
            KvEvent::Stored { block_size, .. } | KvEvent::StoredBlocks { block_size, .. } => {
                Some(*block_size).filter(|b| *b > 0)
            }
            _ => None,
        }),
        _ => None,
    };
    let mut sm = StateMachine::new();
    let pool = Command::ConfigPut {
        owner: Some(Owner::Admin),
        kind: POOL_KIND.into(),
        name: c.item.pool.clone(),
        value: PoolConfig {
            block_size: block_size.unwrap_or(16),
            models: Vec::new(),
            lora_adapters: Vec::new(),
        }
        .to_json(),
    };
    let ingest = Command::Ingest(IngestBatch {
        source: Default::default(),
        first_seq: 1,
        last_seq: 1,
        items: vec![c.item],
    });
    for (index, command) in [(1, pool), (2, ingest)] {
        let _ = sm.apply(&Entry {
            index,
            timestamp_ms: 1_000,
            command,
        });
    }
});
