//! The `kvplane` command line.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

use crate::config::{Config, Overrides};
use kvplane_bench::{BenchCmd, demo, sim_engine};
use kvplane_cli::route::{self, RouteArgs, StatusArgs};
use kvplane_cli::{cluster, config as config_cmd, explain, validate};

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
    Explain(explain::ExplainArgs),
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
    Demo(demo::DemoArgs),
    /// Raft membership: status, add, remove.
    Cluster(cluster::ClusterArgs),
    /// Config objects: put (as admin), delete (as admin or on behalf of their owner).
    Config(config_cmd::ConfigArgs),
    /// Check policy YAML offline: every problem, with file, document and field path.
    Validate(validate::ValidateArgs),
    /// Certificates for development.
    #[command(subcommand)]
    Tls(TlsCmd),
    /// Print the CustomResourceDefinitions of the six kinds (five routing kinds, AccessPolicy).
    Crds,
    /// Benchmarks (JSON on stdout).
    #[command(subcommand)]
    Bench(BenchCmd),
}

#[derive(Debug, Subcommand)]
enum TlsCmd {
    /// A CA and certificates for a local cluster's members, an operator and a gateway.
    DevCerts(kvplane_cli::tls::DevCertsArgs),
}

#[derive(Debug, Subcommand)]
enum SimCmd {
    /// One simulated vLLM engine (OpenAI API, /metrics, ZMQ KV events).
    Engine(sim_engine::SimEngineArgs),
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
        Cmd::Route(a) => rt.block_on(route::route(a, false)),
        Cmd::Explain(a) => rt.block_on(explain::run(a)),
        Cmd::Status(a) => rt.block_on(route::status(a)),
        Cmd::Sim(SimCmd::Engine(a)) => rt.block_on(async {
            let t = crate::telemetry::init(crate::config::LogFormat::from_env(), "kvplane-sim");
            let r = sim_engine::engine(a, shutdown_signal()).await;
            t.shutdown();
            r
        }),
        Cmd::Bridge(a) => rt.block_on(async {
            let t = crate::telemetry::init(crate::config::LogFormat::from_env(), "kvplane-bridge");
            let r = crate::bridge_cmd::bridge(a, shutdown_signal()).await;
            t.shutdown();
            r
        }),
        Cmd::Gateway(a) => rt.block_on(async {
            let t = crate::telemetry::init(crate::config::LogFormat::from_env(), "kvplane-gateway");
            let r = crate::gateway_cmd::gateway(a, shutdown_signal()).await;
            t.shutdown();
            r
        }),
        Cmd::Demo(a) => rt.block_on(demo::run(a)),
        Cmd::Cluster(a) => rt.block_on(cluster::run(a)),
        Cmd::Config(a) => rt.block_on(config_cmd::run(a)),
        Cmd::Bench(c) => rt.block_on(kvplane_bench::run(c)),
        Cmd::Validate(a) => validate::validate(&a),
        Cmd::Tls(TlsCmd::DevCerts(a)) => kvplane_cli::tls::dev_certs(&a),
        Cmd::Crds => {
            validate::crds();
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
