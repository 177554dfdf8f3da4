//! Health checks of the engines a worker set lists at fixed addresses (`spec.endpoints`): while
//! this node leads, it asks each listed engine's health path (vLLM's `/health`) every
//! interval; an engine that fails `failures` checks in a row is taken out of routing by an
//! `EndpointHealth` entry, and one answered check brings it back. Pods found in Kubernetes
//! have their readiness from Kubernetes instead; engines only a bridge announces have their
//! lease.
//!
//! The replicated state holds only whether each listed engine is routable; the count of
//! failed checks is the leader's own and starts again at a new leader (an engine then needs
//! `failures` more failed checks to go, but a change is never proposed twice: the leader
//! compares with what the state says).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use kvplane_state::{Command, EndpointHealth, Found, HealthUpdate, Proposer, View};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use serde::Deserialize;
use tokio::sync::watch;

use super::Context;

/// `[endpoint_health]` of the node config.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct EndpointHealthSection {
    /// How often the leader checks every listed engine (0: never; listed engines are then
    /// always routable).
    pub interval_ms: u64,
    /// How long one check may take before it counts as failed.
    pub timeout_ms: u64,
    /// Failed checks in a row that take an engine out of routing.
    pub failures: u32,
    /// The path asked, with success (2xx) meaning the engine serves.
    pub path: String,
    /// A PEM file of the CA (or CAs) that signed `https://` engines' certificates, trusted
    /// besides the public roots (an engine behind a private CA fails every check without it).
    pub ca_file: Option<std::path::PathBuf>,
}

impl Default for EndpointHealthSection {
    fn default() -> Self {
        Self {
            interval_ms: 2_000,
            timeout_ms: 1_000,
            failures: 2,
            path: "/health".into(),
            ca_file: None,
        }
    }
}

impl EndpointHealthSection {
    /// Every problem, named by its key.
    pub fn problems(&self) -> Vec<String> {
        let mut p = Vec::new();
        if self.interval_ms > 0 && self.timeout_ms == 0 {
            p.push("endpoint_health.timeout_ms must be at least 1".into());
        }
        if self.failures == 0 {
            p.push("endpoint_health.failures must be at least 1".into());
        }
        if !self.path.starts_with('/') {
            p.push(format!(
                "endpoint_health.path {:?} must start with /",
                self.path
            ));
        }
        if let Err(e) = self.client() {
            p.push(format!("endpoint_health.ca_file: {e}"));
        }
        p
    }

    /// The checks' HTTP client: the timeout, and the CA file's certificates when there is one.
    fn client(&self) -> Result<reqwest::Client, String> {
        let mut b = reqwest::Client::builder().timeout(Duration::from_millis(self.timeout_ms));
        if let Some(path) = &self.ca_file {
            let pem = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
            let certs = reqwest::Certificate::from_pem_bundle(&pem)
                .map_err(|e| format!("{}: {e}", path.display()))?;
            if certs.is_empty() {
                return Err(format!("{}: no certificate in it", path.display()));
            }
            for c in certs {
                b = b.add_root_certificate(c);
            }
        }
        b.build().map_err(|e| e.to_string())
    }
}

/// What the checks did, for `/metrics`.
#[derive(Debug, Default)]
pub struct EndpointHealthMetrics {
    checks: Counter,
    failed: Counter,
    changes: Counter,
    errors: Counter,
    down: Gauge,
}

impl EndpointHealthMetrics {
    pub fn register(&self, r: &mut Registry) {
        r.register(
            "kvplane_endpoint_health_checks",
            "Health checks of listed engines made by this node while leading",
            self.checks.clone(),
        );
        r.register(
            "kvplane_endpoint_health_checks_failed",
            "Health checks of listed engines that got no success answer in time",
            self.failed.clone(),
        );
        r.register(
            "kvplane_endpoint_health_changes_applied",
            "Listed engines taken out of routing or brought back, committed to the replicated state",
            self.changes.clone(),
        );
        r.register(
            "kvplane_endpoint_health_errors",
            "Health changes this node could not commit",
            self.errors.clone(),
        );
        r.register(
            "kvplane_endpoint_health_engines_down",
            "Listed engines the replicated state holds out of routing (as this node applied it)",
            self.down.clone(),
        );
    }
}

/// One listed engine: `(worker set, worker, address)` (an engine moved to another address is
/// another engine: its failed checks start again).
type Key = (String, String, String);

/// The engines to check: every worker whose endpoint is its worker set's list, and whether the
/// state has it routable.
fn listed(view: &View) -> Vec<(Key, bool)> {
    view.workers()
        .filter(|w| w.found == Some(Found::Static))
        .filter_map(|w| {
            let address = w.address.as_deref()?;
            Some((
                (w.pool.clone(), w.name.to_string(), address.to_owned()),
                w.up,
            ))
        })
        .collect()
}

/// The entries that bring the state in line with the checks just made (`answered`, per
/// engine), given the failed checks in a row so far (`failing`, updated here): an engine goes
/// after `failures` of them, comes back after one answer.
fn changes(
    engines: &[(Key, bool)],
    answered: &[bool],
    failing: &mut HashMap<Key, u32>,
    failures: u32,
) -> Vec<HealthUpdate> {
    failing.retain(|k, _| engines.iter().any(|(e, _)| e == k));
    let mut by_pool: BTreeMap<&str, Vec<EndpointHealth>> = BTreeMap::new();
    for ((key, up), ok) in engines.iter().zip(answered) {
        // Only what differs from the state: an engine within its failures keeps what the
        // state says of it, whichever that is.
        let change = if *ok {
            failing.remove(key);
            (!*up).then_some(true)
        } else {
            let n = failing.entry(key.clone()).or_default();
            *n = n.saturating_add(1);
            (*up && *n >= failures).then_some(false)
        };
        if let Some(ready) = change {
            by_pool.entry(&key.0).or_default().push(EndpointHealth {
                worker: key.1.clone(),
                address: key.2.clone(),
                ready,
            });
        }
    }
    by_pool
        .into_iter()
        .map(|(pool, endpoints)| HealthUpdate {
            pool: pool.to_owned(),
            endpoints,
        })
        .collect()
}

/// Whether the engine at `address` answers `path` with success within the client's timeout.
async fn answers(client: &reqwest::Client, address: &str, path: &str) -> bool {
    let url = format!("{}{path}", address.trim_end_matches('/'));
    client
        .get(url)
        .send()
        .await
        .is_ok_and(|r| r.status().is_success())
}

/// How often a leader with the checks off looks for engines earlier checks took out.
const OFF_EVERY: Duration = Duration::from_secs(1);

/// Checks the listed engines every interval while this node leads, until `stop`. With the
/// checks off (`interval_ms = 0`) every listed engine counts as answering: one that checks
/// took out (before a restart with them off) is brought back, and the list is trusted.
pub async fn run<P: Proposer>(
    cfg: EndpointHealthSection,
    node: Context<P>,
    metrics: Arc<EndpointHealthMetrics>,
    mut stop: watch::Receiver<bool>,
) {
    let checking = cfg.interval_ms > 0;
    // With the checks off no engine is asked: no client is needed.
    let client = match cfg.client() {
        Ok(c) => Some(c),
        Err(_) if !checking => None,
        Err(e) => {
            tracing::error!(error = %e, "no http client for the listed engines' health checks");
            return;
        }
    };
    let every = if checking {
        Duration::from_millis(cfg.interval_ms)
    } else {
        OFF_EVERY
    };
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut failing: HashMap<Key, u32> = HashMap::new();
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.changed() => return,
        }
        let view = node.state.load();
        let engines = listed(&view);
        let down = engines.iter().filter(|(_, up)| !up).count();
        metrics.down.set(i64::try_from(down).unwrap_or(i64::MAX));
        if !node.leading() {
            failing.clear();
            continue;
        }
        let answered = if let Some(client) = client.as_ref().filter(|_| checking) {
            let answered = futures::future::join_all(
                engines
                    .iter()
                    .map(|((_, _, address), _)| answers(client, address, &cfg.path)),
            )
            .await;
            metrics.checks.inc_by(engines.len() as u64);
            metrics
                .failed
                .inc_by(answered.iter().filter(|ok| !**ok).count() as u64);
            answered
        } else {
            vec![true; engines.len()]
        };
        for update in changes(&engines, &answered, &mut failing, cfg.failures) {
            let pool = update.pool.clone();
            let (up, down): (Vec<_>, Vec<_>) = update.endpoints.iter().partition(|e| e.ready);
            let names = |v: Vec<&EndpointHealth>| -> Vec<String> {
                v.into_iter().map(|e| e.worker.clone()).collect()
            };
            let (up, down) = (names(up), names(down));
            match node.log.propose(Command::EndpointHealth(update)).await {
                Ok(index) => {
                    metrics.changes.inc();
                    if checking {
                        tracing::warn!(
                            worker_set = pool,
                            ?down,
                            ?up,
                            index,
                            "listed engines' health changed"
                        );
                    } else {
                        tracing::warn!(
                            worker_set = pool,
                            ?up,
                            index,
                            "health checks are off: listed engines they took out are routable again"
                        );
                    }
                }
                Err(e) => {
                    metrics.errors.inc();
                    tracing::warn!(worker_set = pool, error = %e, "listed engines' health not applied");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn engine(worker: &str, up: bool) -> (Key, bool) {
        (
            (
                "ws".to_owned(),
                worker.to_owned(),
                format!("http://{worker}"),
            ),
            up,
        )
    }

    fn said(updates: &[HealthUpdate]) -> Vec<(String, bool)> {
        updates
            .iter()
            .flat_map(|u| u.endpoints.iter().map(|e| (e.worker.clone(), e.ready)))
            .collect()
    }

    #[test]
    fn an_engine_goes_after_its_failures_in_a_row_and_comes_back_after_one_answer() {
        let mut failing = HashMap::new();
        let e = [engine("a", true), engine("b", true)];
        // One failure of two allowed: nothing yet.
        assert!(changes(&e, &[false, true], &mut failing, 2).is_empty());
        // An answer in between starts the count again.
        assert!(changes(&e, &[true, true], &mut failing, 2).is_empty());
        assert!(changes(&e, &[false, true], &mut failing, 2).is_empty());
        let out = changes(&e, &[false, true], &mut failing, 2);
        assert_eq!(said(&out), [("a".to_owned(), false)]);
        // The state took it out; failing further proposes nothing more.
        let e = [engine("a", false), engine("b", true)];
        assert!(changes(&e, &[false, true], &mut failing, 2).is_empty());
        let out = changes(&e, &[true, true], &mut failing, 2);
        assert_eq!(said(&out), [("a".to_owned(), true)]);
    }

    #[test]
    fn a_down_engine_still_failing_is_not_brought_back_by_a_new_leaders_empty_count() {
        // A new leader has no count; the state says down: a failed check keeps it down.
        let mut failing = HashMap::new();
        let e = [engine("a", false)];
        assert!(changes(&e, &[false], &mut failing, 3).is_empty());
        assert!(changes(&e, &[false], &mut failing, 3).is_empty());
    }

    #[test]
    fn engines_no_longer_listed_are_forgotten() {
        let mut failing = HashMap::new();
        changes(&[engine("a", true)], &[false], &mut failing, 2);
        assert_eq!(failing.len(), 1);
        changes(&[engine("b", true)], &[true], &mut failing, 2);
        assert!(failing.is_empty());
    }

    #[test]
    fn a_ca_file_that_cannot_be_read_or_holds_no_certificate_is_a_problem_named_by_its_key() {
        let dir = std::env::temp_dir().join(format!("kvplane-health-ca-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let empty = dir.join("empty.pem");
        std::fs::write(&empty, "").unwrap();
        for file in [dir.join("missing.pem"), empty] {
            let s = EndpointHealthSection {
                ca_file: Some(file.clone()),
                ..Default::default()
            };
            let p = s.problems();
            assert!(
                p.len() == 1 && p[0].starts_with("endpoint_health.ca_file: "),
                "{p:?}"
            );
        }
        assert!(EndpointHealthSection::default().problems().is_empty());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn each_worker_set_gets_its_own_entry() {
        let mut failing = HashMap::new();
        let other = (
            ("other".to_owned(), "c".to_owned(), "http://c".to_owned()),
            true,
        );
        let out = changes(
            &[engine("a", true), other],
            &[false, false],
            &mut failing,
            1,
        );
        let pools: Vec<&str> = out.iter().map(|u| u.pool.as_str()).collect();
        assert_eq!(pools, ["other", "ws"]);
    }
}
