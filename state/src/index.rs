//! One pool's prefix index: for every cached block, the worker ranks that hold it, keyed by
//! the block's *sequence hash* - the hash of its tokens chained over every block before it
//! (dynamo-kv-router's `compute_block_hash_for_seq` and `compute_next_seq_hash`).
//!
//! Why not the engines' own block hashes, and why not dynamo-kv-router's radix tree (see
//! DEVELOPERS.md and README, "Prefix index"): engines that hash with different seeds give the same content
//! different hashes, and the tree (1.6.1) resolves a parent by its engine hash wherever it
//! first saw it, so after one engine evicts, the other's blocks stay matched; and its compressed
//! walk credits a worker with blocks below a shared block another worker removed. Keyed by
//! sequence hash, a worker matches `k` blocks exactly when it holds the first `k` blocks of the
//! prompt: the same content on two engines is one key, and a removal takes away exactly the
//! block removed. The engines' hashes stay in [`crate::blocks::RankBlocks`], mapped to the
//! sequence hashes, for parents and removals.
//!
//! The index is read on the callers' threads while apply writes it: it is split in shards by
//! the sequence hash's top bits, each a hash map behind its own lock, and a lookup holds one
//! shard's read lock for one block at a time, so Route never waits for ingest for long. Apply
//! does not write block by block: it gathers its writes ([`Writes`]) and hands them to the
//! index writer thread ([`crate::writer`]), which sorts them by shard and applies a shard's
//! run of up to [`RUN`] under one write lock (a locked instruction per block serialized the
//! cache misses: per-block locking cost about 60% of apply). Apply waits for the writer at
//! the entry's end and writes what it gathered since the last hand-off itself, the same way. (`dashmap`, one write lock per block on apply's thread, was the index
//! before; `scc::HashIndex`, whose reads take no lock, looked blocks up no faster here and
//! took about twice the memory per block.) It is live, not a snapshot: a reader holding the
//! View of index N may see effects of entry N+1 while the writer applies them. Instead of
//! hiding that, every entry first raises [`PoolIndex::through`] to its index, and a reader
//! that loads it after its lookups has an upper bound on what it saw (the View's applied
//! index is the lower one).
//!
//! A block's holders are a sorted multiset: a rank that holds one sequence hash under two
//! engine hashes (vLLM's hash also covers multimodal keys the sequence hash does not) is in it
//! twice, and stays a holder until both are removed. A write therefore needs no answer from
//! the index, which is what lets apply defer it.
//!
//! The index keeps a multiset hash of what it holds ([`PoolIndex::content`]: the wrapping sum
//! of `xxh3_128` of each `(sequence hash, holder)` it holds), changed by the writes that
//! change the maps and by nothing else, so the state digest covers the index as it is - a
//! write lost on the way (the writer thread gone with a batch, a restore that rebuilt less)
//! shows as a different digest, not only as different answers. [`PoolIndex::computed_content`]
//! recounts it from the maps.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError, RwLock};

use dynamo_kv_router::protocols::{
    BlockHashOptions, LocalBlockHash, compute_block_hash_for_seq, compute_next_seq_hash,
};
use rustc_hash::FxHashMap;
use smallvec::SmallVec;
use xxhash_rust::xxh3::{xxh3_64_with_seed, xxh3_128};

/// A prompt's first `blocks` blocks as one key: the sequence hash of its last one (chained, so
/// two prompts share it only if they share all of those blocks, under the same salt).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Anchor {
    pub blocks: u32,
    pub seq: u64,
}

/// How many prompt blocks each worker rank already holds, consecutively from block 0.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Overlap {
    /// Complete blocks in the prompt (the trailing partial block is never cached).
    pub prompt_blocks: u32,
    /// Matched blocks per holder id, sorted by holder; ranks with no match are absent.
    matched: Vec<(u64, u32)>,
}

impl Overlap {
    /// The best match of one worker over its ranks: `(blocks, rank)` (the lowest rank of
    /// equal matches).
    pub fn best_for(&self, worker: u64) -> (u32, u32) {
        let first = holder(worker, 0);
        let at = self.matched.partition_point(|&(h, _)| h < first);
        self.matched[at..]
            .iter()
            .take_while(|&&(h, _)| unpack(h).0 == worker)
            .map(|&(h, blocks)| (blocks, unpack(h).1))
            .max_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(&a.1)))
            .unwrap_or((0, 0))
    }

    /// [`Self::best_for`] of each of `workers` (ids), in their order. When the ids lie close
    /// together (a pool's workers, numbered as they came), one pass over the matches into a
    /// table by id instead of a search per worker.
    pub fn best_for_each(&self, workers: &[u64]) -> Vec<(u32, u32)> {
        let (Some(&lo), Some(&hi)) = (workers.iter().min(), workers.iter().max()) else {
            return Vec::new();
        };
        let span = hi - lo + 1;
        if span > 4 * workers.len() as u64 + 64 {
            return workers.iter().map(|&w| self.best_for(w)).collect();
        }
        let mut by_id = vec![(0u32, 0u32); span as usize];
        for &(h, blocks) in &self.matched {
            let (w, rank) = unpack(h);
            // Within a worker the ranks come in order: the first of equal matches stays.
            if (lo..=hi).contains(&w) && blocks > by_id[(w - lo) as usize].0 {
                by_id[(w - lo) as usize] = (blocks, rank);
            }
        }
        workers.iter().map(|&w| by_id[(w - lo) as usize]).collect()
    }

    /// The longest match of any worker rank.
    pub fn best_blocks(&self) -> u32 {
        self.matched.iter().map(|&(_, n)| n).max().unwrap_or(0)
    }

    /// Matched blocks per `(worker id, dp rank)`.
    pub fn by_rank(&self) -> BTreeMap<(u64, u32), u32> {
        self.matched.iter().map(|&(h, n)| (unpack(h), n)).collect()
    }
}

/// Bits of a holder id that carry the dp rank (the worker id takes the rest).
const RANK_BITS: u32 = 24;

/// The largest dp rank a holder id can carry.
pub const MAX_DP_RANK: u32 = (1 << RANK_BITS) - 1;

/// A worker rank as one sortable id: the worker id above the rank.
fn holder(worker: u64, dp_rank: u32) -> u64 {
    // Worker ids count up from 1, one per worker ever seen: far below 2^40.
    debug_assert!(worker < 1 << (64 - RANK_BITS));
    (worker << RANK_BITS) | u64::from(dp_rank & MAX_DP_RANK)
}

fn unpack(h: u64) -> (u64, u32) {
    (h >> RANK_BITS, (h & u64::from(MAX_DP_RANK)) as u32)
}

/// One hold's part of [`PoolIndex::content`].
fn hold_fact(seq: u64, holder: u64) -> u128 {
    let mut buf = [0u8; 16];
    buf[..8].copy_from_slice(&seq.to_le_bytes());
    buf[8..].copy_from_slice(&holder.to_le_bytes());
    xxh3_128(&buf)
}

/// The holders of one block, sorted, a rank once per engine hash it holds the block under
/// (most blocks have one or two).
type Holders = SmallVec<[u64; 2]>;

/// Shards of the index: a power of two, enough that readers on many cores rarely meet apply
/// in the same shard.
const SHARDS: usize = 64;

/// Writes applied under one lock hold at most: a reader waits for at most this many.
const RUN: usize = 128;

/// The shard of a sequence hash: its top bits (the hash is already uniform).
fn shard_of(seq: u64) -> usize {
    (seq >> (64 - SHARDS.trailing_zeros())) as usize
}

/// One shard, on cache lines of its own (readers of neighbouring shards do not share a lock's
/// line).
#[repr(align(128))]
#[derive(Default)]
struct Shard(RwLock<FxHashMap<u64, Holders>>);

impl Shard {
    fn read(&self) -> std::sync::RwLockReadGuard<'_, FxHashMap<u64, Holders>> {
        // A panic under the lock leaves the map whole (writes are single pushes and removals).
        self.0.read().unwrap_or_else(PoisonError::into_inner)
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, FxHashMap<u64, Holders>> {
        self.0.write().unwrap_or_else(PoisonError::into_inner)
    }
}

/// One write: a holder added to or taken off a block.
#[derive(Debug, Clone, Copy, Default)]
struct Op {
    seq: u64,
    holder: u64,
    add: bool,
}

/// Writes to one index in the order apply made them, and the room to sort them by shard
/// (stably: two writes of one block are in one shard and keep their order).
#[derive(Debug, Default)]
pub(crate) struct Writes {
    ops: Vec<Op>,
    by_shard: Vec<Op>,
}

impl Writes {
    fn push(&mut self, op: Op) {
        self.ops.push(op);
    }

    /// Adds `dp_rank` of `worker` as a holder of the block with sequence hash `seq` (once
    /// more, when it holds it already under another engine hash).
    pub(crate) fn add(&mut self, seq: u64, worker: u64, dp_rank: u32) {
        self.push(Op {
            seq,
            holder: holder(worker, dp_rank),
            add: true,
        });
    }

    /// Writes gathered.
    pub(crate) fn len(&self) -> usize {
        self.ops.len()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }

    /// Takes one hold of `dp_rank` of `worker` off the block with sequence hash `seq`.
    pub(crate) fn remove(&mut self, seq: u64, worker: u64, dp_rank: u32) {
        self.push(Op {
            seq,
            holder: holder(worker, dp_rank),
            add: false,
        });
    }
}

pub struct PoolIndex {
    block_size: u32,
    shards: Box<[Shard]>,
    /// The highest entry index whose effects may be in the index.
    through: AtomicU64,
    /// The multiset hash of every hold in the maps (see the module's docs).
    content: Mutex<u128>,
}

impl std::fmt::Debug for PoolIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PoolIndex")
            .field("block_size", &self.block_size)
            .field("blocks", &self.len())
            .finish_non_exhaustive()
    }
}

impl PoolIndex {
    pub fn new(block_size: u32) -> Self {
        Self {
            block_size,
            shards: (0..SHARDS).map(|_| Shard::default()).collect(),
            through: AtomicU64::new(0),
            content: Mutex::new(0),
        }
    }

    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    /// The highest entry index whose effects may be in the index now. Loaded after a lookup,
    /// it bounds what that lookup saw from above.
    pub fn through(&self) -> u64 {
        self.through.load(Ordering::Acquire)
    }

    /// Marks that entry `index` is about to write; called before its first write.
    pub(crate) fn entering(&self, index: u64) {
        self.through.fetch_max(index, Ordering::AcqRel);
    }

    /// Hashes a prompt's blocks the way engines' events are keyed (xxh3 over each full block's
    /// tokens, with the LoRA adapter mixed into the seed).
    pub fn hash_tokens(&self, tokens: &[u32], lora_name: Option<&str>) -> Vec<LocalBlockHash> {
        compute_block_hash_for_seq(
            tokens,
            self.block_size,
            BlockHashOptions {
                lora_name,
                ..Default::default()
            },
        )
    }

    /// Block hashes with a cache salt mixed into every block's: how entries from before
    /// compact entries ([`crate::KvEvent::Stored`]) keyed a salted chain.
    pub(crate) fn hash_tokens_salted_per_block(
        &self,
        tokens: &[u32],
        lora_name: Option<&str>,
        cache_salt: Option<&str>,
    ) -> Vec<LocalBlockHash> {
        compute_block_hash_for_seq(
            tokens,
            self.block_size,
            BlockHashOptions {
                lora_name,
                cache_namespace: cache_salt,
                ..Default::default()
            },
        )
    }

    /// [`PoolIndex::overlaps_hashed`] of a request under a LoRA adapter and a cache salt.
    pub fn overlaps_keyed(
        &self,
        tokens: &[u32],
        lora_name: Option<&str>,
        cache_salt: Option<&str>,
    ) -> Overlap {
        self.overlaps_hashed(&self.hash_tokens(tokens, lora_name), cache_salt)
    }

    pub fn overlaps(&self, tokens: &[u32], lora_name: Option<&str>) -> Overlap {
        self.overlaps_keyed(tokens, lora_name, None)
    }

    /// Prompt blocks held per worker rank, consecutively from the first, for a prompt already
    /// hashed, under a cache salt (see [`root`]). Safe to call while apply writes.
    pub fn overlaps_hashed(&self, hashes: &[LocalBlockHash], cache_salt: Option<&str>) -> Overlap {
        self.overlaps_walk(hashes, cache_salt, None)
    }

    /// [`PoolIndex::overlaps_hashed`], and the prompt's [`Anchor`]s (every `every`th block's
    /// and the last complete block's): what a router remembers of a prompt it routed before
    /// the engine's events say what it caches. The chain is hashed once for both.
    pub fn overlaps_anchored(
        &self,
        hashes: &[LocalBlockHash],
        cache_salt: Option<&str>,
        every: usize,
    ) -> (Overlap, Vec<Anchor>) {
        let mut anchors = Vec::with_capacity(hashes.len() / every.max(1) + 1);
        let o = self.overlaps_walk(hashes, cache_salt, Some((every.max(1), &mut anchors)));
        (o, anchors)
    }

    fn overlaps_walk(
        &self,
        hashes: &[LocalBlockHash],
        cache_salt: Option<&str>,
        mut anchors: Option<(usize, &mut Vec<Anchor>)>,
    ) -> Overlap {
        // The ranks holding every block so far (sorted), and how many blocks that is; a rank
        // leaves with the count it reached.
        let mut active: Vec<u64> = Vec::new();
        let mut ended: Vec<(u64, u32)> = Vec::new();
        let mut depth = 0u32;
        let mut seq = None;
        let mut probing = true;
        for (i, &local) in hashes.iter().enumerate() {
            let s = match seq {
                None => root(local, cache_salt),
                Some(p) => chain(Some(p), local),
            };
            seq = Some(s);
            if let Some((every, out)) = &mut anchors
                && ((i + 1) % *every == 0 || i + 1 == hashes.len())
            {
                out.push(Anchor {
                    blocks: u32::try_from(i + 1).unwrap_or(u32::MAX),
                    seq: s,
                });
            }
            if !probing {
                continue;
            }
            let shard = self.shards[shard_of(s)].read();
            let Some(here) = shard.get(&s) else {
                probing = false;
                if anchors.is_none() {
                    break;
                }
                continue;
            };
            if i == 0 {
                active.extend_from_slice(here);
                // A rank holding the block twice is one holder here.
                active.dedup();
            } else if *active != **here {
                // (A shared prefix's blocks mostly have the same holders: nothing to do.)
                keep_common(&mut active, here, |h| ended.push((h, depth)));
            }
            drop(shard);
            if active.is_empty() {
                probing = false;
                if anchors.is_none() {
                    break;
                }
                continue;
            }
            depth = u32::try_from(i + 1).unwrap_or(u32::MAX);
        }
        ended.extend(active.into_iter().map(|h| (h, depth)));
        // Each holder left once: sorting by holder alone is a total order.
        ended.sort_unstable_by_key(|&(h, _)| h);
        Overlap {
            prompt_blocks: u32::try_from(hashes.len()).unwrap_or(u32::MAX),
            matched: ended,
        }
    }

    /// Applies an entry's writes, a shard's run of up to [`RUN`] under one lock hold, and
    /// leaves `writes` empty (its buffers kept for the next entry).
    pub(crate) fn write(&self, writes: &mut Writes) {
        // Sorted by shard (a counting sort: stable), then each shard's in runs.
        let mut starts = [0usize; SHARDS + 1];
        for op in &writes.ops {
            starts[shard_of(op.seq) + 1] += 1;
        }
        for s in 0..SHARDS {
            starts[s + 1] += starts[s];
        }
        let sorted = &mut writes.by_shard;
        sorted.clear();
        sorted.resize(writes.ops.len(), Op::default());
        let mut next = starts;
        for op in &writes.ops {
            let s = shard_of(op.seq);
            sorted[next[s]] = *op;
            next[s] += 1;
        }
        let mut delta = 0u128;
        for (s, shard) in self.shards.iter().enumerate() {
            for run in sorted[starts[s]..starts[s + 1]].chunks(RUN) {
                let mut map = shard.write();
                for op in run {
                    match apply_op(&mut map, *op) {
                        Some(true) => delta = delta.wrapping_add(hold_fact(op.seq, op.holder)),
                        Some(false) => delta = delta.wrapping_sub(hold_fact(op.seq, op.holder)),
                        None => {}
                    }
                }
            }
        }
        let mut content = self.content.lock().unwrap_or_else(PoisonError::into_inner);
        *content = content.wrapping_add(delta);
        writes.ops.clear();
    }

    /// The multiset hash of every `(sequence hash, holder)` hold, as the writes that changed
    /// the maps kept it. Read it when no write is under way (apply reads it between entries).
    pub fn content(&self) -> u128 {
        *self.content.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// [`PoolIndex::content`] recounted from the maps (in their order: a sum does not depend
    /// on it).
    pub fn computed_content(&self) -> u128 {
        let mut sum = 0u128;
        for shard in &*self.shards {
            for (&seq, holders) in shard.read().iter() {
                for &h in holders {
                    sum = sum.wrapping_add(hold_fact(seq, h));
                }
            }
        }
        sum
    }

    /// Blocks with at least one holder.
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| s.read().len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.shards.iter().all(|s| s.read().is_empty())
    }
}

/// Applies one write: `Some(true)` when it added a hold, `Some(false)` when it took one off,
/// `None` when there was none to take.
fn apply_op(map: &mut FxHashMap<u64, Holders>, op: Op) -> Option<bool> {
    if op.add {
        let e = map.entry(op.seq).or_default();
        let at = e.partition_point(|&h| h <= op.holder);
        e.insert(at, op.holder);
        Some(true)
    } else if let Some(e) = map.get_mut(&op.seq)
        && let Ok(at) = e.binary_search(&op.holder)
    {
        e.remove(at);
        if e.is_empty() {
            map.remove(&op.seq);
        }
        Some(false)
    } else {
        None
    }
}

/// Damage, for the tests that prove the digest sees it.
#[cfg(test)]
impl PoolIndex {
    /// The lowest `(sequence hash, holder)` hold in the index.
    fn lowest_hold(&self) -> Option<(u64, u64)> {
        self.shards
            .iter()
            .filter_map(|s| {
                s.read()
                    .iter()
                    .filter_map(|(&seq, h)| h.first().map(|&h| (seq, h)))
                    .min()
            })
            .min()
    }

    /// Takes the lowest hold off as a lost write would leave the index: the maps and their
    /// content change, the state's block facts do not.
    pub(crate) fn lose_a_hold(&self) -> bool {
        let Some((seq, holder)) = self.lowest_hold() else {
            return false;
        };
        let mut writes = Writes::default();
        writes.push(Op {
            seq,
            holder,
            add: false,
        });
        self.write(&mut writes);
        true
    }

    /// Takes the lowest hold off the maps behind their content's back.
    pub(crate) fn corrupt_a_hold(&self) -> bool {
        let Some((seq, holder)) = self.lowest_hold() else {
            return false;
        };
        let op = Op {
            seq,
            holder,
            add: false,
        };
        apply_op(&mut self.shards[shard_of(seq)].write(), op).is_some()
    }
}

/// The keys of a stored event's blocks, as the leader computes them once for every member
/// ([`crate::KvEvent::compact`]): each block's tokens hashed under its LoRA adapter.
pub(crate) fn block_keys(tokens: &[u32], block_size: u32, lora_name: Option<&str>) -> Vec<u64> {
    compute_block_hash_for_seq(
        tokens,
        block_size,
        BlockHashOptions {
            lora_name,
            ..Default::default()
        },
    )
    .into_iter()
    .map(|h| h.0)
    .collect()
}

/// The sequence hash of a chain's first block: its own hash, mixed with the chain's cache salt
/// when it has one (vLLM shares blocks only among requests with the same salt). The salt
/// enters once, here: every later block chains over it, so a continuation, which names only
/// its parent, is keyed under its chain's salt without carrying it.
pub(crate) fn root(local: LocalBlockHash, cache_salt: Option<&str>) -> u64 {
    match cache_salt {
        None => local.0,
        Some(salt) => xxh3_64_with_seed(salt.as_bytes(), local.0),
    }
}

/// The sequence hashes of a run of blocks (their own hashes, `locals`) after `parent`; with no
/// parent, the run starts a chain, its first block keyed under `salt` ([`root`]).
pub(crate) fn chain_run(
    parent: Option<u64>,
    locals: impl Iterator<Item = u64>,
    salt: Option<&str>,
) -> Vec<u64> {
    let mut seq = parent;
    locals
        .map(|l| {
            let local = LocalBlockHash(l);
            let s = match seq {
                None => root(local, salt),
                Some(_) => chain(seq, local),
            };
            seq = Some(s);
            s
        })
        .collect()
}

/// The sequence hash of a block: its own hash for the first block, chained over its parent's
/// sequence hash after.
pub(crate) fn chain(parent: Option<u64>, local: LocalBlockHash) -> u64 {
    match parent {
        None => local.0,
        Some(p) => compute_next_seq_hash(p, local),
    }
}

/// Keeps in `active` what sorted `here` also holds (both sorted); hands each other one to `left`.
fn keep_common(active: &mut Vec<u64>, here: &[u64], mut left: impl FnMut(u64)) {
    let mut j = 0;
    active.retain(|&x| {
        while j < here.len() && here[j] < x {
            j += 1;
        }
        let kept = j < here.len() && here[j] == x;
        if !kept {
            left(x);
        }
        kept
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Tokens of `n` blocks of 4, the same for every caller.
    fn prompt(n: u32) -> Vec<u32> {
        (0..n * 4).collect()
    }

    /// Makes `(worker, rank)` a holder of the prompt's first `blocks` blocks.
    fn hold(index: &PoolIndex, worker: u64, rank: u32, blocks: usize) {
        let mut seq = None;
        for local in index.hash_tokens(&prompt(8), None).into_iter().take(blocks) {
            let s = chain(seq, local);
            seq = Some(s);
            let mut w = Writes::default();
            w.add(s, worker, rank);
            index.write(&mut w);
        }
    }

    #[test]
    fn a_worker_matches_its_best_rank_and_the_lowest_of_equal_ranks() {
        let index = PoolIndex::new(4);
        hold(&index, 1, 0, 1);
        hold(&index, 1, 2, 3);
        hold(&index, 1, 1, 3);
        hold(&index, 2, 5, 2);
        hold(&index, 3, 0, 8);
        let o = index.overlaps(&prompt(6), None);
        assert_eq!(o.prompt_blocks, 6);
        assert_eq!(o.best_for(1), (3, 1));
        assert_eq!(o.best_for(2), (2, 5));
        assert_eq!(o.best_for(3), (6, 0));
        assert_eq!(o.best_for(4), (0, 0));
        assert_eq!(o.best_blocks(), 6);
        let expected: BTreeMap<(u64, u32), u32> = [
            ((1, 0), 1),
            ((1, 1), 3),
            ((1, 2), 3),
            ((2, 5), 2),
            ((3, 0), 6),
        ]
        .into_iter()
        .collect();
        assert_eq!(o.by_rank(), expected);
    }

    #[test]
    fn a_long_prompts_matches_are_each_ranks_run_of_held_blocks_from_the_first() {
        use proptest::prelude::*;
        // Prompts of up to a hundred blocks, holds with gaps anywhere.
        const LONG: u32 = 100;
        proptest!(|(
            holds in proptest::collection::vec(
                (
                    1u64..5,
                    0u32..3,
                    0..=LONG as usize,
                    proptest::collection::btree_set(0..LONG as usize, 0..8),
                ),
                0..6,
            ),
            blocks in 0..=LONG,
            salted in any::<bool>(),
        )| {
            let salt = salted.then_some("s");
            let index = PoolIndex::new(4);
            let locals = index.hash_tokens(&prompt(LONG), None);
            let seqs = chain_run(None, locals.iter().map(|l| l.0), salt);
            // Each hold: a run from the first block, and a few blocks anywhere.
            let holds: Vec<(u64, u32, std::collections::BTreeSet<usize>)> = holds
                .into_iter()
                .map(|(w, r, run, mut extra)| {
                    extra.extend(0..run);
                    (w, r, extra)
                })
                .collect();
            for (worker, rank, held) in &holds {
                let mut w = Writes::default();
                for &b in held {
                    w.add(seqs[b], *worker, *rank);
                }
                index.write(&mut w);
            }
            // The oracle: per rank, the blocks it holds at all, then its run from block 0.
            let mut held: BTreeMap<(u64, u32), std::collections::BTreeSet<usize>> = BTreeMap::new();
            for (worker, rank, h) in &holds {
                held.entry((*worker, *rank)).or_default().extend(h);
            }
            let expected: BTreeMap<(u64, u32), u32> = held
                .into_iter()
                .map(|(k, h)| (k, (0..blocks as usize).take_while(|b| h.contains(b)).count() as u32))
                .filter(|&(_, n)| n > 0)
                .collect();
            let o = index.overlaps_keyed(&prompt(blocks), None, salt);
            prop_assert_eq!(o.prompt_blocks, blocks);
            prop_assert_eq!(o.by_rank(), expected);
            // With anchors: the same matches, and the chain's hash after every 16th block and
            // after the last, as the stored blocks are keyed.
            let hashed = index.hash_tokens(&prompt(blocks), None);
            let (a, anchors) = index.overlaps_anchored(&hashed, salt, 16);
            prop_assert_eq!(a, o);
            let want: Vec<Anchor> = (1..=blocks as usize)
                .filter(|&n| n % 16 == 0 || n == blocks as usize)
                .map(|n| Anchor { blocks: n as u32, seq: seqs[n - 1] })
                .collect();
            prop_assert_eq!(anchors, want);
        });
    }

    #[test]
    fn best_for_each_is_best_for_of_each_worker_in_order() {
        let index = PoolIndex::new(4);
        for (w, rank, blocks) in [
            (1, 0, 1),
            (1, 2, 3),
            (1, 1, 3),
            (2, 5, 2),
            (3, 0, 8),
            (9, 3, 4),
        ] {
            hold(&index, w, rank, blocks);
        }
        let o = index.overlaps(&prompt(6), None);
        // Close ids (a table), far ids (a search each), none, a worker absent, order kept.
        for ids in [
            vec![3, 1, 2, 4, 9],
            vec![9, 1, 3, 2, 1_000_000],
            vec![],
            vec![7],
        ] {
            let each: Vec<(u32, u32)> = ids.iter().map(|&w| o.best_for(w)).collect();
            assert_eq!(o.best_for_each(&ids), each, "{ids:?}");
        }
    }
}
