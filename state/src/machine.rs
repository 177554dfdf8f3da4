//! The deterministic state machine.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::Owner;
use crate::blocks::{Change, RankBlocks};
use crate::config::{POOL_KIND, PoolConfig, worker_set_pool};
use crate::digest::{Digest, Hasher};
use crate::endpoints::Discovered;
use crate::index::{MAX_DP_RANK, Writes};
use crate::view::{PoolView, StateHandle, View, WorkerView};
use crate::writer::IndexWriter;
use crate::{
    ApplyError, Command, ConfigKey, ConfigObject, Entry, IngestBatch, IngestItem, IngestPayload,
    KvEvent, PoolIndex, Source, Tier, WorkerMetrics,
};
use kvplane_policy::{Catalog, Kind, Object};

/// Where an entry is in the log and when its proposer proposed it: all of an entry apply
/// reads besides its command.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stamp {
    pub index: u64,
    pub timestamp_ms: u64,
}

/// How a stored event names its blocks' keys.
#[derive(Clone, Copy)]
enum Keys<'a> {
    /// Token ids, as entries from before compact entries carry them.
    Tokens {
        token_ids: &'a [u32],
        lora_name: Option<&'a str>,
        cache_salt: Option<&'a str>,
    },
    /// Each block's own hash, as the leader computed it ([`KvEvent::compact`]).
    Hashed {
        locals: &'a [u64],
        cache_salt: Option<&'a str>,
    },
}

/// Why the state machine dropped part of an entry. Counted identically on every replica.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum DropReason {
    /// A message for a pool that is not configured.
    UnknownPool,
    /// A message from a worker that announced it went down (until it comes back up).
    WorkerDown,
    /// A stored event whose block size differs from its pool's.
    BlockSizeMismatch,
    /// A stored event whose token count is not `blocks * block_size`.
    MalformedEvent,
    /// A stored event whose parent block this worker does not hold (lost or late events).
    ParentMissing,
    /// A removal of a block this worker does not hold.
    RemoveUnknown,
    /// A stream message at or below the recorded stream position (already applied).
    Duplicate,
    /// A removal from a KV-cache group that is not a prefix cache (hybrid models).
    NonPrimaryGroup,
}

impl DropReason {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::UnknownPool => "unknown_pool",
            Self::WorkerDown => "worker_down",
            Self::BlockSizeMismatch => "block_size_mismatch",
            Self::MalformedEvent => "malformed_event",
            Self::ParentMissing => "parent_missing",
            Self::RemoveUnknown => "remove_unknown",
            Self::Duplicate => "duplicate",
            Self::NonPrimaryGroup => "non_primary_group",
        }
    }
}

/// What one entry did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Applied {
    pub index: u64,
    /// KV events applied to the index.
    pub kv_events: u64,
    /// Items or events dropped, by reason.
    pub dropped: BTreeMap<DropReason, u64>,
    /// A configuration command that was refused (state unchanged by it).
    pub rejected: Option<ApplyError>,
    /// What a quota batch granted and released.
    pub quota: Option<crate::QuotaApplied>,
    /// Workers an [`Command::ExpireLeases`] took down: (pool, worker).
    pub expired: Vec<(String, String)>,
    /// Workers whose messages were dropped because their pool does not exist: (pool, worker).
    pub unknown_pool: BTreeSet<(String, String)>,
}

#[derive(Debug)]
pub(crate) struct Pool {
    pub(crate) config: PoolConfig,
    pub(crate) index: Arc<PoolIndex>,
    /// The index content last folded into the digest's index part (see
    /// [`StateMachine::fold_indexes`]; not state).
    pub(crate) folded: u128,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct Worker {
    pub(crate) id: u64,
    pub(crate) up: bool,
    pub(crate) address: Option<String>,
    pub(crate) metrics: WorkerMetrics,
    pub(crate) metrics_index: u64,
    pub(crate) metrics_at_ms: u64,
    /// Proposer time of the entry that carried its last stream message (its lease). Not in
    /// the digest, like `metrics_at_ms`: it depends on how the stream was cut into entries;
    /// what it decides (a worker going down) is.
    #[serde(default)]
    pub(crate) heard_ms: u64,
    /// What its worker set's static endpoints or Kubernetes say of it, if they know it (see
    /// [`crate::endpoints`]).
    #[serde(default)]
    pub(crate) discovered: Option<Discovered>,
    /// Created by its endpoint source, no stream message of its applied yet: its first one
    /// starts its stream as a new worker's would (down until then, so no lease expires).
    #[serde(default)]
    pub(crate) awaiting_stream: bool,
}

impl Worker {
    /// Whether requests may go to it: what its endpoint source says when it has one, else
    /// what its stream says.
    pub(crate) fn routable(&self) -> bool {
        self.discovered.as_ref().map_or(self.up, |d| d.ready)
    }

    /// Where requests go: its endpoint source's address, else the one it announced.
    pub(crate) fn serving_address(&self) -> Option<&str> {
        self.discovered
            .as_ref()
            .map(|d| d.address.as_str())
            .or(self.address.as_deref())
    }
}

/// Index writes gathered before apply hands them to the index writer (a few events' worth:
/// the writer starts early, and a channel message carries many writes).
const SEND_WRITES_AT: usize = 1024;

/// The state of one kvplane replica. Owned by one applier; read through [`StateMachine::handle`].
#[derive(Debug)]
pub struct StateMachine {
    pub(crate) applied_index: u64,
    pub(crate) config_index: u64,
    /// The last message applied of each ingest source.
    pub(crate) positions: BTreeMap<Source, u64>,
    pub(crate) next_worker_id: u64,
    pub(crate) config: BTreeMap<(String, String), Vec<u8>>,
    /// Who wrote each object of `config` (objects from before owners have none).
    pub(crate) owners: Arc<BTreeMap<(String, String), Owner>>,
    pub(crate) pools: BTreeMap<String, Pool>,
    /// Keyed by `(pool, worker name)`.
    pub(crate) workers: BTreeMap<(String, String), Worker>,
    /// Keyed by `(worker id, dp rank)`.
    pub(crate) ranks: BTreeMap<(u64, u32), RankBlocks>,
    pub(crate) blocks_digest: u128,
    pub(crate) indexed_blocks: u64,
    pub(crate) dropped: BTreeMap<DropReason, u64>,
    /// The policy-kind objects of `config`, parsed.
    pub(crate) catalog: Arc<Catalog>,
    /// Tenant limits' escrow.
    pub(crate) quota: Arc<crate::Ledger>,
    /// The digest's parts, kept up to date as apply changes what they cover (see
    /// [`StateMachine::digest`], which recomputes them).
    pub(crate) parts: DigestParts,
    /// The digest's index part: the wrapping sum of each pool's [`index_fact`] of the content
    /// folded in at the last publish, so a publish costs the pools an entry wrote, not every pool.
    pub(crate) indexes: u128,
    /// What changed since the last publish (not state: never hashed or snapshotted).
    pub(crate) dirty: Dirty,
    /// The current entry's index writes not yet sent to the index writer, and the index they
    /// are for (not state).
    pub(crate) writes: Writes,
    pub(crate) writes_to: Option<Arc<PoolIndex>>,
    /// Other pools' writes gathered in this entry, not yet sent.
    pub(crate) parked: Vec<(Arc<PoolIndex>, Writes)>,
    pub(crate) writer: IndexWriter,
    /// Room for a worker's key while an item applies (not state).
    pub(crate) key_buffer: (String, String),
    pub(crate) handle: StateHandle,
}

/// The digest's parts other than the blocks' (which live in `blocks_digest`).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct DigestParts {
    pub(crate) config: u128,
    /// Wrapping sum of [`worker_fact`]s.
    pub(crate) workers: u128,
    pub(crate) quota: u128,
}

/// Pools whose published view is out of date.
#[derive(Debug, Default)]
pub(crate) struct Dirty {
    pub(crate) all: bool,
    pub(crate) pools: BTreeSet<String>,
}

/// The contribution of one worker to the digest's worker part.
pub(crate) fn worker_fact(pool: &str, name: &str, w: &Worker) -> u128 {
    let mut h = Hasher::new();
    h.str(pool).str(name).u64(w.id).u64(u64::from(w.up));
    h.str(w.address.as_deref().unwrap_or(""));
    h.u64(u64::from(w.metrics.running))
        .u64(u64::from(w.metrics.waiting))
        .f64(w.metrics.kv_cache_usage)
        .f64(w.metrics.prefix_cache_hit_rate)
        .f64(w.metrics.ttft_sum_s)
        .u64(w.metrics.ttft_count);
    // Hashed only when present: workers known from their streams alone keep the facts they
    // had before endpoints could be discovered.
    if let Some(d) = &w.discovered {
        h.str(d.found.as_str())
            .str(&d.address)
            .u64(u64::from(d.ready));
    }
    if w.awaiting_stream {
        h.str("awaiting_stream");
    }
    h.finish().0
}

impl Default for StateMachine {
    fn default() -> Self {
        Self::new()
    }
}

impl StateMachine {
    pub fn new() -> Self {
        let sm = Self {
            applied_index: 0,
            config_index: 0,
            positions: BTreeMap::new(),
            next_worker_id: 1,
            config: BTreeMap::new(),
            owners: Arc::default(),
            pools: BTreeMap::new(),
            workers: BTreeMap::new(),
            ranks: BTreeMap::new(),
            blocks_digest: 0,
            indexed_blocks: 0,
            dropped: BTreeMap::new(),
            catalog: Arc::default(),
            quota: Arc::default(),
            parts: DigestParts::default(),
            indexes: 0,
            dirty: Dirty::default(),
            writes: Writes::default(),
            writes_to: None,
            parked: Vec::new(),
            writer: IndexWriter::default(),
            key_buffer: Default::default(),
            handle: StateHandle::new(View::empty()),
        };
        let mut sm = sm;
        sm.parts = sm.computed_parts();
        sm.publish();
        sm
    }

    /// The handle readers use; it sees every entry once it is applied.
    pub fn handle(&self) -> StateHandle {
        self.handle.clone()
    }

    /// Publishes to an existing handle from now on (a state restored from a snapshot keeps
    /// serving the readers of the state it replaces).
    pub fn with_handle(mut self, handle: StateHandle) -> Self {
        self.handle = handle;
        self.dirty.all = true;
        self.publish();
        self
    }

    pub fn applied_index(&self) -> u64 {
        self.applied_index
    }

    /// The last ingest-stream sequence applied.
    pub fn last_stream_seq(&self) -> u64 {
        self.position(&Source::stream())
    }

    /// The last message of `source` applied (0: none yet).
    pub fn position(&self, source: &Source) -> u64 {
        self.positions.get(source).copied().unwrap_or(0)
    }

    /// Blocks currently in the prefix indexes (GPU tier, all pools).
    pub fn indexed_blocks(&self) -> u64 {
        self.indexed_blocks
    }

    /// Applies one entry. Entries must come in increasing index order (gaps are allowed:
    /// a log may hold entries that are not for the state machine).
    pub fn apply(&mut self, entry: &Entry) -> Result<Applied, ApplyError> {
        let at = Stamp {
            index: entry.index,
            timestamp_ms: entry.timestamp_ms,
        };
        self.apply_command(at, &entry.command)
    }

    /// [`Self::apply`] of `command` at `at` (a log holds its command where this cannot take it:
    /// a Raft entry shares it).
    pub fn apply_command(&mut self, at: Stamp, command: &Command) -> Result<Applied, ApplyError> {
        if at.index <= self.applied_index {
            return Err(ApplyError::OutOfOrder {
                applied: self.applied_index,
                got: at.index,
            });
        }
        let mut out = Applied {
            index: at.index,
            ..Applied::default()
        };
        match command {
            Command::Noop => {}
            Command::Ingest(batch) => self.apply_ingest(at, batch, &mut out),
            Command::ConfigPut {
                kind,
                name,
                value,
                owner,
            } => {
                let put = ConfigObject {
                    kind: kind.clone(),
                    name: name.clone(),
                    value: value.clone(),
                };
                out.rejected = self.config_change(at.index, &[put], &[], *owner).err();
            }
            Command::ConfigDelete { kind, name, owner } => {
                let key = ConfigKey {
                    kind: kind.clone(),
                    name: name.clone(),
                };
                out.rejected = self.config_change(at.index, &[], &[key], *owner).err();
            }
            Command::ConfigApply {
                puts,
                deletes,
                owner,
            } => {
                out.rejected = self.config_change(at.index, puts, deletes, *owner).err();
            }
            Command::Quota(batch) => {
                let catalog = self.catalog.clone();
                out.quota =
                    Some(Arc::make_mut(&mut self.quota).apply(batch, at.timestamp_ms, &catalog));
                self.parts.quota = quota_part(&self.quota);
            }
            Command::QuotaClose {
                replica,
                incarnation,
            } => {
                Arc::make_mut(&mut self.quota).close(*replica, *incarnation);
                self.parts.quota = quota_part(&self.quota);
            }
            Command::QuotaRetire { replica } => {
                Arc::make_mut(&mut self.quota).retire(*replica);
                self.parts.quota = quota_part(&self.quota);
            }
            Command::ExpireLeases { lease_ms } => self.expire_leases(at, *lease_ms, &mut out),
            Command::Endpoints(update) => out.rejected = self.apply_endpoints(update).err(),
            Command::EndpointHealth(update) => out.rejected = self.apply_health(update).err(),
        }
        self.flush_writes();
        for (reason, n) in &out.dropped {
            *self.dropped.entry(*reason).or_default() += n;
        }
        self.applied_index = at.index;
        self.publish();
        Ok(out)
    }

    /// Gathers index writes for `index` from now on (another pool's gathered writes wait, so
    /// a stream that interleaves pools still sends many writes at a time).
    fn write_to(&mut self, index: &Arc<PoolIndex>) {
        if self
            .writes_to
            .as_ref()
            .is_some_and(|to| Arc::ptr_eq(to, index))
        {
            return;
        }
        let parked = self
            .parked
            .iter()
            .position(|(to, _)| Arc::ptr_eq(to, index));
        let next = match parked {
            Some(i) => self.parked.swap_remove(i).1,
            None => self.writer.buffer(),
        };
        let writes = std::mem::replace(&mut self.writes, next);
        if let Some(to) = self.writes_to.replace(index.clone()) {
            self.parked.push((to, writes));
        }
    }

    /// Hands the writes gathered for the current index to the index writer.
    fn send_writes(&mut self) {
        debug_assert!(self.writes.is_empty() || self.writes_to.is_some());
        if let Some(index) = &self.writes_to
            && !self.writes.is_empty()
        {
            let next = self.writer.buffer();
            let writes = std::mem::replace(&mut self.writes, next);
            self.writer.send(index.clone(), writes);
        }
    }

    /// Applies every gathered write (at the entry's end: a reader of the entry's View sees all
    /// of them). What was sent is awaited; what remains apply writes itself, after the writer
    /// finished (so each index still takes its writes in order): sent, it would be written
    /// while apply only waits for it, and a small entry would pay two thread hand-offs for it.
    fn flush_writes(&mut self) {
        self.writer.wait();
        debug_assert!(self.writes.is_empty() || self.writes_to.is_some());
        if let Some(index) = self.writes_to.take()
            && !self.writes.is_empty()
        {
            index.write(&mut self.writes);
        }
        for (index, mut writes) in std::mem::take(&mut self.parked) {
            if !writes.is_empty() {
                index.write(&mut writes);
            }
            self.writer.give_back(writes);
        }
    }

    fn apply_ingest(&mut self, at: Stamp, batch: &IngestBatch, out: &mut Applied) {
        let applied = self.position(&batch.source);
        for item in &batch.items {
            if item.seq <= applied {
                *out.dropped.entry(DropReason::Duplicate).or_default() += 1;
                continue;
            }
            self.apply_item(at, item, out);
        }
        if batch.last_seq > applied {
            self.positions.insert(batch.source.clone(), batch.last_seq);
        }
    }

    /// Takes down every up worker last heard from more than `lease_ms` before the entry at `at`.
    fn expire_leases(&mut self, at: Stamp, lease_ms: u64, out: &mut Applied) {
        let expired: Vec<(String, String)> = self
            .workers
            .iter()
            .filter(|((pool, _), w)| {
                w.up && self.pools.contains_key(pool)
                    && w.heard_ms.saturating_add(lease_ms) < at.timestamp_ms
            })
            .map(|(k, _)| k.clone())
            .collect();
        for (pool, worker) in &expired {
            let down = IngestItem {
                seq: 0,
                pool: pool.clone(),
                worker: worker.clone(),
                payload: IngestPayload::Worker {
                    up: false,
                    address: None,
                },
            };
            self.apply_item(at, &down, out);
        }
        out.expired = expired;
    }

    /// Applies one stream message to its worker, keeping the digest's worker part and the
    /// pool's published view up to date.
    fn apply_item(&mut self, at: Stamp, item: &IngestItem, out: &mut Applied) {
        let Some(pool) = self.pools.get(&item.pool) else {
            *out.dropped.entry(DropReason::UnknownPool).or_default() += 1;
            out.unknown_pool
                .insert((item.pool.clone(), item.worker.clone()));
            return;
        };
        let index = pool.index.clone();
        self.write_to(&index);
        // The worker's key, in a buffer kept from item to item (no allocation per message).
        let mut key = std::mem::take(&mut self.key_buffer);
        key.0.clone_from(&item.pool);
        key.1.clone_from(&item.worker);
        // KV events change no fact of a worker whose stream has started (its blocks are facts
        // of their own): the worker's digest part is recomputed only for what can change it.
        let facts_change = !matches!(item.payload, IngestPayload::Kv(_))
            || self.workers.get(&key).is_none_or(|w| w.awaiting_stream);
        let fact = |sm: &Self| {
            sm.workers
                .get(&key)
                .map_or(0, |w| worker_fact(&key.0, &key.1, w))
        };
        let before = if facts_change { fact(self) } else { 0 };
        self.apply_to_worker(at, item, &index, &key, out);
        if facts_change {
            self.parts.workers = self
                .parts
                .workers
                .wrapping_sub(before)
                .wrapping_add(fact(self));
        }
        if !self.dirty.pools.contains(&item.pool) {
            self.dirty.pools.insert(item.pool.clone());
        }
        self.key_buffer = key;
        if self.writes.len() >= SEND_WRITES_AT {
            self.send_writes();
        }
    }

    fn apply_to_worker(
        &mut self,
        at: Stamp,
        item: &IngestItem,
        index: &Arc<PoolIndex>,
        key: &(String, String),
        out: &mut Applied,
    ) {
        if !self.workers.contains_key(key) {
            if matches!(item.payload, IngestPayload::Worker { up: false, .. }) {
                return;
            }
            let id = self.next_worker_id;
            self.next_worker_id += 1;
            self.workers.insert(
                key.clone(),
                Worker {
                    id,
                    up: true,
                    address: None,
                    metrics: WorkerMetrics::default(),
                    metrics_index: 0,
                    metrics_at_ms: 0,
                    heard_ms: at.timestamp_ms,
                    discovered: None,
                    awaiting_stream: false,
                },
            );
        }
        let Some(worker) = self.workers.get_mut(key) else {
            return;
        };
        if worker.awaiting_stream {
            if matches!(item.payload, IngestPayload::Worker { up: false, .. }) {
                return;
            }
            worker.awaiting_stream = false;
            worker.up = true;
        }
        worker.heard_ms = at.timestamp_ms;
        let wid = worker.id;
        match &item.payload {
            IngestPayload::Worker { up: true, address } => {
                worker.up = true;
                if address.is_some() {
                    worker.address.clone_from(address);
                }
            }
            IngestPayload::Worker { up: false, .. } => {
                worker.up = false;
                if worker.discovered.is_some() {
                    // Still routable: no load it last reported stands for how loaded it is.
                    worker.metrics = WorkerMetrics::default();
                    worker.metrics_index = 0;
                    worker.metrics_at_ms = 0;
                }
                let ranks: Vec<u32> = self
                    .ranks
                    .range((wid, 0)..=(wid, u32::MAX))
                    .map(|(&(_, r), _)| r)
                    .collect();
                index.entering(at.index);
                for rank in ranks {
                    self.clear_rank(wid, rank);
                }
            }
            _ if !worker.up => {
                *out.dropped.entry(DropReason::WorkerDown).or_default() += 1;
            }
            IngestPayload::Metrics(m) => {
                worker.metrics = *m;
                worker.metrics_index = at.index;
                worker.metrics_at_ms = at.timestamp_ms;
            }
            IngestPayload::Kv(batch) => {
                index.entering(at.index);
                for ev in &batch.events {
                    self.apply_kv(index, wid, batch.dp_rank, ev, out);
                }
            }
        }
    }

    fn apply_kv(&mut self, index: &PoolIndex, wid: u64, dp: u32, ev: &KvEvent, out: &mut Applied) {
        let drop = |out: &mut Applied, r: DropReason| {
            *out.dropped.entry(r).or_default() += 1;
        };
        if dp > MAX_DP_RANK {
            return drop(out, DropReason::MalformedEvent);
        }
        match ev {
            KvEvent::Stored {
                block_hashes,
                parent_hash,
                token_ids,
                block_size,
                lora_name,
                cache_salt,
                tier,
            } => {
                let keys = Keys::Tokens {
                    token_ids,
                    lora_name: lora_name.as_deref(),
                    cache_salt: cache_salt.as_deref(),
                };
                let store = (block_hashes.as_slice(), *parent_hash, *block_size, *tier);
                if let Err(r) = self.apply_store(index, (wid, dp), store, keys, out) {
                    drop(out, r);
                }
            }
            KvEvent::StoredBlocks {
                block_hashes,
                parent_hash,
                locals,
                block_size,
                cache_salt,
                tier,
            } => {
                let keys = Keys::Hashed {
                    locals,
                    cache_salt: cache_salt.as_deref(),
                };
                let store = (block_hashes.as_slice(), *parent_hash, *block_size, *tier);
                if let Err(r) = self.apply_store(index, (wid, dp), store, keys, out) {
                    drop(out, r);
                }
            }
            KvEvent::OtherGroup { group } => {
                let rank = self.ranks.entry((wid, dp)).or_default();
                let d = rank.other_group(wid, dp, *group);
                self.blocks_digest = self.blocks_digest.wrapping_add(d);
                out.kv_events += 1;
            }
            KvEvent::Removed { block_hashes, tier } => {
                self.remove_from_group((wid, dp), block_hashes, *tier, 0, out);
            }
            KvEvent::RemovedFromGroup {
                block_hashes,
                tier,
                group,
            } => {
                self.remove_from_group((wid, dp), block_hashes, *tier, *group, out);
            }
            KvEvent::Cleared => {
                self.clear_rank(wid, dp);
                out.kv_events += 1;
            }
        }
    }

    /// One stored event: `(engine hashes, parent, block size, tier)` and its blocks' keys.
    fn apply_store(
        &mut self,
        index: &PoolIndex,
        (wid, dp): (u64, u32),
        (block_hashes, parent_hash, block_size, tier): (&[u64], Option<u64>, u32, Tier),
        keys: Keys<'_>,
        out: &mut Applied,
    ) -> Result<(), DropReason> {
        if tier != Tier::Gpu {
            self.store_lower(wid, dp, block_hashes, tier, out);
            return Ok(());
        }
        if block_size != index.block_size() {
            return Err(DropReason::BlockSizeMismatch);
        }
        let whole = match keys {
            Keys::Tokens { token_ids, .. } => {
                token_ids.len() == block_hashes.len() * block_size as usize
            }
            Keys::Hashed { locals, .. } => locals.len() == block_hashes.len(),
        };
        if !whole {
            return Err(DropReason::MalformedEvent);
        }
        let Ok(parent_seq) = self.parent_seq(wid, dp, parent_hash) else {
            return Err(DropReason::ParentMissing);
        };
        let (seqs, salt) = match keys {
            Keys::Tokens {
                token_ids,
                lora_name,
                cache_salt,
            } => {
                // A salted chain's continuation is hashed under its parent's salt, mixed into
                // every block's hash, and the salt kept per block.
                let salt: Option<Arc<str>> = match (cache_salt, parent_hash) {
                    (Some(s), _) => Some(s.into()),
                    (None, Some(p)) => self.ranks.get(&(wid, dp)).and_then(|r| r.salt(p)),
                    (None, None) => None,
                };
                let locals =
                    index.hash_tokens_salted_per_block(token_ids, lora_name, salt.as_deref());
                let seqs = crate::index::chain_run(parent_seq, locals.iter().map(|l| l.0), None);
                (seqs, salt)
            }
            // The salt is the chain root's: a continuation chains over its parent's key.
            Keys::Hashed { locals, cache_salt } => (
                crate::index::chain_run(parent_seq, locals.iter().copied(), cache_salt),
                None,
            ),
        };
        self.store_gpu(wid, dp, block_hashes, &seqs, salt.as_ref());
        out.kv_events += 1;
        Ok(())
    }

    /// The sequence hash of a store's parent on this rank's GPU tier: `Ok(None)` for a chain's
    /// first event, `Err(())` when the rank does not hold the parent there.
    fn parent_seq(&self, wid: u64, dp: u32, parent: Option<u64>) -> Result<Option<u64>, ()> {
        match parent {
            None => Ok(None),
            Some(p) => self
                .ranks
                .get(&(wid, dp))
                .and_then(|r| r.gpu_seq(p))
                .map(Some)
                .ok_or(()),
        }
    }

    /// A store on a tier that is not indexed: kept (its events may be placeholders without
    /// tokens), never indexed.
    fn store_lower(&mut self, wid: u64, dp: u32, hashes: &[u64], tier: Tier, out: &mut Applied) {
        let rank = self.ranks.entry((wid, dp)).or_default();
        for &h in hashes {
            let a = rank.store(wid, dp, h, tier, 0);
            self.blocks_digest = self.blocks_digest.wrapping_add(a.digest);
        }
        out.kv_events += 1;
    }

    /// Stores GPU blocks under their sequence hashes (`seqs`, one per hash), moving the index's
    /// holds with them. A block's per-block salt (what entries from before compact entries
    /// keep) becomes `salt`: a store without one clears it.
    fn store_gpu(
        &mut self,
        wid: u64,
        dp: u32,
        hashes: &[u64],
        seqs: &[u64],
        salt: Option<&Arc<str>>,
    ) {
        if hashes.is_empty() {
            return;
        }
        let rank = self.ranks.entry((wid, dp)).or_default();
        for (&h, &s) in hashes.iter().zip(seqs) {
            let a = rank.store(wid, dp, h, Tier::Gpu, s);
            self.blocks_digest = self.blocks_digest.wrapping_add(a.digest);
            self.indexed_blocks = self.indexed_blocks.saturating_add_signed(a.gpu);
            let d = match salt {
                Some(salt) => rank.set_salt(wid, dp, h, salt.clone()),
                None => rank.clear_salt(wid, dp, h),
            };
            self.blocks_digest = self.blocks_digest.wrapping_add(d);
            match a.change {
                Change::Appeared => self.writes.add(s, wid, dp),
                Change::Moved { from } => {
                    self.writes.remove(from, wid, dp);
                    self.writes.add(s, wid, dp);
                }
                _ => {}
            }
        }
    }

    /// Takes `hashes` out of `tier` for one rank, unless `group` is one the rank said is not a
    /// prefix cache (a hybrid model's sliding window names the same blocks).
    fn remove_from_group(
        &mut self,
        (wid, dp): (u64, u32),
        hashes: &[u64],
        tier: Tier,
        group: u32,
        out: &mut Applied,
    ) {
        if self
            .ranks
            .get(&(wid, dp))
            .is_some_and(|r| r.other_groups.contains(&group))
        {
            *out.dropped.entry(DropReason::NonPrimaryGroup).or_default() += 1;
            return;
        }
        let rank = self.ranks.entry((wid, dp)).or_default();
        let mut unknown = 0;
        for &h in hashes {
            let a = rank.remove(wid, dp, h, tier);
            self.blocks_digest = self.blocks_digest.wrapping_add(a.digest);
            self.indexed_blocks = self.indexed_blocks.saturating_add_signed(a.gpu);
            match a.change {
                Change::Unknown => unknown += 1,
                Change::Disappeared { seq } if tier == Tier::Gpu => {
                    self.writes.remove(seq, wid, dp);
                }
                _ => {}
            }
        }
        if rank.blocks.is_empty() && rank.salts.is_empty() && rank.other_groups.is_empty() {
            self.ranks.remove(&(wid, dp));
        }
        if unknown > 0 {
            *out.dropped.entry(DropReason::RemoveUnknown).or_default() += unknown;
        }
        out.kv_events += 1;
    }

    fn clear_rank(&mut self, wid: u64, dp: u32) {
        if let Some(rank) = self.ranks.remove(&(wid, dp)) {
            self.blocks_digest = self.blocks_digest.wrapping_sub(rank.digest);
            self.indexed_blocks = self.indexed_blocks.saturating_sub(rank.gpu_blocks);
            for seq in rank.blocks.gpu_seqs() {
                self.writes.remove(seq, wid, dp);
            }
        }
    }

    /// Applies puts and deletes together after checking that `owner` may write every object
    /// they name and that the result is consistent; refuses all of them otherwise.
    fn config_change(
        &mut self,
        index: u64,
        puts: &[ConfigObject],
        deletes: &[ConfigKey],
        owner: Option<Owner>,
    ) -> Result<(), ApplyError> {
        if let Some(by) = owner {
            let keys = puts
                .iter()
                .map(|p| (&p.kind, &p.name))
                .chain(deletes.iter().map(|d| (&d.kind, &d.name)));
            for (kind, name) in keys {
                match self.owners.get(&(kind.clone(), name.clone())) {
                    Some(&o) if o != by => {
                        return Err(ApplyError::Owned {
                            kind: kind.clone(),
                            name: name.clone(),
                            owner: o,
                            by,
                        });
                    }
                    _ => {}
                }
            }
        }
        let invalid = |kind: &str, name: &str, reason: String| ApplyError::InvalidConfig {
            kind: kind.into(),
            name: name.into(),
            reason,
        };
        let unknown = |kind: &str, name: &str| {
            invalid(
                kind,
                name,
                format!(
                    "unknown config kind (known: {POOL_KIND}, {})",
                    Kind::ALL.map(Kind::as_str).join(", ")
                ),
            )
        };
        // Dry run: the catalog (config pools included) as it would be.
        let mut catalog = (*self.catalog).clone();
        let clash = |name: &str| {
            invalid(
                Kind::WorkerSet.as_str(),
                name,
                format!("a {POOL_KIND} of the same name exists (both would own one index)"),
            )
        };
        for d in deletes {
            match Kind::parse(&d.kind) {
                Some(Kind::WorkerSet) if catalog.config_pools.contains_key(&d.name) => {}
                Some(k) => {
                    catalog.remove(k, &d.name);
                }
                None if d.kind == POOL_KIND => {
                    catalog.remove_config_pool(&d.name);
                }
                None => return Err(unknown(&d.kind, &d.name)),
            }
        }
        let mut pool_puts = Vec::new();
        for p in puts {
            match Kind::parse(&p.kind) {
                Some(k) => {
                    let o = Object::from_json(k, &p.name, &p.value)
                        .map_err(|e| invalid(&p.kind, &p.name, e.to_string()))?;
                    if k == Kind::WorkerSet && catalog.config_pools.contains_key(&p.name) {
                        return Err(clash(&p.name));
                    }
                    catalog.insert(o);
                }
                None if p.kind == POOL_KIND => {
                    let cfg = PoolConfig::parse(&p.name, &p.value)?;
                    if catalog.worker_sets.contains_key(&p.name)
                        && !catalog.config_pools.contains_key(&p.name)
                    {
                        return Err(clash(&p.name));
                    }
                    catalog.put_config_pool(
                        &p.name,
                        cfg.block_size,
                        &cfg.models,
                        &cfg.lora_adapters,
                    );
                    pool_puts.push((p, cfg));
                }
                None => return Err(unknown(&p.kind, &p.name)),
            }
        }
        if let Some(problem) = catalog.problems().first() {
            return Err(invalid(
                problem.kind.as_str(),
                &problem.name,
                format!("{}: {}", problem.path, problem.message),
            ));
        }
        // Apply: it can no longer fail.
        let owners = Arc::make_mut(&mut self.owners);
        for d in deletes {
            owners.remove(&(d.kind.clone(), d.name.clone()));
        }
        if let Some(o) = owner {
            for p in puts {
                owners.insert((p.kind.clone(), p.name.clone()), o);
            }
        }
        for d in deletes {
            self.config_delete(&d.kind, &d.name);
        }
        for (p, cfg) in pool_puts {
            self.pool_put(&p.name, cfg);
        }
        for p in puts.iter().filter(|p| p.kind != POOL_KIND) {
            if let Some(ws) = catalog.worker_sets.get(&p.name)
                && p.kind == Kind::WorkerSet.as_str()
            {
                self.ensure_index(&p.name, worker_set_pool(ws));
                self.apply_static_endpoints(&p.name, ws);
            }
            self.config
                .insert((p.kind.clone(), p.name.clone()), p.value.clone());
        }
        self.catalog = Arc::new(catalog);
        self.config_index = index;
        self.parts.config = self.config_part();
        self.dirty.all = true;
        Ok(())
    }

    fn pool_put(&mut self, name: &str, cfg: PoolConfig) {
        self.config
            .insert((POOL_KIND.to_owned(), name.to_owned()), cfg.to_json());
        self.ensure_index(name, cfg);
    }

    /// Makes `name`'s index match `cfg` (a new block size starts an empty index).
    fn ensure_index(&mut self, name: &str, cfg: PoolConfig) {
        let replace_index = match self.pools.get(name) {
            Some(p) => p.config.block_size != cfg.block_size,
            None => true,
        };
        if replace_index {
            self.drop_pool_blocks(name);
        }
        let index_arc = match self.pools.remove(name) {
            Some(p) if !replace_index => p.index,
            _ => Arc::new(PoolIndex::new(cfg.block_size)),
        };
        self.pools.insert(
            name.to_owned(),
            Pool {
                config: cfg,
                index: index_arc,
                folded: 0,
            },
        );
    }

    fn config_delete(&mut self, kind: &str, name: &str) {
        if self
            .config
            .remove(&(kind.to_owned(), name.to_owned()))
            .is_none()
        {
            return;
        }
        if kind == POOL_KIND || kind == Kind::WorkerSet.as_str() {
            self.drop_pool_blocks(name);
            self.pools.remove(name);
            let parts = &mut self.parts;
            self.workers.retain(|(pool, n), w| {
                let keep = pool != name;
                if !keep {
                    parts.workers = parts.workers.wrapping_sub(worker_fact(pool, n, w));
                }
                keep
            });
        }
    }

    /// Forgets every block of every worker in `pool` (its index is about to be replaced).
    fn drop_pool_blocks(&mut self, pool: &str) {
        let ids: Vec<u64> = self
            .workers
            .iter()
            .filter(|((p, _), _)| p == pool)
            .map(|(_, w)| w.id)
            .collect();
        for wid in ids {
            let keys: Vec<(u64, u32)> = self
                .ranks
                .range((wid, 0)..=(wid, u32::MAX))
                .map(|(k, _)| *k)
                .collect();
            for k in keys {
                if let Some(rank) = self.ranks.remove(&k) {
                    self.blocks_digest = self.blocks_digest.wrapping_sub(rank.digest);
                    self.indexed_blocks = self.indexed_blocks.saturating_sub(rank.gpu_blocks);
                }
            }
        }
    }

    /// The digest of the whole state (see [`crate::digest`] for what it covers), computed
    /// from scratch: the reference the digest apply keeps up to date must equal.
    pub fn digest(&self) -> Digest {
        let indexes = self.pools.iter().fold(0u128, |sum, (name, pool)| {
            sum.wrapping_add(index_fact(name, pool.index.computed_content()))
        });
        self.digest_of(
            self.computed_blocks(),
            self.computed_parts(),
            Indexes::Summed(indexes),
        )
    }

    /// The digest from the parts apply keeps up to date (what readers see in the View), once
    /// [`Self::fold_indexes`] folded in the last entry's index writes.
    pub(crate) fn kept_digest(&self) -> Digest {
        self.digest_of(
            self.blocks_digest,
            self.parts,
            Indexes::Summed(self.indexes),
        )
    }

    /// The digest as snapshots of format 4 recorded it: without the prefix indexes' content.
    pub(crate) fn digest_without_indexes(&self) -> Digest {
        self.digest_of(self.computed_blocks(), self.computed_parts(), Indexes::Left)
    }

    /// The digest as snapshots of format 5 recorded it: each pool's name and index content in
    /// pool order.
    pub(crate) fn digest_with_indexes_in_order(&self) -> Digest {
        let ordered = |h: &mut Hasher| {
            h.u64(self.pools.len() as u64);
            for (name, pool) in &self.pools {
                h.str(name).u128(pool.index.computed_content());
            }
        };
        self.digest_of(
            self.computed_blocks(),
            self.computed_parts(),
            Indexes::Ordered(&ordered),
        )
    }

    fn digest_of(&self, blocks: u128, parts: DigestParts, indexes: Indexes<'_>) -> Digest {
        let mut h = Hasher::new();
        h.u128(blocks)
            .u64(u64::try_from(self.positions.len()).unwrap_or(u64::MAX));
        for (source, seq) in &self.positions {
            h.str(source.as_str()).u64(*seq);
        }
        h.u64(self.next_worker_id)
            .u128(parts.config)
            .u128(parts.workers)
            .u128(parts.quota);
        match indexes {
            Indexes::Left => {}
            Indexes::Ordered(walk) => walk(&mut h),
            Indexes::Summed(sum) => {
                h.u64(self.pools.len() as u64).u128(sum);
            }
        }
        h.finish()
    }

    /// Folds the index content of the pools `dirty` names (every pool's, when `dirty.all`) into
    /// the digest's index part. Apply has waited for its index writes: the contents are the
    /// entry's.
    fn fold_indexes(&mut self, dirty: &Dirty) {
        if dirty.all {
            self.indexes = 0;
            for (name, pool) in &mut self.pools {
                pool.folded = pool.index.content();
                self.indexes = self.indexes.wrapping_add(index_fact(name, pool.folded));
            }
            return;
        }
        for name in &dirty.pools {
            if let Some(pool) = self.pools.get_mut(name) {
                let content = pool.index.content();
                if content != pool.folded {
                    self.indexes = self
                        .indexes
                        .wrapping_sub(index_fact(name, pool.folded))
                        .wrapping_add(index_fact(name, content));
                    pool.folded = content;
                }
            }
        }
    }

    /// Every rank's block, salt and group facts, summed afresh.
    fn computed_blocks(&self) -> u128 {
        let mut sum = 0u128;
        for (&(worker, dp_rank), rank) in &self.ranks {
            for (hash, held) in rank.blocks.iter() {
                sum = sum.wrapping_add(crate::digest::block_fact(worker, dp_rank, hash, held));
            }
            for (&hash, salt) in &rank.salts {
                sum = sum.wrapping_add(crate::blocks::salt_fact(worker, dp_rank, hash, salt));
            }
            for &g in &rank.other_groups {
                sum = sum.wrapping_add(crate::blocks::group_fact(worker, dp_rank, g));
            }
        }
        sum
    }

    pub(crate) fn computed_parts(&self) -> DigestParts {
        DigestParts {
            config: self.config_part(),
            workers: self.workers.iter().fold(0u128, |sum, ((p, n), w)| {
                sum.wrapping_add(worker_fact(p, n, w))
            }),
            quota: quota_part(&self.quota),
        }
    }

    /// Every config object with its owner, in key order.
    fn config_part(&self) -> u128 {
        let mut h = Hasher::new();
        h.u64(self.config.len() as u64);
        // Owners are keyed as `config` is (a subset of its keys): walked beside it, in order.
        let mut owners = self.owners.iter().peekable();
        for (key, value) in &self.config {
            h.str(&key.0).str(&key.1).bytes(value);
            if let Some((_, o)) = owners.next_if(|(k, _)| *k == key) {
                h.str(o.as_str());
            }
        }
        h.finish().0
    }

    /// Publishes the current state to readers. Pools nothing changed keep their published view,
    /// and the map of views is the previous View's with only the changed pools replaced.
    pub(crate) fn publish(&mut self) {
        let dirty = std::mem::take(&mut self.dirty);
        self.fold_indexes(&dirty);
        let before = self.handle.load();
        let pools = if dirty.all {
            self.pools
                .iter()
                .map(|(name, pool)| {
                    let view = self.pool_view(name, pool, before.pools.get(name).map(|p| &**p));
                    (name.clone(), Arc::new(view))
                })
                .collect()
        } else {
            let mut pools = before.pools.clone();
            for name in &dirty.pools {
                match self.pools.get(name) {
                    Some(pool) => {
                        let view = self.pool_view(name, pool, before.pools.get(name).map(|p| &**p));
                        pools.insert(name.clone(), Arc::new(view));
                    }
                    None => {
                        pools.remove(name);
                    }
                }
            }
            pools
        };
        debug_assert_eq!(
            pools.len(),
            self.pools.len(),
            "a pool came or went without dirty.all"
        );
        self.handle.store(View {
            applied_index: self.applied_index,
            config_index: self.config_index,
            last_stream_seq: self.last_stream_seq(),
            positions: self.positions.clone(),
            digest: self.kept_digest(),
            indexed_blocks: self.indexed_blocks,
            pools,
            dropped: self.dropped.iter().map(|(r, n)| (r.as_str(), *n)).collect(),
            catalog: self.catalog.clone(),
            owners: self.owners.clone(),
            quota: self.quota.clone(),
        });
    }

    /// What readers see of pool `name`: its config, index and workers. A worker's name and
    /// address are shared with the `before` view's record of it when they are the same (readers
    /// may tell workers apart by the name's pointer while it lasts; see `kvplane-api`'s
    /// predictor).
    fn pool_view(&self, name: &str, pool: &Pool, before: Option<&PoolView>) -> PoolView {
        let mut old = before.map_or(&[][..], |b| &b.workers[..]).iter().peekable();
        let workers = self
            .workers
            .range((name.to_owned(), String::new())..)
            .take_while(|((p, _), _)| p == name)
            .map(|((p, n), w)| {
                // Both lists are sorted by name: the same worker's record, if any, is next.
                while old.next_if(|o| *o.name < **n).is_some() {}
                let same = old.next_if(|o| *o.name == **n);
                (p, n, w, same)
            })
            .map(|(p, n, w, same)| WorkerView {
                pool: p.clone(),
                name: same.map_or_else(|| n.as_str().into(), |o| o.name.clone()),
                id: w.id,
                up: w.routable(),
                streaming: w.up,
                found: w.discovered.as_ref().map(|d| d.found),
                address: match (same.and_then(|o| o.address.as_ref()), w.serving_address()) {
                    (Some(kept), Some(a)) if **kept == *a => Some(kept.clone()),
                    (_, a) => a.map(Into::into),
                },
                metrics: w.metrics,
                metrics_index: w.metrics_index,
                metrics_at_ms: w.metrics_at_ms,
                heard_ms: w.heard_ms,
                indexed_blocks: self
                    .ranks
                    .range((w.id, 0)..=(w.id, u32::MAX))
                    .map(|(_, r)| r.gpu_blocks)
                    .sum(),
            })
            .collect();
        PoolView {
            name: name.to_owned(),
            config: pool.config.clone(),
            index: pool.index.clone(),
            workers,
        }
    }
}

/// One pool's index in the digest's index part: its name and its index's content.
fn index_fact(name: &str, content: u128) -> u128 {
    let mut h = Hasher::new();
    h.str(name).u128(content);
    h.finish().0
}

/// How a digest covers the prefix indexes.
enum Indexes<'a> {
    /// Not at all (snapshot format 4).
    Left,
    /// Each pool's name and content, in pool order (format 5).
    Ordered(&'a dyn Fn(&mut Hasher)),
    /// The sum of the pools' [`index_fact`]s, and their number.
    Summed(u128),
}

/// The ledger's part of the digest.
fn quota_part(quota: &crate::Ledger) -> u128 {
    let mut h = Hasher::new();
    quota.hash(&mut h);
    h.finish().0
}
