//! The state digest: a stable 128-bit hash of everything a routing decision depends on.
//!
//! Blocks are hashed incrementally as a multiset hash: each `(worker, rank, engine hash,
//! sequence hash, tiers)` fact contributes `xxh3_128` of its fixed-width encoding, and
//! contributions are added with wrapping arithmetic, so adding and removing facts is O(1) and
//! order does not matter. The prefix index should be a function of these facts (each GPU fact
//! puts its rank under its sequence hash), but it is written apart from them (on the writer
//! thread, or rebuilt by a restore), so the digest also covers each pool's index as it is: its
//! content hash ([`crate::PoolIndex::content`], a multiset hash of its holds kept by the
//! writes), and [`crate::StateMachine::digest`] recounts that from the index's maps. A replica
//! whose index lost a write reports another digest although its block count agrees. Workers
//! are a multiset hash too, kept as apply changes them; the config and the quota ledger are hashed
//! when an entry changes them. Log positions (entry indexes, proposer timestamps) are
//! deliberately left out: a node that rebuilds its state by replaying the same stream in
//! different batches arrives at the same digest.

use std::fmt;

use xxhash_rust::xxh3::{Xxh3, xxh3_128};

/// A state digest, shown as 32 hex digits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Digest(pub u128);

impl fmt::Display for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

/// The contribution of one block fact to the block multiset hash.
pub(crate) fn block_fact(worker: u64, dp_rank: u32, hash: u64, held: crate::blocks::Held) -> u128 {
    let mut buf = [0u8; 29];
    buf[0..8].copy_from_slice(&worker.to_le_bytes());
    buf[8..12].copy_from_slice(&dp_rank.to_le_bytes());
    buf[12..20].copy_from_slice(&hash.to_le_bytes());
    buf[20..28].copy_from_slice(&held.seq.to_le_bytes());
    buf[28] = held.tiers;
    xxh3_128(&buf)
}

/// A streaming hasher for the small parts of the state, with length-prefixed fields.
pub(crate) struct Hasher(Xxh3);

impl Hasher {
    pub(crate) fn new() -> Self {
        Self(Xxh3::new())
    }
    pub(crate) fn u64(&mut self, v: u64) -> &mut Self {
        self.0.update(&v.to_le_bytes());
        self
    }
    pub(crate) fn u128(&mut self, v: u128) -> &mut Self {
        self.0.update(&v.to_le_bytes());
        self
    }
    pub(crate) fn f64(&mut self, v: f64) -> &mut Self {
        self.u64(v.to_bits())
    }
    pub(crate) fn bytes(&mut self, v: &[u8]) -> &mut Self {
        self.u64(v.len() as u64);
        self.0.update(v);
        self
    }
    pub(crate) fn str(&mut self, v: &str) -> &mut Self {
        self.bytes(v.as_bytes())
    }
    pub(crate) fn finish(&self) -> Digest {
        Digest(self.0.digest128())
    }
}
