//! The commands of the replicated log. Everything that changes the state is one of these.

use serde::{Deserialize, Serialize};

/// One log entry: its position, the proposer's clock, and what to do.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Entry {
    /// Log index, strictly increasing from 1.
    pub index: u64,
    /// Milliseconds since the Unix epoch on the proposer when it proposed the entry.
    /// The only clock the state machine ever reads.
    pub timestamp_ms: u64,
    pub command: Command,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Command {
    /// Does nothing (a new leader's first entry, for instance).
    Noop,
    /// Messages consumed from the ingest stream, in stream order.
    Ingest(IngestBatch),
    /// Creates or replaces one configuration object (`value` is its JSON) for `owner`.
    ConfigPut {
        kind: String,
        name: String,
        value: Vec<u8>,
        /// `None` in entries written before objects had owners: such a write claims nothing.
        #[serde(default)]
        owner: Option<crate::Owner>,
    },
    /// Removes one configuration object of `owner`.
    ConfigDelete {
        kind: String,
        name: String,
        #[serde(default)]
        owner: Option<crate::Owner>,
    },
    /// Puts and deletes applied together, or not at all: a policy change takes effect at one
    /// log index on every replica, and the resulting set of objects is always consistent.
    ConfigApply {
        puts: Vec<ConfigObject>,
        deletes: Vec<ConfigKey>,
        #[serde(default)]
        owner: Option<crate::Owner>,
    },
    /// Escrow grants asked for, and released, by one replica (see [`crate::Ledger`]).
    Quota(crate::QuotaBatch),
    /// Every worker that is up and was last heard from (any stream message of its) more than
    /// `lease_ms` before this entry's timestamp goes down, as if it had announced so: a
    /// stopped bridge cannot leave its worker routable. Proposed by the leader.
    ExpireLeases { lease_ms: u64 },
    /// Every endpoint Kubernetes reports now for a worker set that finds its engines there
    /// (its selector's pods, or its `InferencePool`'s). Proposed by the leader.
    Endpoints(crate::EndpointsUpdate),
    /// What the leader's health checks found of a worker set's static endpoints: those that
    /// stopped answering are not routable until they answer again. Proposed by the leader.
    EndpointHealth(crate::HealthUpdate),
    /// A replica's process stops in order, having settled what it acknowledged and released
    /// what it did not spend: its tickets settle nothing through the ledger any more
    /// ([`crate::Ledger::close`]).
    QuotaClose { replica: u64, incarnation: u64 },
    /// A replica left the cluster for good (its member was removed): what its process held is
    /// no one's, and the tickets of its requests give back what they did not use
    /// ([`crate::Ledger::retire`]). Proposed by the leader.
    QuotaRetire { replica: u64 },
}

impl Command {
    /// The one `ConfigApply` by `owner` that turns the catalog `current` into `desired`, with
    /// its numbers of puts and deletes; `None` when they are equal.
    pub fn config_change(
        current: &kvplane_policy::Catalog,
        desired: &kvplane_policy::Catalog,
        owner: Option<crate::Owner>,
    ) -> Option<(Self, usize, usize)> {
        let (puts, deletes) = current.diff(desired);
        if puts.is_empty() && deletes.is_empty() {
            return None;
        }
        let command = Self::ConfigApply {
            owner,
            puts: puts.iter().map(ConfigObject::policy).collect(),
            deletes: deletes
                .iter()
                .map(|(k, n)| ConfigKey {
                    kind: k.as_str().to_owned(),
                    name: n.clone(),
                })
                .collect(),
        };
        Some((command, puts.len(), deletes.len()))
    }

    /// Its name, for logs and traces.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Noop => "noop",
            Self::Ingest(_) => "ingest",
            Self::ConfigPut { .. } => "config_put",
            Self::ConfigDelete { .. } => "config_delete",
            Self::ConfigApply { .. } => "config_apply",
            Self::Quota(_) => "quota",
            Self::ExpireLeases { .. } => "expire_leases",
            Self::Endpoints(_) => "endpoints",
            Self::EndpointHealth(_) => "endpoint_health",
            Self::QuotaClose { .. } => "quota_close",
            Self::QuotaRetire { .. } => "quota_retire",
        }
    }
}

/// A configuration object: its kind (`pool`, or one of the policy kinds such as
/// `InferencePolicy`), name and JSON value.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConfigObject {
    pub kind: String,
    pub name: String,
    pub value: Vec<u8>,
}

impl ConfigObject {
    /// A policy object as the state stores it.
    pub fn policy(o: &kvplane_policy::Object) -> Self {
        Self {
            kind: o.kind().as_str().to_owned(),
            name: o.name.clone(),
            value: o.to_json(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConfigKey {
    pub kind: String,
    pub name: String,
}

/// Where ingested messages come from. Each source numbers its messages on its own and the
/// state keeps a position per source, so a second source (another stream, another engine
/// dialect, a remote cluster's stream) never shares a sequence space with the first. The
/// node's ingest stream is the default source (`""`: what entries from before sources hold).
#[derive(Debug, Clone, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Source(pub String);

impl Source {
    /// The node's ingest stream.
    pub fn stream() -> Self {
        Self::default()
    }

    pub fn named(name: impl Into<String>) -> Self {
        Self(name.into())
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.0.is_empty() {
            f.write_str("the ingest stream")
        } else {
            f.write_str(&self.0)
        }
    }
}

/// A run of consecutive messages of one source. `first_seq..=last_seq` covers every message
/// the proposer consumed, including those it rejected, so the source's position moves past them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct IngestBatch {
    /// Absent in entries from before sources: the ingest stream.
    #[serde(default)]
    pub source: Source,
    pub first_seq: u64,
    pub last_seq: u64,
    pub items: Vec<IngestItem>,
}

/// One accepted stream message, with the worker it came from (from its subject).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct IngestItem {
    pub seq: u64,
    pub pool: String,
    pub worker: String,
    pub payload: IngestPayload,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum IngestPayload {
    /// One vLLM KV-event batch, decoded.
    Kv(KvBatch),
    /// An engine metrics sample.
    Metrics(WorkerMetrics),
    /// The worker announced itself (with its serving address) or went away.
    Worker { up: bool, address: Option<String> },
}

/// A decoded vLLM KV-event batch (one engine scheduler step).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KvBatch {
    pub dp_rank: u32,
    pub events: Vec<KvEvent>,
}

/// Where a block lives. Only [`Tier::Gpu`] blocks are scored for prefix routing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Tier {
    /// GPU memory of this engine (`medium` GPU or nil, `locality` LOCAL or nil).
    Gpu,
    /// Host memory offload (`medium` CPU).
    Cpu,
    /// Disk or external storage offload (`medium` STORAGE).
    Storage,
    /// Held by another engine (`locality` REMOTE).
    Remote,
}

impl Tier {
    pub const ALL: [Tier; 4] = [Tier::Gpu, Tier::Cpu, Tier::Storage, Tier::Remote];

    pub fn slot(self) -> usize {
        self as usize
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum KvEvent {
    /// An engine's `BlockStored` as decoded, with its token ids. The leader proposes it as
    /// [`KvEvent::StoredBlocks`] ([`KvEvent::compact`]); entries written before compact entries
    /// hold this form, which applies as those builds applied it (its cache salt mixed into every
    /// block's hash, a continuation's taken from its parent, kept per block).
    Stored {
        /// vLLM's block hashes (reduced to 64 bits), one per block.
        block_hashes: Vec<u64>,
        parent_hash: Option<u64>,
        /// The tokens of all blocks, `block_size` per block (in a log entry: one binary).
        #[serde(with = "crate::token_bytes")]
        token_ids: Vec<u32>,
        block_size: u32,
        lora_name: Option<String>,
        /// vLLM's `cache_salt` of the request that stored the chain, when this event starts it
        /// (its first block's extra keys); a continuation inherits its parent's.
        cache_salt: Option<String>,
        tier: Tier,
    },
    Removed {
        block_hashes: Vec<u64>,
        tier: Tier,
    },
    /// A removal from KV-cache group `group` (vLLM's `group_idx`, named only when not 0):
    /// ignored when the rank said that group is not a prefix cache, a [`KvEvent::Removed`]
    /// otherwise.
    RemovedFromGroup {
        block_hashes: Vec<u64>,
        tier: Tier,
        group: u32,
    },
    /// The engine stored blocks of KV-cache group `group`, which is not full attention
    /// (sliding window, mamba...): those blocks are not indexed, and the rank's removals from
    /// that group are ignored from now on.
    OtherGroup {
        group: u32,
    },
    /// Every block of this worker rank is gone.
    Cleared,
    /// A `BlockStored` as the leader proposes it: hashed once, on the leader, so no member
    /// hashes token ids again and an entry carries eight bytes per block instead of the
    /// block's token ids.
    StoredBlocks {
        /// vLLM's block hashes (reduced to 64 bits), one per block.
        #[serde(with = "crate::hash_bytes")]
        block_hashes: Vec<u64>,
        parent_hash: Option<u64>,
        /// Each block's own hash: its tokens under the LoRA adapter that stored it (the prefix
        /// index's `LocalBlockHash`), one per block; empty on a tier that is not indexed.
        #[serde(with = "crate::hash_bytes")]
        locals: Vec<u64>,
        block_size: u32,
        /// vLLM's `cache_salt` of a chain's first event: mixed into the sequence hash of the
        /// chain's first block, which every later block chains over (a continuation needs
        /// none; one it names is not used).
        cache_salt: Option<String>,
        tier: Tier,
    },
}

impl KvEvent {
    /// The event as the leader proposes it: a [`KvEvent::Stored`] becomes
    /// [`KvEvent::StoredBlocks`], its blocks hashed here (each block's tokens under its LoRA
    /// adapter). A GPU store whose token ids are not whole blocks is left as it is: apply
    /// drops it as malformed, as it always has.
    pub fn compact(self) -> Self {
        match self {
            Self::Stored {
                block_hashes,
                parent_hash,
                token_ids,
                block_size,
                lora_name,
                cache_salt,
                tier,
            } if tier != Tier::Gpu
                || (block_size > 0
                    && token_ids.len() == block_hashes.len() * block_size as usize) =>
            {
                let locals = if tier == Tier::Gpu {
                    crate::index::block_keys(&token_ids, block_size, lora_name.as_deref())
                } else {
                    Vec::new()
                };
                Self::StoredBlocks {
                    block_hashes,
                    parent_hash,
                    locals,
                    block_size,
                    cache_salt,
                    tier,
                }
            }
            other => other,
        }
    }
}

impl KvBatch {
    /// The batch as the leader proposes it (see [`KvEvent::compact`]).
    pub fn compact(self) -> Self {
        Self {
            dp_rank: self.dp_rank,
            events: self.events.into_iter().map(KvEvent::compact).collect(),
        }
    }
}

/// An engine's load as last reported (vLLM's gauges).
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct WorkerMetrics {
    pub running: u32,
    pub waiting: u32,
    /// GPU KV-cache usage, 0..=1.
    pub kv_cache_usage: f64,
    /// Prefix-cache hit rate over the engine's lifetime, 0..=1.
    pub prefix_cache_hit_rate: f64,
    /// The engine's time-to-first-token histogram so far: sum (seconds) and count.
    pub ttft_sum_s: f64,
    pub ttft_count: u64,
}

impl Entry {
    /// Encodes the entry for a log (MessagePack).
    pub fn encode(&self) -> Vec<u8> {
        // Serializing these plain types into a Vec cannot fail.
        rmp_serde::to_vec(self).unwrap_or_default()
    }

    pub fn decode(bytes: &[u8]) -> Result<Self, rmp_serde::decode::Error> {
        rmp_serde::from_slice(bytes)
    }
}
