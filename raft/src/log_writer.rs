//! The log's writer thread: every change to the log file goes through it, in the order the
//! member asked for them. What arrives while one write transaction is being committed and
//! fsynced goes into the next one (group commit), so appends from the Raft core never wait
//! on the disk and many appends share one fsync.
//!
//! An append's entries go into [`Tail`] (readable by the log's readers) before the writer
//! takes them, and stay there after their transaction committed (then its `IOFlushed`
//! callback is called) until newer ones push them out: apply and replication read the newest
//! entries, and find them there instead of decoding them from the file.

use std::collections::BTreeMap;
use std::io;
use std::sync::mpsc::{Receiver, Sender};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;

use openraft::alias::{EntryOf, LogIdOf, VoteOf};
use openraft::storage::IOFlushed;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::registry::Registry;
use redb::{Database, Durability, WriteTransaction};
use serde::Serialize;
use tokio::sync::oneshot;

use crate::TypeConfig;
use crate::log_store::{COMMITTED, LOG, META, PURGED, VOTE};

/// Most operations one transaction takes; the rest wait for the next.
const MAX_OPS_PER_COMMIT: usize = 1024;

/// Written entries the tail keeps, at most, by count and by encoded size.
const KEEP_WRITTEN: usize = 4096;
const KEEP_WRITTEN_BYTES: usize = 64 << 20;

pub(crate) type Entry = Arc<EntryOf<TypeConfig>>;

/// The log's newest entries in memory, by index: every entry handed to the writer and not
/// yet committed, and below them the last ones written (their encoded size kept), up to
/// [`KEEP_WRITTEN`] or [`KEEP_WRITTEN_BYTES`]. Contiguous: appends are, a truncation cuts
/// the top off and a purge or trim the bottom, and entries are written lowest first.
#[derive(Debug, Default)]
pub(crate) struct Tail {
    entries: BTreeMap<u64, (Entry, Option<usize>)>,
    written: usize,
    written_bytes: usize,
}

impl Tail {
    /// Entries of `range`, in order.
    pub(crate) fn range(&self, range: (std::ops::Bound<u64>, std::ops::Bound<u64>)) -> Vec<Entry> {
        self.entries
            .range(range)
            .map(|(_, (e, _))| e.clone())
            .collect()
    }

    /// The newest entry's log id.
    pub(crate) fn last(&self) -> Option<LogIdOf<TypeConfig>> {
        self.entries.last_key_value().map(|(_, (e, _))| e.log_id)
    }

    fn stage(&mut self, e: &Entry) {
        if let Some((_, Some(size))) = self.entries.insert(e.log_id.index, (e.clone(), None)) {
            self.forget_written(size);
        }
    }

    fn forget_written(&mut self, size: usize) {
        self.written -= 1;
        self.written_bytes -= size;
    }

    /// Marks this very entry written (a truncation may have replaced it).
    fn mark_written(&mut self, e: &Entry, size: usize) {
        if let Some((kept, at @ None)) = self.entries.get_mut(&e.log_id.index)
            && Arc::ptr_eq(kept, e)
        {
            *at = Some(size);
            self.written += 1;
            self.written_bytes += size;
        }
    }

    fn remove(&mut self, index: u64) {
        if let Some((_, Some(size))) = self.entries.remove(&index) {
            self.forget_written(size);
        }
    }

    fn truncate(&mut self, from: u64) {
        let cut: Vec<u64> = self.entries.range(from..).map(|(i, _)| *i).collect();
        for i in cut {
            self.remove(i);
        }
    }

    fn purge(&mut self, upto: u64) {
        while let Some((&i, _)) = self.entries.first_key_value()
            && i <= upto
        {
            self.remove(i);
        }
    }

    /// Drops the oldest written entries beyond the bounds.
    fn trim(&mut self) {
        while self.written > KEEP_WRITTEN || self.written_bytes > KEEP_WRITTEN_BYTES {
            match self.entries.first_key_value() {
                Some((&i, (_, Some(_)))) => self.remove(i),
                _ => break,
            }
        }
    }
}

/// One change to the log file.
pub(crate) enum Op {
    /// Entries already in the [`Tail`]; `flushed` is told when they are on disk.
    Append {
        entries: Vec<Entry>,
        flushed: IOFlushed<TypeConfig>,
    },
    /// The committed log id: written with the next transaction, nobody waits for it.
    Committed(Option<LogIdOf<TypeConfig>>),
    Vote(VoteOf<TypeConfig>, oneshot::Sender<io::Result<()>>),
    /// Removes every entry from this index on.
    Truncate(u64, oneshot::Sender<io::Result<()>>),
    /// Removes every entry up to this log id's index, and records it as purged.
    Purge(LogIdOf<TypeConfig>, oneshot::Sender<io::Result<()>>),
}

impl Op {
    /// Whether the transaction holding it must be durable before anyone is answered.
    fn needs_fsync(&self) -> bool {
        !matches!(self, Op::Committed(_))
    }

    fn answer(self, result: &Result<(), (io::ErrorKind, String)>) {
        let reply = || {
            result
                .clone()
                .map_err(|(kind, msg)| io::Error::new(kind, msg))
        };
        match self {
            Op::Append { flushed, .. } => flushed.io_completed(reply()),
            Op::Committed(_) => {}
            Op::Vote(_, done) | Op::Truncate(_, done) | Op::Purge(_, done) => {
                let _ = done.send(reply());
            }
        }
    }
}

/// Transactions and entries the writer committed (`/metrics`, the benchmark): entries per
/// fsync is how well appends share them.
#[derive(Debug, Clone, Default)]
pub struct WriterCounts {
    fsyncs: Counter,
    entries: Counter,
}

impl WriterCounts {
    pub fn register(&self, r: &mut Registry) {
        r.register(
            "kvplane_raft_log_fsyncs",
            "Write transactions of the raft log committed with an fsync",
            self.fsyncs.clone(),
        );
        r.register(
            "kvplane_raft_log_entries_written",
            "Entries written to the raft log",
            self.entries.clone(),
        );
    }

    /// Transactions fsynced so far.
    pub fn fsyncs(&self) -> u64 {
        self.fsyncs.get()
    }

    /// Entries written so far.
    pub fn entries(&self) -> u64 {
        self.entries.get()
    }
}

/// The writer thread and the way to it; the thread stops (after what it was given) and is
/// joined when this is dropped, so the log file is closed once the last handle is gone.
#[derive(Debug)]
pub(crate) struct Writer {
    tx: Option<Sender<Op>>,
    thread: Option<JoinHandle<()>>,
    pub(crate) counts: WriterCounts,
}

impl Writer {
    pub(crate) fn start(db: Arc<Database>, tail: Arc<Mutex<Tail>>) -> io::Result<Self> {
        let (tx, rx) = std::sync::mpsc::channel();
        let counts = WriterCounts::default();
        let kept = counts.clone();
        let thread = std::thread::Builder::new()
            .name("raft-log".into())
            .spawn(move || run(&db, &tail, &rx, &kept))?;
        Ok(Self {
            tx: Some(tx),
            thread: Some(thread),
            counts,
        })
    }

    pub(crate) fn send(&self, op: Op) -> io::Result<()> {
        self.tx
            .as_ref()
            .and_then(|tx| tx.send(op).ok())
            .ok_or_else(|| io::Error::other("the raft log's writer stopped"))
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        self.tx = None;
        if let Some(t) = self.thread.take()
            && t.join().is_err()
        {
            tracing::error!("the raft log's writer thread panicked");
        }
    }
}

pub(crate) fn lock(tail: &Mutex<Tail>) -> MutexGuard<'_, Tail> {
    tail.lock().unwrap_or_else(|p| p.into_inner())
}

/// Adds entries to the tail; returns them as the writer takes them.
pub(crate) fn stage(
    tail: &Mutex<Tail>,
    entries: impl IntoIterator<Item = EntryOf<TypeConfig>>,
) -> Vec<Entry> {
    let entries: Vec<Entry> = entries.into_iter().map(Arc::new).collect();
    let mut t = lock(tail);
    for e in &entries {
        t.stage(e);
    }
    entries
}

fn run(db: &Database, tail: &Mutex<Tail>, rx: &Receiver<Op>, counts: &WriterCounts) {
    while let Ok(first) = rx.recv() {
        let mut ops = vec![first];
        while ops.len() < MAX_OPS_PER_COMMIT
            && let Ok(op) = rx.try_recv()
        {
            ops.push(op);
        }
        let durable = ops.iter().any(Op::needs_fsync);
        let result = write(db, &ops, durable);
        if let Ok(sizes) = &result {
            // The file holds the round now: the tail follows it, op by op, before anyone is
            // answered (a truncation returns with its entries gone from both).
            let mut written = 0;
            let mut sizes = sizes.iter();
            let mut t = lock(tail);
            for op in &ops {
                match op {
                    Op::Append { entries, .. } => {
                        written += entries.len() as u64;
                        for e in entries {
                            t.mark_written(e, sizes.next().copied().unwrap_or(0));
                        }
                    }
                    Op::Truncate(from, _) => t.truncate(*from),
                    Op::Purge(log_id, _) => t.purge(log_id.index),
                    Op::Committed(_) | Op::Vote(..) => {}
                }
            }
            t.trim();
            drop(t);
            counts.entries.inc_by(written);
            if durable {
                counts.fsyncs.inc();
            }
        }
        let result = result.map(|_| ()).map_err(|e| (e.kind(), e.to_string()));
        if let Err((_, e)) = &result {
            tracing::error!(error = %e, "the raft log could not be written");
        }
        for op in ops {
            op.answer(&result);
        }
    }
}

fn io_err(e: impl std::fmt::Display) -> io::Error {
    io::Error::other(e.to_string())
}

fn encode<T: Serialize>(v: &T) -> io::Result<Vec<u8>> {
    rmp_serde::to_vec(v).map_err(io_err)
}

/// One transaction for `ops`, in order: durable (fsynced) unless it only moves the committed
/// log id, which a restart may find older than it was (openraft then re-learns it). Returns
/// the encoded size of every entry appended, in order.
fn write(db: &Database, ops: &[Op], durable: bool) -> io::Result<Vec<usize>> {
    let mut txn = db.begin_write().map_err(io_err)?;
    if !durable {
        txn.set_durability(Durability::None).map_err(io_err)?;
    }
    let mut sizes = Vec::new();
    for op in ops {
        apply(&txn, op, &mut sizes)?;
    }
    txn.commit().map_err(io_err)?;
    Ok(sizes)
}

fn put_meta<T: Serialize>(txn: &WriteTransaction, key: &str, v: &T) -> io::Result<()> {
    let bytes = encode(v)?;
    let mut table = txn.open_table(META).map_err(io_err)?;
    table.insert(key, bytes.as_slice()).map_err(io_err)?;
    Ok(())
}

fn apply(txn: &WriteTransaction, op: &Op, sizes: &mut Vec<usize>) -> io::Result<()> {
    match op {
        Op::Append { entries, .. } => {
            let mut table = txn.open_table(LOG).map_err(io_err)?;
            for e in entries {
                let bytes = encode(e.as_ref())?;
                sizes.push(bytes.len());
                table
                    .insert(e.log_id.index, bytes.as_slice())
                    .map_err(io_err)?;
            }
        }
        Op::Committed(c) => put_meta(txn, COMMITTED, c)?,
        Op::Vote(v, _) => put_meta(txn, VOTE, v)?,
        Op::Truncate(from, _) => {
            let mut table = txn.open_table(LOG).map_err(io_err)?;
            table
                .retain_in::<u64, _>(from.., |_, _| false)
                .map_err(io_err)?;
        }
        Op::Purge(log_id, _) => {
            put_meta(txn, PURGED, log_id)?;
            let mut table = txn.open_table(LOG).map_err(io_err)?;
            table
                .retain_in::<u64, _>(..=log_id.index, |_, _| false)
                .map_err(io_err)?;
        }
    }
    Ok(())
}
