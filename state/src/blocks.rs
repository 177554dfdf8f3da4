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

/// The blocks of one `(worker, dp_rank)`.
#[derive(Debug, Default, Clone)]
pub(crate) struct RankBlocks {
    pub(crate) blocks: FxHashMap<u64, Held>,
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
        self.blocks.get(&hash).copied().unwrap_or_default()
    }

    /// The sequence hash of a block this rank holds on the GPU tier.
    pub(crate) fn gpu_seq(&self, hash: u64) -> Option<u64> {
        self.blocks
            .get(&hash)
            .filter(|b| b.has(Tier::Gpu))
            .map(|b| b.seq)
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
            self.blocks.remove(&hash);
            if let Some(salt) = self.salts.remove(&hash) {
                removed = removed.wrapping_add(salt_fact(worker, dp_rank, hash, &salt));
            }
        } else {
            added = block_fact(worker, dp_rank, hash, new);
            self.blocks.insert(hash, new);
        }
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
