//! The operator's subcommands of the `kvplane` binary: clients of a running node's gRPC API
//! and the offline checks. None of it runs inside a node; the server crate (`node/`) only
//! offers these as subcommands.
//!
//! - [`route`]: `kvplane route` and `kvplane status`.
//! - [`explain`]: `kvplane explain`, online or offline (a snapshot, a data directory, a live
//!   node's exported state, a policy directory).
//! - [`cluster`]: `kvplane cluster status|add|remove`.
//! - [`config`]: `kvplane config put|delete`.
//! - [`validate`]: `kvplane validate` and `kvplane crds`.
//! - [`tls`]: `kvplane tls dev-certs`; [`dial`]: the `--tls-dir` every client subcommand takes.

pub mod cluster;
pub mod config;
pub mod dial;
pub mod explain;
pub mod route;
pub mod tls;
pub mod validate;

/// The node a subcommand talks to.
#[derive(Debug, Clone, clap::Args)]
pub struct NodeAddr {
    /// Any member's gRPC address (a follower forwards writes to the leader).
    #[arg(
        long,
        env = "KVPLANE_ADDR",
        default_value = "http://127.0.0.1:7070",
        global = true
    )]
    pub addr: String,
    #[command(flatten)]
    pub tls: dial::TlsArgs,
}
