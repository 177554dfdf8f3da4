//! An engine batch larger than NATS takes in one message, as several batches that each fit.
//!
//! The parts are vLLM batches in the current wire format: the events in order, a long
//! `BlockStored` cut between blocks (the second part's parent is the first part's last block,
//! so its salt is inherited) and a long `BlockRemoved` cut between hashes. Applied in order,
//! the parts change the index exactly as the batch would. The cut is deterministic, so a
//! restarted bridge that republishes the rest of a batch cuts it the same way.

use bytes::Bytes;
use kvplane_state::{KvBatch, KvEvent};

use crate::DecodeError;
use crate::vllm::{SkippedEvent, decode_batch, encode_batch};

/// Why a batch could not be cut into parts that fit.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SplitError {
    #[error("the batch does not decode: {0}")]
    Decode(#[from] DecodeError),
    #[error("one block's event takes {size} bytes, over the {limit} bytes a message may hold")]
    BlockTooLarge { size: usize, limit: usize },
}

/// What [`fit`] made of a batch.
#[derive(Debug, Clone, PartialEq)]
pub struct Parts {
    pub parts: Vec<Bytes>,
    /// Events the decoder skipped (unknown types, malformed): not in any part.
    pub skipped: usize,
}

/// `payload` itself when it is at most `limit` bytes, else parts of at most `limit` bytes each.
pub fn fit(payload: Bytes, limit: usize) -> Result<Parts, SplitError> {
    if payload.len() <= limit {
        return Ok(Parts {
            parts: vec![payload],
            skipped: 0,
        });
    }
    let decoded = decode_batch(&payload)?;
    let mut parts = Vec::new();
    cut(
        decoded.ts,
        decoded.batch.dp_rank,
        &decoded.batch.events,
        limit,
        &mut parts,
    )?;
    // A non-primary group's store stays in the events (the state learns of the group).
    let skipped = decoded
        .skipped
        .iter()
        .filter(|s| !matches!(s, SkippedEvent::NonPrimaryGroup))
        .count();
    Ok(Parts { parts, skipped })
}

fn cut(
    ts: f64,
    dp_rank: u32,
    events: &[KvEvent],
    limit: usize,
    out: &mut Vec<Bytes>,
) -> Result<(), SplitError> {
    let encoded = encode_batch(
        ts,
        &KvBatch {
            dp_rank,
            events: events.to_vec(),
        },
    );
    if encoded.len() <= limit {
        out.push(Bytes::from(encoded));
        return Ok(());
    }
    if events.len() > 1 {
        let (a, b) = events.split_at(events.len() / 2);
        cut(ts, dp_rank, a, limit, out)?;
        return cut(ts, dp_rank, b, limit, out);
    }
    let too_large = SplitError::BlockTooLarge {
        size: encoded.len(),
        limit,
    };
    let [event] = events else {
        return Err(too_large);
    };
    let Some((a, b)) = halves(event) else {
        return Err(too_large);
    };
    cut(ts, dp_rank, &[a], limit, out)?;
    cut(ts, dp_rank, &[b], limit, out)
}

/// One event with more than one block as two events that do what it does.
fn halves(event: &KvEvent) -> Option<(KvEvent, KvEvent)> {
    match event {
        KvEvent::Stored {
            block_hashes,
            parent_hash,
            token_ids,
            block_size,
            lora_name,
            cache_salt,
            tier,
        } if block_hashes.len() > 1 => {
            let mid = block_hashes.len() / 2;
            let per_block = usize::try_from(*block_size).ok()?;
            // Tokens are cut with the blocks when there are `block_size` per block; events
            // without tokens (offload placeholders) have none to cut.
            let (first_tokens, second_tokens) = if token_ids.is_empty() {
                (Vec::new(), Vec::new())
            } else if token_ids.len() == block_hashes.len() * per_block {
                let (a, b) = token_ids.split_at(mid * per_block);
                (a.to_vec(), b.to_vec())
            } else {
                return None;
            };
            let first = KvEvent::Stored {
                block_hashes: block_hashes[..mid].to_vec(),
                parent_hash: *parent_hash,
                token_ids: first_tokens,
                block_size: *block_size,
                lora_name: lora_name.clone(),
                cache_salt: cache_salt.clone(),
                tier: *tier,
            };
            let second = KvEvent::Stored {
                block_hashes: block_hashes[mid..].to_vec(),
                parent_hash: Some(block_hashes[mid - 1]),
                token_ids: second_tokens,
                block_size: *block_size,
                lora_name: lora_name.clone(),
                cache_salt: None,
                tier: *tier,
            };
            Some((first, second))
        }
        KvEvent::Removed { block_hashes, tier } if block_hashes.len() > 1 => {
            let (a, b) = block_hashes.split_at(block_hashes.len() / 2);
            Some((
                KvEvent::Removed {
                    block_hashes: a.to_vec(),
                    tier: *tier,
                },
                KvEvent::Removed {
                    block_hashes: b.to_vec(),
                    tier: *tier,
                },
            ))
        }
        KvEvent::RemovedFromGroup {
            block_hashes,
            tier,
            group,
        } if block_hashes.len() > 1 => {
            let (a, b) = block_hashes.split_at(block_hashes.len() / 2);
            let part = |h: &[u64]| KvEvent::RemovedFromGroup {
                block_hashes: h.to_vec(),
                tier: *tier,
                group: *group,
            };
            Some((part(a), part(b)))
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use kvplane_state::Tier;
    use proptest::prelude::*;

    use super::*;

    /// What a batch does to the index, one block at a time: the reference the parts are held to.
    #[derive(Debug, Clone, PartialEq)]
    enum BlockOp {
        Store {
            hash: u64,
            parent: Option<u64>,
            tokens: Vec<u32>,
            lora: Option<String>,
            /// The salt when this block names one; `None`: inherited from its parent.
            salt: Option<String>,
            tier: Tier,
        },
        Remove {
            hash: u64,
            tier: Tier,
            group: u32,
        },
        Other(KvEvent),
    }

    fn block_ops(events: &[KvEvent]) -> Vec<BlockOp> {
        let mut ops = Vec::new();
        for e in events {
            match e {
                KvEvent::Stored {
                    block_hashes,
                    parent_hash,
                    token_ids,
                    block_size,
                    lora_name,
                    cache_salt,
                    tier,
                } => {
                    let bs = *block_size as usize;
                    let mut parent = *parent_hash;
                    for (i, h) in block_hashes.iter().enumerate() {
                        let tokens = token_ids
                            .get(i * bs..(i + 1) * bs)
                            .map(<[u32]>::to_vec)
                            .unwrap_or_default();
                        ops.push(BlockOp::Store {
                            hash: *h,
                            parent,
                            tokens,
                            lora: lora_name.clone(),
                            salt: if i == 0 { cache_salt.clone() } else { None },
                            tier: *tier,
                        });
                        parent = Some(*h);
                    }
                }
                KvEvent::Removed { block_hashes, tier } => {
                    ops.extend(block_hashes.iter().map(|h| BlockOp::Remove {
                        hash: *h,
                        tier: *tier,
                        group: 0,
                    }));
                }
                KvEvent::RemovedFromGroup {
                    block_hashes,
                    tier,
                    group,
                } => ops.extend(block_hashes.iter().map(|h| BlockOp::Remove {
                    hash: *h,
                    tier: *tier,
                    group: *group,
                })),
                other => ops.push(BlockOp::Other(other.clone())),
            }
        }
        ops
    }

    fn tier() -> impl Strategy<Value = Tier> {
        prop_oneof![
            Just(Tier::Gpu),
            Just(Tier::Cpu),
            Just(Tier::Storage),
            Just(Tier::Remote)
        ]
    }

    fn event() -> impl Strategy<Value = KvEvent> {
        prop_oneof![
            (
                prop::collection::vec(any::<u64>(), 1..40),
                prop::option::of(any::<u64>()),
                prop::option::of("[a-z]{1,8}"),
                prop::option::of("[a-z]{1,8}"),
                tier(),
                any::<bool>(),
            )
                .prop_map(|(hashes, parent, lora, salt, tier, with_tokens)| {
                    let tokens = if with_tokens {
                        (0..hashes.len() as u32 * 4).map(|t| t * 7919).collect()
                    } else {
                        Vec::new()
                    };
                    KvEvent::Stored {
                        block_hashes: hashes,
                        parent_hash: parent,
                        token_ids: tokens,
                        block_size: 4,
                        lora_name: lora,
                        cache_salt: salt,
                        tier,
                    }
                }),
            (prop::collection::vec(any::<u64>(), 1..60), tier()).prop_map(|(h, tier)| {
                KvEvent::Removed {
                    block_hashes: h,
                    tier,
                }
            }),
            (prop::collection::vec(any::<u64>(), 1..60), tier(), 1u32..3).prop_map(
                |(h, tier, group)| KvEvent::RemovedFromGroup {
                    block_hashes: h,
                    tier,
                    group
                }
            ),
            Just(KvEvent::Cleared),
            (1u32..3).prop_map(|group| KvEvent::OtherGroup { group }),
        ]
    }

    proptest! {
        #[test]
        fn parts_fit_and_do_to_the_index_what_the_batch_does(
            events in prop::collection::vec(event(), 1..12),
            dp_rank in 0u32..4,
            limit in 300usize..3000,
        ) {
            let batch = KvBatch { dp_rank, events };
            let payload = Bytes::from(encode_batch(1.5, &batch));
            let parts = fit(payload.clone(), limit).unwrap();
            prop_assert_eq!(parts.skipped, 0);
            let mut events = Vec::new();
            for p in &parts.parts {
                prop_assert!(p.len() <= limit, "a part of {} bytes over {}", p.len(), limit);
                let d = decode_batch(p).unwrap();
                prop_assert_eq!(d.batch.dp_rank, dp_rank);
                events.extend(d.batch.events);
            }
            // The reference: the whole batch as the consumer would have decoded it.
            let whole = decode_batch(&payload).unwrap().batch.events;
            prop_assert_eq!(block_ops(&events), block_ops(&whole));
            if payload.len() <= limit {
                prop_assert_eq!(parts.parts, vec![payload]);
            }
        }
    }

    #[test]
    fn a_block_larger_than_a_message_is_refused_with_its_size() {
        let batch = KvBatch {
            dp_rank: 0,
            events: vec![KvEvent::Stored {
                block_hashes: vec![7],
                parent_hash: None,
                token_ids: (0..4000).collect(),
                block_size: 4000,
                lora_name: None,
                cache_salt: None,
                tier: Tier::Gpu,
            }],
        };
        let payload = Bytes::from(encode_batch(0.0, &batch));
        let err = fit(payload.clone(), 1000).unwrap_err();
        assert_eq!(
            err,
            SplitError::BlockTooLarge {
                size: payload.len(),
                limit: 1000
            }
        );
    }

    #[test]
    fn a_payload_that_is_not_msgpack_is_a_decode_error() {
        let err = fit(Bytes::from_static(&[0xc1; 64]), 10).unwrap_err();
        assert!(matches!(err, SplitError::Decode(_)), "{err}");
    }
}
