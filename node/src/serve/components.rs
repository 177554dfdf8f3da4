//! The node's components, by group, each spawned into the node's [`Tasks`].

use std::sync::Arc;
use std::time::Duration;

use kvplane_api::{Escrow, QuotaConfig};
use kvplane_ingest::IngestConfig;
use tokio::sync::watch;

use super::grpc;
use super::ingest::{LeadIngest, StreamSource};
use super::parts::Parts;
use super::ready::Ready;
use super::tasks::Tasks;
use crate::sources;

/// The member's own: its gauges, the join of a new member, a StatefulSet's scale-downs.
pub(super) async fn member(p: &Parts, tasks: &mut Tasks, ready: Ready) {
    let snapshot_file = p
        .cfg
        .data_dir
        .join(kvplane_raft::STATE_DIR)
        .join(kvplane_raft::SNAPSHOT_FILE);
    let (gauges, member) = (p.metrics.raft.clone(), p.member.clone());
    let ready = Arc::new(move || ready().is_ok());
    tasks.spawn("raft gauges", |stop| {
        gauges.run(member, snapshot_file, ready, stop)
    });
    let (state, handle) = (p.metrics.state.clone(), p.member.handle.clone());
    tasks.spawn("state gauges", |stop| state.follow(handle, stop));
    let member = p.member.clone();
    tasks.spawn("join", |stop| async move { member.join(stop).await });
    // Raft stopping on its own (a log write failed) leaves a member that can do nothing:
    // the node stops, and exits with an error, to be started again on what its disk holds.
    let member = p.member.clone();
    tasks.spawn_critical("raft", |mut stop| async move {
        tokio::select! {
            () = member.stopped() => {}
            _ = stop.wait_for(|s| *s) => {}
        }
    });
    if let Some(k) = p
        .cfg
        .raft
        .kubernetes
        .as_ref()
        .filter(|k| k.manage_membership)
        && let Some(pod) = &p.member.membership.pod
        // A learner set (another cluster's) never leads: its ordinal 0 follows its own set's
        // scale-down through the members it joined.
        && (!p.member.membership.learner || pod.ordinal == 0)
    {
        match kube::Client::try_default().await {
            Ok(client) => {
                let (namespace, set) = (
                    k.namespace().unwrap_or_else(|_| "default".into()),
                    pod.set.clone(),
                );
                let (every, member) = (
                    Duration::from_millis(k.membership_check_ms),
                    p.member.clone(),
                );
                if p.member.membership.learner {
                    tasks.spawn("learner set membership", |stop| {
                        kvplane_raft::follow_learner_set(
                            client, namespace, set, every, member, stop,
                        )
                    });
                } else {
                    tasks.spawn("statefulset membership", |stop| {
                        kvplane_raft::follow_statefulset(
                            client, namespace, set, every, member, stop,
                        )
                    });
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "no kubernetes client: scale-downs will not leave the membership by themselves")
            }
        }
    }
}

/// The config sources, kept in the state by whoever leads; the counter of their passes when
/// there is one (a new leader's ingest waits for a pass).
pub(super) fn config_sources(p: &mut Parts, tasks: &mut Tasks) -> Option<watch::Receiver<u64>> {
    let member = p.member.clone();
    let source = sources::Context {
        log: p.member.log.clone(),
        state: p.member.handle.clone(),
        leading: Arc::new(move || member.is_leader()),
        synced: Arc::new(watch::channel(0).0),
        tokenizers: p.tokenizers.clone(),
    };
    let synced =
        (p.cfg.policy_dir.is_some() || p.kube.is_some()).then(|| source.synced.subscribe());
    if let Some(dir) = p.cfg.policy_dir.clone() {
        let every = Duration::from_millis(p.cfg.policy_poll_ms);
        let bounds = kvplane_policy::FileBounds {
            file_bytes: p.cfg.limits.policy_file_bytes,
            file_nodes: p.cfg.limits.policy_file_nodes,
        };
        let (s, m) = (source.clone(), p.metrics.directory.clone());
        tasks.spawn("policy directory", |stop| {
            sources::directory::run((dir, bounds), every, s, m, stop)
        });
    }
    {
        // Also with the checks off: it then brings back what earlier checks took out.
        let (cfg, s) = (p.cfg.endpoint_health.clone(), source.clone());
        let m = p.metrics.endpoint_health.clone();
        tasks.spawn("listed engines' health", |stop| {
            sources::static_health::run(cfg, s, m, stop)
        });
    }
    if let Some((client, namespace, resync)) = p.kube_engines.take() {
        let (s, m) = (source.clone(), p.metrics.kube_engines.clone());
        tasks.spawn("kubernetes engines", |stop| {
            sources::kube_engines::run(client, namespace, resync, s, m, stop)
        });
    }
    if let Some((client, namespace, resync)) = p.kube.take() {
        let m = p.metrics.kubernetes.clone();
        tasks.spawn("kubernetes policies", |stop| {
            sources::kubernetes::run(client, namespace, resync, source, m, stop)
        });
    }
    synced
}

/// The leader's ingest of the node's stream and other clusters' (connected to here, each
/// through its own NATS).
pub(super) fn ingest(p: &Parts, tasks: &mut Tasks, config_synced: Option<watch::Receiver<u64>>) {
    let config = |stream: &str, source: kvplane_state::Source| IngestConfig {
        stream: stream.to_owned(),
        max_batch_messages: p.cfg.ingest.max_batch_messages,
        max_batch_delay: Duration::from_millis(p.cfg.ingest.max_batch_delay_ms),
        max_message_bytes: p.cfg.ingest.max_message_bytes,
        stall_after: Duration::from_millis(p.cfg.ingest.stall_after_ms),
        create_stream: source == kvplane_state::Source::stream(),
        source,
    };
    let mut sources = vec![StreamSource {
        js: async_nats::jetstream::new(p.nats.clone()),
        config: config(&p.cfg.ingest.stream, kvplane_state::Source::stream()),
    }];
    for (c, nats) in p.cfg.ingest.clusters.iter().zip(&p.cluster_nats) {
        p.metrics.ingest.add_source(&c.name);
        sources.push(StreamSource {
            js: async_nats::jetstream::new(nats.clone()),
            config: config(&c.stream, kvplane_state::Source::named(c.name.clone())),
        });
    }
    let lead = LeadIngest {
        member: p.member.clone(),
        sources,
        metrics: p.metrics.ingest.clone(),
        lease: (p.cfg.ingest.worker_lease_ms > 0)
            .then(|| Duration::from_millis(p.cfg.ingest.worker_lease_ms)),
        pools: p.cfg.declared_pools(),
        config_synced,
    };
    tasks.spawn("ingest", |stop| lead.run(stop));
}

/// Routing's components - the escrow's refiller, the tokenizer loader, the decision gossip -
/// and the services they feed.
pub(super) fn routing(p: &Parts, tasks: &mut Tasks) -> grpc::Services {
    let (cfg, handle) = (&p.cfg, &p.member.handle);
    let quota = QuotaConfig {
        replica: p.member.membership.id,
        incarnation: p.incarnation,
        grant_wait: Duration::from_millis(cfg.quota.grant_wait_ms),
        idle_release: Duration::from_millis(cfg.quota.idle_release_ms),
        default_max_output_tokens: cfg.quota.default_max_output_tokens,
        ..Default::default()
    };
    let escrow = Arc::new(Escrow::new(quota, handle.clone(), p.metrics.quota.clone()));
    let (e, m) = (escrow.clone(), p.member.clone());
    tasks.spawn("quota refiller", |stop| {
        kvplane_api::run_refiller(e, m, stop)
    });
    let (t, h) = (p.tokenizers.clone(), handle.clone());
    tasks.spawn("tokenizer loader", |stop| {
        kvplane_api::run_tokenizer_loader(t, h, Duration::from_secs(1), stop)
    });
    let (routed, outgoing) = crate::routed_share::sink(p.metrics.share.clone());
    let (nats, id, predictor, m) = (
        p.nats.clone(),
        cfg.node_id.clone(),
        p.predictor.clone(),
        p.metrics.share.clone(),
    );
    tasks.spawn("decision gossip", |stop| {
        crate::routed_share::run(nats, id, predictor, outgoing, m, stop)
    });
    let shared = grpc::Shared {
        tokenizers: p.tokenizers.clone(),
        predictor: p.predictor.clone(),
        escrow,
        routed,
        rtt: p.rtt.clone(),
    };
    grpc::services(cfg, &p.member, &p.metrics, shared, p.access.clone())
}
