//! kvplane's replicated state machine.
//!
//! Every change to what kvplane knows is a [`Command`] in a log [`Entry`]; [`StateMachine::apply`]
//! applies entries one at a time, deterministically: no wall clock (time comes from the entry),
//! no randomness, no hash-map iteration order in anything that reaches the state or its digest.
//! Replicas that apply the same entries hold the same state and report the same [`Digest`].
//!
//! Readers never block the applier: after each entry the machine publishes an immutable
//! [`View`] (workers, metrics, pool configs) through a [`StateHandle`], and the prefix index
//! (sequence hash to holder ranks, in a sharded map) is read concurrently with apply, which
//! hands its writes to a thread of their own and waits for them before it publishes (what
//! remains at an entry's end it writes itself).

mod blocks;
mod command;
mod config;
mod digest;
#[cfg(test)]
mod digest_covers_index;
mod endpoints;
mod error;
mod hash_bytes;
mod index;
mod log;
mod machine;
mod owner;
mod quota;
mod quota_settle;
mod snapshot;
mod token_bytes;
mod view;
mod writer;

pub use command::{
    Command, ConfigKey, ConfigObject, Entry, IngestBatch, IngestItem, IngestPayload, KvBatch,
    KvEvent, Source, Tier, WorkerMetrics,
};
pub use config::{POOL_KIND, PoolConfig, valid_name};
pub use digest::Digest;
pub use endpoints::{
    Discovered, DiscoveredEndpoint, EndpointHealth, EndpointsUpdate, Found, HealthUpdate,
};
pub use error::{ApplyError, SnapshotError};
pub use index::{Anchor, MAX_DP_RANK, Overlap, PoolIndex};
pub use log::{Cause, LogFailure, ProposeError, Proposer, Unavailable};
pub use machine::{Applied, DropReason, Stamp, StateMachine};
pub use owner::Owner;
pub use quota::{
    Amount, Book, Ledger, QuotaApplied, QuotaAsk, QuotaBatch, QuotaRelease, QuotaSettle, Ticket,
};
pub use snapshot::Captured;
pub use view::{PoolView, StateHandle, View, WorkerView};
