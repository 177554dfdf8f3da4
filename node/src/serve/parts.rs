//! What a node's components are made of: its Raft member, metrics, NATS connection,
//! tokenizers and predictor, built once before any component starts.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use kvplane_api::Tokenizers;
use kvplane_api::predict::{Predictor, wall_clock};
use kvplane_raft::RaftMember;
use prometheus_client::registry::Registry;

use super::Bound;
use super::metrics::NodeMetrics;
use super::ready::{Ready, readiness};
use crate::config::Config;

pub(super) struct Parts {
    pub cfg: Config,
    pub member: Arc<RaftMember>,
    pub metrics: NodeMetrics,
    pub nats: async_nats::Client,
    /// Other clusters' NATS (`[[ingest.clusters]]`, in order).
    pub cluster_nats: Vec<async_nats::Client>,
    pub tokenizers: Arc<Tokenizers>,
    pub predictor: Arc<Predictor>,
    /// Round trips measured from reports, when `[locality] measure_rtt`.
    pub rtt: Option<Arc<kvplane_api::rtt::RttMeter>>,
    /// Every component's metrics.
    pub registry: Arc<Registry>,
    /// The Kubernetes client, namespace and resync period of `[policy_kubernetes]`.
    pub kube: Option<KubeWatch>,
    /// The same of `[kubernetes_engines]`.
    pub kube_engines: Option<KubeWatch>,
    /// This process's incarnation in the quota ledger.
    pub incarnation: u64,
    /// `[tls]`: the configurations in force (files watched for rotation).
    pub tls: Option<kvplane_tls::Tls>,
    /// Who may do what on the gRPC port.
    pub access: kvplane_api::Access,
}

impl Parts {
    /// Opens the member's log and state (every node is a Raft member: one of its own is a
    /// one-member cluster), connects to NATS, loads the tokenizers.
    pub(super) async fn assemble(cfg: Config, bound: Bound) -> anyhow::Result<Self> {
        let metrics = NodeMetrics::default();
        let mut registry = Registry::default();
        metrics.register(
            &mut registry,
            cfg.policy_kubernetes.is_some(),
            cfg.kubernetes_engines.is_some(),
        );
        let kube = match &cfg.policy_kubernetes {
            Some(k) => {
                Some(kube_watch("policy_kubernetes", k.namespace.as_deref(), k.resync_ms).await?)
            }
            None => None,
        };
        let kube_engines = match &cfg.kubernetes_engines {
            Some(k) => {
                Some(kube_watch("kubernetes_engines", k.namespace.as_deref(), k.resync_ms).await?)
            }
            None => None,
        };
        let tokenizers =
            Arc::new(Tokenizers::with_models(&cfg.tokenizer_dirs()).context("tokenizers")?);
        tokenizers.register(&mut registry);
        let predictor = Arc::new(Predictor::new(wall_clock()));
        predictor.register(&mut registry);
        let rtt = cfg.locality.measure_rtt.then(|| {
            let meter = Arc::new(kvplane_api::rtt::RttMeter::new(cfg.locality.clone()));
            meter.register(&mut registry);
            meter
        });
        let on_applied: kvplane_raft::OnApplied = {
            let m = metrics.state.clone();
            Arc::new(move |a| m.observe(a))
        };
        let incarnation = crate::incarnation::next(&cfg.data_dir, kvplane_api::wall_ms())?;
        let tls = match &cfg.tls {
            Some(s) => {
                let m = kvplane_tls::TlsMetrics::default();
                m.register(&mut registry);
                Some(kvplane_tls::Tls::load(s, m).context("tls")?)
            }
            None => None,
        };
        let members = match &tls {
            Some(tls) => Some(members(&cfg, tls)?),
            None => None,
        };
        let dialer = kvplane_tls::Dialer::new(tls.clone());
        let member = Arc::new(
            RaftMember::start(&cfg.raft, &cfg.data_dir, bound.grpc, on_applied, dialer).await?,
        );
        let access = access(&cfg, members, &member, &mut registry);
        registry.register_collector(crate::process_metrics::ProcessCollector::boxed());
        member.failures.register(&mut registry);
        member.log_writes.register(&mut registry);
        registry.register(
            "kvplane_raft_snapshot_failures",
            "Snapshot builds that failed (the state could not be captured or encoded, or the disk refused the file); the previous snapshot stays",
            member.snapshot_failures.clone(),
        );
        let name = format!("kvplane-{}", cfg.node_id);
        let nats = connect_nats(
            &name,
            (&cfg.nats_url, &cfg.nats),
            "nats_url",
            "not ready until it is back",
        )
        .await?;
        let mut cluster_nats = Vec::new();
        for (i, c) in cfg.ingest.clusters.iter().enumerate() {
            let key = format!("ingest.clusters[{i}].nats_url");
            let then = "its engines' events wait in its stream until it is back";
            cluster_nats.push(connect_nats(&name, (&c.nats_url, &c.nats), &key, then).await?);
        }
        Ok(Self {
            cfg,
            member,
            metrics,
            nats,
            cluster_nats,
            tokenizers,
            predictor,
            rtt,
            registry: Arc::new(registry),
            kube,
            kube_engines,
            incarnation,
            tls,
            access,
        })
    }

    /// Ready while the member knows a leader and keeps up, and NATS is reachable.
    pub(super) fn ready(&self) -> Ready {
        let lag = self.cfg.raft.ready_max_lag_entries;
        let lease = Duration::from_millis(self.cfg.raft.election_timeout_max_ms * 2);
        readiness(
            self.member.clone(),
            (lag, lease),
            self.nats.clone(),
            self.cfg.nats_url.clone(),
            (
                self.metrics.ingest.clone(),
                self.cfg.ingest.ready_max_pending_messages,
            ),
        )
    }
}

/// A connection to the NATS at `url` with `auth`, retried in the background from the start;
/// its log lines name the URL (async-nats's own name no server), and a lost connection says
/// what follows (`then`). `key` names the setting in errors.
async fn connect_nats(
    name: &str,
    (url, auth): (&str, &kvplane_ingest::NatsAuth),
    key: &str,
    then: &'static str,
) -> anyhow::Result<async_nats::Client> {
    let logged = url.to_owned();
    let options = async_nats::ConnectOptions::new()
        .name(name)
        .retry_on_initial_connect()
        .event_callback(move |event| {
            let url = logged.clone();
            async move {
                match event {
                    async_nats::Event::Connected => tracing::info!(%url, "nats connected"),
                    async_nats::Event::Disconnected => {
                        tracing::warn!(%url, "nats unreachable; {then}");
                    }
                    other => tracing::warn!(%url, event = %other, "nats"),
                }
            }
        });
    auth.apply(options)
        .await?
        .connect(url)
        .await
        .with_context(|| format!("cannot use {key} {url}"))
}

/// The members' identities (default: this node's own), which the other members' certificates
/// must name: as callers of Raft RPCs, and as servers this node dials.
fn members(cfg: &Config, tls: &kvplane_tls::Tls) -> anyhow::Result<Vec<String>> {
    let mut members = cfg.access.members.clone();
    if members.is_empty() {
        let own = tls.own_identity().context(
            "tls: this node's certificate names no URI or DNS name to know the other members by; set access.members",
        )?;
        members.push(own.0);
    }
    let check = members.clone();
    tls.check_servers(Arc::new(move |id| {
        check
            .iter()
            .any(|m| kvplane_policy::access::names(m, &id.0))
    }))
    .context("tls")?;
    Ok(members)
}

/// Who may do what: with TLS (`members` known), members and `[access]` administrators hold
/// every right, others what the replicated `AccessPolicy` objects grant.
fn access(
    cfg: &Config,
    members: Option<Vec<String>>,
    member: &RaftMember,
    registry: &mut Registry,
) -> kvplane_api::Access {
    let metrics = kvplane_api::AccessMetrics::default();
    metrics.register(registry);
    let state = member.handle.clone();
    let Some(members) = members else {
        tracing::warn!(
            "no [tls] section: the grpc port is plaintext and every caller may do everything"
        );
        return kvplane_api::Access::unchecked(state, metrics);
    };
    tracing::info!(?members, admins = ?cfg.access.admins, "tls on: callers are named by their certificates");
    kvplane_api::Access::new(true, members, cfg.access.admins.clone(), state, metrics)
}

/// A Kubernetes client, the namespace it watches and how often its watcher resyncs.
pub(super) type KubeWatch = (kube::Client, String, Duration);

/// The client, namespace (default: the client's) and resync period of config section `section`.
async fn kube_watch(
    section: &str,
    namespace: Option<&str>,
    resync_ms: u64,
) -> anyhow::Result<KubeWatch> {
    let client = kube::Client::try_default()
        .await
        .map_err(|e| anyhow::anyhow!("{section}: no kubernetes client: {e}"))?;
    let namespace = namespace.map_or_else(|| client.default_namespace().to_owned(), str::to_owned);
    Ok((client, namespace, Duration::from_millis(resync_ms)))
}
