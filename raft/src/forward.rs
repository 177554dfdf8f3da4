//! Writes and linearizable reads from any member: the leader proposes or confirms itself; a
//! follower forwards to the leader over `kvplane.v1.Raft` and then waits until it has applied
//! the result locally, so the caller reads its own write on the replica it asked. A replica
//! that cannot reach the leader's recorded address (a learner in another cluster) sends
//! through a member it can reach, which passes the request on to its leader once
//! ([`Replica::relay_write`], [`Replica::relay_read_index`]).

use std::time::{Duration, Instant};

use kvplane_proto::v1::RaftPayload;
use kvplane_state::{Command, LogFailure, ProposeError, Unavailable};
use openraft::async_runtime::WatchReceiver;
use openraft::errors::{ClientWriteError, LinearizableReadError, RaftError};
use serde::{Deserialize, Serialize};

use crate::network::{PeerError, decode, encode};
use crate::{ApplyResult, KvRaft, Network, Proposal};

/// Why the leader did not act on a forwarded request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ForwardError {
    /// The receiver is not the leader (it names the leader it knows of).
    NotLeader {
        leader: Option<u64>,
    },
    Failed(String),
    /// A relaying member reached no answer in time: the outcome is unknown (its words).
    Unavailable(String),
}

pub(crate) type ForwardReply = Result<ApplyResult, ForwardError>;
pub(crate) type ReadIndexReply = Result<u64, ForwardError>;

/// One member's way to write and to read linearizably, whoever leads.
#[derive(Clone)]
pub struct Replica {
    raft: KvRaft,
    network: Network,
    timeout: Duration,
    failures: crate::ProposeFailures,
    /// Members to relay through instead of calling the leader (empty: call it).
    via: Vec<String>,
    /// Which of `via` the next attempt goes to.
    turn: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl std::fmt::Debug for Replica {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Replica")
            .field("timeout", &self.timeout)
            .field("via", &self.via)
            .finish_non_exhaustive()
    }
}

/// Whether a result is returned once this member applied it (its own caller reads it here) or
/// as soon as the leader gave it (a relayed request: the sender waits for its own apply).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Applied {
    Here,
    Elsewhere,
}

/// Where one attempt goes.
enum Route {
    /// This member leads.
    Here,
    /// The leader, at its recorded address.
    Leader(u64, String),
    /// A member at this address, which passes the request on to its leader.
    Relay(String),
}

/// What one attempt against the current leader came to.
enum Attempt<T> {
    Done(T),
    /// Nothing was done; try again once the leader is known (or changed).
    Retry(String),
}

impl Replica {
    /// `timeout` bounds every write and read barrier, leader changes included.
    pub fn new(
        raft: KvRaft,
        network: Network,
        timeout: Duration,
        failures: crate::ProposeFailures,
    ) -> Self {
        Self {
            raft,
            network,
            timeout,
            failures,
            via: Vec::new(),
            turn: std::sync::Arc::default(),
        }
    }

    /// The same replica sending every write and read barrier it does not serve itself through
    /// `via` (any of them, in turn), never to the leader's recorded address.
    pub fn relaying_through(mut self, via: Vec<String>) -> Self {
        self.via = via;
        self
    }

    /// The same replica calling the leader itself: what a relaying member uses, so that a
    /// relayed request takes one hop at most.
    pub(crate) fn direct(&self) -> Self {
        Self {
            via: Vec::new(),
            ..self.clone()
        }
    }

    /// Commits `command` through the leader and waits until this replica applied it.
    pub async fn write(&self, command: Command) -> Result<u64, ProposeError> {
        let result = self.write_through_leader(command).await;
        self.failures.count("replica_write", result)
    }

    async fn write_through_leader(&self, command: Command) -> Result<u64, ProposeError> {
        let result = self
            .apply_through_leader("write", Applied::Here, command)
            .await?;
        match result.rejected {
            None => Ok(result.index),
            Some(reason) => Err(ProposeError::Refused {
                index: result.index,
                reason,
            }),
        }
    }

    async fn apply_through_leader(
        &self,
        what: &'static str,
        applied: Applied,
        command: Command,
    ) -> Result<ApplyResult, ProposeError> {
        self.with_leader(what, applied, |route| {
            let command = command.clone();
            async move {
                match route {
                    Route::Here => self.write_here(command).await,
                    Route::Leader(id, addr) => self.write_at(Some(id), &addr, command).await,
                    Route::Relay(addr) => self.write_at(None, &addr, command).await,
                }
            }
        })
        .await
    }

    /// A write another member relayed here: committed through this member's leader, answered
    /// as soon as the leader answers (the sender waits for its own apply; this member need not
    /// have applied it). No leader reached in time answers as a member that does not lead;
    /// anything else that failed, with its words. The sender tries neither again: this member
    /// already tried until its own timeout.
    pub(crate) async fn relay_write(&self, command: Command) -> ForwardReply {
        let result = self
            .apply_through_leader("relayed write", Applied::Elsewhere, command)
            .await;
        self.failures
            .count("relay_write", result)
            .map_err(relay_error)
    }

    /// A read barrier another member relayed here: the leader's read index (the sender waits
    /// until it applied that far).
    pub(crate) async fn relay_read_index(&self) -> ReadIndexReply {
        let result = self.read_index(Applied::Elsewhere).await;
        self.failures
            .count("relay_read_barrier", result)
            .map_err(relay_error)
    }

    /// Resolves with an index once this replica has applied everything committed before the
    /// call (the leader confirmed its leadership with a quorum).
    pub async fn read_barrier(&self) -> Result<u64, ProposeError> {
        let result = self.read_index(Applied::Here).await;
        self.failures.count("read_barrier", result)
    }

    /// The leader's read index, retried on any failure (a read changes nothing).
    async fn read_index(&self, applied: Applied) -> Result<u64, ProposeError> {
        self.with_leader("linearizable read", applied, |route| async move {
            let (id, addr) = match route {
                Route::Here => return self.read_index_here().await,
                Route::Leader(id, addr) => (Some(id), addr),
                Route::Relay(addr) => (None, addr),
            };
            let reply: ReadIndexReply = match self.call(id, &addr, Rpc::ReadIndex).await {
                Ok(r) => r,
                Err(e) => return Ok(Attempt::Retry(e.to_string())),
            };
            match (reply, id) {
                (Ok(index), _) => Ok(Attempt::Done(index)),
                (Err(ForwardError::NotLeader { .. }), Some(id)) => {
                    Ok(Attempt::Retry(format!("node {id} no longer leads")))
                }
                (Err(ForwardError::NotLeader { .. }), None) => Ok(Attempt::Retry(format!(
                    "{addr} reached no leader to relay the read to"
                ))),
                (
                    Err(ForwardError::Failed(message) | ForwardError::Unavailable(message)),
                    Some(leader),
                ) => Err(ProposeError::Unavailable(Unavailable::LeaderNotConfirmed {
                    leader,
                    message,
                })),
                (Err(ForwardError::Failed(message) | ForwardError::Unavailable(message)), None) => {
                    Err(ProposeError::Unavailable(Unavailable::RelayNotConfirmed {
                        via: addr,
                        message,
                    }))
                }
            }
        })
        .await
    }

    async fn read_index_here(&self) -> Result<Attempt<u64>, ProposeError> {
        match self
            .raft
            .ensure_linearizable(openraft::ReadPolicy::ReadIndex)
            .await
        {
            Ok(read) => Ok(Attempt::Done(read.log_id().index)),
            Err(RaftError::APIError(LinearizableReadError::ForwardToLeader(_))) => {
                Ok(Attempt::Retry("leadership moved".into()))
            }
            Err(e) => Err(ProposeError::Unavailable(Unavailable::NotConfirmed(
                std::sync::Arc::new(e),
            ))),
        }
    }

    /// Runs `attempt` against the current leader (here, at its address, or through a relay),
    /// retrying while no leader is known or the leader moved, until the timeout; then waits
    /// until this replica's applied index reaches the result's.
    async fn with_leader<T, F, Fut>(
        &self,
        what: &'static str,
        applied: Applied,
        mut attempt: F,
    ) -> Result<T, ProposeError>
    where
        T: Indexed,
        F: FnMut(Route) -> Fut,
        Fut: std::future::Future<Output = Result<Attempt<T>, ProposeError>>,
    {
        let deadline = Instant::now() + self.timeout;
        let mut why = String::from("no leader is known");
        loop {
            let m = self.raft.metrics().borrow_watched().clone();
            let route = match m.current_leader {
                Some(l) if l == m.id => Some(Route::Here),
                // A relaying replica relays even before it has heard from a leader (a learner
                // just added): its relay knows one.
                _ if !self.via.is_empty() => {
                    // In turn across calls: a relay that fails one write is not the next one's.
                    let turn = self.turn.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    Some(Route::Relay(self.via[turn % self.via.len()].clone()))
                }
                Some(l) => {
                    let addr = m
                        .membership_config
                        .membership()
                        .get_node(&l)
                        .map(|n| n.addr.clone())
                        .unwrap_or_default();
                    Some(Route::Leader(l, addr))
                }
                None => None,
            };
            let outcome = match route {
                Some(route) => tokio::time::timeout_at(deadline.into(), attempt(route)).await,
                None => Ok(Ok(Attempt::Retry("no leader is known".into()))),
            };
            match outcome {
                Ok(Ok(Attempt::Done(t))) if applied == Applied::Elsewhere => return Ok(t),
                Ok(Ok(Attempt::Done(t))) => {
                    let remaining = deadline.saturating_duration_since(Instant::now());
                    self.raft
                        .wait(Some(remaining.max(Duration::from_millis(1))))
                        .applied_index_at_least(Some(t.index()), what)
                        .await
                        .map_err(|e| {
                            ProposeError::Unavailable(Unavailable::NotApplied {
                                what,
                                index: t.index(),
                                cause: std::sync::Arc::new(e),
                            })
                        })?;
                    return Ok(t);
                }
                Ok(Ok(Attempt::Retry(reason))) => why = reason,
                Ok(Err(e)) => return Err(e),
                Err(_) => {
                    return Err(ProposeError::Unavailable(Unavailable::OutcomeUnknown {
                        what,
                        timeout: self.timeout,
                        why,
                    }));
                }
            }
            if Instant::now() >= deadline {
                return Err(ProposeError::Unavailable(Unavailable::NoLeader {
                    what,
                    timeout: self.timeout,
                    why,
                }));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn write_here(&self, command: Command) -> Result<Attempt<ApplyResult>, ProposeError> {
        match self.raft.client_write(Proposal::now(command)).await {
            Ok(r) => Ok(Attempt::Done(r.data)),
            Err(RaftError::APIError(ClientWriteError::ForwardToLeader(_))) => {
                Ok(Attempt::Retry("leadership moved".into()))
            }
            Err(e) => Err(ProposeError::Log(LogFailure::Local(std::sync::Arc::new(e)))),
        }
    }

    /// A write sent to leader `id` at `addr`, or (no id) to the relay at `addr`. A relayed
    /// write is tried again only when it surely never left: its connection was refused. One
    /// sent to the leader itself is tried again after any error, though it may have been
    /// applied: every command a follower forwards (`Admin` config puts and deletes, quota
    /// batches and closes) is idempotent - a quota batch carries a sequence the ledger applies
    /// once, a config object or deletion replaces, a close restates - so applying it twice
    /// leaves the same state.
    async fn write_at(
        &self,
        id: Option<u64>,
        addr: &str,
        command: Command,
    ) -> Result<Attempt<ApplyResult>, ProposeError> {
        let reply: ForwardReply = match self.call(id, addr, Rpc::Propose(&command)).await {
            Ok(r) => r,
            Err(e) if id.is_some() || !e.delivered_maybe() => {
                return Ok(Attempt::Retry(e.to_string()));
            }
            Err(e) => {
                return Err(ProposeError::Unavailable(Unavailable::RelayLost {
                    via: addr.to_owned(),
                    why: e.to_string(),
                }));
            }
        };
        match (reply, id) {
            (Ok(r), _) => Ok(Attempt::Done(r)),
            (Err(ForwardError::NotLeader { .. }), Some(id)) => {
                Ok(Attempt::Retry(format!("node {id} no longer leads")))
            }
            (Err(ForwardError::NotLeader { .. }), None) => {
                Err(ProposeError::Unavailable(Unavailable::NoLeader {
                    what: "relayed write",
                    timeout: self.timeout,
                    why: format!("{addr} reached no leader to relay it to"),
                }))
            }
            (
                Err(ForwardError::Failed(message) | ForwardError::Unavailable(message)),
                Some(leader),
            ) => Err(ProposeError::Log(LogFailure::Leader { leader, message })),
            (Err(ForwardError::Unavailable(why)), None) => {
                Err(ProposeError::Unavailable(Unavailable::RelayLost {
                    via: addr.to_owned(),
                    why,
                }))
            }
            (Err(ForwardError::Failed(message)), None) => {
                Err(ProposeError::Log(LogFailure::Relay {
                    via: addr.to_owned(),
                    message,
                }))
            }
        }
    }

    /// One RPC to the leader `id` at `addr`, or (no id) to a member at `addr` that relays it.
    /// An error may come after the request reached it (a reset or a lost answer): see
    /// [`PeerError::delivered_maybe`].
    async fn call<R: serde::de::DeserializeOwned>(
        &self,
        id: Option<u64>,
        addr: &str,
        rpc: Rpc<'_>,
    ) -> Result<R, PeerError> {
        let mut client = match id {
            Some(id) => self.network.peer(id, addr)?,
            None => self.network.relay(addr)?,
        };
        let payload = RaftPayload {
            data: match rpc {
                Rpc::Propose(c) => encode(c)?,
                Rpc::ReadIndex => Vec::new(),
            },
            relay: id.is_none(),
        };
        let reply = match rpc {
            Rpc::Propose(_) => client.propose(payload).await,
            Rpc::ReadIndex => client.read_index(payload).await,
        };
        match reply {
            Ok(r) => decode(&r.into_inner().data),
            Err(s) => Err(PeerError::from_status(id, addr, &s)),
        }
    }
}

/// A relayed request's failure as its sender reads it: nothing done (no leader reached in
/// time) may be tried again, anything else may not.
fn relay_error(e: ProposeError) -> ForwardError {
    match e {
        ProposeError::Unavailable(Unavailable::NoLeader { .. }) => {
            ForwardError::NotLeader { leader: None }
        }
        e @ ProposeError::Unavailable(_) => ForwardError::Unavailable(e.to_string()),
        e => ForwardError::Failed(e.to_string()),
    }
}

enum Rpc<'a> {
    Propose(&'a Command),
    ReadIndex,
}

/// Results that carry the log index a replica must apply before answering.
trait Indexed {
    fn index(&self) -> u64;
}

impl Indexed for ApplyResult {
    fn index(&self) -> u64 {
        self.index
    }
}

impl Indexed for u64 {
    fn index(&self) -> u64 {
        *self
    }
}
