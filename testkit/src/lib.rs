//! What kvplane's tests and its demo share.
//!
//! - [`process`]: starting real processes and reading their ready lines, stopping and
//!   signalling them; results, not panics (the demo reports what failed).
//! - [`fleet`]: a test's fleet of real processes - [`Nats`], [`Node`] (`kvplane serve`),
//!   [`Cluster`], [`Engine`] (`kvplane sim engine` plus `kvplane bridge`), [`gateway`] -
//!   each on free loopback ports in its own directory, killed when dropped. These panic with
//!   the process's log on failure: they are for tests.
//! - [`eventually`]: one way to wait, on a condition polled until it holds.
//! - [`metrics_text`]: a sample's value, a histogram's buckets and quantiles, read from a
//!   Prometheus metrics text.
//! - [`link`]: a TCP link between a client and a server that a test can cut and heal.
//! - [`ext_proc`]: an ext_proc stream's messages as Envoy sends them (the picker's clients).
//! - [`state`]: a fleet in a state ([`state::TestFleet`]): policies, workers, metrics and KV
//!   events applied as a node's log would, and the real routing service over it - for the
//!   semantics that need no process (policies, quotas, routing) in milliseconds.
//!
//! The `kvplane` binary is found by [`process::kvplane_binary`]. `fleet` and `state` are the
//! `fleet` feature (on by default, for tests); the benchmarks and the demo link only `process`, `eventually` and `metrics_text`.

pub mod eventually;
#[cfg(feature = "fleet")]
pub mod ext_proc;
#[cfg(feature = "fleet")]
pub mod fleet;
#[cfg(feature = "fleet")]
pub mod link;
pub mod metrics_text;
#[cfg(feature = "fleet")]
pub mod pki;
pub mod process;
#[cfg(feature = "fleet")]
pub mod state;

pub use eventually::{eventually, eventually_sync};
#[cfg(feature = "fleet")]
pub use fleet::{
    Cluster, Engine, EngineOptions, Nats, Node, NodeOptions, Proc, RaftOptions, field, free_port,
    gateway, gateway_with, http_get, kvplane_ok, publish, spawn_ready,
};
pub use metrics_text::{histogram_buckets, metric_value, quantile_bound};
