//! Whole-system drivers of the `kvplane` binary: `kvplane bench ...` (benchmarks that print
//! JSON, checked in CI in their small modes), `kvplane demo` (a local fleet end to end) and
//! `kvplane sim engine` (one simulated vLLM engine, the demo's and the tests' fleet).
//! They start real Raft members, drive `api/`'s RouterService on `state/`, and run `sim/`'s
//! engine model; none of it runs inside a node.

mod catalog_size;
pub mod cluster;
pub mod demo;
mod grants;
pub mod ingest;
mod procs;
pub(crate) mod routing;
pub mod sim_engine;

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
}

pub async fn run(cmd: BenchCmd) -> anyhow::Result<()> {
    match cmd {
        BenchCmd::Cluster(a) => cluster::run(a).await,
        BenchCmd::Routing(a) => routing::run(a).await,
        BenchCmd::Ingest(a) => ingest::run(a).await,
    }
}
