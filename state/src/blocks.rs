//! Reference-counted block residency per worker rank, with its share of the digest.
//!
//! vLLM re-announces blocks (a prefix-cache hit stores the same hash again), so a block is in
//! the prefix index while its GPU reference count is above zero and leaves it only when the
//! count returns to zero. Lower tiers are counted the same way but never indexed.

use std::collections::BTreeMap;
use std::sync::Arc;

use rustc_hash::FxHashMap;

use crate::Tier;
use crate::digest::block_fact;

/// Reference counts of one block hash, per [`Tier`] (saturating at `u16::MAX`: vLLM
/// re-announces a block a handful of times, not tens of thousands).
pub(crate) type Refs = [u16; 4];

/// The blocks of one `(worker, dp_rank)`.
#[derive(Debug, Default, Clone)]
pub(crate) struct RankBlocks {
    pub(crate) blocks: FxHashMap<u64, Refs>,
    /// Wrapping sum of this rank's block facts.
    pub(crate) digest: u128,
    /// Blocks with a GPU reference.
    pub(crate) gpu_blocks: u64,
    /// The cache salt of salted blocks (a continuation of their chain is hashed under it).
    pub(crate) salts: BTreeMap<u64, Arc<str>>,
}

/// The contribution of a block's salt to the digest.
pub(crate) fn salt_fact(worker: u64, dp_rank: u32, hash: u64, salt: &str) -> u128 {
    let mut h = crate::digest::Hasher::new();
    h.u64(worker).u64(u64::from(dp_rank)).u64(hash).str(salt);
    h.finish().0
}

/// What a reference change did to a block's presence in one tier.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Change {
    /// The tier count went from zero to one.
    Appeared,
    /// The tier count went from one to zero.
    Disappeared,
    /// Still present (or still absent for a no-op).
    Unchanged,
    /// A decrement of a count that was already zero.
    Unknown,
}

impl RankBlocks {
    pub(crate) fn refs(&self, hash: u64) -> Refs {
        self.blocks.get(&hash).copied().unwrap_or_default()
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

    /// Adds (`delta = 1`) or drops (`delta = -1`) one reference of `hash` in `tier`.
    /// Returns the change and the digest delta to apply to the global sum.
    pub(crate) fn adjust(
        &mut self,
        worker: u64,
        dp_rank: u32,
        hash: u64,
        tier: Tier,
        add: bool,
    ) -> (Change, u128, i128) {
        let old = self.refs(hash);
        let mut new = old;
        let slot = tier.slot();
        let change = if add {
            new[slot] = new[slot].saturating_add(1);
            if old[slot] == 0 {
                Change::Appeared
            } else {
                Change::Unchanged
            }
        } else if old[slot] == 0 {
            return (Change::Unknown, 0, 0);
        } else {
            new[slot] -= 1;
            if new[slot] == 0 {
                Change::Disappeared
            } else {
                Change::Unchanged
            }
        };
        let mut removed = 0u128;
        let mut added = 0u128;
        if old != [0; 4] {
            removed = block_fact(worker, dp_rank, hash, &old);
        }
        if new == [0; 4] {
            self.blocks.remove(&hash);
            if let Some(salt) = self.salts.remove(&hash) {
                removed = removed.wrapping_add(salt_fact(worker, dp_rank, hash, &salt));
            }
        } else {
            added = block_fact(worker, dp_rank, hash, &new);
            self.blocks.insert(hash, new);
        }
        self.digest = self.digest.wrapping_sub(removed).wrapping_add(added);
        let gpu_delta: i128 = match (tier, &change) {
            (Tier::Gpu, Change::Appeared) => 1,
            (Tier::Gpu, Change::Disappeared) => -1,
            _ => 0,
        };
        self.gpu_blocks = self.gpu_blocks.saturating_add_signed(gpu_delta as i64);
        (change, added.wrapping_sub(removed), gpu_delta)
    }
}
