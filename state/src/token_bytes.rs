//! A stored event's token ids in an entry: one MessagePack binary (four bytes per id, little
//! endian) rather than an array of integers: one byte string instead of a MessagePack integer and a serde
//! visit per id (an ingest entry is mostly token ids; every member encodes it for its log and
//! decodes it off the wire). Entries written as an array still decode, and a
//! human-readable format (JSON) keeps the array.

use serde::de::{Error, SeqAccess, Visitor};
use serde::{Deserializer, Serializer};

pub(crate) fn serialize<S: Serializer>(tokens: &[u32], s: S) -> Result<S::Ok, S::Error> {
    if s.is_human_readable() {
        return s.collect_seq(tokens);
    }
    let mut bytes = Vec::with_capacity(tokens.len() * 4);
    for t in tokens {
        bytes.extend_from_slice(&t.to_le_bytes());
    }
    s.serialize_bytes(&bytes)
}

pub(crate) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u32>, D::Error> {
    if d.is_human_readable() {
        return d.deserialize_seq(Tokens);
    }
    d.deserialize_any(Tokens)
}

struct Tokens;

impl<'de> Visitor<'de> for Tokens {
    type Value = Vec<u32>;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("token ids: four little-endian bytes each, or an array of integers")
    }

    fn visit_bytes<E: Error>(self, b: &[u8]) -> Result<Vec<u32>, E> {
        if !b.len().is_multiple_of(4) {
            return Err(E::invalid_length(b.len(), &self));
        }
        Ok(b.chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<u32>, A::Error> {
        let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1 << 16));
        while let Some(t) = seq.next_element()? {
            out.push(t);
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use crate::{KvEvent, Tier};

    fn stored(tokens: Vec<u32>) -> KvEvent {
        KvEvent::Stored {
            block_hashes: vec![7],
            parent_hash: None,
            token_ids: tokens,
            block_size: 4,
            lora_name: None,
            cache_salt: None,
            tier: Tier::Gpu,
        }
    }

    /// The event as entries were encoded before: the same fields, token ids an array.
    #[derive(serde::Serialize)]
    enum OldKvEvent {
        Stored {
            block_hashes: Vec<u64>,
            parent_hash: Option<u64>,
            token_ids: Vec<u32>,
            block_size: u32,
            lora_name: Option<String>,
            cache_salt: Option<String>,
            tier: Tier,
        },
    }

    #[test]
    fn token_ids_round_trip_as_one_binary() {
        let tokens = vec![0, 1, 255, 65_536, u32::MAX];
        let bytes = rmp_serde::to_vec(&stored(tokens.clone())).unwrap();
        // The five ids are one bin8 of 20 bytes (0xc4 0x14), not five integers.
        assert!(bytes.windows(2).any(|w| w == [0xc4, 20]));
        let back: KvEvent = rmp_serde::from_slice(&bytes).unwrap();
        assert_eq!(back, stored(tokens.clone()));
        let named: KvEvent =
            rmp_serde::from_slice(&rmp_serde::to_vec_named(&stored(tokens.clone())).unwrap())
                .unwrap();
        assert_eq!(named, stored(tokens));
    }

    #[test]
    fn entries_written_with_token_ids_as_an_array_still_decode() {
        let tokens = vec![3, 1, 4, 1, 5, 9, 2, 6];
        let old = OldKvEvent::Stored {
            block_hashes: vec![7],
            parent_hash: None,
            token_ids: tokens.clone(),
            block_size: 4,
            lora_name: None,
            cache_salt: None,
            tier: Tier::Gpu,
        };
        for bytes in [
            rmp_serde::to_vec(&old).unwrap(),
            rmp_serde::to_vec_named(&old).unwrap(),
        ] {
            let back: KvEvent = rmp_serde::from_slice(&bytes).unwrap();
            assert_eq!(back, stored(tokens.clone()));
        }
    }

    #[test]
    fn a_binary_that_is_not_whole_ids_is_refused() {
        let mut bytes = rmp_serde::to_vec(&stored(vec![1, 2])).unwrap();
        // bin8 of 8 bytes -> claim 7, dropping the last byte.
        let at = bytes.windows(2).position(|w| w == [0xc4, 8]).unwrap();
        bytes[at + 1] = 7;
        bytes.remove(at + 2 + 7);
        let err = rmp_serde::from_slice::<KvEvent>(&bytes).unwrap_err();
        assert!(err.to_string().contains("token ids"), "{err}");
    }

    #[test]
    fn json_keeps_token_ids_an_array() {
        let json = serde_json::to_string(&stored(vec![1, 2, 3])).unwrap();
        assert!(json.contains("\"token_ids\":[1,2,3]"), "{json}");
        let back: KvEvent = serde_json::from_str(&json).unwrap();
        assert_eq!(back, stored(vec![1, 2, 3]));
    }
}
