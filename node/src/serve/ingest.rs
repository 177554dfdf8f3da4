//! Ingest while leading: declare the configured pools, then consume every stream - the
//! node's own and other clusters' (`[[ingest.clusters]]`) - each from the position the state
//! records for it. Consuming stops as soon as leadership is lost; the next leader resumes
//! from the positions in the replicated state, and replayed messages are dropped by `apply`.
//! A consumer that ends while this member still leads is started again, with the others.

use std::sync::Arc;
use std::time::Duration;

use kvplane_ingest::{IngestConfig, IngestMetrics, Ingestor};
use kvplane_raft::RaftMember;
use kvplane_state::{Command, Owner, POOL_KIND, PoolConfig, Proposer, StateHandle};
use tokio::sync::watch;

use crate::config::PoolSection;

/// One stream the leader consumes, through its NATS connection.
pub(super) struct StreamSource {
    pub js: async_nats::jetstream::Context,
    pub config: IngestConfig,
}

/// What the leader's ingest needs.
pub(super) struct LeadIngest {
    pub member: Arc<RaftMember>,
    /// The node's own stream, then other clusters'. Each cluster's stream is consumed on its
    /// own: one that cannot be reached delays only its own events.
    pub sources: Vec<StreamSource>,
    pub metrics: Arc<IngestMetrics>,
    /// Workers' lease, when they have one.
    pub lease: Option<Duration>,
    /// The pools of the node configuration (`[[pools]]`), the node's own.
    pub pools: Vec<PoolSection>,
    /// The config sources' passes, when there are sources: a new leader waits for one.
    pub config_synced: Option<watch::Receiver<u64>>,
}

impl LeadIngest {
    /// Ingests during every term this member leads, until `stop`.
    pub(super) async fn run(mut self, mut stop: watch::Receiver<bool>) {
        let (log, handle) = (self.member.log.clone(), self.member.handle.clone());
        // Set while the consumer is started again within one lead (after it ended on its
        // own): the term's start is not repeated, and each further restart waits longer.
        let mut again: Option<Duration> = None;
        loop {
            if !self.member.wait_leadership(&mut stop).await {
                return;
            }
            if again.is_none() {
                // First: a member added while the config sources catch up must find this
                // address.
                self.member.refresh_own_address().await;
                // The config sources apply what they have first (at most 10 s): an engine's
                // messages for a worker set the catalog is about to hold are not dropped as of
                // an unknown pool.
                if let Some(rx) = &mut self.config_synced {
                    let seen = *rx.borrow_and_update();
                    let _ =
                        tokio::time::timeout(Duration::from_secs(10), rx.wait_for(|n| *n > seen))
                            .await;
                }
                tracing::info!(
                    applied = handle.load().applied_index,
                    "leading: starting ingest"
                );
                if let Err(e) = reconcile_pools(&self.pools, &log, &handle).await {
                    tracing::warn!(error = %e, "could not declare the configured pools");
                }
            }
            let (term_tx, _) = watch::channel(false);
            let mut consumers = Vec::new();
            let mut lags = Vec::new();
            for s in &self.sources {
                let ingestor = Ingestor::new(
                    s.js.clone(),
                    s.config.clone(),
                    log.clone(),
                    self.metrics.clone(),
                );
                let (h, source, term) =
                    (handle.clone(), s.config.source.clone(), term_tx.subscribe());
                consumers.push(tokio::spawn(async move {
                    ingestor
                        .run(
                            move || h.load().positions.get(&source).copied().unwrap_or(0),
                            term,
                        )
                        .await
                }));
                lags.push(tokio::spawn(super::lag::watch(
                    s.js.clone(),
                    s.config.stream.clone(),
                    (handle.clone(), s.config.source.clone()),
                    self.metrics.clone(),
                    term_tx.subscribe(),
                )));
            }
            let leases = self.lease.map(|lease| {
                tokio::spawn(super::lease::expire(
                    log.clone(),
                    handle.clone(),
                    lease,
                    self.metrics.clone(),
                    term_tx.subscribe(),
                ))
            });
            let retire = tokio::spawn(super::retire::retire_removed(
                self.member.clone(),
                term_tx.subscribe(),
            ));
            // Until leadership is lost - or the consumer ends on its own while this member
            // still leads (a proposal refused in a term change too quick to see, say): then
            // this term's tasks stop and ingest starts again, or nothing would consume the
            // stream until the next election.
            let ended = tokio::select! {
                () = self.member.wait_lost_leadership(&mut stop) => None,
                (ended, i, _) = futures::future::select_all(consumers.iter_mut()) => Some((ended, i)),
            };
            let _ = term_tx.send(true);
            let mut first = None;
            for (i, task) in consumers.into_iter().enumerate() {
                match ended {
                    Some((_, j)) if i == j => {}
                    _ => {
                        let result = task.await;
                        first.get_or_insert(result);
                    }
                }
            }
            let ended = match ended {
                Some((ended, _)) => ended,
                None => first.unwrap_or(Ok(Ok(()))),
            };
            for lag in lags {
                let _ = lag.await;
            }
            let _ = retire.await;
            if let Some(t) = leases {
                let _ = t.await;
            }
            let why = match ended {
                Ok(Ok(())) => "stopped".to_owned(),
                Ok(Err(e)) => e.to_string(),
                Err(e) => format!("the consumer failed: {e}"),
            };
            if self.member.is_leader() && !*stop.borrow() {
                let wait = again.map_or(Duration::from_millis(200), |d| {
                    (d * 2).min(Duration::from_secs(5))
                });
                again = Some(wait);
                tracing::warn!(
                    error = why,
                    retry_in_ms = wait.as_millis(),
                    "ingest ended while this member leads; starting it again"
                );
                tokio::select! {
                    _ = tokio::time::sleep(wait) => {}
                    _ = stop.changed() => {}
                }
            } else {
                again = None;
                self.metrics.stopped();
                tracing::info!(error = why, "not leading: ingest stopped");
            }
        }
    }
}

/// Declares the pools of the node configuration (creating or updating them; they are the
/// node's). A pool another source owns is left alone, with a warning. The node never deletes a
/// pool it no longer declares (members may run different configurations during a rollout):
/// `Admin.DeleteConfig` with owner `node` does.
async fn reconcile_pools(
    pools: &[PoolSection],
    log: &impl Proposer,
    handle: &StateHandle,
) -> Result<(), kvplane_state::ProposeError> {
    let view = handle.load();
    for p in pools {
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
