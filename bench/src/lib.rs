//! Whole-system drivers of the `kvplane` binary: `kvplane bench ...` (benchmarks that print
//! JSON, checked in CI in their small modes), `kvplane demo` (a local fleet end to end) and
//! `kvplane sim engine` (one simulated vLLM engine, the demo's and the tests' fleet).
//! They start real Raft members, drive `api/`'s RouterService on `state/`, and run `sim/`'s
//! engine model; none of it runs inside a node.

mod catalog_size;
mod client;
pub mod cluster;
pub mod demo;
mod demo_pki;
pub mod external;
mod grants;
pub mod ingest;
mod procs;
pub(crate) mod routing;
pub mod sim_engine;
mod svg;

#[derive(Debug, clap::Subcommand)]
pub enum BenchCmd {
    /// Raft's cost: committed events/s through three members vs a bare state machine, grant
    /// entries/s of the tenant-limit ledger, and leader-stop to first-commit times.
    Cluster(cluster::ClusterBenchArgs),
    /// Routing strategies on a simulated fleet in virtual time: TTFT, throughput, cache hits,
    /// load imbalance per workload; JSON on stdout, a table on stderr, SVG charts.
    Routing(routing::RoutingBenchArgs),
    /// Ingest at fleet scale: simulated vLLM engines publish KV-event batches through a real
    /// nats-server into a cluster of real nodes; what it keeps up with, publish-to-decision
    /// lag, memory per indexed block, CPU per 1k events, optional leader kills; checked
    /// against the engines' own caches.
    Ingest(ingest::IngestBenchArgs),
    /// Routing on engines we did not write: a fleet of NVIDIA Dynamo's mocker engines behind
    /// round-robin, Dynamo's own KV router and kvplane, same workloads, fresh fleets; TTFT
    /// percentiles per strategy, JSON on stdout, a table on stderr.
    External(external::ExternalBenchArgs),
}

pub async fn run(cmd: BenchCmd) -> anyhow::Result<()> {
    match cmd {
        BenchCmd::Cluster(a) => cluster::run(a).await,
        BenchCmd::Routing(a) => routing::run(a).await,
        BenchCmd::Ingest(a) => ingest::run(a).await,
        BenchCmd::External(a) => external::run(a).await,
    }
}
