//! `kvplane serve`: one node, assembled from components that each run until the one stop
//! signal (`tasks.rs`): the member's gauges, the config sources, the leader's ingest, the quota
//! refiller, the tokenizer loader, the replicas' decision gossip, gRPC and HTTP.
//!
//! ```text
//! NATS JetStream --(ordered consumer, leader)--> Ingestor --propose--> Raft --apply--> StateMachine
//!                                                                                    | publishes
//!                          gRPC Router/Admin <--- reads (lock-free) ---- StateHandle <+
//! ```

mod grpc;
mod http;
mod ingest;
mod metrics;
mod tasks;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use kvplane_api::predict::{Predictor, wall_clock};
use kvplane_api::{Escrow, QuotaConfig, Tokenizers};
use kvplane_ingest::IngestConfig;
use kvplane_raft::RaftMember;
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;

use crate::config::Config;
use crate::sources;

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
    let metrics = metrics::NodeMetrics::default();
    let mut registry = Registry::default();
    metrics.register(&mut registry, cfg.policy_kubernetes.is_some());
    let kube = kube_source(&cfg).await?;
    let tokenizers =
        Arc::new(Tokenizers::with_models(&cfg.tokenizer_dirs()).context("tokenizers")?);
    tokenizers.register(&mut registry);
    let predictor = Arc::new(Predictor::new(wall_clock()));
    predictor.register(&mut registry);
    let registry = Arc::new(registry);

    // The log: every node is a Raft member (a node of its own is a one-member cluster).
    let on_applied: kvplane_raft::OnApplied = {
        let m = metrics.state.clone();
        Arc::new(move |a| m.observe(a))
    };
    let member =
        Arc::new(RaftMember::start(&cfg.raft, &cfg.data_dir, bound.grpc, on_applied).await?);
    let handle = member.handle.clone();
    let ready: http::Ready = {
        let (m, lag) = (member.clone(), cfg.raft.ready_max_lag_entries);
        let lease = Duration::from_millis(cfg.raft.election_timeout_max_ms * 2);
        Arc::new(move || m.readiness(lag, lease))
    };
    let nats = async_nats::ConnectOptions::new()
        .name(format!("kvplane-{}", cfg.node_id))
        .retry_on_initial_connect()
        .connect(cfg.nats_url.as_str())
        .await
        .with_context(|| format!("cannot use nats_url {}", cfg.nats_url))?;

    let mut tasks = tasks::Tasks::new();
    let stop_signal = tasks.stop_signal();
    let stop = || stop_signal.clone();
    let snapshot_file = cfg
        .data_dir
        .join(kvplane_raft::STATE_DIR)
        .join(kvplane_raft::SNAPSHOT_FILE);
    tasks.spawn(
        "raft gauges",
        metrics
            .raft
            .clone()
            .run(member.clone(), snapshot_file, ready.clone(), stop()),
    );
    tasks.spawn(
        "state gauges",
        metrics.state.clone().follow(handle.clone(), stop()),
    );
    tasks.spawn("join", {
        let (m, s) = (member.clone(), stop());
        async move { m.join(s).await }
    });
    if let Some(follow) = statefulset_follower(&cfg, &member, stop()).await {
        tasks.spawn("statefulset membership", follow);
    }
    // The config sources, kept in the state by whoever leads.
    let source = sources::Context {
        log: member.log.clone(),
        state: handle.clone(),
        leading: {
            let m = member.clone();
            Arc::new(move || m.is_leader())
        },
        synced: Arc::new(tokio::sync::watch::channel(0).0),
        tokenizers: tokenizers.clone(),
    };
    let config_synced =
        (cfg.policy_dir.is_some() || kube.is_some()).then(|| source.synced.subscribe());
    if let Some(dir) = cfg.policy_dir.clone() {
        let every = Duration::from_millis(cfg.policy_poll_ms);
        tasks.spawn(
            "policy directory",
            sources::directory::run(
                dir,
                every,
                source.clone(),
                metrics.directory.clone(),
                stop(),
            ),
        );
    }
    if let Some((client, namespace, resync)) = kube {
        tasks.spawn(
            "kubernetes policies",
            sources::kubernetes::run(
                client,
                namespace,
                resync,
                source.clone(),
                metrics.kubernetes.clone(),
                stop(),
            ),
        );
    }
    let lead = ingest::LeadIngest {
        member: member.clone(),
        stream: async_nats::jetstream::new(nats.clone()),
        config: IngestConfig {
            stream: cfg.ingest.stream.clone(),
            max_batch_messages: cfg.ingest.max_batch_messages,
            max_batch_delay: Duration::from_millis(cfg.ingest.max_batch_delay_ms),
            max_message_bytes: cfg.ingest.max_message_bytes,
        },
        metrics: metrics.ingest.clone(),
        pools: cfg.declared_pools(),
        config_synced,
    };
    tasks.spawn("ingest", lead.run(stop()));

    // Routing: the escrow and its refiller, tokenizers, the decision gossip, gRPC and HTTP.
    let escrow = Arc::new(Escrow::new(
        quota_config(&cfg, &member),
        handle.clone(),
        metrics.quota.clone(),
    ));
    tasks.spawn(
        "quota refiller",
        kvplane_api::run_refiller(escrow.clone(), member.clone(), stop()),
    );
    tasks.spawn(
        "tokenizer loader",
        kvplane_api::run_tokenizer_loader(
            tokenizers.clone(),
            handle.clone(),
            Duration::from_secs(1),
            stop(),
        ),
    );
    let (routed, routed_rx) = crate::routed_share::sink(metrics.share.clone());
    tasks.spawn(
        "decision gossip",
        crate::routed_share::run(
            nats,
            cfg.node_id.clone(),
            predictor.clone(),
            routed_rx,
            metrics.share.clone(),
            stop(),
        ),
    );
    let shared = grpc::Shared {
        tokenizers,
        predictor,
        escrow,
        routed,
    };
    let services = grpc::services(&cfg, &member, &metrics, shared);
    tasks.spawn("grpc", grpc::serve(grpc, services, member.clone(), stop()));
    tasks.spawn("http", http::serve(http, registry, ready, stop()));

    tracing::info!(node_id = cfg.node_id, grpc = %bound.grpc, http = %bound.http, applied_index = handle.load().applied_index, "kvplane node serving");
    on_ready(bound);
    shutdown.await;
    tracing::info!("shutting down");
    tasks.stop().await;
    member.stop(Duration::from_secs(10)).await;
    tracing::info!("stopped");
    Ok(())
}

/// The escrow's settings: this member's id names the replica in the ledger.
fn quota_config(cfg: &Config, member: &RaftMember) -> QuotaConfig {
    QuotaConfig {
        replica: member.membership.id,
        grant_wait: Duration::from_millis(cfg.quota.grant_wait_ms),
        idle_release: Duration::from_millis(cfg.quota.idle_release_ms),
        default_max_output_tokens: cfg.quota.default_max_output_tokens,
        ..Default::default()
    }
}

/// The Kubernetes client, namespace and resync period of `[policy_kubernetes]`, when set.
async fn kube_source(cfg: &Config) -> anyhow::Result<Option<(kube::Client, String, Duration)>> {
    let Some(k) = &cfg.policy_kubernetes else {
        return Ok(None);
    };
    let client = kube::Client::try_default()
        .await
        .map_err(|e| anyhow::anyhow!("policy_kubernetes: no kubernetes client: {e}"))?;
    let namespace = k
        .namespace
        .clone()
        .unwrap_or_else(|| client.default_namespace().to_owned());
    Ok(Some((
        client,
        namespace,
        Duration::from_millis(k.resync_ms),
    )))
}

/// A StatefulSet's leader follows its scale-downs, when `[raft.kubernetes]` asks for it and
/// this member is one of its pods.
async fn statefulset_follower(
    cfg: &Config,
    member: &Arc<RaftMember>,
    stop: tokio::sync::watch::Receiver<bool>,
) -> Option<impl Future<Output = ()> + Send + 'static> {
    let k = cfg
        .raft
        .kubernetes
        .as_ref()
        .filter(|k| k.manage_membership)?;
    let pod = member.membership.pod.as_ref()?;
    let client = match kube::Client::try_default().await {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!(error = %e, "no kubernetes client: scale-downs will not leave the membership by themselves");
            return None;
        }
    };
    Some(kvplane_raft::follow_statefulset(
        client,
        k.namespace().unwrap_or_else(|_| "default".into()),
        pod.set.clone(),
        Duration::from_millis(k.membership_check_ms),
        member.clone(),
        stop,
    ))
}
