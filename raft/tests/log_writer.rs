//! The log's writer thread, through the public log: appends queued without waiting read back
//! in one run across memory and file (beyond the 4,096 written entries it keeps), are all
//! written once acknowledged, survive reopening, and the last handle dropped closes the file. (Rounds held on
//! purpose, truncation, purge and failures are tested in `raft/src/log_writer.rs`.)

#![allow(clippy::unwrap_used)]

use kvplane_raft::{LogStore, Proposal, TypeConfig};
use kvplane_state::Command;
use openraft::RaftLogReader;
use openraft::alias::EntryOf;
use openraft::entry::RaftEntry;
use openraft::storage::{IOFlushed, RaftLogStorage};
use openraft::testing::log_id;
use openraft::type_config::TypeConfigExt;

fn entry(index: u64) -> EntryOf<TypeConfig> {
    EntryOf::<TypeConfig>::new_normal(
        log_id::<TypeConfig>(1, 1, index),
        Proposal::now(Command::Noop),
    )
}

/// More than the written entries the log keeps in memory (4,096).
const APPENDS: u64 = 5_000;

/// Appends `1..=APPENDS` one call each, without waiting for any flush in between; returns
/// the flush acknowledgements, in order.
async fn append_all(
    log: &mut LogStore,
) -> Vec<tokio::sync::oneshot::Receiver<Result<(), std::io::Error>>> {
    let mut acks = Vec::new();
    for i in 1..=APPENDS {
        let (tx, rx) = TypeConfig::oneshot();
        log.append([entry(i)], IOFlushed::signal(tx)).await.unwrap();
        acks.push(rx);
    }
    acks
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn appends_queued_without_waiting_read_back_across_memory_and_file_and_survive_reopening() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("raft-log.redb");
    {
        let mut log = LogStore::open(&path).unwrap();
        let acks = append_all(&mut log).await;
        // Readable as soon as append returned, flushed or not.
        let mut reader = log.get_log_reader().await;
        let read = reader.try_get_log_entries(1..=APPENDS).await.unwrap();
        assert_eq!(
            read.iter().map(|e| e.log_id.index).collect::<Vec<_>>(),
            (1..=APPENDS).collect::<Vec<_>>()
        );
        assert_eq!(
            log.get_log_state().await.unwrap().last_log_id,
            Some(log_id::<TypeConfig>(1, 1, APPENDS))
        );
        for ack in acks {
            ack.await.unwrap().unwrap();
        }
        // Now the oldest come from the file, the newest from memory: one run either way.
        let read = reader.try_get_log_entries(1..=APPENDS).await.unwrap();
        assert_eq!(
            read.iter().map(|e| e.log_id.index).collect::<Vec<_>>(),
            (1..=APPENDS).collect::<Vec<_>>()
        );
        let read = reader.try_get_log_entries(10..20).await.unwrap();
        assert_eq!(read.first().map(|e| e.log_id.index), Some(10));
        assert_eq!(read.len(), 10);
        let counts = log.counts();
        assert_eq!(counts.entries(), APPENDS);
        // At most one fsync per append (how many share one depends on timing: the writer
        // held between rounds shows them sharing, in `raft/src/log_writer.rs`).
        assert!(
            counts.fsyncs() >= 1 && counts.fsyncs() <= APPENDS,
            "{} fsyncs for {APPENDS} appends",
            counts.fsyncs()
        );
    }
    // The last handle is gone: the file is closed and opens again at once.
    let mut log = LogStore::open(&path).unwrap();
    let read = log.try_get_log_entries(1..=APPENDS).await.unwrap();
    assert_eq!(read.len() as u64, APPENDS);
    assert_eq!(
        read.last().unwrap().log_id,
        log_id::<TypeConfig>(1, 1, APPENDS)
    );
}
