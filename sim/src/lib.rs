//! A simulated vLLM engine, close enough to the real one that kvplane cannot tell:
//! the OpenAI-compatible API, vLLM's `/metrics`, and KV-cache events over ZMQ in vLLM's wire
//! format, driven by an engine model ([`model::Engine`]) whose time to first token depends on
//! the queue and on the cached prefix the way a real engine's does.
//!
//! The model runs in virtual time, so the same code serves the real-time simulator
//! (`kvplane sim engine`) and virtual-time benchmarks.

pub mod hash;
pub mod model;
pub mod params;
pub mod rng;
pub mod server;
pub mod workload;
mod zmq_pub;

pub use params::EngineParams;
pub use zmq_pub::{KvPublisher, PublisherEndpoints};
