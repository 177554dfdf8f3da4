//! `kvplane serve`: one node, assembled from components that each run until the one stop
//! signal (`tasks.rs`): the member's gauges, the config sources, the leader's ingest, the quota
//! refiller, the tokenizer loader, the replicas' decision gossip, gRPC and HTTP.
//!
//! ```text
//! NATS JetStream --(ordered consumer, leader)--> Ingestor --propose--> Raft --apply--> StateMachine
//!                                                                                    | publishes
//!                          gRPC Router/Admin <--- reads (lock-free) ---- StateHandle <+
//! ```

mod components;
mod grpc;
mod http;
mod ingest;
mod lag;
mod lease;
mod metrics;
mod parts;
mod ready;
mod retire;
mod tasks;
mod ticks;

use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Context;
use tokio::net::TcpListener;

use crate::config::Config;

/// Addresses the node actually bound (useful with port 0).
#[derive(Debug, Clone, Copy)]
pub struct Bound {
    pub grpc: SocketAddr,
    pub http: SocketAddr,
}

/// Binds the listeners named in `cfg`.
pub async fn bind(cfg: &Config) -> anyhow::Result<(TcpListener, TcpListener)> {
    let grpc = TcpListener::bind(&cfg.grpc_listen)
        .await
        .with_context(|| format!("cannot listen on grpc_listen {}", cfg.grpc_listen))?;
    let http = TcpListener::bind(&cfg.http_listen)
        .await
        .with_context(|| format!("cannot listen on http_listen {}", cfg.http_listen))?;
    Ok((grpc, http))
}

/// Runs a node until `shutdown` resolves, then stops every component and the member (which
/// writes a final snapshot). `on_ready` is called once both listeners serve.
pub async fn run(
    cfg: Config,
    grpc: TcpListener,
    http: TcpListener,
    shutdown: impl Future<Output = ()> + Send,
    on_ready: impl FnOnce(Bound),
) -> anyhow::Result<()> {
    let bound = Bound {
        grpc: grpc.local_addr()?,
        http: http.local_addr()?,
    };
    let mut p = parts::Parts::assemble(cfg, bound).await?;
    let ready = p.ready();
    let mut tasks = tasks::Tasks::new();
    components::member(&p, &mut tasks, ready.clone()).await;
    let config_synced = components::config_sources(&mut p, &mut tasks);
    components::ingest(&p, &mut tasks, config_synced);
    let services = components::routing(&p, &mut tasks);
    if let Some(tls) = p.tls.clone() {
        tasks.spawn("tls files", |mut stop| async move {
            let watching = tls.watch();
            let _ = stop.wait_for(|s| *s).await;
            watching.abort();
        });
    }
    let member = p.member.clone();
    let r = ready.clone();
    let tls = p.tls.clone();
    tasks.spawn_critical("grpc", |stop| {
        grpc::serve(grpc, tls, services, member, r, stop)
    });
    let port = http::HttpPort {
        tls: p.tls.clone(),
        section: p.cfg.http,
        api: p.metrics.api.clone(),
        registry: p.registry.clone(),
        ready,
    };
    tasks.spawn_critical("http", |stop| http::serve(http, port, stop));

    let applied_index = p.member.handle.load().applied_index;
    tracing::info!(node_id = p.cfg.node_id, grpc = %bound.grpc, http = %bound.http, applied_index, "kvplane node serving");
    on_ready(bound);
    let ended = tokio::select! {
        () = shutdown => None,
        name = tasks.critical_ended() => Some(name),
    };
    tracing::info!("shutting down");
    tasks.stop().await;
    p.member.stop(Duration::from_secs(10)).await;
    tracing::info!("stopped");
    match ended {
        None => Ok(()),
        Some(name) => anyhow::bail!("the {name} component stopped, so the node stopped"),
    }
}
