//! Snapshot out, restore in.
//!
//! Layout: `b"KVPSNAP\0"`, a little-endian u32 format version, the MessagePack payload, and a
//! little-endian xxh3-64 checksum of everything before it. The payload holds every rank's
//! blocks with their tiers and sequence hashes (sorted, so equal states give equal bytes), the
//! workers, the config, the quota ledger and the config objects' owners; the prefix indexes are
//! rebuilt from the ranks' GPU blocks. A restored state is checked against the digest the
//! snapshot recorded, which covers the rebuilt indexes' content: as a sum of each pool's part
//! (format 6), or walking every pool in order (format 5); format 4's digest did not cover them.
//! A snapshot of an older format is checked against its own format's digest.

use std::collections::BTreeMap;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::xxh3_64;

use crate::blocks::{Held, RankBlocks};
use crate::config::{POOL_KIND, PoolConfig};
use crate::machine::{DropReason, Pool, Worker};
use crate::{PoolIndex, SnapshotError, StateMachine};

const MAGIC: &[u8; 8] = b"KVPSNAP\0";
const VERSION: u32 = 6;

/// The format whose digest walked every pool's index content in pool order (same payload).
const VERSION_WITH_INDEXES_IN_ORDER: u32 = 5;

/// The format before the digest covered the prefix indexes (same payload).
const VERSION_WITHOUT_INDEX_DIGEST: u32 = 4;

#[derive(Serialize, Deserialize)]
struct Payload {
    applied_index: u64,
    config_index: u64,
    /// The ingest stream's position.
    last_seq: u64,
    next_worker_id: u64,
    config: Vec<(String, String, Vec<u8>)>,
    workers: Vec<(String, String, Worker)>,
    ranks: Vec<RankSnap>,
    dropped: Vec<(DropReason, u64)>,
    quota: crate::Ledger,
    digest: u128,
    /// Config objects' owners (absent in snapshots from before owners).
    #[serde(default)]
    owners: Vec<(String, String, crate::Owner)>,
    /// The positions of named sources (absent in snapshots from before sources).
    #[serde(default)]
    sources: Vec<(crate::Source, u64)>,
}

#[derive(Serialize, Deserialize)]
struct RankSnap {
    worker: u64,
    dp_rank: u32,
    blocks: Vec<(u64, Held)>,
    salts: Vec<(u64, String)>,
    #[serde(default)]
    other_groups: Vec<u32>,
}

/// A state's copy taken for a snapshot: owned, so it is encoded (and written) while the state
/// applies the next entries.
pub struct Captured {
    payload: Payload,
}

impl Captured {
    /// The applied index the copy was taken at.
    pub fn applied_index(&self) -> u64 {
        self.payload.applied_index
    }

    /// The snapshot bytes: magic, version, MessagePack payload, checksum.
    pub fn encode(self) -> Result<Vec<u8>, SnapshotError> {
        self.encode_as(VERSION)
    }

    fn encode_as(self, version: u32) -> Result<Vec<u8>, SnapshotError> {
        let body = rmp_serde::to_vec(&self.payload)?;
        let mut out = Vec::with_capacity(body.len() + 20);
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&version.to_le_bytes());
        out.extend_from_slice(&body);
        let sum = xxh3_64(&out);
        out.extend_from_slice(&sum.to_le_bytes());
        Ok(out)
    }
}

impl StateMachine {
    /// Serializes the whole state.
    pub fn snapshot(&self) -> Result<Vec<u8>, SnapshotError> {
        self.capture()?.encode()
    }

    /// Copies the whole state for [`Captured::encode`].
    pub fn capture(&self) -> Result<Captured, SnapshotError> {
        let ranks = self
            .ranks
            .iter()
            .map(|(&(worker, dp_rank), r)| {
                let mut blocks: Vec<(u64, Held)> = r.blocks.iter().collect();
                blocks.sort_unstable_by_key(|(h, _)| *h);
                RankSnap {
                    worker,
                    dp_rank,
                    blocks,
                    salts: r.salts.iter().map(|(h, s)| (*h, s.to_string())).collect(),
                    other_groups: r.other_groups.iter().copied().collect(),
                }
            })
            .collect();
        let payload = Payload {
            applied_index: self.applied_index,
            config_index: self.config_index,
            last_seq: self.last_stream_seq(),
            next_worker_id: self.next_worker_id,
            config: self
                .config
                .iter()
                .map(|((k, n), v)| (k.clone(), n.clone(), v.clone()))
                .collect(),
            workers: self
                .workers
                .iter()
                .map(|((p, n), w)| (p.clone(), n.clone(), w.clone()))
                .collect(),
            ranks,
            dropped: self.dropped.iter().map(|(r, n)| (*r, *n)).collect(),
            quota: (*self.quota).clone(),
            digest: self.digest().0,
            owners: self
                .owners
                .iter()
                .map(|((k, n), o)| (k.clone(), n.clone(), *o))
                .collect(),
            sources: self
                .positions
                .iter()
                .filter(|(s, _)| **s != crate::Source::stream())
                .map(|(s, p)| (s.clone(), *p))
                .collect(),
        };
        Ok(Captured { payload })
    }

    /// A snapshot as format 4 wrote it (its digest without the indexes' content).
    /// A snapshot whose first rank's first block `damage` changed (what no apply leaves).
    #[cfg(test)]
    pub(crate) fn snapshot_with_a_block(
        &self,
        damage: impl FnOnce(&mut Held),
    ) -> Result<Vec<u8>, SnapshotError> {
        let mut c = self.capture()?;
        if let Some((_, held)) = c
            .payload
            .ranks
            .first_mut()
            .and_then(|r| r.blocks.first_mut())
        {
            damage(held);
        }
        c.encode()
    }

    #[cfg(test)]
    pub(crate) fn snapshot_in_format_4(&self) -> Result<Vec<u8>, SnapshotError> {
        let mut c = self.capture()?;
        c.payload.digest = self.digest_without_indexes().0;
        c.encode_as(VERSION_WITHOUT_INDEX_DIGEST)
    }

    /// A snapshot as format 5 wrote it (its digest walking the indexes in pool order).
    #[cfg(test)]
    pub(crate) fn snapshot_in_format_5(&self) -> Result<Vec<u8>, SnapshotError> {
        let mut c = self.capture()?;
        c.payload.digest = self.digest_with_indexes_in_order().0;
        c.encode_as(VERSION_WITH_INDEXES_IN_ORDER)
    }

    /// Rebuilds a state from [`StateMachine::snapshot`] bytes.
    pub fn restore(bytes: &[u8]) -> Result<Self, SnapshotError> {
        if bytes.len() < 20 || &bytes[..8] != MAGIC {
            return Err(SnapshotError::BadMagic);
        }
        let (head, tail) = bytes.split_at(bytes.len() - 8);
        let sum = u64::from_le_bytes(tail.try_into().map_err(|_| SnapshotError::Checksum)?);
        if xxh3_64(head) != sum {
            return Err(SnapshotError::Checksum);
        }
        let version = u32::from_le_bytes(
            head[8..12]
                .try_into()
                .map_err(|_| SnapshotError::BadMagic)?,
        );
        if ![
            VERSION,
            VERSION_WITH_INDEXES_IN_ORDER,
            VERSION_WITHOUT_INDEX_DIGEST,
        ]
        .contains(&version)
        {
            return Err(SnapshotError::UnsupportedVersion(version));
        }
        let p: Payload =
            rmp_serde::from_slice(&head[12..]).map_err(|e| SnapshotError::Decode(e.to_string()))?;

        let mut sm = StateMachine::new();
        sm.applied_index = p.applied_index;
        sm.config_index = p.config_index;
        if p.last_seq > 0 {
            sm.positions.insert(crate::Source::stream(), p.last_seq);
        }
        sm.positions.extend(p.sources);
        sm.next_worker_id = p.next_worker_id;
        let mut catalog = kvplane_policy::Catalog::default();
        for (kind, name, value) in p.config {
            let policy_kind = kvplane_policy::Kind::parse(&kind);
            let mut pool = None;
            if let Some(k) = policy_kind {
                let o = kvplane_policy::Object::from_json(k, &name, &value)
                    .map_err(|e| SnapshotError::Decode(e.to_string()))?;
                if let kvplane_policy::Spec::WorkerSet(ws) = &o.spec {
                    pool = Some(crate::config::worker_set_pool(ws));
                }
                catalog.insert(o);
            } else if kind == POOL_KIND {
                let cfg = PoolConfig::parse(&name, &value)
                    .map_err(|e| SnapshotError::Decode(e.to_string()))?;
                catalog.put_config_pool(&name, cfg.block_size, &cfg.models, &cfg.lora_adapters);
                pool = Some(cfg);
            }
            if let Some(cfg) = pool {
                sm.pools.insert(
                    name.clone(),
                    Pool {
                        index: Arc::new(PoolIndex::new(cfg.block_size)),
                        config: cfg,
                        folded: 0,
                    },
                );
            }
            sm.config.insert((kind, name), value);
        }
        sm.catalog = Arc::new(catalog);
        sm.owners = Arc::new(p.owners.into_iter().map(|(k, n, o)| ((k, n), o)).collect());
        sm.workers = p.workers.into_iter().map(|(p, n, w)| ((p, n), w)).collect();
        for r in p.ranks {
            let mut rank = RankBlocks::default();
            rank.blocks.reserve(r.blocks.len());
            for (h, held) in r.blocks {
                // What no apply leaves: a block in no tier, or a sequence hash off the GPU.
                if held.tiers == 0 || (!held.has(crate::Tier::Gpu) && held.seq != 0) {
                    return Err(SnapshotError::BadBlock {
                        worker: r.worker,
                        dp_rank: r.dp_rank,
                        hash: h,
                    });
                }
                let fact = crate::digest::block_fact(r.worker, r.dp_rank, h, held);
                rank.digest = rank.digest.wrapping_add(fact);
                if held.has(crate::Tier::Gpu) {
                    rank.gpu_blocks += 1;
                }
                rank.blocks.set(h, held);
            }
            for (h, salt) in r.salts {
                rank.set_salt(r.worker, r.dp_rank, h, salt.into());
            }
            for g in r.other_groups {
                rank.other_group(r.worker, r.dp_rank, g);
            }
            sm.blocks_digest = sm.blocks_digest.wrapping_add(rank.digest);
            sm.indexed_blocks += rank.gpu_blocks;
            sm.ranks.insert((r.worker, r.dp_rank), rank);
        }
        // The prefix indexes: every GPU block under its sequence hash, in its worker's pool.
        let pool_of: BTreeMap<u64, &str> = sm
            .workers
            .iter()
            .map(|((p, _), w)| (w.id, p.as_str()))
            .collect();
        for (&(worker, dp_rank), rank) in &sm.ranks {
            let index = pool_of
                .get(&worker)
                .and_then(|p| sm.pools.get(*p))
                .map(|p| p.index.clone())
                .ok_or(SnapshotError::OrphanBlocks { worker, dp_rank })?;
            let seqs: Vec<u64> = rank.blocks.gpu_seqs().collect();
            let mut writes = crate::index::Writes::default();
            for seq in seqs {
                writes.add(seq, worker, dp_rank);
            }
            index.write(&mut writes);
        }
        sm.dropped = p.dropped.into_iter().collect();
        sm.quota = Arc::new(p.quota);
        sm.parts = sm.computed_parts();
        sm.dirty.all = true;
        let got = match version {
            VERSION => sm.digest(),
            VERSION_WITH_INDEXES_IN_ORDER => sm.digest_with_indexes_in_order(),
            _ => sm.digest_without_indexes(),
        };
        if got.0 != p.digest {
            return Err(SnapshotError::DigestMismatch {
                want: crate::Digest(p.digest).to_string(),
                got: got.to_string(),
            });
        }
        sm.publish();
        Ok(sm)
    }
}
