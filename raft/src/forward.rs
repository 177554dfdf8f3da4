//! Writes and linearizable reads from any member: the leader proposes or confirms itself; a
//! follower forwards to the leader over `kvplane.v1.Raft` and then waits until it has applied
//! the result locally, so the caller reads its own write on the replica it asked.

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
}

impl std::fmt::Debug for Replica {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Replica")
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
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
        }
    }

    /// Commits `command` through the leader and waits until this replica applied it.
    pub async fn write(&self, command: Command) -> Result<u64, ProposeError> {
        let result = self.write_through_leader(command).await;
        self.failures.count("replica_write", result)
    }

    async fn write_through_leader(&self, command: Command) -> Result<u64, ProposeError> {
        let result = self
            .with_leader("write", |leader| {
                let command = command.clone();
                async move {
                    match leader {
                        None => self.write_here(command).await,
                        Some((id, addr)) => self.write_at(id, &addr, command).await,
                    }
                }
            })
            .await?;
        match result.rejected {
            None => Ok(result.index),
            Some(reason) => Err(ProposeError::Refused {
                index: result.index,
                reason,
            }),
        }
    }

    /// Resolves with an index once this replica has applied everything committed before the
    /// call (the leader confirmed its leadership with a quorum).
    pub async fn read_barrier(&self) -> Result<u64, ProposeError> {
        let result = self.barrier().await;
        self.failures.count("read_barrier", result)
    }

    async fn barrier(&self) -> Result<u64, ProposeError> {
        self.with_leader("linearizable read", |leader| async move {
            match leader {
                None => match self
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
                },
                Some((id, addr)) => {
                    let reply: ReadIndexReply = match self.call(id, &addr, Rpc::ReadIndex).await {
                        Ok(r) => r,
                        Err(e) => return Ok(Attempt::Retry(e.to_string())),
                    };
                    match reply {
                        Ok(index) => Ok(Attempt::Done(index)),
                        Err(ForwardError::NotLeader { .. }) => {
                            Ok(Attempt::Retry(format!("node {id} no longer leads")))
                        }
                        Err(ForwardError::Failed(message)) => {
                            Err(ProposeError::Unavailable(Unavailable::LeaderNotConfirmed {
                                leader: id,
                                message,
                            }))
                        }
                    }
                }
            }
        })
        .await
    }

    /// Runs `attempt` against the current leader (`None` when this node leads), retrying while
    /// no leader is known or the leader moved, until the timeout; then waits until this
    /// replica's applied index reaches the result's.
    async fn with_leader<T, F, Fut>(
        &self,
        what: &'static str,
        mut attempt: F,
    ) -> Result<T, ProposeError>
    where
        T: Indexed,
        F: FnMut(Option<(u64, String)>) -> Fut,
        Fut: std::future::Future<Output = Result<Attempt<T>, ProposeError>>,
    {
        let deadline = Instant::now() + self.timeout;
        let mut why = String::from("no leader is known");
        loop {
            let m = self.raft.metrics().borrow_watched().clone();
            let leader = m.current_leader.map(|l| {
                let addr = m
                    .membership_config
                    .membership()
                    .get_node(&l)
                    .map(|n| n.addr.clone())
                    .unwrap_or_default();
                (l, addr)
            });
            let outcome = match leader {
                Some((l, _)) if l == m.id => {
                    tokio::time::timeout_at(deadline.into(), attempt(None)).await
                }
                Some(remote) => {
                    tokio::time::timeout_at(deadline.into(), attempt(Some(remote))).await
                }
                None => Ok(Ok(Attempt::Retry("no leader is known".into()))),
            };
            match outcome {
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

    async fn write_at(
        &self,
        id: u64,
        addr: &str,
        command: Command,
    ) -> Result<Attempt<ApplyResult>, ProposeError> {
        let reply: ForwardReply = match self.call(id, addr, Rpc::Propose(&command)).await {
            Ok(r) => r,
            Err(e) => return Ok(Attempt::Retry(e.to_string())),
        };
        match reply {
            Ok(r) => Ok(Attempt::Done(r)),
            Err(ForwardError::NotLeader { .. }) => {
                Ok(Attempt::Retry(format!("node {id} no longer leads")))
            }
            Err(ForwardError::Failed(message)) => Err(ProposeError::Log(LogFailure::Leader {
                leader: id,
                message,
            })),
        }
    }

    /// One RPC to the leader. An error means the request did not reach it (so retrying cannot
    /// apply a command twice).
    async fn call<R: serde::de::DeserializeOwned>(
        &self,
        id: u64,
        addr: &str,
        rpc: Rpc<'_>,
    ) -> Result<R, PeerError> {
        let mut client = self.network.peer(id, addr)?;
        let payload = RaftPayload {
            data: match rpc {
                Rpc::Propose(c) => encode(c)?,
                Rpc::ReadIndex => Vec::new(),
            },
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
