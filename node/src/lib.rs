//! The kvplane node: configuration, wiring of state, ingest and API, telemetry, and the
//! subcommands of the `kvplane` binary.

mod bridge_cmd;
pub mod cli;
pub mod config;
mod data_dir_lock;
mod gateway_cmd;
mod incarnation;
pub mod process_metrics;
mod routed_share;
pub mod serve;
pub mod sources;
pub mod telemetry;
