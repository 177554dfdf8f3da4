//! `kvplane serve`: one node, wired together.
//!
//! ```text
//! NATS JetStream --(ordered consumer, leader)--> Ingestor --propose--> Raft --apply--> StateMachine
//!                                                                                    | publishes
//!                          gRPC Router/Admin <--- reads (lock-free) ---- StateHandle <+
//! ```

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use kvplane_api::{AdminService, ApiMetrics, Consistency, IngestStatus, NodeInfo, RouterService};
use kvplane_ingest::{IngestConfig, IngestMetrics, Ingestor};
use kvplane_proto::v1::admin_server::AdminServer;
use kvplane_proto::v1::router_server::RouterServer;
use kvplane_state::{Applied, Command, Owner, POOL_KIND, PoolConfig, Proposer, StateHandle};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::config::Config;
use kvplane_raft::{RaftLog, RaftMember};

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabel {
    reason: &'static str,
}

/// State-machine metrics of this replica.
#[derive(Debug, Default)]
struct StateMetrics {
    applied_index: Gauge,
    indexed_blocks: Gauge,
    kv_events: Counter,
    dropped: Family<ReasonLabel, Counter>,
}

impl StateMetrics {
    fn register(&self, r: &mut Registry) {
        r.register(
            "kvplane_state_applied_index",
            "Log index of the last applied entry",
            self.applied_index.clone(),
        );
        r.register(
            "kvplane_state_indexed_blocks",
            "GPU blocks in the prefix index",
            self.indexed_blocks.clone(),
        );
        r.register(
            "kvplane_state_kv_events",
            "vLLM KV events applied",
            self.kv_events.clone(),
        );
        r.register(
            "kvplane_state_dropped_events",
            "Items the state machine dropped, by reason",
            self.dropped.clone(),
        );
    }

    /// Gauges, from the view readers see.
    fn observe_view(&self, handle: &StateHandle) {
        let view = handle.load();
        self.applied_index
            .set(i64::try_from(view.applied_index).unwrap_or(i64::MAX));
        self.indexed_blocks
            .set(i64::try_from(view.indexed_blocks).unwrap_or(i64::MAX));
    }

    /// Counters, from what one entry did.
    fn observe(&self, a: &Applied) {
        self.kv_events.inc_by(a.kv_events);
        for (reason, n) in &a.dropped {
            self.dropped
                .get_or_create(&ReasonLabel {
                    reason: reason.as_str(),
                })
                .inc_by(*n);
        }
    }
}

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

/// Runs a node until `shutdown` resolves, then stops ingest and the API and writes a final
/// snapshot. `on_ready` is called once both listeners serve.
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
    let mut registry = Registry::default();
    let ingest_metrics = Arc::new(IngestMetrics::default());
    ingest_metrics.register(&mut registry);
    let api_metrics = Arc::new(ApiMetrics::default());
    api_metrics.register(&mut registry);
    let state_metrics = Arc::new(StateMetrics::default());
    state_metrics.register(&mut registry);
    let policy_metrics = Arc::new(crate::policy_source::PolicySourceMetrics::default());
    policy_metrics.register(&mut registry);
    let predictor = Arc::new(kvplane_api::predict::Predictor::new(
        kvplane_api::predict::wall_clock(),
    ));
    predictor.register(&mut registry);
    let share_metrics = Arc::new(crate::routed_share::ShareMetrics::default());
    share_metrics.register(&mut registry);
    let quota_metrics = kvplane_api::QuotaMetrics::default();
    quota_metrics.register(&mut registry);
    let kube_metrics = Arc::new(crate::kube_source::KubeSourceMetrics::default());
    let raft_gauges = Arc::new(kvplane_raft::RaftGauges::default());
    raft_gauges.register(&mut registry);
    let kube_client = match &cfg.policy_kubernetes {
        None => None,
        Some(k) => {
            kube_metrics.register(&mut registry);
            let client = kube::Client::try_default()
                .await
                .map_err(|e| anyhow::anyhow!("policy_kubernetes: no kubernetes client: {e}"))?;
            let namespace = k
                .namespace
                .clone()
                .unwrap_or_else(|| client.default_namespace().to_owned());
            Some((client, namespace, Duration::from_millis(k.resync_ms)))
        }
    };
    let tokenizers = Arc::new(
        kvplane_api::Tokenizers::with_models(
            &cfg.tokenizers
                .iter()
                .map(|t| (t.model.clone(), t.dir.clone()))
                .collect::<Vec<_>>(),
        )
        .context("tokenizers")?,
    );
    tokenizers.register(&mut registry);
    let registry = Arc::new(registry);
    let (stop_tx, stop_rx) = watch::channel(false);

    // The log: every node is a Raft member (a node of its own is a one-member cluster).
    let on_applied: kvplane_raft::OnApplied = {
        let m = state_metrics.clone();
        Arc::new(move |a: &Applied| m.observe(a))
    };
    let member =
        Arc::new(RaftMember::start(&cfg.raft, &cfg.data_dir, bound.grpc, on_applied).await?);
    let (log, handle) = (member.log.clone(), member.handle.clone());
    let consistency: Arc<dyn Consistency> = member.clone();
    // Ready while this member knows a leader and keeps up.
    let ready: Ready = {
        let m = member.clone();
        let (lag, lease) = (
            cfg.raft.ready_max_lag_entries,
            Duration::from_millis(cfg.raft.election_timeout_max_ms * 2),
        );
        Arc::new(move || m.readiness(lag, lease))
    };
    tokio::spawn(
        raft_gauges.clone().run(
            member.clone(),
            cfg.data_dir
                .join(kvplane_raft::STATE_DIR)
                .join(kvplane_raft::SNAPSHOT_FILE),
            ready.clone(),
            stop_rx.clone(),
        ),
    );
    {
        // Entries are applied inside Raft: refresh the state gauges from the view.
        let (m, h, mut rx) = (state_metrics.clone(), handle.clone(), stop_rx.clone());
        tokio::spawn(async move {
            loop {
                m.observe_view(&h);
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_millis(500)) => {}
                    _ = rx.changed() => return,
                }
            }
        });
    }

    let synced: crate::policy_source::Synced = Arc::new(watch::channel(0).0);
    // Ingest: only while this member leads.
    let nats = async_nats::ConnectOptions::new()
        .name(format!("kvplane-{}", cfg.node_id))
        .retry_on_initial_connect()
        .connect(cfg.nats_url.as_str())
        .await
        .with_context(|| format!("cannot use nats_url {}", cfg.nats_url))?;
    let ingest_task = {
        let js = async_nats::jetstream::new(nats.clone());
        let icfg = IngestConfig {
            stream: cfg.ingest.stream.clone(),
            max_batch_messages: cfg.ingest.max_batch_messages,
            max_batch_delay: Duration::from_millis(cfg.ingest.max_batch_delay_ms),
            max_message_bytes: cfg.ingest.max_message_bytes,
        };
        let (h, rx, m, log) = (
            handle.clone(),
            stop_rx.clone(),
            ingest_metrics.clone(),
            log.clone(),
        );
        let first = (cfg.policy_dir.is_some() || cfg.policy_kubernetes.is_some())
            .then(|| synced.subscribe());
        tokio::spawn(lead_ingest(
            member.clone(),
            cfg.clone(),
            js,
            icfg,
            log,
            m,
            h,
            first,
            rx,
        ))
    };

    // gRPC.
    let escrow = Arc::new(kvplane_api::Escrow::new(
        kvplane_api::QuotaConfig {
            replica: member.membership.id,
            grant_wait: Duration::from_millis(cfg.quota.grant_wait_ms),
            idle_release: Duration::from_millis(cfg.quota.idle_release_ms),
            default_max_output_tokens: cfg.quota.default_max_output_tokens,
            ..Default::default()
        },
        handle.clone(),
        quota_metrics,
    ));
    let refill_task = tokio::spawn(kvplane_api::run_refiller(
        escrow.clone(),
        consistency.clone(),
        stop_rx.clone(),
    ));
    let tokenizer_task = tokio::spawn(kvplane_api::run_tokenizer_loader(
        tokenizers.clone(),
        handle.clone(),
        Duration::from_secs(1),
        stop_rx.clone(),
    ));
    let (routed_sink, routed_rx) = crate::routed_share::sink(share_metrics.clone());
    let share_task = tokio::spawn(crate::routed_share::run(
        nats.clone(),
        cfg.node_id.clone(),
        predictor.clone(),
        routed_rx,
        share_metrics,
        stop_rx.clone(),
    ));
    let router = RouterService::new(handle.clone(), cfg.cost, api_metrics.clone())
        .with_tokenizers(tokenizers.clone())
        .with_consistency(consistency.clone())
        .with_quota(escrow.clone())
        .with_predictor(predictor)
        .with_routed_sink(routed_sink);
    let node_info = NodeInfo {
        node_id: cfg.node_id.clone(),
        role: {
            let m = member.clone();
            Arc::new(move || m.role())
        },
        cluster: Some(member.clone() as Arc<dyn kvplane_api::ClusterControl>),
        consistency,
        ingest: {
            let m = ingest_metrics.clone();
            Arc::new(move || IngestStatus {
                stream_last_sequence: m.stream_end(),
                rejected: m.rejected(),
            })
        },
    };
    let admin = AdminService::new(handle.clone(), node_info).with_quota(escrow);
    let (health_reporter, health_service) = tonic_health::server::health_reporter();
    health_reporter
        .set_serving::<RouterServer<RouterService>>()
        .await;
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(kvplane_proto::FILE_DESCRIPTOR_SET)
        .build_v1()?;
    let grpc_task = {
        let mut rx = stop_rx.clone();
        tokio::spawn(
            tonic::transport::Server::builder()
                .layer(crate::telemetry::GrpcTraceLayer)
                .add_service(RouterServer::new(router))
                .add_service(AdminServer::new(admin))
                .add_service(health_service)
                .add_service(reflection)
                .add_service(member.grpc_service())
                .serve_with_incoming_shutdown(
                    tokio_stream::wrappers::TcpListenerStream::new(grpc),
                    async move {
                        let _ = rx.wait_for(|s| *s).await;
                    },
                ),
        )
    };

    // HTTP: metrics and probes.
    let http_task = {
        let mut rx = stop_rx.clone();
        let app = crate::serve::http_app(registry.clone(), ready);
        tokio::spawn(async move {
            axum::serve(http, app)
                .with_graceful_shutdown(async move {
                    let _ = rx.wait_for(|s| *s).await;
                })
                .await
        })
    };

    tracing::info!(
        node_id = cfg.node_id,
        grpc = %bound.grpc,
        http = %bound.http,
        applied_index = handle.load().applied_index,
        "kvplane node serving"
    );
    // The policy directory, kept in the state by whoever leads.
    let policy_task = cfg.policy_dir.clone().map(|dir| {
        tokio::spawn(crate::policy_source::run(
            dir,
            Duration::from_millis(cfg.policy_poll_ms),
            log.clone(),
            handle.clone(),
            leading(&member),
            policy_metrics.clone(),
            synced.clone(),
            tokenizers.clone(),
            stop_rx.clone(),
        ))
    });
    // The policy custom resources of the Kubernetes cluster, likewise.
    let kube_task = kube_client.map(|(client, namespace, resync)| {
        tokio::spawn(crate::kube_source::run(
            client,
            namespace,
            resync,
            log.clone(),
            handle.clone(),
            leading(&member),
            kube_metrics.clone(),
            synced.clone(),
            tokenizers.clone(),
            stop_rx.clone(),
        ))
    });
    // A StatefulSet's leader follows scale-downs.
    let members_task = match &cfg.raft.kubernetes {
        Some(k) if k.manage_membership => {
            let m = &member;
            match (&m.membership.pod, kube::Client::try_default().await) {
                (Some(pod), Ok(client)) => Some(tokio::spawn(kvplane_raft::follow_statefulset(
                    client,
                    k.namespace().unwrap_or_else(|_| "default".into()),
                    pod.set.clone(),
                    Duration::from_millis(k.membership_check_ms),
                    m.clone(),
                    stop_rx.clone(),
                ))),
                (_, Err(e)) => {
                    tracing::warn!(error = %e, "no kubernetes client: scale-downs will not leave the membership by themselves");
                    None
                }
                (None, _) => None,
            }
        }
        _ => None,
    };
    // A new member that is to join asks for membership once its Raft service is up.
    let join_task = {
        let (m, rx) = (member.clone(), stop_rx.clone());
        tokio::spawn(async move { m.join(rx).await })
    };
    on_ready(bound);
    shutdown.await;
    tracing::info!("shutting down");
    let _ = stop_tx.send(true);
    let _ = ingest_task.await;
    for t in [
        Some(join_task),
        members_task,
        policy_task,
        kube_task,
        Some(refill_task),
        Some(share_task),
        Some(tokenizer_task),
    ]
    .into_iter()
    .flatten()
    {
        let _ = t.await;
    }
    if let Ok(Err(e)) = grpc_task.await {
        tracing::warn!(error = %e, "grpc server ended with an error");
    }
    let _ = http_task.await;
    member.final_snapshot(Duration::from_secs(10)).await;
    if let Err(e) = member.raft.shutdown().await {
        tracing::warn!(error = %e, "raft did not shut down cleanly");
    }
    tracing::info!("stopped");
    Ok(())
}

/// While this node leads: declare the configured pools, then consume the stream from the
/// recorded position. Stops consuming as soon as leadership is lost; the next leader resumes
/// from the position in the replicated state, and replayed messages are dropped by `apply`.
#[allow(clippy::too_many_arguments)]
async fn lead_ingest(
    member: Arc<RaftMember>,
    cfg: Config,
    js: async_nats::jetstream::Context,
    icfg: IngestConfig,
    log: RaftLog,
    metrics: Arc<IngestMetrics>,
    handle: StateHandle,
    mut config_synced: Option<watch::Receiver<u64>>,
    mut stop: watch::Receiver<bool>,
) {
    loop {
        if !member.wait_leadership(&mut stop).await {
            return;
        }
        // First: a member added while the config sources catch up must find this address.
        member.refresh_own_address().await;
        // The config sources apply what they have first (at most 10 s): an engine's messages
        // for a worker set the catalog is about to hold are not dropped as of an unknown pool.
        if let Some(rx) = &mut config_synced {
            let seen = *rx.borrow_and_update();
            let _ = tokio::time::timeout(Duration::from_secs(10), rx.wait_for(|n| *n > seen)).await;
        }
        tracing::info!(
            applied = handle.load().applied_index,
            "leading: starting ingest"
        );
        if let Err(e) = reconcile_pools(&cfg, &log, &handle).await {
            tracing::warn!(error = %e, "could not declare the configured pools");
        }
        let (term_tx, term_rx) = watch::channel(false);
        let ingestor = Ingestor::new(js.clone(), icfg.clone(), log.clone(), metrics.clone());
        let h = handle.clone();
        let task = tokio::spawn(async move {
            if let Err(e) = ingestor
                .run(move || h.load().last_stream_seq, term_rx)
                .await
            {
                tracing::info!(error = %e, "ingest stopped");
            }
        });
        member.wait_lost_leadership(&mut stop).await;
        let _ = term_tx.send(true);
        let _ = task.await;
        tracing::info!("not leading: ingest stopped");
    }
}

/// Declares the pools of the node configuration (creating or updating them; they are the
/// node's). A pool another source owns is left alone, with a warning. The node never deletes a
/// pool it no longer declares (members may run different configurations during a rollout):
/// `Admin.DeleteConfig` with owner `node` does.
async fn reconcile_pools(
    cfg: &Config,
    log: &impl Proposer,
    handle: &StateHandle,
) -> anyhow::Result<()> {
    let view = handle.load();
    for p in &cfg.declared_pools() {
        let want = PoolConfig {
            block_size: p.block_size,
            models: p.models.clone(),
            lora_adapters: p.lora_adapters.clone(),
        };
        let owner = view.owner(POOL_KIND, &p.name);
        if let Some(other) = owner.filter(|o| *o != Owner::Node) {
            tracing::warn!(pool = p.name, owner = %other, "a configured pool is owned by another source; left as it is");
            continue;
        }
        if view.pools.get(&p.name).map(|v| &v.config) != Some(&want) || owner.is_none() {
            log.propose(Command::ConfigPut {
                owner: Some(Owner::Node),
                kind: POOL_KIND.into(),
                name: p.name.clone(),
                value: want.to_json(),
            })
            .await?;
        }
    }
    Ok(())
}

/// Why this node is not ready to serve, if it is not.
type Ready = Arc<dyn Fn() -> Result<(), kvplane_raft::NotReady> + Send + Sync>;

fn http_app(registry: Arc<Registry>, ready: Ready) -> axum::Router {
    use axum::http::{StatusCode, header};
    use axum::routing::get;
    axum::Router::new()
        .route(
            "/metrics",
            get(move || {
                let registry = registry.clone();
                async move {
                    let mut body = String::new();
                    match prometheus_client::encoding::text::encode(&mut body, &registry) {
                        Ok(()) => (
                            StatusCode::OK,
                            [(
                                header::CONTENT_TYPE,
                                "application/openmetrics-text; version=1.0.0; charset=utf-8",
                            )],
                            body,
                        ),
                        Err(_) => (
                            StatusCode::INTERNAL_SERVER_ERROR,
                            [(header::CONTENT_TYPE, "text/plain")],
                            "metrics encoding failed".to_owned(),
                        ),
                    }
                }
            }),
        )
        .route("/healthz", get(|| async { "ok" }))
        .route(
            "/readyz",
            get(move || {
                let ready = ready();
                async move {
                    match ready {
                        Ok(()) => (StatusCode::OK, "ready".to_owned()),
                        Err(why) => (StatusCode::SERVICE_UNAVAILABLE, format!("not ready: {why}")),
                    }
                }
            }),
        )
}

/// Whether this node is the one that should act for the cluster now.
fn leading(member: &Arc<RaftMember>) -> Box<dyn Fn() -> bool + Send> {
    let m = member.clone();
    Box::new(move || m.is_leader())
}
