//! The kvplane node: configuration, wiring of state, ingest and API, telemetry, and the
//! subcommands of the `kvplane` binary.

pub mod cli;
pub mod config;
pub mod local_log;
mod route_cmd;
pub mod serve;
pub mod snapshot_store;
mod telemetry;
