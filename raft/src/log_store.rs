//! The Raft log and vote in one redb file.
//!
//! Tables: `log` (index -> MessagePack entry) and `meta` (`vote`, `committed`, `purged`).
//! Every change goes through the log's writer thread ([`crate::log_writer`]), which commits
//! whatever has queued up in one transaction with redb's `Durability::Immediate` (fsync), but
//! for a transaction that only moves the committed log id.
//! An append returns as soon as its entries are readable from memory; openraft is told they
//! are durable (its `IOFlushed` callback) only after their transaction committed. The vote,
//! truncation and purge return only once durable; the committed log id is not waited for (it
//! reads back at once, goes with the next transaction, and is fsynced within 50 ms). After a
//! failed write every later change, and every read, is refused.

use std::fmt::Debug;
use std::io;
use std::ops::{Bound, RangeBounds};
use std::path::Path;
use std::sync::{Arc, Mutex};

use openraft::alias::{EntryOf, LogIdOf, VoteOf};
use openraft::storage::{IOFlushed, LogState, RaftLogStorage};
use openraft::{OptionalSend, RaftLogReader};
use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};
use serde::de::DeserializeOwned;
use tokio::sync::oneshot;

use crate::TypeConfig;
use crate::log_writer::{Op, Tail, Writer, WriterCounts, lock, lowest, stage};

pub(crate) const LOG: TableDefinition<u64, &[u8]> = TableDefinition::new("log");
pub(crate) const META: TableDefinition<&str, &[u8]> = TableDefinition::new("meta");
pub(crate) const VOTE: &str = "vote";
pub(crate) const COMMITTED: &str = "committed";
pub(crate) const PURGED: &str = "purged";

/// Why the log cannot be opened.
#[derive(Debug, thiserror::Error)]
pub enum LogStoreError {
    #[error("cannot open the raft log {path}: {reason}")]
    Open { path: String, reason: String },
}

/// The durable Raft log of one node. Cheap to clone (clones share the database, the tail in
/// memory and the writer thread; the file closes when the last clone is dropped).
#[derive(Debug, Clone)]
pub struct LogStore {
    db: Arc<Database>,
    tail: Arc<Mutex<Tail>>,
    writer: Arc<Writer>,
}

fn io_err(e: impl std::fmt::Display) -> io::Error {
    io::Error::other(e.to_string())
}

fn decode<T: DeserializeOwned>(b: &[u8]) -> io::Result<T> {
    rmp_serde::from_slice(b).map_err(io_err)
}

/// redb's page cache for the log. Its default (1 GiB) filled with pages of entries written once
/// and, but for a lagging follower's catch-up, never read again (the writer's tail serves the
/// newest from memory): `kvplane bench ingest` measured about 700 B of resident memory per
/// indexed block with it, most of it this cache; 64 MiB, about 35 B more than 16 MiB, with no
/// difference in what the replicas kept up with (a catch-up's reads still meet the operating
/// system's page cache).
const PAGE_CACHE_BYTES: usize = 16 << 20;

impl LogStore {
    /// Opens (or creates) the log at `path` and starts its writer thread.
    pub fn open(path: &Path) -> Result<Self, LogStoreError> {
        let err = |e: &dyn std::fmt::Display| LogStoreError::Open {
            path: path.display().to_string(),
            reason: e.to_string(),
        };
        let db = redb::Builder::new()
            .set_cache_size(PAGE_CACHE_BYTES)
            .create(path)
            .map_err(|e| err(&e))?;
        let txn = db.begin_write().map_err(|e| err(&e))?;
        txn.open_table(LOG).map_err(|e| err(&e))?;
        txn.open_table(META).map_err(|e| err(&e))?;
        txn.commit().map_err(|e| err(&e))?;
        let db = Arc::new(db);
        let tail = Arc::new(Mutex::new(Tail::default()));
        let writer = Writer::start(db.clone(), tail.clone()).map_err(|e| err(&e))?;
        Ok(Self {
            db,
            tail,
            writer: Arc::new(writer),
        })
    }

    /// Keeps the writer from taking its next round while the guard lives.
    #[cfg(test)]
    pub(crate) fn pause_writer(&self) -> std::sync::MutexGuard<'_, ()> {
        self.writer.pause()
    }

    /// Makes the writer's rounds fail (or not) as a disk would.
    #[cfg(test)]
    pub(crate) fn fail_writes(&self, fail: bool) {
        self.writer.fail_writes(fail);
    }

    /// What the writer thread has done so far: transactions fsynced and entries written.
    pub fn counts(&self) -> WriterCounts {
        self.writer.counts().clone()
    }

    fn meta<T: DeserializeOwned>(&self, key: &str) -> io::Result<Option<T>> {
        let txn = self.db.begin_read().map_err(io_err)?;
        let table = txn.open_table(META).map_err(io_err)?;
        match table.get(key).map_err(io_err)? {
            Some(v) => decode(v.value()).map(Some),
            None => Ok(None),
        }
    }

    fn last_written(&self) -> io::Result<Option<LogIdOf<TypeConfig>>> {
        let txn = self.db.begin_read().map_err(io_err)?;
        let table = txn.open_table(LOG).map_err(io_err)?;
        match table.last().map_err(io_err)? {
            Some((_, v)) => decode::<EntryOf<TypeConfig>>(v.value()).map(|e| Some(e.log_id)),
            None => Ok(None),
        }
    }

    /// Sends `op` to the writer and waits until it is durable.
    async fn durably(
        &self,
        op: impl FnOnce(oneshot::Sender<io::Result<()>>) -> Op,
    ) -> io::Result<()> {
        let (tx, rx) = oneshot::channel();
        self.writer.send(op(tx))?;
        rx.await
            .map_err(|_| io::Error::other("the raft log's writer stopped"))?
    }
}

fn bounds<RB: RangeBounds<u64>>(range: &RB) -> (Bound<u64>, Bound<u64>) {
    (range.start_bound().cloned(), range.end_bound().cloned())
}

impl RaftLogReader<TypeConfig> for LogStore {
    /// Entries below the tail from the file, then the tail's from memory (a range the tail
    /// holds from its start, as apply's and replication's usually are, does not open the
    /// file). The tail is copied and the file's read transaction begun under the tail's lock,
    /// and the writer drops entries from the tail only after their transaction committed:
    /// every entry is in one or the other. After a failed write nothing is read.
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + OptionalSend>(
        &mut self,
        range: RB,
    ) -> Result<Vec<EntryOf<TypeConfig>>, io::Error> {
        let (start, end) = bounds(&range);
        let (tail, txn) = {
            let t = lock(&self.tail);
            t.readable()?;
            let tail = t.range((start, end));
            let from_start = tail
                .first()
                .is_some_and(|e| Some(e.log_id.index) == lowest(start));
            let txn = if from_start {
                None
            } else {
                Some(self.db.begin_read().map_err(io_err)?)
            };
            (tail, txn)
        };
        let mut out = Vec::new();
        if let Some(txn) = txn {
            let end = match tail.first() {
                Some(first) => Bound::Excluded(first.log_id.index),
                None => end,
            };
            let table = txn.open_table(LOG).map_err(io_err)?;
            for item in table.range::<u64>((start, end)).map_err(io_err)? {
                let (_, v) = item.map_err(io_err)?;
                out.push(decode(v.value())?);
            }
        }
        out.extend(tail.iter().map(|e| e.as_ref().clone()));
        Ok(out)
    }

    async fn read_vote(&mut self) -> Result<Option<VoteOf<TypeConfig>>, io::Error> {
        self.meta(VOTE)
    }
}

impl RaftLogStorage<TypeConfig> for LogStore {
    type LogReader = Self;

    async fn get_log_state(&mut self) -> Result<LogState<TypeConfig>, io::Error> {
        let last_purged_log_id: Option<LogIdOf<TypeConfig>> = self.meta(PURGED)?;
        let newest = lock(&self.tail).last();
        let last_log_id = match newest {
            Some(id) => Some(id),
            None => self.last_written()?.or(last_purged_log_id),
        };
        Ok(LogState {
            last_purged_log_id,
            last_log_id,
        })
    }

    async fn get_log_reader(&mut self) -> Self::LogReader {
        self.clone()
    }

    async fn save_vote(&mut self, vote: &VoteOf<TypeConfig>) -> Result<(), io::Error> {
        let vote = *vote;
        self.durably(|done| Op::Vote(vote, done)).await
    }

    /// Not waited for: it is written with the next transaction and fsynced within 50 ms
    /// (openraft re-learns a committed id that a crash lost).
    async fn save_committed(
        &mut self,
        committed: Option<LogIdOf<TypeConfig>>,
    ) -> Result<(), io::Error> {
        lock(&self.tail).commit(committed)?;
        self.writer.send(Op::Committed(committed))
    }

    /// The last one saved, written yet or not.
    async fn read_committed(&mut self) -> Result<Option<LogIdOf<TypeConfig>>, io::Error> {
        if let Some(c) = lock(&self.tail).committed() {
            return Ok(c);
        }
        Ok(self
            .meta::<Option<LogIdOf<TypeConfig>>>(COMMITTED)?
            .flatten())
    }

    /// Returns once the entries are readable; `callback` is told when they are on disk.
    async fn append<I>(
        &mut self,
        entries: I,
        callback: IOFlushed<TypeConfig>,
    ) -> Result<(), io::Error>
    where
        I: IntoIterator<Item = EntryOf<TypeConfig>> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        let entries = stage(&self.tail, entries)?;
        self.writer.send(Op::Append {
            entries,
            flushed: callback,
        })
    }

    async fn truncate_after(
        &mut self,
        last_log_id: Option<LogIdOf<TypeConfig>>,
    ) -> Result<(), io::Error> {
        let from = last_log_id.map_or(0, |l| l.index + 1);
        self.durably(|done| Op::Truncate(from, done)).await
    }

    async fn purge(&mut self, log_id: LogIdOf<TypeConfig>) -> Result<(), io::Error> {
        self.durably(|done| Op::Purge(log_id, done)).await
    }
}
