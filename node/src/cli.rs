//! The `kvplane` command line.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

use crate::config::{Config, Overrides};
use crate::route_cmd::{self, RouteArgs, StatusArgs};

#[derive(Debug, Parser)]
#[command(
    name = "kvplane",
    version,
    about = "A Raft-replicated control plane for vLLM fleets"
)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Run a kvplane node.
    Serve(Overrides),
    /// Ask a node where one request should go.
    Route(RouteArgs),
    /// Show every candidate a node considered for a request, and why it won or lost; offline
    /// with `--state SNAPSHOT_OR_ADDR` and/or `--policies DIR`.
    Explain(crate::explain_cmd::ExplainArgs),
    /// Show a node's state: applied index, digest, workers, ingest position.
    Status(StatusArgs),
    /// Simulators.
    #[command(subcommand)]
    Sim(SimCmd),
    /// Join one vLLM engine to the fleet: its ZMQ KV events and metrics, onto NATS.
    Bridge(crate::bridge_cmd::BridgeArgs),
    /// An OpenAI-compatible HTTP gateway that routes with kvplane.
    Gateway(crate::gateway_cmd::GatewayArgs),
    /// Run a local fleet end to end and compare kvplane with round-robin.
    Demo(crate::demo::DemoArgs),
    /// Raft membership: status, add, remove.
    Cluster(crate::cluster_cmd::ClusterArgs),
    /// Config objects: put (as admin), delete (as admin or on behalf of their owner).
    Config(crate::config_cmd::ConfigArgs),
    /// Check policy YAML offline: every problem, with file, document and field path.
    Validate(crate::policy_cmd::ValidateArgs),
    /// Print the CustomResourceDefinitions of the five policy kinds.
    Crds,
    /// Benchmarks (JSON on stdout).
    #[command(subcommand)]
    Bench(crate::bench::BenchCmd),
}

#[derive(Debug, Subcommand)]
enum SimCmd {
    /// One simulated vLLM engine (OpenAI API, /metrics, ZMQ KV events).
    Engine(crate::sim_cmd::SimEngineArgs),
}

pub fn main() -> ExitCode {
    let cli = Cli::parse();
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("kvplane: cannot start the async runtime: {e}");
            return ExitCode::from(70);
        }
    };
    let result = match cli.command {
        Cmd::Serve(o) => match Config::load(&o) {
            Ok(cfg) => rt.block_on(serve(cfg)),
            Err(e) => {
                eprintln!("kvplane: {e}");
                return ExitCode::from(2);
            }
        },
        Cmd::Route(a) => rt.block_on(route_cmd::route(a, false)),
        Cmd::Explain(a) => rt.block_on(crate::explain_cmd::run(a)),
        Cmd::Status(a) => rt.block_on(route_cmd::status(a)),
        Cmd::Sim(SimCmd::Engine(a)) => rt.block_on(async {
            let t = crate::telemetry::init(crate::config::LogFormat::Text, "kvplane-sim");
            let r = crate::sim_cmd::engine(a, shutdown_signal()).await;
            t.shutdown();
            r
        }),
        Cmd::Bridge(a) => rt.block_on(async {
            let t = crate::telemetry::init(crate::config::LogFormat::Text, "kvplane-bridge");
            let r = crate::bridge_cmd::bridge(a, shutdown_signal()).await;
            t.shutdown();
            r
        }),
        Cmd::Gateway(a) => rt.block_on(async {
            let t = crate::telemetry::init(crate::config::LogFormat::Text, "kvplane-gateway");
            let r = crate::gateway_cmd::gateway(a, shutdown_signal()).await;
            t.shutdown();
            r
        }),
        Cmd::Demo(a) => rt.block_on(crate::demo::run(a)),
        Cmd::Cluster(a) => rt.block_on(crate::cluster_cmd::run(a)),
        Cmd::Config(a) => rt.block_on(crate::config_cmd::run(a)),
        Cmd::Bench(c) => rt.block_on(crate::bench::run(c)),
        Cmd::Validate(a) => crate::policy_cmd::validate(&a),
        Cmd::Crds => {
            crate::policy_cmd::crds();
            Ok(())
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvplane: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn serve(cfg: Config) -> anyhow::Result<()> {
    let telemetry = crate::telemetry::init(cfg.log_format, "kvplane");
    // One process per data directory, before anything else: held until the node has stopped.
    let _data_dir = crate::data_dir_lock::DataDirLock::acquire(&cfg.data_dir)?;
    let (grpc, http) = crate::serve::bind(&cfg).await?;
    let r = crate::serve::run(cfg, grpc, http, shutdown_signal(), |b| {
        // One machine-readable line on stdout; logs go to stderr.
        println!("kvplane ready grpc={} http={}", b.grpc, b.http);
    })
    .await;
    telemetry.shutdown();
    r
}

/// Resolves on SIGTERM or SIGINT.
pub(crate) async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = term => {}
    }
}
