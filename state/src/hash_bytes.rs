//! A compact stored event's hashes in an entry: one MessagePack binary (eight bytes per hash,
//! little endian) rather than an array of integers, as [`crate::token_bytes`] does for token
//! ids. A human-readable format (JSON) keeps the array.

use serde::de::{Error, SeqAccess, Visitor};
use serde::{Deserializer, Serializer};

pub(crate) fn serialize<S: Serializer>(hashes: &[u64], s: S) -> Result<S::Ok, S::Error> {
    if s.is_human_readable() {
        return s.collect_seq(hashes);
    }
    let mut bytes = Vec::with_capacity(hashes.len() * 8);
    for h in hashes {
        bytes.extend_from_slice(&h.to_le_bytes());
    }
    s.serialize_bytes(&bytes)
}

pub(crate) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u64>, D::Error> {
    if d.is_human_readable() {
        return d.deserialize_seq(Hashes);
    }
    d.deserialize_any(Hashes)
}

struct Hashes;

impl<'de> Visitor<'de> for Hashes {
    type Value = Vec<u64>;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("block hashes: eight little-endian bytes each, or an array of integers")
    }

    fn visit_bytes<E: Error>(self, b: &[u8]) -> Result<Vec<u64>, E> {
        if !b.len().is_multiple_of(8) {
            return Err(E::invalid_length(b.len(), &self));
        }
        Ok(b.chunks_exact(8)
            .map(|c| u64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]))
            .collect())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<u64>, A::Error> {
        let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1 << 16));
        while let Some(h) = seq.next_element()? {
            out.push(h);
        }
        Ok(out)
    }
}
