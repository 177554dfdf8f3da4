//! Test harness: the fleet of real processes is `kvplane-testkit`'s (shared with the demo);
//! what is here is only for this crate's tests (Raft cluster set-ups, prompts and chains).

#![allow(dead_code, unused_imports, clippy::unwrap_used)]

pub use kvplane_testkit::*;

mod answers;
mod engines;
mod envoy;
mod in_process;
mod raft;
pub use answers::{sse_events, sse_json, test_python};
pub use engines::{node_with_engines, node_with_engines_under, wait_workers_up, words};
pub use envoy::spawn_envoy;
pub use in_process::InProcess;
pub use raft::{
    chain, exported_state, prompt, publish_chains, remote_learner, routed_worker, started,
    started_with_limits, started_with_limits_and,
};
