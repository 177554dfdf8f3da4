//! The faults of [`crate::schedule`] applied to the fleet, and their heals.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use kvplane_proto::v1::RemoveMemberRequest;

use crate::fleet::Fleet;
use crate::probe::{failpoints, http_body, status};
use crate::schedule::{Fault, Step};

/// A slow disk: each log round (a transaction, fsynced) takes 100 ms more, each snapshot 1 s.
const SLOW_DISK: &str = "raft-log-write=sleep(100);raft-snapshot-write=sleep(1000)";
/// A disk far behind: each log round takes a second more (a leader's followers commit what it
/// has not written yet).
const DISK_BEHIND: &str = "raft-log-write=sleep(1000)";
/// Entries a leader whose disk is behind must apply before it is killed.
const APPLIED_BEHIND: u64 = 10;
/// Where Debian's libfaketime is, by architecture.
const FAKETIME: [&str; 2] = [
    "/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1",
    "/usr/lib/aarch64-linux-gnu/faketime/libfaketimeMT.so.1",
];

/// A fault in force, to be healed.
#[derive(Debug, Clone, Copy)]
pub enum Injected {
    Killed(usize),
    Paused(usize),
    Isolated(usize),
    /// Every member isolated.
    Split,
    Nats,
    NatsPaused,
    /// Every member restarted in turn (nothing left to heal), and how long the slowest took
    /// from its start to the fleet ready.
    Rolled(Duration),
    /// The member at this index is a new incarnation, joining.
    Replaced(usize),
    /// This many members were added at the end of the list.
    Scaled(usize),
    /// The member at this index runs with a skewed clock.
    Skewed(usize),
    /// The member at this index had its log writes fail (it should have exited).
    DiskFailed(usize),
    /// The member at this index has failpoints set (a slow disk, failing snapshots).
    Failpoints(usize),
    /// Failing snapshot writes on every member.
    SnapshotsFailing,
    /// Engine `w`'s bridge was killed (SIGKILL).
    BridgeKilled(usize),
    /// Engine `w`'s bridge is frozen (SIGSTOP).
    BridgePaused(usize),
    GatewayKilled,
    GatewayPaused,
}

impl Injected {
    /// The member the fault is on (none for NATS and faults on every member).
    pub fn member(self) -> Option<usize> {
        match self {
            Injected::Killed(i)
            | Injected::Paused(i)
            | Injected::Isolated(i)
            | Injected::Replaced(i)
            | Injected::Skewed(i)
            | Injected::DiskFailed(i)
            | Injected::Failpoints(i) => Some(i),
            Injected::Split
            | Injected::Nats
            | Injected::NatsPaused
            | Injected::Rolled(_)
            | Injected::Scaled(_)
            | Injected::SnapshotsFailing
            | Injected::BridgeKilled(_)
            | Injected::BridgePaused(_)
            | Injected::GatewayKilled
            | Injected::GatewayPaused => None,
        }
    }
}

impl Fleet {
    /// SIGTERM to member `i`, waiting up to 30 s for its clean exit (a blocking wait, off the
    /// runtime's threads).
    fn stop_in_order(&mut self, i: usize) -> anyhow::Result<()> {
        let node = &mut self.cluster.nodes[i];
        let exit = tokio::task::block_in_place(|| node.terminate_within(Duration::from_secs(30)));
        match exit {
            Some(exit) if exit.success() => Ok(()),
            Some(exit) => bail!("member {i} exited with {exit} on SIGTERM"),
            None => bail!("member {i} did not exit within 30 s of SIGTERM (killed)"),
        }
    }

    /// Removes member `id` through whichever member leads.
    async fn remove(&self, id: u64, within: Duration) -> anyhow::Result<()> {
        let started = Instant::now();
        loop {
            let mut last = String::from("no leader");
            if let Some(l) = self.leader().await {
                match self.cluster.nodes[l]
                    .admin()
                    .await
                    .remove_member(RemoveMemberRequest {
                        id,
                        ..Default::default()
                    })
                    .await
                {
                    Ok(_) => return Ok(()),
                    Err(e) => last = e.to_string(),
                }
            }
            if started.elapsed() > within {
                bail!("member {id} not removed within {within:?}: {last}");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Applies `step`'s fault; returns what to heal.
    pub async fn inject(&mut self, step: &Step) -> anyhow::Result<Injected> {
        let leader = match self.leader().await {
            Some(l) => l,
            None => bail!("no leader to inject {} on", step.fault.label()),
        };
        let followers: Vec<usize> = (0..self.cluster.nodes.len())
            .filter(|i| *i != leader)
            .collect();
        let follower = followers[(step.pick % followers.len() as u64) as usize];
        let on = if matches!(
            step.fault,
            Fault::KillLeader
                | Fault::KillLeaderBehind
                | Fault::PauseLeader
                | Fault::IsolateLeader
                | Fault::DiskFailsLeader
                | Fault::SlowDiskLeader
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
                for i in 0..self.cluster.nodes.len() {
                    self.cluster.isolate(i).await;
                }
                Injected::Split
            }
            Fault::RestartNats => {
                self.cluster.nats.kill();
                Injected::Nats
            }
            Fault::PauseNats => {
                if !self.cluster.nats.freeze(true) {
                    bail!("kill -STOP nats-server failed");
                }
                Injected::NatsPaused
            }
            Fault::RollingRestart => {
                let mut slowest = Duration::ZERO;
                for i in followers.iter().copied().chain([leader]) {
                    self.stop_in_order(i)?;
                    let started = Instant::now();
                    self.cluster.nodes[i].restart();
                    self.wait_healthy(Duration::from_secs(60), |_| true)
                        .await
                        .with_context(|| format!("after member {i} restarted"))?;
                    slowest = slowest.max(started.elapsed());
                }
                Injected::Rolled(slowest)
            }
            Fault::WipeFollower => {
                let addr = self.cluster.nodes[on].grpc.to_string();
                self.cluster.nodes[on].kill();
                std::fs::remove_dir_all(self.cluster.nodes[on].dir.join("data"))?;
                let name = format!("kvplane-{on}");
                let new = self.join_new(&name, Some(addr));
                // The new incarnation takes the old one's place in the list.
                self.cluster.nodes.swap(on, new);
                self.cluster.nodes.pop();
                Injected::Replaced(on)
            }
            Fault::ScaleOut => {
                for k in 0..2 {
                    self.join_new(&format!("kvplane-extra{k}"), None);
                }
                self.wait_membership(Duration::from_secs(60)).await?;
                Injected::Scaled(2)
            }
            Fault::SkewFollower => {
                let lib = FAKETIME
                    .iter()
                    .find(|p| std::path::Path::new(p).exists())
                    .context("libfaketime is not installed (scripts/install-deps installs it)")?;
                self.stop_in_order(on)?;
                let node = &mut self.cluster.nodes[on];
                node.env.extend([
                    ("LD_PRELOAD".to_owned(), (*lib).to_owned()),
                    ("FAKETIME".to_owned(), "+1.5".to_owned()),
                    ("FAKETIME_DONT_FAKE_MONOTONIC".to_owned(), "1".to_owned()),
                ]);
                node.restart();
                Injected::Skewed(on)
            }
            Fault::DiskFailsLeader | Fault::DiskFailsFollower => {
                failpoints(&self.cluster.nodes[on], "raft-log-write=return").await?;
                Injected::DiskFailed(on)
            }
            Fault::SlowDiskLeader => {
                failpoints(&self.cluster.nodes[on], SLOW_DISK).await?;
                Injected::Failpoints(on)
            }
            Fault::SnapshotsFail => {
                let before = self.snapshot_failures().await;
                for n in &self.cluster.nodes {
                    failpoints(n, "raft-snapshot-write=return").await?;
                }
                // Held until a build was refused (a snapshot comes every few hundred
                // entries), at most 40 s: what is checked is what follows one.
                let started = Instant::now();
                let refused = loop {
                    let refused: u64 = self
                        .snapshot_failures()
                        .await
                        .iter()
                        .map(|(url, n)| n.saturating_sub(before.get(url).copied().unwrap_or(0)))
                        .sum();
                    if refused > 0 || started.elapsed() > Duration::from_secs(40) {
                        break refused;
                    }
                    tokio::time::sleep(Duration::from_millis(200)).await;
                };
                self.snapshots_refused += refused;
                if refused == 0 {
                    self.snapshots_never_refused += 1;
                }
                Injected::SnapshotsFailing
            }
            Fault::KillBridge => {
                let w = (step.pick % self.engines.len() as u64) as usize;
                self.engines[w].bridge.kill();
                Injected::BridgeKilled(w)
            }
            Fault::PauseBridge => {
                let w = (step.pick % self.engines.len() as u64) as usize;
                self.engines[w].freeze_bridge(true)?;
                Injected::BridgePaused(w)
            }
            Fault::KillLeaderBehind => {
                self.kill_behind(on).await?;
                Injected::Killed(on)
            }
            Fault::KillGateway => {
                self.gateway.kill();
                Injected::GatewayKilled
            }
            Fault::PauseGateway => {
                self.freeze_gateway(true)?;
                Injected::GatewayPaused
            }
        })
    }

    /// Slows member `i`'s log writes to a second a round, waits until it applied
    /// [`APPLIED_BEHIND`] more entries (committed by the others' disks while its own waits;
    /// at most 10 s: a member that did not get there is killed anyway, and a line says so),
    /// then kills it.
    async fn kill_behind(&mut self, i: usize) -> anyhow::Result<()> {
        let node = &self.cluster.nodes[i];
        let from = status(node)
            .await
            .with_context(|| format!("member {i}, the leader, did not answer its status"))?
            .applied_index;
        failpoints(node, DISK_BEHIND).await?;
        let started = Instant::now();
        let mut applied = from;
        while applied < from + APPLIED_BEHIND && started.elapsed() < Duration::from_secs(10) {
            tokio::time::sleep(Duration::from_millis(20)).await;
            if let Some(s) = status(node).await {
                applied = s.applied_index;
            }
        }
        if applied < from + APPLIED_BEHIND {
            eprintln!(
                "  member {i} applied {} of {APPLIED_BEHIND} entries behind its disk within 10 s; killed anyway",
                applied - from
            );
        }
        self.cluster.nodes[i].kill();
        Ok(())
    }

    fn freeze_gateway(&self, frozen: bool) -> anyhow::Result<()> {
        if !self.gateway.freeze(frozen) {
            bail!("freezing ({frozen}) the gateway failed");
        }
        Ok(())
    }

    /// Snapshot builds refused so far, by the process of each member that answers (a
    /// restarted member is another process, counting from 0, on another HTTP port).
    async fn snapshot_failures(&self) -> BTreeMap<String, u64> {
        let mut by = BTreeMap::new();
        for n in &self.cluster.nodes {
            let url = n.http_url("/metrics");
            if let Some(text) = http_body(&url).await {
                let v =
                    kvplane_testkit::metric_value(&text, "kvplane_raft_snapshot_failures_total");
                by.insert(url, v as u64);
            }
        }
        by
    }

    /// Undoes `injected`.
    pub async fn heal(&mut self, injected: Injected) -> anyhow::Result<()> {
        match injected {
            Injected::Killed(i) => self.cluster.nodes[i].restart(),
            Injected::Paused(i) => self.cluster.nodes[i].resume(),
            Injected::Isolated(_) | Injected::Split => self.cluster.heal().await,
            Injected::Nats => self.cluster.nats.restart(),
            Injected::NatsPaused => {
                if !self.cluster.nats.freeze(false) {
                    bail!("kill -CONT nats-server failed");
                }
            }
            Injected::Rolled(_) => {}
            Injected::Replaced(_) => self.wait_membership(Duration::from_secs(60)).await?,
            Injected::Scaled(n) => {
                let from = self.cluster.nodes.len() - n;
                for i in from..self.cluster.nodes.len() {
                    let id = self.cluster.nodes[i]
                        .raft_id
                        .context("a member without an id")?;
                    self.remove(id, Duration::from_secs(60)).await?;
                }
                self.cluster.nodes.truncate(from);
                self.wait_membership(Duration::from_secs(60)).await?;
            }
            Injected::Skewed(i) => {
                self.stop_in_order(i)?;
                let node = &mut self.cluster.nodes[i];
                node.env
                    .retain(|(k, _)| !k.starts_with("FAKETIME") && k != "LD_PRELOAD");
                node.restart();
            }
            Injected::DiskFailed(i) => {
                // The next append fails; the member must then end on its own, with an error.
                let started = Instant::now();
                let node = &mut self.cluster.nodes[i];
                let exit = loop {
                    if let Some(exit) = node.exited() {
                        break exit;
                    }
                    if started.elapsed() > Duration::from_secs(30) {
                        bail!("member {i} still runs 30 s after its log writes were set to fail");
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                };
                if exit.success() {
                    bail!("member {i} exited successfully after its log writes failed");
                }
                node.restart();
            }
            Injected::Failpoints(i) => failpoints(&self.cluster.nodes[i], "").await?,
            Injected::SnapshotsFailing => {
                // A builder kept its last snapshot and goes on; a follower that could not
                // write a snapshot sent by the leader stopped Raft, as after a failed log
                // write, and exits: it is given up to 10 s to end (no answer while it ends
                // counts as ending), then started again. Any other exit fails the run.
                for node in &mut self.cluster.nodes {
                    if let Err(e) = failpoints(node, "").await
                        && node.is_running()
                    {
                        return Err(e);
                    }
                }
                let started = Instant::now();
                loop {
                    let mut stopping = false;
                    for (i, node) in self.cluster.nodes.iter_mut().enumerate() {
                        match node.exited() {
                            Some(exit) => {
                                let log = node.log();
                                let install = log.contains("raft stopped")
                                    && log.contains(
                                        "a snapshot sent by the leader could not be written",
                                    );
                                if exit.success() || !install {
                                    bail!(
                                        "member {i} exited ({exit}) while snapshot writes failed, not for a snapshot it was sent"
                                    );
                                }
                                node.restart();
                                self.restarted.push(i);
                            }
                            None => {
                                stopping |= status(node).await.is_none_or(|s| s.role == "shutdown");
                            }
                        }
                    }
                    if !stopping {
                        break;
                    }
                    if started.elapsed() > Duration::from_secs(10) {
                        bail!("a member whose raft stopped has not exited within 10 s");
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
            Injected::BridgeKilled(w) => self.engines[w].bridge.restart(),
            Injected::BridgePaused(w) => self.engines[w].freeze_bridge(false)?,
            // Started again on its port (it says ready once it listens).
            Injected::GatewayKilled => self.gateway.restart(),
            Injected::GatewayPaused => self.freeze_gateway(false)?,
        }
        Ok(())
    }
}
