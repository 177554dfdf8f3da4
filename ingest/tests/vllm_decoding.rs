//! The decoder accepts every shape vLLM has sent and refuses the rest with a clear reason.

#![allow(clippy::unwrap_used)]

use kvplane_ingest::DecodeError;
use kvplane_ingest::vllm::{SkippedEvent, decode_batch, encode_batch};
use kvplane_state::{KvBatch, KvEvent, Tier};
use rmpv::Value;

fn encode(v: &Value) -> Vec<u8> {
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, v).unwrap();
    out
}

fn s(x: &str) -> Value {
    Value::from(x)
}

fn stored_map(extra: Vec<(Value, Value)>) -> Value {
    let mut m = vec![
        (s("type"), s("BlockStored")),
        (s("block_hashes"), Value::Array(vec![Value::from(7u64)])),
        (s("parent_block_hash"), Value::Nil),
        (
            s("token_ids"),
            Value::Array((0..4u32).map(Value::from).collect()),
        ),
        (s("block_size"), Value::from(4)),
    ];
    m.extend(extra);
    Value::Map(m)
}

fn batch(events: Vec<Value>) -> Vec<u8> {
    encode(&Value::Array(vec![
        Value::F64(1.5),
        Value::Array(events),
        Value::Nil,
    ]))
}

#[test]
fn map_shaped_batches_are_accepted() {
    let payload = encode(&Value::Map(vec![
        (s("ts"), Value::F64(2.0)),
        (s("events"), Value::Array(vec![stored_map(vec![])])),
        (s("data_parallel_rank"), Value::from(3)),
    ]));
    let d = decode_batch(&payload).unwrap();
    assert_eq!(d.batch.dp_rank, 3);
    assert_eq!(d.batch.events.len(), 1);
}

#[test]
fn negative_i64_hashes_are_reinterpreted_bit_for_bit() {
    let ev = Value::Array(vec![
        s("BlockRemoved"),
        Value::Array(vec![Value::from(-2i64)]),
        Value::Nil,
    ]);
    let d = decode_batch(&batch(vec![ev])).unwrap();
    assert_eq!(
        d.batch.events,
        vec![KvEvent::Removed {
            block_hashes: vec![u64::MAX - 1],
            tier: Tier::Gpu
        }]
    );
}

/// sha256 digests are 32 bytes, xxhash's 128-bit form 16 (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`).
#[test]
fn byte_hashes_of_32_and_16_bytes_reduce_to_their_low_64_bits_big_endian() {
    for len in [32usize, 16] {
        let mut digest = vec![0xaau8; len];
        digest[len - 8..].copy_from_slice(&0x0102_0304_0506_0708u64.to_be_bytes());
        let ev = Value::Map(vec![
            (s("type"), s("BlockRemoved")),
            (s("block_hashes"), Value::Array(vec![Value::Binary(digest)])),
        ]);
        let d = decode_batch(&batch(vec![ev])).unwrap();
        assert!(d.skipped.is_empty(), "{len} bytes: {:?}", d.skipped);
        assert_eq!(
            d.batch.events,
            vec![KvEvent::Removed {
                block_hashes: vec![0x0102_0304_0506_0708],
                tier: Tier::Gpu
            }],
            "{len} bytes"
        );
    }
}

#[test]
fn unknown_extra_fields_are_ignored() {
    let ev = stored_map(vec![
        (s("session_id"), s("abc")),
        (s("some_future_field"), Value::Array(vec![])),
    ]);
    let d = decode_batch(&batch(vec![ev])).unwrap();
    assert!(d.skipped.is_empty());
    assert_eq!(d.batch.events.len(), 1);
}

#[test]
fn media_and_locality_map_to_tiers() {
    let cases = [
        (vec![(s("medium"), s("CPU"))], Tier::Cpu),
        (vec![(s("medium"), s("STORAGE"))], Tier::Storage),
        (vec![(s("medium"), Value::Nil)], Tier::Gpu),
        (
            vec![(s("medium"), s("GPU")), (s("locality"), s("REMOTE"))],
            Tier::Remote,
        ),
        (vec![(s("locality"), s("LOCAL"))], Tier::Gpu),
    ];
    for (extra, want) in cases {
        let d = decode_batch(&batch(vec![stored_map(extra)])).unwrap();
        match &d.batch.events[0] {
            KvEvent::Stored { tier, .. } => assert_eq!(*tier, want),
            other => panic!("{other:?}"),
        }
    }
}

#[test]
fn sliding_window_groups_are_skipped_not_indexed() {
    let ev = stored_map(vec![
        (s("group_idx"), Value::from(1)),
        (s("kv_cache_spec_kind"), s("sliding_window")),
    ]);
    let d = decode_batch(&batch(vec![ev])).unwrap();
    // Only the group is kept, so that the state ignores that group's removals.
    assert_eq!(d.batch.events, vec![KvEvent::OtherGroup { group: 1 }]);
    assert_eq!(d.skipped, vec![SkippedEvent::NonPrimaryGroup]);
}

/// vLLM names the KV-cache group of a removal only when it is not 0.
#[test]
fn removals_name_their_group_when_it_is_not_the_first() {
    let removed = |extra: Vec<(Value, Value)>| {
        let mut m = vec![
            (s("type"), s("BlockRemoved")),
            (s("block_hashes"), Value::Array(vec![Value::from(7u64)])),
        ];
        m.extend(extra);
        Value::Map(m)
    };
    let d = decode_batch(&batch(vec![
        removed(vec![]),
        removed(vec![(s("group_idx"), Value::from(2))]),
    ]))
    .unwrap();
    assert_eq!(
        d.batch.events,
        vec![
            KvEvent::Removed {
                block_hashes: vec![7],
                tier: Tier::Gpu
            },
            KvEvent::RemovedFromGroup {
                block_hashes: vec![7],
                tier: Tier::Gpu,
                group: 2
            },
        ]
    );
}

#[test]
fn unknown_event_types_are_skipped_and_the_rest_kept() {
    let unknown = Value::Map(vec![(s("type"), s("BlockTeleported"))]);
    let d = decode_batch(&batch(vec![unknown, stored_map(vec![])])).unwrap();
    assert_eq!(d.batch.events.len(), 1);
    assert_eq!(
        d.skipped,
        vec![SkippedEvent::UnknownType("BlockTeleported".into())]
    );
    assert_eq!(d.skipped[0].reason(), "unknown_event_type");
}

#[test]
fn malformed_events_are_skipped_with_the_field_named() {
    let bad = Value::Map(vec![
        (s("type"), s("BlockStored")),
        (s("block_hashes"), s("nope")),
    ]);
    let d = decode_batch(&batch(vec![bad])).unwrap();
    match &d.skipped[0] {
        SkippedEvent::Malformed(why) => assert!(why.contains("block_hashes"), "{why}"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn truncated_msgpack_is_an_error() {
    let full = batch(vec![stored_map(vec![])]);
    for cut in [1, full.len() / 2, full.len() - 1] {
        assert!(
            matches!(decode_batch(&full[..cut]), Err(DecodeError::Msgpack(_))),
            "cut {cut}"
        );
    }
}

#[test]
fn trailing_bytes_are_an_error() {
    let mut payload = batch(vec![]);
    payload.push(0xc0);
    assert_eq!(decode_batch(&payload), Err(DecodeError::TrailingBytes(1)));
}

#[test]
fn a_batch_that_is_not_an_array_or_map_is_an_error() {
    assert_eq!(
        decode_batch(&encode(&Value::from(5))),
        Err(DecodeError::BatchShape("an integer"))
    );
}

#[test]
fn encoded_batches_decode_to_the_same_events() {
    let b = KvBatch {
        dp_rank: 2,
        events: vec![
            KvEvent::Stored {
                block_hashes: vec![1, u64::MAX],
                parent_hash: Some(9),
                token_ids: (0..8).collect(),
                block_size: 4,
                lora_name: Some("adapter".into()),
                cache_salt: None,
                tier: Tier::Gpu,
            },
            KvEvent::Removed {
                block_hashes: vec![1],
                tier: Tier::Cpu,
            },
            KvEvent::Stored {
                block_hashes: vec![3],
                parent_hash: None,
                token_ids: (0..4).collect(),
                block_size: 4,
                lora_name: None,
                cache_salt: None,
                tier: Tier::Remote,
            },
            KvEvent::Cleared,
        ],
    };
    let d = decode_batch(&encode_batch(3.0, &b)).unwrap();
    assert_eq!(d.batch, b);
    assert_eq!(d.ts, 3.0);
}

#[test]
fn the_cache_salt_comes_from_the_first_blocks_extra_keys_after_the_lora_key() {
    let salt_of = |extra: Vec<(Value, Value)>| match &decode_batch(&batch(vec![stored_map(extra)]))
        .unwrap()
        .batch
        .events[0]
    {
        KvEvent::Stored { cache_salt, .. } => cache_salt.clone(),
        other => panic!("{other:?}"),
    };
    assert_eq!(salt_of(vec![]), None);
    let keys = |k: Vec<Value>| (s("extra_keys"), Value::Array(vec![Value::Array(k)]));
    assert_eq!(
        salt_of(vec![keys(vec![s("alice")])]).as_deref(),
        Some("alice")
    );
    assert_eq!(
        salt_of(vec![
            (s("lora_name"), s("ad")),
            keys(vec![s("ad"), s("alice")])
        ])
        .as_deref(),
        Some("alice")
    );
    assert_eq!(
        salt_of(vec![(s("lora_name"), s("ad")), keys(vec![s("ad")])]),
        None
    );
    assert_eq!(
        salt_of(vec![(s("extra_keys"), Value::Array(vec![Value::Nil]))]),
        None
    );
    // What the simulator and tests encode decodes back the same.
    let ev = KvEvent::Stored {
        block_hashes: vec![1, 2],
        parent_hash: None,
        token_ids: (0..8).collect(),
        block_size: 4,
        lora_name: Some("ad".into()),
        cache_salt: Some("alice".into()),
        tier: Tier::Gpu,
    };
    let b = KvBatch {
        dp_rank: 0,
        events: vec![ev.clone()],
    };
    assert_eq!(
        decode_batch(&encode_batch(0.0, &b)).unwrap().batch.events,
        vec![ev]
    );
}

/// vLLM's CPU offload stores may be placeholders: block size 0 and no tokens. They decode into
/// their tier; on the GPU tier the same shape is malformed.
#[test]
fn offload_placeholders_without_tokens_decode_and_gpu_ones_do_not() {
    let placeholder = |medium: &str| {
        Value::Map(vec![
            (s("type"), s("BlockStored")),
            (s("block_hashes"), Value::Array(vec![Value::from(7u64)])),
            (s("parent_block_hash"), Value::Nil),
            (s("token_ids"), Value::Array(vec![])),
            (s("block_size"), Value::from(0)),
            (s("medium"), s(medium)),
        ])
    };
    let d = decode_batch(&batch(vec![placeholder("CPU")])).unwrap();
    assert!(d.skipped.is_empty(), "{:?}", d.skipped);
    match &d.batch.events[0] {
        KvEvent::Stored {
            tier, block_size, ..
        } => assert_eq!((*tier, *block_size), (Tier::Cpu, 0)),
        other => panic!("{other:?}"),
    }
    let d = decode_batch(&batch(vec![placeholder("GPU")])).unwrap();
    assert!(d.batch.events.is_empty());
    assert_eq!(d.skipped[0].reason(), "malformed_event");
}
