//! openraft's own storage test suite against the redb log and the kvplane state machine.

#![allow(clippy::unwrap_used)]

use kvplane_raft::{LogStore, ReplicatedState, TypeConfig};
use kvplane_state::StateMachine;
use openraft::StorageError;
use openraft::testing::log::{StoreBuilder, Suite};
use tempfile::TempDir;

struct Builder;

impl StoreBuilder<TypeConfig, LogStore, ReplicatedState, TempDir> for Builder {
    async fn build(
        &self,
    ) -> Result<(TempDir, LogStore, ReplicatedState), StorageError<TypeConfig>> {
        let dir = tempfile::tempdir().unwrap();
        let log = LogStore::open(&dir.path().join("raft-log.redb")).unwrap();
        Ok((dir, log, ReplicatedState::new(StateMachine::new())))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redb_log_and_state_machine_pass_openraft_storage_suite() {
    Suite::test_all(Builder).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_log_survives_reopening() {
    use openraft::RaftLogReader;
    use openraft::storage::RaftLogStorage;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("raft-log.redb");
    {
        let mut log = LogStore::open(&path).unwrap();
        let vote = openraft::alias::VoteOf::<TypeConfig>::new(3, 1);
        log.save_vote(&vote).await.unwrap();
    }
    let mut log = LogStore::open(&path).unwrap();
    let vote = log.read_vote().await.unwrap().unwrap();
    assert_eq!(vote, openraft::alias::VoteOf::<TypeConfig>::new(3, 1));
    let state = log.get_log_state().await.unwrap();
    assert!(state.last_log_id.is_none());
}
