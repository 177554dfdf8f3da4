//! The Raft log and vote in one redb file.
//!
//! Tables: `log` (index -> MessagePack entry) and `meta` (`vote`, `committed`, `purged`).
//! Every mutation is one write transaction committed with redb's default
//! `Durability::Immediate`, so when a method returns (or an append's callback fires) the change
//! is on disk.

use std::fmt::Debug;
use std::io;
use std::ops::{Bound, RangeBounds};
use std::path::Path;
use std::sync::Arc;

use openraft::alias::{EntryOf, LogIdOf, VoteOf};
use openraft::storage::{IOFlushed, LogState, RaftLogStorage};
use openraft::{OptionalSend, RaftLogReader};
use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::TypeConfig;

const LOG: TableDefinition<u64, &[u8]> = TableDefinition::new("log");
const META: TableDefinition<&str, &[u8]> = TableDefinition::new("meta");
const VOTE: &str = "vote";
const COMMITTED: &str = "committed";
const PURGED: &str = "purged";

/// Why the log cannot be opened.
#[derive(Debug, thiserror::Error)]
pub enum LogStoreError {
    #[error("cannot open the raft log {path}: {reason}")]
    Open { path: String, reason: String },
}

/// The durable Raft log of one node. Cheap to clone (clones share the database).
#[derive(Debug, Clone)]
pub struct LogStore {
    db: Arc<Database>,
}

fn io_err(e: impl std::fmt::Display) -> io::Error {
    io::Error::other(e.to_string())
}

fn encode<T: Serialize>(v: &T) -> io::Result<Vec<u8>> {
    rmp_serde::to_vec(v).map_err(io_err)
}

fn decode<T: DeserializeOwned>(b: &[u8]) -> io::Result<T> {
    rmp_serde::from_slice(b).map_err(io_err)
}

impl LogStore {
    /// Opens (or creates) the log at `path`.
    pub fn open(path: &Path) -> Result<Self, LogStoreError> {
        let err = |e: &dyn std::fmt::Display| LogStoreError::Open {
            path: path.display().to_string(),
            reason: e.to_string(),
        };
        let db = Database::create(path).map_err(|e| err(&e))?;
        let txn = db.begin_write().map_err(|e| err(&e))?;
        txn.open_table(LOG).map_err(|e| err(&e))?;
        txn.open_table(META).map_err(|e| err(&e))?;
        txn.commit().map_err(|e| err(&e))?;
        Ok(Self { db: Arc::new(db) })
    }

    fn meta<T: DeserializeOwned>(&self, key: &str) -> io::Result<Option<T>> {
        let txn = self.db.begin_read().map_err(io_err)?;
        let table = txn.open_table(META).map_err(io_err)?;
        match table.get(key).map_err(io_err)? {
            Some(v) => decode(v.value()).map(Some),
            None => Ok(None),
        }
    }

    fn put_meta<T: Serialize>(&self, key: &str, v: &T) -> io::Result<()> {
        let bytes = encode(v)?;
        let txn = self.db.begin_write().map_err(io_err)?;
        {
            let mut table = txn.open_table(META).map_err(io_err)?;
            table.insert(key, bytes.as_slice()).map_err(io_err)?;
        }
        txn.commit().map_err(io_err)
    }

    fn last_entry(&self) -> io::Result<Option<EntryOf<TypeConfig>>> {
        let txn = self.db.begin_read().map_err(io_err)?;
        let table = txn.open_table(LOG).map_err(io_err)?;
        match table.last().map_err(io_err)? {
            Some((_, v)) => decode(v.value()).map(Some),
            None => Ok(None),
        }
    }
}

fn bounds<RB: RangeBounds<u64>>(range: &RB) -> (Bound<u64>, Bound<u64>) {
    (range.start_bound().cloned(), range.end_bound().cloned())
}

impl RaftLogReader<TypeConfig> for LogStore {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + OptionalSend>(
        &mut self,
        range: RB,
    ) -> Result<Vec<EntryOf<TypeConfig>>, io::Error> {
        let txn = self.db.begin_read().map_err(io_err)?;
        let table = txn.open_table(LOG).map_err(io_err)?;
        let mut out = Vec::new();
        for item in table.range::<u64>(bounds(&range)).map_err(io_err)? {
            let (_, v) = item.map_err(io_err)?;
            out.push(decode(v.value())?);
        }
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
        let last_log_id = match self.last_entry()? {
            Some(e) => Some(e.log_id),
            None => last_purged_log_id,
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
        self.put_meta(VOTE, vote)
    }

    async fn save_committed(
        &mut self,
        committed: Option<LogIdOf<TypeConfig>>,
    ) -> Result<(), io::Error> {
        self.put_meta(COMMITTED, &committed)
    }

    async fn read_committed(&mut self) -> Result<Option<LogIdOf<TypeConfig>>, io::Error> {
        Ok(self
            .meta::<Option<LogIdOf<TypeConfig>>>(COMMITTED)?
            .flatten())
    }

    async fn append<I>(
        &mut self,
        entries: I,
        callback: IOFlushed<TypeConfig>,
    ) -> Result<(), io::Error>
    where
        I: IntoIterator<Item = EntryOf<TypeConfig>> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        let result = (|| {
            let txn = self.db.begin_write().map_err(io_err)?;
            {
                let mut table = txn.open_table(LOG).map_err(io_err)?;
                for e in entries {
                    let bytes = encode(&e)?;
                    table
                        .insert(e.log_id.index, bytes.as_slice())
                        .map_err(io_err)?;
                }
            }
            txn.commit().map_err(io_err)
        })();
        // Durable (the commit fsynced) before the callback says so.
        let reply = result
            .as_ref()
            .map(|_| ())
            .map_err(|e| io::Error::new(e.kind(), e.to_string()));
        callback.io_completed(reply);
        result
    }

    async fn truncate_after(
        &mut self,
        last_log_id: Option<LogIdOf<TypeConfig>>,
    ) -> Result<(), io::Error> {
        let from = last_log_id.map_or(0, |l| l.index + 1);
        let txn = self.db.begin_write().map_err(io_err)?;
        {
            let mut table = txn.open_table(LOG).map_err(io_err)?;
            table
                .retain_in::<u64, _>(from.., |_, _| false)
                .map_err(io_err)?;
        }
        txn.commit().map_err(io_err)
    }

    async fn purge(&mut self, log_id: LogIdOf<TypeConfig>) -> Result<(), io::Error> {
        let bytes = encode(&log_id)?;
        let txn = self.db.begin_write().map_err(io_err)?;
        {
            let mut meta = txn.open_table(META).map_err(io_err)?;
            meta.insert(PURGED, bytes.as_slice()).map_err(io_err)?;
            let mut table = txn.open_table(LOG).map_err(io_err)?;
            table
                .retain_in::<u64, _>(..=log_id.index, |_, _| false)
                .map_err(io_err)?;
        }
        txn.commit().map_err(io_err)
    }
}
