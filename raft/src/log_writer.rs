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
use std::ops::Bound;
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Instant;

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

/// How long a committed id written without an fsync waits, at most, for a transaction that
/// fsyncs it: then the writer fsyncs it on its own, or fsyncs the next round (so a restart
/// replays what was committed but for the last 50 ms).
const SYNC_COMMITTED_AFTER: std::time::Duration = std::time::Duration::from_millis(50);

/// Written entries the tail keeps, at most, by count and by encoded size. It holds them
/// decoded, which for compact ingest entries is a few times their encoded size (a message's
/// pool and worker names, its batch's vectors): `kvplane bench ingest` measured 64 MiB of
/// encoded entries at about 90 B of resident memory per indexed block, 4 MiB at about 40 B less,
/// and the replicas kept up the same (apply and replication read what was just written; a
/// follower catching up from further back reads the file).
const KEEP_WRITTEN: usize = 4096;
const KEEP_WRITTEN_BYTES: usize = 4 << 20;

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
    /// The last committed id handed to the writer, written or not (read back at once).
    committed: Option<Option<LogIdOf<TypeConfig>>>,
    /// Set (with the unwritten entries dropped, under the same lock) once a write failed:
    /// nothing more is staged.
    failed: bool,
}

impl Tail {
    /// Entries of `range`, in order (none for an empty or inverted range, which
    /// `BTreeMap::range` would panic on).
    pub(crate) fn range(&self, range: (Bound<u64>, Bound<u64>)) -> Vec<Entry> {
        let highest = match range.1 {
            Bound::Included(i) => Some(i),
            Bound::Excluded(i) => i.checked_sub(1),
            Bound::Unbounded => Some(u64::MAX),
        };
        match (lowest(range.0), highest) {
            (Some(lo), Some(hi)) if lo <= hi => self
                .entries
                .range(lo..=hi)
                .map(|(_, (e, _))| e.clone())
                .collect(),
            _ => Vec::new(),
        }
    }

    /// The newest entry's log id.
    pub(crate) fn last(&self) -> Option<LogIdOf<TypeConfig>> {
        self.entries.last_key_value().map(|(_, (e, _))| e.log_id)
    }

    fn stage(&mut self, e: &Entry) {
        debug_assert!(
            self.entries
                .last_key_value()
                .is_none_or(|(&last, _)| e.log_id.index <= last + 1),
            "appends keep the tail contiguous"
        );
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
        let cut = self.entries.split_off(&from);
        self.forget(cut);
    }

    fn purge(&mut self, upto: u64) {
        let kept = match upto.checked_add(1) {
            Some(next) => self.entries.split_off(&next),
            None => BTreeMap::new(),
        };
        let gone = std::mem::replace(&mut self.entries, kept);
        self.forget(gone);
    }

    /// Takes entries that left the tail off its written counts.
    fn forget(&mut self, gone: BTreeMap<u64, (Entry, Option<usize>)>) {
        for (_, (_, size)) in gone {
            if let Some(size) = size {
                self.forget_written(size);
            }
        }
    }

    /// After a failed write: every entry not written leaves (it never will be), and nothing
    /// more is staged.
    fn fail(&mut self) {
        self.failed = true;
        self.entries.retain(|_, (_, size)| size.is_some());
    }

    /// Refuses reads once a write failed: the entries it dropped may have been committed by
    /// the other members (replicated from memory before this disk refused them), and a read
    /// that skipped them would apply a log with a hole.
    pub(crate) fn readable(&self) -> io::Result<()> {
        if self.failed {
            return Err(io::Error::other(
                "the raft log failed a write: what it did not write cannot be read",
            ));
        }
        Ok(())
    }

    /// Records the committed id handed to the writer (refused after a failed write).
    pub(crate) fn commit(&mut self, committed: Option<LogIdOf<TypeConfig>>) -> io::Result<()> {
        refuse_if(self.failed)?;
        self.committed = Some(committed);
        Ok(())
    }

    /// The last committed id handed to the writer, if any was.
    pub(crate) fn committed(&self) -> Option<Option<LogIdOf<TypeConfig>>> {
        self.committed
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

/// What the writer thread and the log's handles share besides the tail.
#[derive(Debug, Default)]
struct Shared {
    counts: WriterCounts,
    /// Held by a test to keep the writer from starting its next round.
    #[cfg(test)]
    gate: Mutex<()>,
    /// Set by a test to make the next rounds fail as a disk would.
    #[cfg(test)]
    fail: std::sync::atomic::AtomicBool,
}

/// The writer thread and the way to it; the thread stops (after what it was given) and is
/// joined when this is dropped, so the log file is closed once the last handle is gone.
#[derive(Debug)]
pub(crate) struct Writer {
    tx: Option<Sender<Op>>,
    thread: Option<JoinHandle<()>>,
    shared: Arc<Shared>,
}

impl Writer {
    pub(crate) fn start(db: Arc<Database>, tail: Arc<Mutex<Tail>>) -> io::Result<Self> {
        let (tx, rx) = std::sync::mpsc::channel();
        let shared = Arc::new(Shared::default());
        let kept = shared.clone();
        let thread = std::thread::Builder::new()
            .name("raft-log".into())
            .spawn(move || {
                run(&Context {
                    db: &db,
                    tail: &tail,
                    rx: &rx,
                    shared: &kept,
                })
            })?;
        Ok(Self {
            tx: Some(tx),
            thread: Some(thread),
            shared,
        })
    }

    pub(crate) fn counts(&self) -> &WriterCounts {
        &self.shared.counts
    }

    /// Makes the writer's rounds fail (or not) as a disk would.
    #[cfg(test)]
    pub(crate) fn fail_writes(&self, fail: bool) {
        self.shared
            .fail
            .store(fail, std::sync::atomic::Ordering::SeqCst);
    }

    /// Keeps the writer from taking its next round until the guard is dropped (what is sent
    /// meanwhile goes into that round together). It holds neither a round already past the
    /// gate nor the idle fsync of a committed id.
    #[cfg(test)]
    pub(crate) fn pause(&self) -> MutexGuard<'_, ()> {
        self.shared.gate.lock().unwrap_or_else(|p| p.into_inner())
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

/// The lowest index a range's start admits (`None`: none).
pub(crate) fn lowest(start: Bound<u64>) -> Option<u64> {
    match start {
        Bound::Included(i) => Some(i),
        Bound::Excluded(i) => i.checked_add(1),
        Bound::Unbounded => Some(0),
    }
}

pub(crate) fn lock(tail: &Mutex<Tail>) -> MutexGuard<'_, Tail> {
    tail.lock().unwrap_or_else(|p| p.into_inner())
}

/// An error when a write failed: the log takes no more.
fn refuse_if(failed: bool) -> io::Result<()> {
    if failed {
        return Err(io::Error::other(
            "the raft log failed a write and takes no more",
        ));
    }
    Ok(())
}

/// Adds entries to the tail (refused after a failed write); returns them as the writer takes
/// them.
pub(crate) fn stage(
    tail: &Mutex<Tail>,
    entries: impl IntoIterator<Item = EntryOf<TypeConfig>>,
) -> io::Result<Vec<Entry>> {
    let entries: Vec<Entry> = entries.into_iter().map(Arc::new).collect();
    let mut t = lock(tail);
    refuse_if(t.failed)?;
    for e in &entries {
        t.stage(e);
    }
    Ok(entries)
}

/// What the thread works with.
struct Context<'a> {
    db: &'a Database,
    tail: &'a Mutex<Tail>,
    rx: &'a Receiver<Op>,
    shared: &'a Shared,
}

fn run(cx: &Context<'_>) {
    // Set by the first round that failed: every later op is refused unwritten, so the file
    // never gets entries (or a committed id) past a hole.
    let mut failed: Option<(io::ErrorKind, String)> = None;
    // When the committed id written without an fsync must be fsynced at the latest.
    let mut sync_by: Option<Instant> = None;
    loop {
        let first = match sync_by {
            Some(at) => match cx
                .rx
                .recv_timeout(at.saturating_duration_since(Instant::now()))
            {
                Ok(op) => op,
                Err(RecvTimeoutError::Timeout) => {
                    // Nothing followed in time: the committed id is made durable on its own.
                    sync_by = None;
                    if failed.is_none() {
                        match sync(cx.db) {
                            Ok(()) => {
                                cx.shared.counts.fsyncs.inc();
                            }
                            Err(e) => fail(cx, &mut failed, (e.kind(), e.to_string())),
                        }
                    }
                    continue;
                }
                Err(RecvTimeoutError::Disconnected) => return,
            },
            None => match cx.rx.recv() {
                Ok(op) => op,
                Err(_) => return,
            },
        };
        #[cfg(test)]
        let gate = cx.shared.gate.lock().unwrap_or_else(|p| p.into_inner());
        let mut ops = vec![first];
        while ops.len() < MAX_OPS_PER_COMMIT
            && let Ok(op) = cx.rx.try_recv()
        {
            ops.push(op);
        }
        #[cfg(test)]
        drop(gate);
        let overdue = sync_by.is_some_and(|at| Instant::now() >= at);
        let result = match &failed {
            Some(e) => Err(e.clone()),
            None => round(cx, &ops, overdue),
        };
        match &result {
            Ok(true) => sync_by = None,
            Ok(false) => {
                sync_by.get_or_insert_with(|| Instant::now() + SYNC_COMMITTED_AFTER);
            }
            Err(e) => fail(cx, &mut failed, e.clone()),
        }
        let result = result.map(|_| ());
        for op in ops {
            op.answer(&result);
        }
    }
}

/// Latches the first failure: appends are refused from now on, and the entries the tail
/// holds unwritten (they never will be) leave it.
fn fail(
    cx: &Context<'_>,
    failed: &mut Option<(io::ErrorKind, String)>,
    e: (io::ErrorKind, String),
) {
    if failed.is_some() {
        return;
    }
    tracing::error!(error = %e.1, "the raft log could not be written; it takes no more writes");
    lock(cx.tail).fail();
    *failed = Some(e);
}

/// Writes one round (fsynced when an op needs it or `overdue`) and brings the tail in line
/// with the file; returns whether it fsynced. A panic in the write is an error like any other
/// (the ops are still answered).
fn round(cx: &Context<'_>, ops: &[Op], overdue: bool) -> Result<bool, (io::ErrorKind, String)> {
    let durable = overdue || ops.iter().any(Op::needs_fsync);
    // A disk that refuses the round (`return`) or takes long over it (`sleep(ms)`).
    fail::fail_point!(crate::failpoints::LOG_WRITE, |_| Err((
        io::ErrorKind::Other,
        format!(
            "injected write failure (failpoint {})",
            crate::failpoints::LOG_WRITE
        )
    )));
    #[cfg(test)]
    if cx.shared.fail.load(std::sync::atomic::Ordering::SeqCst) {
        return Err((io::ErrorKind::Other, "injected write failure".into()));
    }
    let written =
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| write(cx.db, ops, durable)))
            .unwrap_or_else(|_| Err(io::Error::other("the raft log's writer panicked")));
    let sizes = written.map_err(|e| (e.kind(), e.to_string()))?;
    // The file holds the round now: the tail follows it, op by op, before anyone is answered
    // (a truncation returns with its entries gone from both).
    let mut entries = 0;
    let mut sizes = sizes.iter();
    let mut t = lock(cx.tail);
    for op in ops {
        match op {
            Op::Append { entries: es, .. } => {
                entries += es.len() as u64;
                for e in es {
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
    cx.shared.counts.entries.inc_by(entries);
    if durable {
        cx.shared.counts.fsyncs.inc();
    }
    Ok(durable)
}

/// An empty durable transaction: makes every earlier one durable.
fn sync(db: &Database) -> io::Result<()> {
    db.begin_write().map_err(io_err)?.commit().map_err(io_err)
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

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use kvplane_state::Command;
    use openraft::alias::EntryOf;
    use openraft::entry::RaftEntry;
    use openraft::storage::{IOFlushed, RaftLogStorage};
    use openraft::testing::log_id;
    use openraft::type_config::TypeConfigExt;
    use openraft::{RaftLogReader, Vote};

    use crate::{LogStore, Proposal, TypeConfig};

    fn entry(term: u64, index: u64) -> EntryOf<TypeConfig> {
        EntryOf::<TypeConfig>::new_normal(
            log_id::<TypeConfig>(term, 1, index),
            Proposal::now(Command::Noop),
        )
    }

    type Ack =
        openraft::type_config::alias::OneshotReceiverOf<TypeConfig, Result<(), std::io::Error>>;

    async fn append(log: &mut LogStore, from: u64, to: u64) -> Vec<Ack> {
        let mut acks = Vec::new();
        for i in from..=to {
            let (tx, rx) = TypeConfig::oneshot();
            log.append([entry(1, i)], IOFlushed::signal(tx))
                .await
                .unwrap();
            acks.push(rx);
        }
        acks
    }

    fn indexes(entries: &[EntryOf<TypeConfig>]) -> Vec<u64> {
        entries.iter().map(|e| e.log_id.index).collect()
    }

    #[tokio::test]
    #[expect(
        clippy::await_holding_lock,
        reason = "the gate holds the writer thread, not a task: nothing awaited here waits for it"
    )]
    async fn queued_appends_are_readable_before_their_flush_and_share_one_fsync() {
        let dir = tempfile::tempdir().unwrap();
        let mut log = LogStore::open(&dir.path().join("log.redb")).unwrap();
        let holder = log.clone();
        let paused = holder.pause_writer();
        let mut acks = append(&mut log, 1, 100).await;
        // Nothing is on disk yet, and every entry reads back, from memory.
        assert!(acks.iter_mut().all(|a| a.try_recv().is_err()));
        assert_eq!(log.counts().fsyncs(), 0);
        let read = log.try_get_log_entries(1..=100).await.unwrap();
        assert_eq!(indexes(&read), (1..=100).collect::<Vec<_>>());
        assert_eq!(
            log.get_log_state().await.unwrap().last_log_id,
            Some(log_id::<TypeConfig>(1, 1, 100))
        );
        drop(paused);
        for a in acks {
            a.await.unwrap().unwrap();
        }
        assert_eq!((log.counts().entries(), log.counts().fsyncs()), (100, 1));
    }

    #[tokio::test]
    #[expect(
        clippy::await_holding_lock,
        reason = "the gate holds the writer thread, not a task: nothing awaited here waits for it"
    )]
    async fn a_truncation_queued_behind_unflushed_appends_leaves_only_what_came_before_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("log.redb");
        {
            let mut log = LogStore::open(&path).unwrap();
            let holder = log.clone();
            let paused = holder.pause_writer();
            let acks = append(&mut log, 1, 50).await;
            let mut other = log.clone();
            let mut truncate =
                std::pin::pin!(other.truncate_after(Some(log_id::<TypeConfig>(1, 1, 20))));
            // Sent behind the appends; it cannot finish while the writer waits.
            assert!(futures::poll!(&mut truncate).is_pending());
            drop(paused);
            truncate.await.unwrap();
            assert_eq!(
                log.counts().fsyncs(),
                1,
                "appends and truncation in one round"
            );
            for a in acks {
                a.await.unwrap().unwrap();
            }
            let read = log.try_get_log_entries(1..).await.unwrap();
            assert_eq!(indexes(&read), (1..=20).collect::<Vec<_>>());
            // The next entries come under a new term, after the cut.
            let (tx, rx) = TypeConfig::oneshot();
            log.append([entry(2, 21)], IOFlushed::signal(tx))
                .await
                .unwrap();
            rx.await.unwrap().unwrap();
        }
        let mut log = LogStore::open(&path).unwrap();
        let read = log.try_get_log_entries(1..).await.unwrap();
        assert_eq!(indexes(&read), (1..=21).collect::<Vec<_>>());
        assert_eq!(read[20].log_id, log_id::<TypeConfig>(2, 1, 21));
    }

    #[tokio::test]
    async fn a_purge_reads_the_rest_across_memory_and_file() {
        let dir = tempfile::tempdir().unwrap();
        let mut log = LogStore::open(&dir.path().join("log.redb")).unwrap();
        // Beyond what the tail keeps written: the oldest are read from the file.
        let n = super::KEEP_WRITTEN as u64 + 500;
        for a in append(&mut log, 1, n).await {
            a.await.unwrap().unwrap();
        }
        // Purged in the file only (the tail starts at 501): a read spans both.
        log.purge(log_id::<TypeConfig>(1, 1, 300)).await.unwrap();
        let read = log.try_get_log_entries(1..=n).await.unwrap();
        assert_eq!(indexes(&read), (301..=n).collect::<Vec<_>>());
        let read = log.try_get_log_entries(400..600).await.unwrap();
        assert_eq!(indexes(&read), (400..600).collect::<Vec<_>>());
        // Purged into what memory holds.
        log.purge(log_id::<TypeConfig>(1, 1, 600)).await.unwrap();
        let read = log.try_get_log_entries(1..=n).await.unwrap();
        assert_eq!(indexes(&read), (601..=n).collect::<Vec<_>>());
        let read = log.try_get_log_entries(400..700).await.unwrap();
        assert_eq!(indexes(&read), (601..700).collect::<Vec<_>>());
        let state = log.get_log_state().await.unwrap();
        assert_eq!(
            state.last_purged_log_id,
            Some(log_id::<TypeConfig>(1, 1, 600))
        );
        assert_eq!(state.last_log_id, Some(log_id::<TypeConfig>(1, 1, n)));
    }

    #[tokio::test]
    async fn after_a_failed_write_every_later_change_and_read_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("log.redb");
        {
            let mut log = LogStore::open(&path).unwrap();
            for a in append(&mut log, 1, 3).await {
                a.await.unwrap().unwrap();
            }
            log.fail_writes(true);
            // Two entries in one append, the round that takes them fails.
            let (tx, rx) = TypeConfig::oneshot();
            log.append([entry(1, 4), entry(1, 5)], IOFlushed::signal(tx))
                .await
                .unwrap();
            assert!(rx.await.unwrap().is_err());
            // The failed entries are gone from memory, and reads are refused: the other members
            // may have committed 4 and 5 (replicated from memory), and a read without them
            // would have a hole.
            let refused = log.try_get_log_entries(1..).await.unwrap_err();
            assert!(refused.to_string().contains("failed a write"), "{refused}");
            assert_eq!(
                log.get_log_state().await.unwrap().last_log_id,
                Some(log_id::<TypeConfig>(1, 1, 3))
            );
            // The disk is back, but the log behind the failed entries has a hole: it takes
            // nothing more, not even the committed id.
            log.fail_writes(false);
            let (tx, _rx) = TypeConfig::oneshot();
            assert!(
                log.append([entry(1, 6)], IOFlushed::signal(tx))
                    .await
                    .is_err()
            );
            assert!(
                log.save_committed(Some(log_id::<TypeConfig>(1, 1, 3)))
                    .await
                    .is_err()
            );
            assert!(log.save_vote(&Vote::new(2, 1)).await.is_err());
        }
        let mut log = LogStore::open(&path).unwrap();
        let read = log.try_get_log_entries(1..).await.unwrap();
        assert_eq!(indexes(&read), vec![1, 2, 3]);
        assert_eq!(log.read_committed().await.unwrap(), None);
        assert_eq!(log.read_vote().await.unwrap(), None);
    }

    #[tokio::test]
    async fn a_committed_id_nothing_follows_is_fsynced_on_its_own() {
        let dir = tempfile::tempdir().unwrap();
        let mut log = LogStore::open(&dir.path().join("log.redb")).unwrap();
        log.save_vote(&Vote::new(1, 1)).await.unwrap();
        for a in append(&mut log, 1, 1).await {
            a.await.unwrap().unwrap();
        }
        let before = log.counts().fsyncs();
        log.save_committed(Some(log_id::<TypeConfig>(1, 1, 1)))
            .await
            .unwrap();
        let saved = Instant::now();
        let deadline = saved + Duration::from_secs(10);
        while log.counts().fsyncs() == before {
            assert!(
                Instant::now() < deadline,
                "the committed id was never fsynced"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        // Written unfsynced first, fsynced once the 50 ms ran out (never sooner).
        assert!(
            saved.elapsed() >= super::SYNC_COMMITTED_AFTER,
            "{:?}",
            saved.elapsed()
        );
    }

    #[tokio::test]
    #[expect(
        clippy::await_holding_lock,
        reason = "the gate holds the writer thread, not a task: nothing awaited here waits for it"
    )]
    async fn a_committed_id_reads_back_before_it_is_written() {
        let dir = tempfile::tempdir().unwrap();
        let mut log = LogStore::open(&dir.path().join("log.redb")).unwrap();
        let holder = log.clone();
        let paused = holder.pause_writer();
        let id = Some(log_id::<TypeConfig>(1, 1, 7));
        log.save_committed(id).await.unwrap();
        assert_eq!(log.read_committed().await.unwrap(), id);
        drop(paused);
    }
}
