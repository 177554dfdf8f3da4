//! `kvplane bridge`: the sidecar that joins one engine to the fleet.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use kvplane_ingest::bridge::{BridgeConfig, BridgeMetrics, run};
use kvplane_state::valid_name;
use prometheus_client::registry::Registry;
use tokio::sync::watch;

#[derive(Debug, Clone, clap::Args)]
pub struct BridgeArgs {
    #[arg(long, env = "KVPLANE_POOL", default_value = "default")]
    pub pool: String,
    /// This engine's worker name (unique in its pool; 1-63 of [a-z0-9-_]).
    #[arg(long, env = "KVPLANE_WORKER")]
    pub worker: String,
    /// The engine's data-parallel rank when each rank has its own bridge (vLLM's
    /// `data_parallel_rank`; its ZMQ ports are the base ports plus the rank). Its batches go
    /// to the rank's own subject, so each bridge resumes from its own last batch.
    #[arg(long, env = "KVPLANE_DP_RANK")]
    pub dp_rank: Option<u32>,
    /// The engine's HTTP base URL.
    #[arg(
        long,
        env = "KVPLANE_ENGINE_URL",
        default_value = "http://127.0.0.1:8000"
    )]
    pub engine_url: String,
    /// The address gateways should use for this engine (default: --engine-url).
    #[arg(long, env = "KVPLANE_ANNOUNCE_ADDRESS")]
    pub announce_address: Option<String>,
    #[arg(long, env = "KVPLANE_ZMQ_PUB", default_value = "tcp://127.0.0.1:5557")]
    pub zmq_pub: String,
    #[arg(
        long,
        env = "KVPLANE_ZMQ_REPLAY",
        default_value = "tcp://127.0.0.1:5558"
    )]
    pub zmq_replay: String,
    #[arg(
        long,
        env = "KVPLANE_NATS_URL",
        default_value = "nats://127.0.0.1:4222"
    )]
    pub nats_url: String,
    /// A NATS credentials file (user JWT and nkey seed).
    #[arg(long, env = "KVPLANE_NATS_CREDS")]
    pub nats_creds: Option<std::path::PathBuf>,
    /// A NATS user, with --nats-password-file.
    #[arg(long, env = "KVPLANE_NATS_USER")]
    pub nats_user: Option<String>,
    #[arg(long, env = "KVPLANE_NATS_PASSWORD_FILE")]
    pub nats_password_file: Option<std::path::PathBuf>,
    /// The CA of the NATS server's certificate: TLS to NATS.
    #[arg(long, env = "KVPLANE_NATS_CA")]
    pub nats_ca: Option<std::path::PathBuf>,
    /// A client certificate and key for a NATS server that verifies clients.
    #[arg(long, env = "KVPLANE_NATS_CERT")]
    pub nats_cert: Option<std::path::PathBuf>,
    #[arg(long, env = "KVPLANE_NATS_KEY")]
    pub nats_key: Option<std::path::PathBuf>,
    #[arg(long, default_value = "KVPLANE")]
    pub stream: String,
    #[arg(long, default_value_t = 500)]
    pub scrape_interval_ms: u64,
    /// Batches held while NATS is unreachable; beyond that they are counted as lost.
    #[arg(long, default_value_t = 100_000)]
    pub max_pending: usize,
    /// Address for the bridge's own /metrics. Port 0 picks a free port.
    #[arg(long, default_value = "127.0.0.1:0")]
    pub http_listen: String,
    /// While the engine is up, announce it again this often (ms).
    #[arg(long, default_value_t = 30_000)]
    pub announce_every_ms: u64,
}

pub async fn bridge(
    a: BridgeArgs,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let mut problems = Vec::new();
    if !valid_name(&a.pool) {
        problems.push(format!(
            "pool {:?} must be 1-63 characters of [a-z0-9-_]",
            a.pool
        ));
    }
    if !valid_name(&a.worker) {
        problems.push(format!(
            "worker {:?} must be 1-63 characters of [a-z0-9-_]",
            a.worker
        ));
    }
    if a.scrape_interval_ms == 0 {
        problems.push("scrape-interval-ms must be at least 1".into());
    }
    let nats_auth = kvplane_ingest::NatsAuth {
        creds_file: a.nats_creds,
        user: a.nats_user,
        password_file: a.nats_password_file,
        ca: a.nats_ca,
        cert: a.nats_cert,
        key: a.nats_key,
    };
    problems.extend(nats_auth.problems(|key| {
        match key {
            "creds_file" => "--nats-creds",
            "password_file" => "--nats-password-file",
            "user" => "--nats-user",
            "ca" => "--nats-ca",
            "cert" => "--nats-cert",
            _ => "--nats-key",
        }
        .to_owned()
    }));
    if !problems.is_empty() {
        anyhow::bail!("invalid bridge arguments:\n  - {}", problems.join("\n  - "));
    }
    let metrics = Arc::new(BridgeMetrics::default());
    let mut registry = Registry::default();
    metrics.register(&mut registry);
    registry.register_collector(crate::process_metrics::ProcessCollector::boxed());
    let registry = Arc::new(registry);
    let listener = tokio::net::TcpListener::bind(&a.http_listen)
        .await
        .with_context(|| format!("cannot listen on --http-listen {}", a.http_listen))?;
    let addr = listener.local_addr()?;
    let (stop_tx, stop_rx) = watch::channel(false);
    let app = axum::Router::new().route(
        "/metrics",
        axum::routing::get(move || {
            let registry = registry.clone();
            async move {
                let mut out = String::new();
                let _ = prometheus_client::encoding::text::encode(&mut out, &registry);
                // What prometheus-client writes is OpenMetrics text, and says so.
                (
                    [(
                        axum::http::header::CONTENT_TYPE,
                        "application/openmetrics-text; version=1.0.0; charset=utf-8",
                    )],
                    out,
                )
            }
        }),
    );
    let mut rx = stop_rx.clone();
    let http = tokio::spawn(async move {
        // Nagle off, as on every other listener of kvplane's (a scrape's answer is not held
        // for the scraper's ACK of its headers).
        use axum::serve::ListenerExt as _;
        let listener = listener.tap_io(|tcp| {
            let _ = tcp.set_nodelay(true);
        });
        axum::serve(listener, app)
            .with_graceful_shutdown(async move {
                let _ = rx.wait_for(|s| *s).await;
            })
            .await
    });
    let cfg = BridgeConfig {
        pool: a.pool,
        worker: a.worker,
        dp_rank: a.dp_rank,
        engine_url: a.engine_url,
        announce_address: a.announce_address,
        zmq_pub: a.zmq_pub,
        zmq_replay: a.zmq_replay,
        nats_url: a.nats_url,
        nats_auth,
        stream: a.stream,
        scrape_interval: Duration::from_millis(a.scrape_interval_ms),
        max_pending: a.max_pending,
        replay_timeout: Duration::from_secs(2),
        announce_every: Duration::from_millis(a.announce_every_ms.max(1)),
    };
    println!("kvplane-bridge ready http={addr}");
    let task = tokio::spawn(run(cfg, metrics, stop_rx));
    shutdown.await;
    let _ = stop_tx.send(true);
    let _ = task.await;
    let _ = http.await;
    Ok(())
}
