//! The in-process log of a single node: commands are numbered, stamped with this node's
//! clock, and applied in order on one dedicated thread that owns the [`StateMachine`].
//! Raft replaces this log; the state machine and the proposers do not change.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use kvplane_state::{Command, Entry, ProposeError, Proposer, StateHandle, StateMachine};
use tokio::sync::{mpsc, oneshot};

use crate::snapshot_store::SnapshotStore;

enum Request {
    Propose(Command, oneshot::Sender<Result<u64, ProposeError>>),
    Export(oneshot::Sender<(u64, Vec<u8>)>),
}

/// When the applier takes snapshots.
#[derive(Debug, Clone, Copy)]
pub struct SnapshotPolicy {
    pub every_entries: u64,
    pub every: Duration,
}

/// The proposing side of the in-process log; cheap to clone.
#[derive(Debug, Clone)]
pub struct LocalLog {
    tx: mpsc::Sender<Request>,
}

/// The applier thread; joining it waits for the final snapshot.
#[derive(Debug)]
pub struct Applier {
    thread: std::thread::JoinHandle<()>,
}

impl Applier {
    pub fn join(self) {
        let _ = self.thread.join();
    }
}

impl LocalLog {
    /// Starts the applier for `sm`. The log continues after `sm`'s applied index. The applier
    /// stops (with a final snapshot) once every `LocalLog` clone is dropped.
    pub fn start(
        sm: StateMachine,
        store: SnapshotStore,
        policy: SnapshotPolicy,
        on_applied: Arc<dyn Fn(&kvplane_state::Applied) + Send + Sync>,
    ) -> (Self, StateHandle, Applier) {
        let handle = sm.handle();
        let (tx, rx) = mpsc::channel::<Request>(1024);
        let thread = std::thread::Builder::new()
            .name("kvplane-apply".into())
            .spawn(move || apply_loop(sm, rx, store, policy, on_applied))
            .unwrap_or_else(|e| {
                // Without an applier thread the node cannot work at all.
                tracing::error!(error = %e, "cannot start the applier thread");
                std::process::exit(70);
            });
        (Self { tx }, handle, Applier { thread })
    }
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

fn apply_loop(
    mut sm: StateMachine,
    mut rx: mpsc::Receiver<Request>,
    store: SnapshotStore,
    policy: SnapshotPolicy,
    on_applied: Arc<dyn Fn(&kvplane_state::Applied) + Send + Sync>,
) {
    let mut since_snapshot = 0u64;
    let mut last_snapshot = Instant::now();
    let take = |sm: &StateMachine, why: &str| match store.save(sm) {
        Ok(bytes) => tracing::info!(index = sm.applied_index(), bytes, why, "snapshot written"),
        Err(e) => tracing::error!(error = %e, "snapshot failed"),
    };
    while let Some(request) = rx.blocking_recv() {
        let (command, reply) = match request {
            Request::Propose(command, reply) => (command, reply),
            Request::Export(reply) => {
                let _ = reply.send((sm.applied_index(), sm.snapshot()));
                continue;
            }
        };
        let entry = Entry {
            index: sm.applied_index() + 1,
            timestamp_ms: now_ms(),
            command,
        };
        let result = sm
            .apply(&entry)
            .map_err(|e| ProposeError::Log(e.to_string()))
            .and_then(|applied| {
                on_applied(&applied);
                match &applied.rejected {
                    None => Ok(entry.index),
                    Some(e) => {
                        tracing::warn!(index = entry.index, error = %e, "command refused");
                        Err(ProposeError::Refused {
                            index: entry.index,
                            reason: e.to_string(),
                        })
                    }
                }
            });
        let _ = reply.send(result);
        since_snapshot += 1;
        if since_snapshot >= policy.every_entries
            || (since_snapshot > 0 && last_snapshot.elapsed() >= policy.every)
        {
            take(&sm, "periodic");
            since_snapshot = 0;
            last_snapshot = Instant::now();
        }
    }
    take(&sm, "shutdown");
}

impl Proposer for LocalLog {
    async fn propose(&self, command: Command) -> Result<u64, ProposeError> {
        let (tx, rx) = oneshot::channel();
        self.tx
            .send(Request::Propose(command, tx))
            .await
            .map_err(|_| ProposeError::Closed)?;
        rx.await.map_err(|_| ProposeError::Closed)?
    }
}

impl LocalLog {
    /// The applier's whole state as snapshot bytes, between two entries.
    pub async fn export(&self) -> Result<(u64, Vec<u8>), ProposeError> {
        let (tx, rx) = oneshot::channel();
        self.tx
            .send(Request::Export(tx))
            .await
            .map_err(|_| ProposeError::Closed)?;
        rx.await.map_err(|_| ProposeError::Closed)
    }
}

/// A standalone node's writes and reads: every committed entry is applied before its
/// proposer hears back, so the local state is always linearizable.
#[derive(Debug, Clone)]
pub struct LocalConsistency {
    pub log: LocalLog,
    pub handle: StateHandle,
}

impl kvplane_api::Consistency for LocalConsistency {
    fn write(&self, command: Command) -> futures::future::BoxFuture<'_, Result<u64, ProposeError>> {
        Box::pin(self.log.propose(command))
    }

    fn read_barrier(&self) -> futures::future::BoxFuture<'_, Result<u64, ProposeError>> {
        let index = self.handle.load().applied_index;
        Box::pin(async move { Ok(index) })
    }

    fn export_state(&self) -> futures::future::BoxFuture<'_, Result<(u64, Vec<u8>), ProposeError>> {
        Box::pin(self.log.export())
    }
}
