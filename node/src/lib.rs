//! The kvplane node: configuration, wiring of state, ingest and API, telemetry, and the
//! subcommands of the `kvplane` binary.

mod bench;
mod bridge_cmd;
pub mod cli;
mod cluster_cmd;
pub mod config;
mod config_cmd;
mod data_dir_lock;
pub mod demo;
mod explain_cmd;
mod gateway_cmd;
pub mod kube_source;
mod policy_cmd;
mod policy_source;
mod route_cmd;
mod routed_share;
pub mod serve;
mod sim_cmd;
pub mod telemetry;
