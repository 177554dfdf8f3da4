//! Block residency per worker rank, keyed by the engine's block hash, with its share of the
//! digest.
//!
//! A block is in a tier or not: a repeated store is a no-op and one removal takes it out.
//! vLLM re-announces reused blocks (`kv_cache_report_mode="full"`) and evicts each block once,
//! so counting stores would keep a re-announced block forever; the price of presence is that
//! when an engine holds two physical copies of one hash and evicts one, the index forgets the
//! other - it under-reports, never routes to a block the engine no longer holds.
//!
//! Each GPU block also records its sequence hash (its content chained over its parents'), the
//! key it has in the pool's prefix index, so removals and continuations resolve an engine's
//! hash to the index's key.

use std::collections::BTreeMap;
use std::sync::Arc;

use rustc_hash::FxHashMap;
use serde::{Deserialize, Serialize};

use crate::Tier;
use crate::digest::block_fact;

/// What a rank holds under one engine hash.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Held {
    /// The sequence hash the block is indexed under (meaningful while it is on the GPU tier).
    pub(crate) seq: u64,
    /// One bit per [`Tier`] slot.
    pub(crate) tiers: u8,
}

impl Held {
    pub(crate) fn has(self, tier: Tier) -> bool {
        self.tiers & (1 << tier.slot()) != 0
    }
}

/// What a rank holds, by engine hash, in two maps: the GPU tier's blocks (nearly all of them)
/// with only their sequence hash, 16 bytes an entry where one map of [`Held`] took 24 (its
/// tier bits pad it to 16 bytes), and the blocks of any other tier with their other tiers'
/// bits. A block in two tiers is in both maps.
#[derive(Debug, Default, Clone)]
pub(crate) struct Residency {
    /// Engine hash -> sequence hash, for the blocks on the GPU tier.
    gpu: FxHashMap<u64, u64>,
    /// Engine hash -> tier bits without the GPU's, for the blocks in another tier.
    other: FxHashMap<u64, u8>,
}

const GPU_BIT: u8 = 1 << 0;
const _: () = assert!(GPU_BIT == 1 << Tier::Gpu as usize);

impl Residency {
    /// What the rank holds under `hash` (no tier: nothing).
    pub(crate) fn get(&self, hash: u64) -> Held {
        let other = if self.other.is_empty() {
            0
        } else {
            self.other.get(&hash).copied().unwrap_or(0)
        };
        match self.gpu.get(&hash) {
            Some(&seq) => Held {
                seq,
                tiers: other | GPU_BIT,
            },
            None => Held {
                seq: 0,
                tiers: other,
            },
        }
    }

    /// Sets what the rank holds under `hash` (a block in no tier is removed; off the GPU tier
    /// a block keeps no sequence hash).
    pub(crate) fn set(&mut self, hash: u64, held: Held) {
        debug_assert!(held.has(Tier::Gpu) || held.seq == 0, "{held:?}");
        if held.has(Tier::Gpu) {
            self.gpu.insert(hash, held.seq);
        } else {
            self.gpu.remove(&hash);
        }
        let other = held.tiers & !GPU_BIT;
        if other != 0 {
            self.other.insert(hash, other);
        } else if !self.other.is_empty() {
            self.other.remove(&hash);
        }
    }

    /// The sequence hash of a block on the GPU tier.
    pub(crate) fn gpu_seq(&self, hash: u64) -> Option<u64> {
        self.gpu.get(&hash).copied()
    }

    /// The sequence hashes of the blocks on the GPU tier (one per engine hash).
    pub(crate) fn gpu_seqs(&self) -> impl Iterator<Item = u64> + '_ {
        self.gpu.values().copied()
    }

    /// Every block the rank holds, each engine hash once, in no order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (u64, Held)> + '_ {
        let on_gpu = self.gpu.iter().map(|(&h, &seq)| {
            let other = self.other.get(&h).copied().unwrap_or(0);
            (
                h,
                Held {
                    seq,
                    tiers: other | GPU_BIT,
                },
            )
        });
        let elsewhere = self
            .other
            .iter()
            .filter(|(h, _)| !self.gpu.contains_key(h))
            .map(|(&h, &tiers)| (h, Held { seq: 0, tiers }));
        on_gpu.chain(elsewhere)
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.gpu.is_empty() && self.other.is_empty()
    }

    /// Room for `n` more GPU blocks.
    pub(crate) fn reserve(&mut self, n: usize) {
        self.gpu.reserve(n);
    }
}

/// The blocks of one `(worker, dp_rank)`.
#[derive(Debug, Default, Clone)]
pub(crate) struct RankBlocks {
    pub(crate) blocks: Residency,
    /// Wrapping sum of this rank's block facts.
    pub(crate) digest: u128,
    /// Blocks on the GPU tier.
    pub(crate) gpu_blocks: u64,
    /// The cache salt of salted blocks (a continuation of their chain is hashed under it).
    pub(crate) salts: BTreeMap<u64, Arc<str>>,
    /// KV-cache groups (vLLM's `group_idx`) the engine said are not full attention: removals
    /// from them do not touch this rank's blocks.
    pub(crate) other_groups: std::collections::BTreeSet<u32>,
}

/// The contribution of a non-prefix-cache group to the digest.
pub(crate) fn group_fact(worker: u64, dp_rank: u32, group: u32) -> u128 {
    let mut h = crate::digest::Hasher::new();
    h.str("group")
        .u64(worker)
        .u64(u64::from(dp_rank))
        .u64(u64::from(group));
    h.finish().0
}

/// The contribution of a block's salt to the digest.
pub(crate) fn salt_fact(worker: u64, dp_rank: u32, hash: u64, salt: &str) -> u128 {
    let mut h = crate::digest::Hasher::new();
    h.u64(worker).u64(u64::from(dp_rank)).u64(hash).str(salt);
    h.finish().0
}

/// What a store or removal did to a block's presence in one tier.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Change {
    /// The block entered the tier.
    Appeared,
    /// The block was on the GPU tier under another sequence hash (its content changed under
    /// the same engine hash): the index must move it.
    Moved { from: u64 },
    /// The block left the tier.
    Disappeared { seq: u64 },
    /// Already there (a store).
    Unchanged,
    /// A removal of a block the tier does not hold.
    Unknown,
}

/// A change and what it did to the digest and to the GPU block count.
pub(crate) struct Adjusted {
    pub(crate) change: Change,
    pub(crate) digest: u128,
    pub(crate) gpu: i64,
}

impl RankBlocks {
    pub(crate) fn get(&self, hash: u64) -> Held {
        self.blocks.get(hash)
    }

    /// The sequence hash of a block this rank holds on the GPU tier.
    pub(crate) fn gpu_seq(&self, hash: u64) -> Option<u64> {
        self.blocks.gpu_seq(hash)
    }

    pub(crate) fn salt(&self, hash: u64) -> Option<Arc<str>> {
        self.salts.get(&hash).cloned()
    }

    /// Records the salt of a block now present; returns the digest delta.
    pub(crate) fn set_salt(
        &mut self,
        worker: u64,
        dp_rank: u32,
        hash: u64,
        salt: Arc<str>,
    ) -> u128 {
        let mut d = salt_fact(worker, dp_rank, hash, &salt);
        if let Some(old) = self.salts.insert(hash, salt) {
            d = d.wrapping_sub(salt_fact(worker, dp_rank, hash, &old));
        }
        self.digest = self.digest.wrapping_add(d);
        d
    }

    /// Records that `group` is not a prefix cache; returns the digest delta.
    pub(crate) fn other_group(&mut self, worker: u64, dp_rank: u32, group: u32) -> u128 {
        if !self.other_groups.insert(group) {
            return 0;
        }
        let d = group_fact(worker, dp_rank, group);
        self.digest = self.digest.wrapping_add(d);
        d
    }

    /// Forgets a block's salt; returns the digest delta.
    pub(crate) fn clear_salt(&mut self, worker: u64, dp_rank: u32, hash: u64) -> u128 {
        match self.salts.remove(&hash) {
            Some(old) => {
                let d = 0u128.wrapping_sub(salt_fact(worker, dp_rank, hash, &old));
                self.digest = self.digest.wrapping_add(d);
                d
            }
            None => 0,
        }
    }

    /// Puts `hash` in `tier` (with its sequence hash `seq` on the GPU tier).
    pub(crate) fn store(
        &mut self,
        worker: u64,
        dp_rank: u32,
        hash: u64,
        tier: Tier,
        seq: u64,
    ) -> Adjusted {
        let old = self.get(hash);
        let mut new = old;
        new.tiers |= 1 << tier.slot();
        let change = match (old.has(tier), tier) {
            (false, Tier::Gpu) => {
                new.seq = seq;
                Change::Appeared
            }
            (false, _) => Change::Appeared,
            (true, Tier::Gpu) if old.seq != seq => {
                new.seq = seq;
                Change::Moved { from: old.seq }
            }
            (true, _) => Change::Unchanged,
        };
        self.replace((worker, dp_rank, hash), old, new, change, tier)
    }

    /// Takes `hash` out of `tier`.
    pub(crate) fn remove(&mut self, worker: u64, dp_rank: u32, hash: u64, tier: Tier) -> Adjusted {
        let old = self.get(hash);
        if !old.has(tier) {
            return Adjusted {
                change: Change::Unknown,
                digest: 0,
                gpu: 0,
            };
        }
        let mut new = old;
        new.tiers &= !(1 << tier.slot());
        if !new.has(Tier::Gpu) {
            new.seq = 0;
        }
        let change = Change::Disappeared { seq: old.seq };
        self.replace((worker, dp_rank, hash), old, new, change, tier)
    }

    /// Replaces `old` by `new` for the block `(worker, dp_rank, hash)`.
    fn replace(
        &mut self,
        (worker, dp_rank, hash): (u64, u32, u64),
        old: Held,
        new: Held,
        change: Change,
        tier: Tier,
    ) -> Adjusted {
        if old == new {
            return Adjusted {
                change,
                digest: 0,
                gpu: 0,
            };
        }
        let mut removed = 0u128;
        let mut added = 0u128;
        if old.tiers != 0 {
            removed = block_fact(worker, dp_rank, hash, old);
        }
        if new.tiers == 0 {
            if let Some(salt) = self.salts.remove(&hash) {
                removed = removed.wrapping_add(salt_fact(worker, dp_rank, hash, &salt));
            }
        } else {
            added = block_fact(worker, dp_rank, hash, new);
        }
        self.blocks.set(hash, new);
        self.digest = self.digest.wrapping_sub(removed).wrapping_add(added);
        let gpu = match (tier, &change) {
            (Tier::Gpu, Change::Appeared) => 1,
            (Tier::Gpu, Change::Disappeared { .. }) => -1,
            _ => 0,
        };
        self.gpu_blocks = self.gpu_blocks.saturating_add_signed(gpu);
        Adjusted {
            change,
            digest: added.wrapping_sub(removed),
            gpu,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use proptest::prelude::*;

    use super::*;

    /// A store or a removal of one of a few engine hashes in one tier.
    fn op() -> impl Strategy<Value = (bool, u64, usize, u64)> {
        (any::<bool>(), 0..6u64, 0..Tier::ALL.len(), 1..4u64)
    }

    proptest! {
        /// Blocks stored and removed in any tiers read back as one map of what each engine
        /// hash holds says they do: its tiers, and its sequence hash while it is on the GPU.
        #[test]
        fn residency_holds_what_a_map_of_each_blocks_tiers_holds(
            ops in proptest::collection::vec(op(), 0..200)
        ) {
            let mut rank = RankBlocks::default();
            let mut model: BTreeMap<u64, Held> = BTreeMap::new();
            for (store, hash, slot, seq) in ops {
                let tier = Tier::ALL[slot];
                let old = model.get(&hash).copied().unwrap_or_default();
                let mut new = old;
                if store {
                    new.tiers |= 1 << tier.slot();
                    if tier == Tier::Gpu {
                        new.seq = seq;
                    }
                    rank.store(1, 0, hash, tier, seq);
                } else {
                    new.tiers &= !(1 << tier.slot());
                    if !new.has(Tier::Gpu) {
                        new.seq = 0;
                    }
                    rank.remove(1, 0, hash, tier);
                }
                if new.tiers == 0 {
                    model.remove(&hash);
                } else {
                    model.insert(hash, new);
                }
                let held: BTreeMap<u64, Held> = rank.blocks.iter().collect();
                prop_assert_eq!(&held, &model);
                prop_assert_eq!(rank.blocks.iter().count(), model.len());
                for h in 0..6 {
                    prop_assert_eq!(rank.get(h), model.get(&h).copied().unwrap_or_default());
                }
                let mut seqs: Vec<u64> = rank.blocks.gpu_seqs().collect();
                let mut expected: Vec<u64> =
                    model.values().filter(|b| b.has(Tier::Gpu)).map(|b| b.seq).collect();
                seqs.sort_unstable();
                expected.sort_unstable();
                prop_assert_eq!(seqs, expected);
                prop_assert_eq!(rank.gpu_blocks, model.values().filter(|b| b.has(Tier::Gpu)).count() as u64);
                prop_assert_eq!(rank.blocks.is_empty(), model.is_empty());
                let digest = model
                    .iter()
                    .fold(0u128, |d, (&h, &b)| d.wrapping_add(block_fact(1, 0, h, b)));
                prop_assert_eq!(rank.digest, digest);
            }
        }
    }
}
