//! Who a StatefulSet member is, and whether it may start a cluster.
//!
//! - **Ids are never reused.** A pod's Raft id is chosen when its volume is new and kept in
//!   `raft/node_id` on it: `creation time in µs * 1000 + ordinal + 1`. A pod that comes back
//!   with a lost volume has forgotten its vote, so it must not vote under its old id: it gets a
//!   new one, and the leader replaces the old member at the same address when it joins (see
//!   [`stale_members`]). A volume that predates this file keeps `ordinal + 1`.
//! - **Only one cluster.** Ordinal 0 with an empty log initializes a one-member cluster only
//!   once every other pod that exists (its DNS name resolves) answered that it is in none; if
//!   one is in a cluster, ordinal 0 joins it instead. So a lost volume on pod 0 never starts a
//!   second cluster beside the running one.

use std::io;
use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

const ID_FILE: &str = "node_id";

/// The id kept in `dir`, or a new one written there durably. `had_log` says whether `dir`
/// already held a Raft log (an older volume: its id was `ordinal + 1`) - except for a
/// `learner` pod, whose volume with a log but no id was not made by a learner set (a one-pod
/// learner's, under a static id): `ordinal + 1` may be a voter's, so it is refused.
pub fn persistent_id(dir: &Path, ordinal: u64, had_log: bool, learner: bool) -> io::Result<u64> {
    let path = dir.join(ID_FILE);
    match std::fs::read_to_string(&path) {
        Ok(s) => s.trim().parse().map_err(|e| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!("{} does not hold a raft id: {e}", path.display()),
            )
        }),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            if had_log && learner {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!(
                        "{} is missing on a volume that holds a raft log: a learner pod takes no id from its ordinal (ordinal + 1 may be a voter's); write the id it had there, or give it a new volume",
                        path.display()
                    ),
                ));
            }
            let id = if had_log {
                ordinal + 1
            } else {
                micros_now() * 1000 + ordinal % 1000 + 1
            };
            crate::durable::replace(&path, format!("{id}\n").as_bytes())?;
            Ok(id)
        }
        Err(e) => Err(e),
    }
}

fn micros_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(0))
}

/// What one other pod said when asked whether it is in a cluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Peer {
    /// Its name does not resolve: no such pod.
    Absent,
    /// It answered: in no cluster.
    Alone,
    /// It answered: a member of a cluster.
    Member,
    /// It exists but did not answer (yet).
    Silent,
}

/// What ordinal 0 does with an empty log, from what the others said.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Start {
    Initialize,
    Join,
    /// Ask again: some existing pod has not answered.
    Wait,
}

pub fn decide(peers: &[Peer]) -> Start {
    if peers.contains(&Peer::Member) {
        Start::Join
    } else if peers.contains(&Peer::Silent) {
        Start::Wait
    } else {
        Start::Initialize
    }
}

async fn ask(dialer: &kvplane_tls::Dialer, addr: &str) -> Peer {
    if tokio::net::lookup_host(addr)
        .await
        .map_or(true, |mut a| a.next().is_none())
    {
        return Peer::Absent;
    }
    let status = tokio::time::timeout(Duration::from_secs(2), async {
        let mut c =
            kvplane_proto::v1::admin_client::AdminClient::new(dialer.connect(addr).await.ok()?);
        c.cluster_status(kvplane_proto::v1::StatusRequest::default())
            .await
            .ok()
            .map(tonic::Response::into_inner)
    })
    .await
    .ok()
    .flatten();
    match status {
        None => Peer::Silent,
        Some(s) if s.members.is_empty() => Peer::Alone,
        Some(_) => Peer::Member,
    }
}

/// Asks `others` until they settle whether ordinal 0 initializes or joins (or `stop`).
pub async fn may_initialize(
    dialer: &kvplane_tls::Dialer,
    others: &[String],
    stop: &tokio::sync::watch::Receiver<bool>,
) -> bool {
    let mut round = 0u32;
    loop {
        let mut peers = Vec::with_capacity(others.len());
        for o in others {
            peers.push(ask(dialer, o).await);
        }
        match decide(&peers) {
            Start::Initialize => return true,
            Start::Join => {
                tracing::info!("a cluster exists: joining it rather than starting one");
                return false;
            }
            Start::Wait => {
                if round.is_multiple_of(10) {
                    tracing::info!(
                        ?peers,
                        "waiting for every pod to say whether it is in a cluster"
                    );
                }
            }
        }
        round += 1;
        if *stop.borrow() {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Members to remove once member `id` joined at `addr`: earlier incarnations at that address
/// (a pod that came back with a new volume).
pub fn stale_members<'a>(
    nodes: impl IntoIterator<Item = (u64, &'a str)>,
    id: u64,
    addr: &str,
) -> Vec<u64> {
    nodes
        .into_iter()
        .filter(|(other, a)| *other != id && *a == addr)
        .map(|(other, _)| other)
        .collect()
}

/// Members of StatefulSet `set` whose ordinal is at least `replicas` (it was scaled down):
/// addressed `<set>-<ordinal><rest>` with the same `rest` (`.<service>.<namespace>.svc.
/// <domain>:<port>`) as the member asking, so a member elsewhere (a learner in another cluster
/// whose pods are named alike) is never one of them. Nothing when `replicas` is 0 (a paused
/// set keeps its membership).
pub fn departed<'a>(
    nodes: impl IntoIterator<Item = (u64, &'a str)>,
    (set, rest): (&str, &str),
    replicas: u64,
) -> Vec<u64> {
    if replicas == 0 {
        return Vec::new();
    }
    let prefix = format!("{set}-");
    nodes
        .into_iter()
        .filter(|(_, addr)| {
            addr.strip_prefix(&prefix)
                .and_then(|tail| tail.strip_suffix(rest))
                .and_then(|n| n.parse::<u64>().ok())
                .is_some_and(|ordinal| ordinal >= replicas)
        })
        .map(|(id, _)| id)
        .collect()
}

/// Members of a learner set scaled down to `replicas` (not 0: a paused set keeps its
/// membership): those recorded at the address of an ordinal at or above it (`ordinals`, each
/// ordinal's address as the set's pods record theirs, whatever the template), voters never.
pub fn departed_learners<'a>(
    nodes: impl IntoIterator<Item = (u64, &'a str)>,
    is_voter: impl Fn(u64) -> bool,
    ordinals: &[String],
    replicas: u64,
) -> Vec<u64> {
    let Ok(from) = usize::try_from(replicas) else {
        return Vec::new();
    };
    if from == 0 {
        return Vec::new();
    }
    let gone = ordinals.get(from..).unwrap_or_default();
    nodes
        .into_iter()
        .filter(|(id, addr)| !is_voter(*id) && gone.iter().any(|g| g == addr))
        .map(|(id, _)| id)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_learner_set_scaled_down_loses_its_higher_ordinals_and_never_a_voter() {
        // Pods on addresses of a template that names no pod: `127.0.{ordinal}.1:7070`.
        let ordinals: Vec<String> = (0..7).map(|o| format!("127.0.{o}.1:7070")).collect();
        let nodes = [
            (1, "a-0:7070"),
            (10, "127.0.0.1:7070"),
            (11, "127.0.1.1:7070"),
            (12, "127.0.2.1:7070"),
            // A voter at a learner's address (misconfigured) stays.
            (2, "127.0.3.1:7070"),
            // Not of this set.
            (13, "127.0.9.1:7070"),
        ];
        let voters = [1u64, 2];
        let gone =
            |replicas| departed_learners(nodes, |id| voters.contains(&id), &ordinals, replicas);
        assert_eq!(gone(1), [11, 12]);
        assert_eq!(gone(2), [12]);
        assert_eq!(gone(3), Vec::<u64>::new());
        assert_eq!(gone(0), Vec::<u64>::new(), "a paused set keeps its members");
        assert_eq!(gone(9), Vec::<u64>::new());
    }

    #[test]
    fn a_new_volume_gets_a_new_id_and_keeps_it() {
        let d = tempfile::tempdir().unwrap();
        let a = persistent_id(d.path(), 2, false, false).unwrap();
        assert_eq!(a % 1000, 3);
        assert!(a > 1_000_000_000_000_000_000);
        assert_eq!(persistent_id(d.path(), 2, false, false).unwrap(), a);
        // Another volume, created later, gets another id.
        while micros_now() * 1000 <= a {}
        let e = tempfile::tempdir().unwrap();
        assert_ne!(persistent_id(e.path(), 2, false, false).unwrap(), a);
        let old = tempfile::tempdir().unwrap();
        assert_eq!(persistent_id(old.path(), 2, true, false).unwrap(), 3);
        // A learner pod on a volume with a log and no id is refused, not made id 3.
        let static_learner = tempfile::tempdir().unwrap();
        let err = persistent_id(static_learner.path(), 2, true, true).unwrap_err();
        assert!(
            err.to_string().contains("a learner pod takes no id"),
            "{err}"
        );
        assert!(!static_learner.path().join(ID_FILE).exists());
        // With its id written there, it keeps it.
        std::fs::write(static_learner.path().join(ID_FILE), "101\n").unwrap();
        assert_eq!(
            persistent_id(static_learner.path(), 2, true, true).unwrap(),
            101
        );
    }

    #[test]
    fn ordinal_zero_joins_a_cluster_that_exists_and_waits_for_silent_pods() {
        use Peer::*;
        assert_eq!(decide(&[Absent, Absent]), Start::Initialize);
        assert_eq!(decide(&[Alone, Absent]), Start::Initialize);
        assert_eq!(decide(&[Alone, Silent]), Start::Wait);
        assert_eq!(decide(&[Silent, Member]), Start::Join);
    }

    #[test]
    fn scale_down_removes_the_ordinals_the_set_no_longer_has() {
        let nodes = [
            (1, "kv-0.peers.ns.svc.cluster.local:7070"),
            (2, "kv-1.peers.ns.svc.cluster.local:7070"),
            (3, "kv-2.peers.ns.svc.cluster.local:7070"),
            (4, "kv-3.peers.ns.svc.cluster.local:7070"),
            (9, "other-4.peers.ns.svc.cluster.local:7070"),
            // A learner in another cluster, its pods named alike.
            (101, "kv-5.peers.ns.svc.cluster-b.example:7070"),
        ];
        let rest = ".peers.ns.svc.cluster.local:7070";
        assert_eq!(departed(nodes, ("kv", rest), 3), vec![4]);
        assert_eq!(departed(nodes, ("kv", rest), 2), vec![3, 4]);
        assert!(departed(nodes, ("kv", rest), 0).is_empty());
        assert_eq!(
            stale_members(nodes, 7, "kv-1.peers.ns.svc.cluster.local:7070"),
            vec![2]
        );
    }
}
