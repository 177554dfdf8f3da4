//! The `state/` machine behind openraft's `RaftStateMachine`.
//!
//! Blank entries (a new leader's first) and membership entries move the applied log id without
//! touching the state; normal entries apply their [`Proposal`] at the entry's log index.
//! A snapshot is `StateMachine::snapshot` bytes plus openraft's metadata; installing one
//! restores the state (the restore checks the digest the snapshot recorded). The current
//! snapshot is kept in `DIR/snapshot.bin` (written to a temporary file, fsynced, renamed, the
//! directory fsynced), so a node that restarts after its log was compacted starts from it and
//! replays only the log after it.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use futures::{Stream, StreamExt};
use kvplane_state::{Applied, Stamp, StateHandle, StateMachine};
use openraft::alias::{LogIdOf, SnapshotMetaOf, SnapshotOf, StoredMembershipOf};
use openraft::storage::{EntryResponder, RaftStateMachine};
use openraft::{EntryPayload, OptionalSend, RaftSnapshotBuilder};
use tokio::sync::Mutex;

use crate::{ApplyResult, TypeConfig, durable};

struct Inner {
    dir: Option<PathBuf>,
    sm: StateMachine,
    last_applied: Option<LogIdOf<TypeConfig>>,
    membership: StoredMembershipOf<TypeConfig>,
    current: Option<(SnapshotMetaOf<TypeConfig>, Vec<u8>)>,
}

/// Told what each applied entry did (metrics); called on the apply path, so it must be quick.
pub type OnApplied = Arc<dyn Fn(&Applied) + Send + Sync>;

/// The replicated state of one node. Cheap to clone (clones share it).
#[derive(Clone)]
pub struct ReplicatedState {
    inner: Arc<Mutex<Inner>>,
    handle: StateHandle,
    on_applied: Option<OnApplied>,
    /// Snapshot builds that failed (the current snapshot stayed), for `/metrics`.
    snapshot_failures: prometheus_client::metrics::counter::Counter,
    /// Set on the builder of a forced build, whose failure is an error.
    forced: bool,
}

impl std::fmt::Debug for ReplicatedState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplicatedState").finish_non_exhaustive()
    }
}

/// The snapshot file in a state directory.
pub const SNAPSHOT_FILE: &str = "snapshot.bin";

#[derive(serde::Serialize, serde::Deserialize)]
struct SnapshotFile {
    meta: SnapshotMetaOf<TypeConfig>,
    data: Vec<u8>,
}

/// The file a snapshot is built into before it replaces the current one (builds run one at a
/// time; a build cut off by a crash leaves it, and the next open removes it).
const BUILD_TAG: &str = "build";

type Current = Option<(SnapshotMetaOf<TypeConfig>, Vec<u8>)>;

impl ReplicatedState {
    /// A state that lives only in memory (tests, tools).
    pub fn new(sm: StateMachine) -> Self {
        Self::with(None, sm, None)
    }

    /// The state of a node whose snapshots live in `dir`: starts from the snapshot there, if any.
    pub fn open(dir: &Path) -> io::Result<Self> {
        std::fs::create_dir_all(dir)?;
        match std::fs::remove_file(dir.join(format!("{SNAPSHOT_FILE}.{BUILD_TAG}"))) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
        let (sm, current) = match std::fs::read(dir.join(SNAPSHOT_FILE)) {
            Ok(bytes) => {
                let file: SnapshotFile = rmp_serde::from_slice(&bytes).map_err(io::Error::other)?;
                let sm = StateMachine::restore(&file.data)
                    .map_err(|e| io::Error::other(e.to_string()))?;
                tracing::info!(
                    index = sm.applied_index(),
                    bytes = file.data.len(),
                    "state restored from snapshot"
                );
                (sm, Some((file.meta, file.data)))
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => (StateMachine::new(), None),
            Err(e) => return Err(e),
        };
        Ok(Self::with(Some(dir.to_owned()), sm, current))
    }

    fn with(dir: Option<PathBuf>, sm: StateMachine, current: Current) -> Self {
        let handle = sm.handle();
        let (last_applied, membership) = match &current {
            Some((meta, _)) => (meta.last_log_id, meta.last_membership.clone()),
            None => (None, StoredMembershipOf::<TypeConfig>::default()),
        };
        Self {
            inner: Arc::new(Mutex::new(Inner {
                dir,
                sm,
                last_applied,
                membership,
                current,
            })),
            handle,
            on_applied: None,
            snapshot_failures: Default::default(),
            forced: false,
        }
    }

    /// Counts snapshot builds that failed (shared with this state's clones).
    pub fn snapshot_failures(&self) -> prometheus_client::metrics::counter::Counter {
        self.snapshot_failures.clone()
    }

    /// The same state, telling `f` what each applied entry did.
    pub fn observed_by(mut self, f: OnApplied) -> Self {
        self.on_applied = Some(f);
        self
    }

    /// Readers' view of the state; it follows every applied entry and every installed snapshot.
    pub fn handle(&self) -> StateHandle {
        self.handle.clone()
    }

    /// The whole state as [`StateMachine::snapshot`] bytes, with its applied index.
    /// The copy is taken under the state's lock and encoded without it, both on a blocking
    /// thread (the tree dump waits for the index writer).
    pub async fn export(&self) -> Result<(u64, Vec<u8>), kvplane_state::SnapshotError> {
        let inner = self.inner.clone().lock_owned().await;
        let captured = tokio::task::spawn_blocking(move || inner.sm.capture())
            .await
            .map_err(|e| kvplane_state::SnapshotError::Task(e.to_string()))??;
        let index = captured.applied_index();
        let bytes = tokio::task::spawn_blocking(move || captured.encode())
            .await
            .map_err(|e| kvplane_state::SnapshotError::Task(e.to_string()))??;
        Ok((index, bytes))
    }
}

/// Reads the state out of a node's Raft snapshot file (`<data_dir>/raft/state/snapshot.bin`).
pub fn read_snapshot_file(path: &Path) -> io::Result<StateMachine> {
    let bytes = std::fs::read(path)?;
    let file: SnapshotFile = rmp_serde::from_slice(&bytes).map_err(io::Error::other)?;
    StateMachine::restore(&file.data).map_err(|e| io::Error::other(e.to_string()))
}

/// Runs `f` on a blocking thread.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> io::Result<T> + Send + 'static,
) -> io::Result<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| io::Error::other(format!("state machine task failed: {e}")))?
}

/// A disk that refuses a snapshot file (`return`) or takes long over it (`sleep(ms)`).
fn snapshot_write_failpoint() -> io::Result<()> {
    fail::fail_point!(crate::failpoints::SNAPSHOT_WRITE, |_| Err(
        io::Error::other(format!(
            "injected write failure (failpoint {})",
            crate::failpoints::SNAPSHOT_WRITE
        ))
    ));
    Ok(())
}

impl Inner {
    /// Makes `(meta, data)` the current snapshot, on disk first when there is a directory.
    fn keep(&mut self, meta: SnapshotMetaOf<TypeConfig>, data: Vec<u8>) -> io::Result<()> {
        if let Some(dir) = &self.dir {
            let file = SnapshotFile { meta, data };
            let bytes = rmp_serde::to_vec(&file).map_err(io::Error::other)?;
            snapshot_write_failpoint()?;
            durable::replace(&dir.join(SNAPSHOT_FILE), &bytes)?;
            self.current = Some((file.meta, file.data));
        } else {
            self.current = Some((meta, data));
        }
        Ok(())
    }
}

impl RaftSnapshotBuilder<TypeConfig> for ReplicatedState {
    type SnapshotData = Vec<u8>;

    /// A build that fails (the index cannot be dumped, the disk refuses the file) is logged
    /// and counted, and answers the current snapshot, or an empty one at no index when there
    /// is none yet: openraft takes a built snapshot no newer than the one it has as nothing
    /// done, where an error would stop Raft on this member. (openraft 0.10.0-alpha.37:
    /// `Engine::on_building_snapshot_done` updates nothing, and purges nothing, when
    /// `SnapshotHandler::update_snapshot` finds the meta no newer; the next build is tried at
    /// the next threshold.) The log it did not compact is still there. A forced build's
    /// failure is an error (see `try_create_snapshot_builder`).
    async fn build_snapshot(&mut self) -> Result<SnapshotOf<TypeConfig, Vec<u8>>, io::Error> {
        match self.try_build().await {
            Ok(s) => Ok(s),
            Err(e) => {
                self.snapshot_failures.inc();
                if self.forced {
                    tracing::error!(error = %e, "forced snapshot not taken");
                    return Err(e);
                }
                tracing::error!(error = %e, "snapshot not taken; the current one stays");
                let inner = self.inner.lock().await;
                Ok(match inner.current.clone() {
                    Some((meta, snapshot)) => SnapshotOf::<TypeConfig, Vec<u8>> { meta, snapshot },
                    None => SnapshotOf::<TypeConfig, Vec<u8>> {
                        meta: SnapshotMetaOf::<TypeConfig> {
                            last_log_id: None,
                            last_membership: inner.membership.clone(),
                        },
                        snapshot: Vec::new(),
                    },
                })
            }
        }
    }
}

impl ReplicatedState {
    async fn try_build(&self) -> Result<SnapshotOf<TypeConfig, Vec<u8>>, io::Error> {
        // Only the copy is taken under the state's lock (the tree dump waits for the index
        // writer, so on a blocking thread); encoding, writing and fsyncing it happen without
        // the lock, while entries keep applying.
        let inner = self.inner.clone().lock_owned().await;
        let (captured, meta, dir) = blocking(move || {
            let meta = SnapshotMetaOf::<TypeConfig> {
                last_log_id: inner.last_applied,
                last_membership: inner.membership.clone(),
            };
            let captured = inner.sm.capture().map_err(io::Error::other)?;
            Ok((captured, meta, inner.dir.clone()))
        })
        .await?;
        let (file, staged) = blocking(move || {
            let file = SnapshotFile {
                meta,
                data: captured.encode().map_err(io::Error::other)?,
            };
            let staged = match &dir {
                Some(dir) => {
                    let bytes = rmp_serde::to_vec(&file).map_err(io::Error::other)?;
                    snapshot_write_failpoint()?;
                    Some((
                        dir.clone(),
                        durable::stage(&dir.join(SNAPSHOT_FILE), &bytes, BUILD_TAG)?,
                    ))
                }
                None => None,
            };
            Ok((file, staged))
        })
        .await?;
        let mut inner = self.inner.clone().lock_owned().await;
        // A snapshot installed from the leader meanwhile is newer: it stays the current one.
        let newer = inner
            .current
            .as_ref()
            .is_some_and(|(m, _)| m.last_log_id > file.meta.last_log_id);
        let file = blocking(move || {
            match staged {
                Some((_, tmp)) if newer => std::fs::remove_file(tmp)?,
                Some((dir, tmp)) => durable::commit(&tmp, &dir.join(SNAPSHOT_FILE))?,
                None => {}
            }
            if !newer {
                inner.current = Some((file.meta.clone(), file.data.clone()));
            }
            Ok(file)
        })
        .await?;
        Ok(SnapshotOf::<TypeConfig, Vec<u8>> {
            meta: file.meta,
            snapshot: file.data,
        })
    }
}

impl RaftStateMachine<TypeConfig> for ReplicatedState {
    type SnapshotData = Vec<u8>;
    type SnapshotBuilder = Self;

    async fn applied_state(
        &mut self,
    ) -> Result<(Option<LogIdOf<TypeConfig>>, StoredMembershipOf<TypeConfig>), io::Error> {
        let inner = self.inner.lock().await;
        Ok((inner.last_applied, inner.membership.clone()))
    }

    async fn apply<Strm>(&mut self, mut entries: Strm) -> Result<(), io::Error>
    where
        Strm: Stream<Item = Result<EntryResponder<TypeConfig>, io::Error>> + Unpin + OptionalSend,
    {
        let mut batch = Vec::new();
        while let Some(item) = entries.next().await {
            batch.push(item?);
        }
        // Applying writes the prefix index and republishes the view: on a blocking thread, so
        // the runtime (Raft's own tasks, the API) never waits for it.
        let mut inner = self.inner.clone().lock_owned().await;
        let on_applied = self.on_applied.clone();
        let answered = blocking(move || {
            let mut answered = Vec::with_capacity(batch.len());
            for (entry, responder) in batch {
                let log_id = entry.log_id;
                let mut result = ApplyResult {
                    index: log_id.index,
                    rejected: None,
                };
                match entry.payload {
                    EntryPayload::Blank => {}
                    EntryPayload::Normal(p) => {
                        let _span = tracing::debug_span!(
                            "raft.apply",
                            index = log_id.index,
                            command = p.command.kind()
                        )
                        .entered();
                        let at = Stamp {
                            index: log_id.index,
                            timestamp_ms: p.timestamp_ms,
                        };
                        let applied = inner
                            .sm
                            .apply_command(at, &p.command)
                            .map_err(|e| io::Error::other(e.to_string()))?;
                        if let Some(f) = &on_applied {
                            f(&applied);
                        }
                        result.rejected = applied.rejected;
                    }
                    EntryPayload::Membership(m) => {
                        inner.membership = StoredMembershipOf::<TypeConfig>::new(Some(log_id), m);
                    }
                }
                inner.last_applied = Some(log_id);
                answered.push((responder, result));
            }
            Ok(answered)
        })
        .await?;
        for (responder, result) in answered {
            if let Some(r) = responder {
                r.send(result);
            }
        }
        Ok(())
    }

    async fn get_snapshot_builder(&mut self) -> Self::SnapshotBuilder {
        self.clone()
    }

    /// A forced build (openraft's, at start, when the log was purged and no snapshot is
    /// there) must not answer an empty snapshot for a failure: its error stops Raft instead.
    async fn try_create_snapshot_builder(&mut self, force: bool) -> Option<Self::SnapshotBuilder> {
        let mut builder = self.clone();
        builder.forced = force;
        Some(builder)
    }

    async fn install_snapshot(
        &mut self,
        meta: &SnapshotMetaOf<TypeConfig>,
        snapshot: Vec<u8>,
    ) -> Result<(), io::Error> {
        let bytes = snapshot.len();
        let handle = self.handle.clone();
        let mut inner = self.inner.clone().lock_owned().await;
        let meta_kept = meta.clone();
        // Restored, then written, then served: a snapshot the disk refused is never served.
        blocking(move || {
            let restored =
                StateMachine::restore(&snapshot).map_err(|e| io::Error::other(e.to_string()))?;
            let (last_applied, membership) =
                (meta_kept.last_log_id, meta_kept.last_membership.clone());
            if let Err(e) = inner.keep(meta_kept, snapshot) {
                tracing::error!(error = %e, "a snapshot sent by the leader could not be written");
                return Err(e);
            }
            inner.sm = restored.with_handle(handle);
            inner.last_applied = last_applied;
            inner.membership = membership;
            Ok::<(), io::Error>(())
        })
        .await?;
        tracing::info!(
            index = meta.last_log_id.as_ref().map_or(0, |l| l.index),
            bytes,
            "installed a snapshot from the leader"
        );
        Ok(())
    }

    async fn get_current_snapshot(
        &mut self,
    ) -> Result<Option<SnapshotOf<TypeConfig, Vec<u8>>>, io::Error> {
        let inner = self.inner.lock().await;
        Ok(inner
            .current
            .as_ref()
            .map(|(meta, data)| SnapshotOf::<TypeConfig, Vec<u8>> {
                meta: meta.clone(),
                snapshot: data.clone(),
            }))
    }
}
