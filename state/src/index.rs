//! One pool's prefix index: dynamo-kv-router's `ThreadPoolIndexer<ConcurrentRadixTreeCompressed>`.
//!
//! Why this index (see README, "Prefix index"): the concurrent radix tree answers
//! `find_matches` on the caller's thread while its single writer thread applies events, so
//! Route never waits for ingest. The state machine is its only writer and waits for the
//! writer queue to drain at the end of every entry ([`PoolIndex::flush`]), so the published
//! applied index never runs ahead of the tree. With one writer thread, events apply in
//! log order on every replica.
//!
//! The tree is live, not a snapshot: a reader holding the View of index N may see effects of
//! entry N+1 (or later) when apply writes them during its lookup. Route never waits for
//! ingest, and two copies of the tree would double its memory, so instead of hiding that the
//! index says how far it may be ahead: every write first raises [`PoolIndex::through`] to the
//! entry's index, and a reader that loads it after its lookups has an upper bound on what it
//! saw (the View's applied index is the lower one: entries up to it are all in).

use std::collections::BTreeMap;

use dynamo_kv_router::indexer::KvIndexerInterface;
use dynamo_kv_router::protocols::{
    BlockHashOptions, ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData, KvCacheRemoveData,
    KvCacheStoreData, KvCacheStoredBlockData, LocalBlockHash, RouterEvent,
    compute_block_hash_for_seq,
};
use dynamo_kv_router::{ConcurrentRadixTreeCompressed, SyncIndexer, ThreadPoolIndexer};

/// How many prompt blocks each worker rank already holds, consecutively from block 0.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Overlap {
    /// Complete blocks in the prompt (the trailing partial block is never cached).
    pub prompt_blocks: u32,
    /// Matched blocks per `(worker id, dp rank)`; ranks with no match are absent.
    pub matched: BTreeMap<(u64, u32), u32>,
}

impl Overlap {
    /// The best match of one worker over its ranks: `(blocks, rank)`.
    pub fn best_for(&self, worker: u64) -> (u32, u32) {
        self.matched
            .range((worker, 0)..=(worker, u32::MAX))
            .map(|(&(_, rank), &blocks)| (blocks, rank))
            .max_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(&a.1)))
            .unwrap_or((0, 0))
    }

    /// The longest match of any worker rank.
    pub fn best_blocks(&self) -> u32 {
        self.matched.values().copied().max().unwrap_or(0)
    }
}

pub struct PoolIndex {
    tree: ThreadPoolIndexer<ConcurrentRadixTreeCompressed>,
    block_size: u32,
    /// The highest entry index whose effects may be in the tree.
    through: std::sync::atomic::AtomicU64,
}

impl std::fmt::Debug for PoolIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PoolIndex")
            .field("block_size", &self.block_size)
            .finish_non_exhaustive()
    }
}

impl PoolIndex {
    pub fn new(block_size: u32) -> Self {
        Self {
            tree: ThreadPoolIndexer::new(ConcurrentRadixTreeCompressed::new(), 1, block_size),
            block_size,
            through: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// The highest entry index whose effects may be in the tree now. Loaded after a lookup, it
    /// bounds what that lookup saw from above.
    pub fn through(&self) -> u64 {
        self.through.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Marks that entry `index` is about to write to the tree; called before its first write.
    pub(crate) fn entering(&self, index: u64) {
        self.through
            .fetch_max(index, std::sync::atomic::Ordering::AcqRel);
    }

    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    /// Hashes a prompt the way the index keys blocks (xxh3 over each full block's tokens,
    /// with the LoRA adapter mixed into the seed).
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

    /// Prompt blocks cached per worker rank. Safe to call while the writer applies events.
    /// [`PoolIndex::overlaps`] of a request under a LoRA adapter and a cache salt (vLLM's
    /// `cache_salt`, mixed into every block's hash as the engines' chained hashes carry it).
    pub fn overlaps_keyed(
        &self,
        tokens: &[u32],
        lora_name: Option<&str>,
        cache_salt: Option<&str>,
    ) -> Overlap {
        self.overlaps_hashed(&self.hash_tokens_keyed(tokens, lora_name, cache_salt))
    }

    /// Block hashes under a LoRA adapter and a cache salt.
    pub fn hash_tokens_keyed(
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

    pub fn overlaps(&self, tokens: &[u32], lora_name: Option<&str>) -> Overlap {
        let hashes = self.hash_tokens(tokens, lora_name);
        self.overlaps_hashed(&hashes)
    }

    /// As [`Self::overlaps`], for a prompt already hashed.
    pub fn overlaps_hashed(&self, hashes: &[LocalBlockHash]) -> Overlap {
        let scores = self.tree.backend().find_matches(hashes, false);
        Overlap {
            prompt_blocks: u32::try_from(hashes.len()).unwrap_or(u32::MAX),
            matched: scores
                .scores
                .into_iter()
                .map(|(w, s)| ((w.worker_id, w.dp_rank), s))
                .collect(),
        }
    }

    pub(crate) fn store(
        &self,
        worker: u64,
        dp_rank: u32,
        event_id: u64,
        parent: Option<u64>,
        blocks: Vec<(u64, LocalBlockHash)>,
    ) {
        let data = KvCacheEventData::Stored(KvCacheStoreData {
            parent_hash: parent.map(ExternalSequenceBlockHash),
            start_position: None,
            blocks: blocks
                .into_iter()
                .map(|(h, local)| KvCacheStoredBlockData {
                    block_hash: ExternalSequenceBlockHash(h),
                    tokens_hash: local,
                    mm_extra_info: None,
                })
                .collect(),
        });
        self.send(worker, dp_rank, event_id, data);
    }

    pub(crate) fn remove(&self, worker: u64, dp_rank: u32, event_id: u64, hashes: Vec<u64>) {
        let data = KvCacheEventData::Removed(KvCacheRemoveData {
            block_hashes: hashes.into_iter().map(ExternalSequenceBlockHash).collect(),
        });
        self.send(worker, dp_rank, event_id, data);
    }

    pub(crate) fn clear(&self, worker: u64, dp_rank: u32, event_id: u64) {
        self.send(worker, dp_rank, event_id, KvCacheEventData::Cleared);
    }

    fn send(&self, worker: u64, dp_rank: u32, event_id: u64, data: KvCacheEventData) {
        let event = RouterEvent::new(
            worker,
            KvCacheEvent {
                event_id,
                data,
                dp_rank,
            },
        );
        self.apply_router_event(event);
    }

    pub(crate) fn apply_router_event(&self, event: RouterEvent) {
        // The queue only fails once the indexer has shut down, which happens on drop.
        let _ = self.tree.enqueue_event(event);
    }

    /// Waits until every event queued so far is visible to readers.
    pub fn flush(&self) {
        block_on(self.tree.flush());
    }

    /// The whole tree as router events, for snapshots.
    pub(crate) fn dump(&self) -> Result<Vec<RouterEvent>, crate::SnapshotError> {
        block_on(self.tree.dump_events()).map_err(|e| crate::SnapshotError::Dump(e.to_string()))
    }
}

/// Waits for the indexer from synchronous code. The indexer answers through tokio channels,
/// which charge the caller's cooperative budget: when `apply` runs inside a tokio task (Raft's
/// state-machine task), an exhausted budget would make every poll return pending and this
/// wait spin forever. Unconstrained, the wait never touches the budget.
fn block_on<F: std::future::Future>(f: F) -> F::Output {
    futures::executor::block_on(tokio::task::unconstrained(f))
}
