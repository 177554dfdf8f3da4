//! The simulated fleet's prefix caches, and the reference the cluster is checked against.
//!
//! Each engine caches prefixes of documents from one shared pool (popular ones more often),
//! so engines hold the same content; each hashes blocks with a seed of its own, as vLLM does
//! when processes' hash seeds differ, so the same content arrives under different hashes.
//! A step is one vLLM batch of 1-4 events: a store starts a document or continues a cached
//! prefix (its parent the prefix's last block), a removal drops a prefix's last blocks, last
//! block first; past its capacity an engine evicts its least recently used prefixes in the
//! same batch. What each engine holds is a plain map: the blocks the index must report.

use std::collections::{BTreeMap, BTreeSet};

use kvplane_sim::rng::Rng;
use kvplane_state::{KvEvent, Tier};
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Blocks per document at most.
const DOC_BLOCKS: u32 = 64;

/// How the fleet's caches behave.
#[derive(Debug, Clone, Copy)]
pub(crate) struct FleetShape {
    pub block_size: u32,
    /// Documents in the shared pool.
    pub docs: u64,
    /// Blocks an engine caches at most.
    pub capacity: u64,
    /// Share of events that store (the rest remove).
    pub store_share: f64,
}

/// One engine's cache.
#[derive(Debug)]
pub(crate) struct Engine {
    pub name: String,
    /// The seed of its block hashes.
    seed: u64,
    rng: Rng,
    /// Document -> cached prefix length in blocks (never 0).
    held: BTreeMap<u64, u32>,
    /// (last use, document), least recent first.
    lru: BTreeSet<(u64, u64)>,
    last_use: BTreeMap<u64, u64>,
    clock: u64,
    /// Blocks held: what the index must report for this worker.
    pub blocks: u64,
}

/// What one step produced.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct StepCounts {
    pub stored_blocks: u64,
    pub removed_blocks: u64,
}

/// The tokens of block `k` of document `doc`: the same on every engine.
pub(crate) fn block_tokens(doc: u64, k: u32, block_size: u32, out: &mut Vec<u32>) {
    for t in 0..block_size {
        let mut key = [0u8; 16];
        key[..8].copy_from_slice(&doc.to_le_bytes());
        key[8..12].copy_from_slice(&k.to_le_bytes());
        key[12..].copy_from_slice(&t.to_le_bytes());
        // Token ids below 50,000, like a real vocabulary's.
        out.push((xxh3_64_with_seed(&key, 0x70c) % 50_000) as u32);
    }
}

impl Engine {
    pub(crate) fn new(name: String, seed: u64) -> Self {
        Self {
            name,
            seed,
            rng: Rng::new(seed),
            held: BTreeMap::new(),
            lru: BTreeSet::new(),
            last_use: BTreeMap::new(),
            clock: 0,
            blocks: 0,
        }
    }

    /// This engine's hash of block `k` of `doc`.
    fn hash(&self, doc: u64, k: u32) -> u64 {
        let mut key = [0u8; 12];
        key[..8].copy_from_slice(&doc.to_le_bytes());
        key[8..].copy_from_slice(&k.to_le_bytes());
        xxh3_64_with_seed(&key, self.seed)
    }

    fn touch(&mut self, doc: u64) {
        self.clock += 1;
        if let Some(old) = self.last_use.insert(doc, self.clock) {
            self.lru.remove(&(old, doc));
        }
        self.lru.insert((self.clock, doc));
    }

    /// Stores blocks `from..to` of `doc` (the engine holds `0..from`).
    pub(crate) fn store(&mut self, doc: u64, to: u32, shape: &FleetShape) -> KvEvent {
        let from = self.held.get(&doc).copied().unwrap_or(0);
        let mut tokens = Vec::with_capacity(((to - from) * shape.block_size) as usize);
        for k in from..to {
            block_tokens(doc, k, shape.block_size, &mut tokens);
        }
        self.held.insert(doc, to);
        self.touch(doc);
        self.blocks += u64::from(to - from);
        KvEvent::Stored {
            block_hashes: (from..to).map(|k| self.hash(doc, k)).collect(),
            parent_hash: (from > 0).then(|| self.hash(doc, from - 1)),
            token_ids: tokens,
            block_size: shape.block_size,
            lora_name: None,
            cache_salt: None,
            tier: Tier::Gpu,
        }
    }

    /// Removes the last `n` cached blocks of `doc`, last first.
    fn remove(&mut self, doc: u64, n: u32) -> KvEvent {
        let len = self.held.get(&doc).copied().unwrap_or(0);
        let n = n.min(len);
        if n == len {
            self.held.remove(&doc);
            if let Some(t) = self.last_use.remove(&doc) {
                self.lru.remove(&(t, doc));
            }
        } else {
            self.held.insert(doc, len - n);
        }
        self.blocks -= u64::from(n);
        KvEvent::Removed {
            block_hashes: (len - n..len).rev().map(|k| self.hash(doc, k)).collect(),
            tier: Tier::Gpu,
        }
    }

    /// A held document, uniformly.
    fn any_held(&mut self) -> Option<u64> {
        let n = self.held.len() as u64;
        (n > 0).then(|| {
            let i = self.rng.below(n) as usize;
            self.held.keys().nth(i).copied().unwrap_or(0)
        })
    }

    /// One batch of events (1-4, plus evictions past capacity).
    pub(crate) fn step(&mut self, shape: &FleetShape, counts: &mut StepCounts) -> Vec<KvEvent> {
        let n = 1 + self.rng.below(4);
        let mut events = Vec::with_capacity(n as usize + 1);
        for _ in 0..n {
            let store = self.held.is_empty() || self.rng.unit() < shape.store_share;
            let doc = if store && self.rng.unit() < 0.5 {
                // A document from the shared pool, popular ones (low numbers) more often.
                let u = self.rng.unit();
                (u * u * u * shape.docs as f64) as u64
            } else {
                self.any_held().unwrap_or(0)
            };
            let len = self.held.get(&doc).copied().unwrap_or(0);
            if store && len < DOC_BLOCKS {
                let to = (len + 1 + self.rng.below(8) as u32).min(DOC_BLOCKS);
                counts.stored_blocks += u64::from(to - len);
                events.push(self.store(doc, to, shape));
            } else if len > 0 {
                let r = 1 + self.rng.below(4) as u32;
                counts.removed_blocks += u64::from(r.min(len));
                events.push(self.remove(doc, r));
            }
        }
        while self.blocks > shape.capacity {
            let Some(&(_, doc)) = self.lru.first() else {
                break;
            };
            let over = u32::try_from(self.blocks - shape.capacity).unwrap_or(u32::MAX);
            let len = self.held.get(&doc).copied().unwrap_or(0);
            counts.removed_blocks += u64::from(over.min(len));
            events.push(self.remove(doc, over));
        }
        events
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SHAPE: FleetShape = FleetShape {
        block_size: 16,
        docs: 100,
        capacity: 200,
        store_share: 0.7,
    };

    /// A store's blocks chain onto what the engine held, a removal names held blocks last
    /// first, and the count the index is checked against is the sum of held prefix lengths.
    #[test]
    fn events_follow_the_cache_and_its_capacity() {
        let mut e = Engine::new("e".into(), 3);
        let mut held: BTreeSet<u64> = BTreeSet::new();
        let mut counts = StepCounts::default();
        for _ in 0..2_000 {
            for ev in e.step(&SHAPE, &mut counts) {
                match ev {
                    KvEvent::Stored {
                        block_hashes,
                        parent_hash,
                        token_ids,
                        ..
                    } => {
                        assert_eq!(token_ids.len(), block_hashes.len() * 16);
                        if let Some(p) = parent_hash {
                            assert!(held.contains(&p), "parent not held");
                        }
                        for h in block_hashes {
                            assert!(held.insert(h), "stored twice");
                        }
                    }
                    KvEvent::Removed { block_hashes, .. } => {
                        for h in block_hashes {
                            assert!(held.remove(&h), "removed what it did not hold");
                        }
                    }
                    other => panic!("unexpected {other:?}"),
                }
            }
            assert!(e.blocks <= SHAPE.capacity);
            assert_eq!(e.blocks, held.len() as u64);
            assert_eq!(
                e.blocks,
                e.held.values().map(|&l| u64::from(l)).sum::<u64>()
            );
        }
        assert_eq!(
            counts.stored_blocks - counts.removed_blocks,
            e.blocks,
            "counts add up"
        );
    }

    /// Two engines hash the same content differently but send the same tokens.
    #[test]
    fn engines_share_content_not_hashes() {
        let (mut a, mut b) = (Engine::new("a".into(), 1), Engine::new("b".into(), 2));
        let (
            KvEvent::Stored {
                block_hashes: ha,
                token_ids: ta,
                ..
            },
            KvEvent::Stored {
                block_hashes: hb,
                token_ids: tb,
                ..
            },
        ) = (a.store(7, 3, &SHAPE), b.store(7, 3, &SHAPE))
        else {
            unreachable!()
        };
        assert_eq!(ta, tb);
        assert!(ha.iter().all(|h| !hb.contains(h)));
    }
}
