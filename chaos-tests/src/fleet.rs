//! The fleet under test: nats-server and three Raft members holding a worker set and two
//! tenants' limits (two-second windows), with the faults of [`crate::schedule`] applied to it.

use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use kvplane_testkit::{Cluster, NodeOptions, publish};

use crate::schedule::{Fault, Step};

/// Members in the cluster.
pub const MEMBERS: usize = 3;
/// The tenants and their budgets per window (tokens).
pub const TENANTS: [(&str, u64); 2] = [("acme", 20_000), ("beta", 10_000)];
pub const WINDOW_MS: u64 = 2_000;
/// Workers announced in pool `gpu`.
pub const WORKERS: usize = 3;

pub struct Fleet {
    pub cluster: Cluster,
    pub js: async_nats::jetstream::Context,
    _policies: tempfile::TempDir,
}

/// A fault in force, to be healed.
#[derive(Debug, Clone, Copy)]
pub enum Injected {
    Killed(usize),
    Paused(usize),
    Isolated(usize),
    /// Every member isolated.
    Split,
    Nats,
}

impl Injected {
    /// The member the fault is on (none for NATS).
    pub fn member(self) -> Option<usize> {
        match self {
            Injected::Killed(i) | Injected::Paused(i) | Injected::Isolated(i) => Some(i),
            Injected::Split | Injected::Nats => None,
        }
    }
}

impl Fleet {
    /// Starts the fleet and waits until every member holds the policies and the workers.
    pub async fn start() -> anyhow::Result<Fleet> {
        let policies = tempfile::tempdir()?;
        let limits: String = TENANTS
            .iter()
            .map(|(t, budget)| {
                format!(
                    "    - {{tenant: {t}, tokensPerMinute: {}, burst: {}, windowSeconds: {}}}\n",
                    budget * 60_000 / WINDOW_MS,
                    budget / 10,
                    WINDOW_MS / 1000
                )
            })
            .collect();
        std::fs::write(
            policies.path().join("fleet.yaml"),
            format!(
                "apiVersion: kvplane.io/v1alpha1\nkind: InferenceWorkerSet\nmetadata: {{name: gpu}}\nspec: {{model: m, blockSize: 16}}\n---\napiVersion: kvplane.io/v1alpha1\nkind: InferencePolicy\nmetadata: {{name: tenants}}\nspec:\n  limits:\n{limits}"
            ),
        )?;
        let cluster = Cluster::start_raft(
            MEMBERS,
            &NodeOptions {
                policy_dir: Some(policies.path().to_owned()),
                ..Default::default()
            },
        );
        let js = cluster.nats.jetstream().await;
        kvplane_ingest::ensure_stream(&js, "KVPLANE").await?;
        for w in 0..WORKERS {
            publish(
                &js,
                kvplane_ingest::worker_subject("gpu", &format!("w{w}")),
                format!(r#"{{"status":"up","address":"http://w{w}:8000"}}"#).into_bytes(),
            )
            .await;
        }
        let fleet = Fleet {
            cluster,
            js,
            _policies: policies,
        };
        fleet
            .wait_healthy(Duration::from_secs(60), |s| {
                s.policy_objects.get("InferencePolicy") == Some(&1)
                    && s.workers.iter().filter(|w| w.up).count() == WORKERS
            })
            .await
            .context("the fleet did not come up")?;
        Ok(fleet)
    }

    /// The member that says it leads, if exactly one of the running ones does.
    pub async fn leader(&self) -> Option<usize> {
        let all: Vec<usize> = (0..MEMBERS).collect();
        self.cluster.leader(&all).await
    }

    /// Applies `step`'s fault; returns what to heal.
    pub async fn inject(&mut self, step: &Step) -> anyhow::Result<Injected> {
        let leader = match self.leader().await {
            Some(l) => l,
            None => bail!("no leader to inject {} on", step.fault.label()),
        };
        let followers: Vec<usize> = (0..MEMBERS).filter(|i| *i != leader).collect();
        let follower = followers[(step.pick % followers.len() as u64) as usize];
        let on = if matches!(
            step.fault,
            Fault::KillLeader | Fault::PauseLeader | Fault::IsolateLeader
        ) {
            leader
        } else {
            follower
        };
        Ok(match step.fault {
            Fault::KillLeader | Fault::KillFollower => {
                self.cluster.nodes[on].kill();
                Injected::Killed(on)
            }
            Fault::PauseLeader | Fault::PauseFollower => {
                self.cluster.nodes[on].pause();
                Injected::Paused(on)
            }
            Fault::IsolateLeader | Fault::IsolateFollower => {
                self.cluster.isolate(on).await;
                Injected::Isolated(on)
            }
            Fault::MuteLeader => {
                let others: Vec<u64> = followers
                    .iter()
                    .filter_map(|f| self.cluster.nodes[*f].raft_id)
                    .collect();
                self.cluster.nodes[leader].block(others).await;
                Injected::Isolated(leader)
            }
            Fault::SplitAll => {
                for i in 0..MEMBERS {
                    self.cluster.isolate(i).await;
                }
                Injected::Split
            }
            Fault::RestartNats => {
                self.cluster.nats.kill();
                Injected::Nats
            }
        })
    }

    /// Undoes `injected`.
    pub async fn heal(&mut self, injected: Injected) {
        match injected {
            Injected::Killed(i) => self.cluster.nodes[i].restart(),
            Injected::Paused(i) => self.cluster.nodes[i].resume(),
            Injected::Isolated(_) | Injected::Split => self.cluster.heal().await,
            Injected::Nats => self.cluster.nats.restart(),
        }
    }

    /// Waits until every member answers ready (`/readyz`) and `also` holds of its status;
    /// returns how long that took.
    pub async fn wait_healthy(
        &self,
        within: Duration,
        also: impl Fn(&kvplane_proto::v1::StatusResponse) -> bool,
    ) -> anyhow::Result<Duration> {
        let started = Instant::now();
        loop {
            let mut healthy = true;
            for n in &self.cluster.nodes {
                healthy &= ready(n).await && status(n).await.is_some_and(|s| also(&s));
                if !healthy {
                    break;
                }
            }
            if healthy {
                return Ok(started.elapsed());
            }
            if started.elapsed() > within {
                bail!("the fleet was not healthy within {within:?}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// Whether `node` answers `/readyz` with 200 (false while it does not answer at all).
pub async fn ready(node: &kvplane_testkit::Node) -> bool {
    let url = node.http_url("/readyz");
    let r = tokio::time::timeout(Duration::from_secs(2), http_status(&url));
    matches!(r.await, Ok(Some(200)))
}

/// The status code of a plaintext `GET url`, or `None` without an answer.
async fn http_status(url: &str) -> Option<u16> {
    let url: tonic::codegen::http::Uri = url.parse().ok()?;
    let addr = format!("{}:{}", url.host()?, url.port_u16()?);
    let mut s = tokio::net::TcpStream::connect(addr).await.ok()?;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    s.write_all(format!("GET {} HTTP/1.0\r\nhost: x\r\n\r\n", url.path()).as_bytes())
        .await
        .ok()?;
    let mut head = [0u8; 12];
    s.read_exact(&mut head).await.ok()?;
    std::str::from_utf8(&head[9..12]).ok()?.parse().ok()
}

/// `node`'s status, or `None` while it does not answer.
pub async fn status(node: &kvplane_testkit::Node) -> Option<kvplane_proto::v1::StatusResponse> {
    let ask = async {
        let mut c = kvplane_proto::v1::admin_client::AdminClient::connect(node.endpoint())
            .await
            .ok()?;
        c.status(kvplane_proto::v1::StatusRequest::default())
            .await
            .ok()
            .map(tonic::Response::into_inner)
    };
    tokio::time::timeout(Duration::from_secs(2), ask)
        .await
        .ok()
        .flatten()
}
