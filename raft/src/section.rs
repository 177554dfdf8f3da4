//! The `[raft]` section: who this member is and how it finds the cluster, from a static peer
//! list, a join list, or a Kubernetes StatefulSet's ordinal and headless-service names.

use std::net::SocketAddr;

use serde::Deserialize;

/// A Raft cluster member.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct PeerSection {
    /// Raft node id: unique, never reused for a node that lost its data.
    pub id: u64,
    /// The member's gRPC address (`host:port`); Raft runs on the API port.
    pub addr: String,
}

/// `[raft]`. Every node is a Raft member: with no `peers`, `join` or `kubernetes` it is a
/// one-member cluster of its own (id 1 unless `id` says otherwise), which `kvplane cluster add`
/// grows with no data migration.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RaftSection {
    /// This node's Raft id (derived from the pod ordinal with `kubernetes`; 1 for a one-member
    /// cluster that names none).
    #[serde(default)]
    pub id: Option<u64>,
    /// The initial members, this node included (static clusters).
    #[serde(default)]
    pub peers: Vec<PeerSection>,
    /// Initialize a new cluster from `peers` when this node's log is empty (set on exactly one
    /// node).
    #[serde(default)]
    pub bootstrap: bool,
    /// Members to ask for membership when this node's log is empty and it does not bootstrap:
    /// it is added as a learner, catches up, then becomes a voter (unless `learner`).
    #[serde(default)]
    pub join: Vec<String>,
    /// Stay a learner once added through `join`: a replica that applies every entry and serves
    /// reads (Route, Explain, Status) from its own state, and never votes or counts toward a
    /// quorum - a replica in another cluster, near its gateways.
    #[serde(default)]
    pub learner: bool,
    /// Send writes, linearizable reads and this node's own join through the `join` addresses,
    /// whose member passes each on to its leader, rather than to the leader's recorded address:
    /// for a replica in another cluster, which reaches the members only at a published name.
    #[serde(default)]
    pub relay_through_join: bool,
    /// This node's address as its peers reach it (default: its entry in `peers`, else
    /// `grpc_listen`).
    #[serde(default)]
    pub advertise_addr: Option<String>,
    /// Derive id, address, bootstrap and join from the StatefulSet pod name.
    #[serde(default)]
    pub kubernetes: Option<KubernetesSection>,
    /// Test only: accept `Admin.SetFaults`, which cuts Raft traffic to chosen peers.
    #[serde(default)]
    pub fault_injection: bool,
    /// Bound on a forwarded write or a linearizable read, leader changes included.
    #[serde(default = "RaftSection::default_forward_timeout_ms")]
    pub forward_timeout_ms: u64,
    /// The least time an AppendEntries carrying entries to another member is given. Openraft
    /// gives one heartbeat interval, which a member a WAN round trip away (a learner in another
    /// cluster) never meets: set this above the longest round trip to any member. (Heartbeats
    /// and votes keep openraft's own timeouts.)
    #[serde(default = "RaftSection::default_rpc_timeout_floor_ms")]
    pub rpc_timeout_floor_ms: u64,
    #[serde(default = "RaftSection::default_heartbeat_ms")]
    pub heartbeat_ms: u64,
    #[serde(default = "RaftSection::default_election_min_ms")]
    pub election_timeout_min_ms: u64,
    #[serde(default = "RaftSection::default_election_max_ms")]
    pub election_timeout_max_ms: u64,
    /// Take a snapshot after this many entries; the log before it is then purged.
    #[serde(default = "RaftSection::default_snapshot_logs")]
    pub snapshot_logs: u64,
    /// Entries kept in the log behind a snapshot, so that a briefly lagging follower catches up
    /// from the log rather than a whole snapshot.
    #[serde(default = "RaftSection::default_keep_logs")]
    pub keep_logs_after_snapshot: u64,
    /// `/readyz` says not ready while this replica has applied fewer than this many entries
    /// fewer than the cluster committed (or knows no leader, or leads without a quorum).
    #[serde(default = "RaftSection::default_ready_max_lag")]
    pub ready_max_lag_entries: u64,
}

/// A StatefulSet member: pod `<statefulset>-<ordinal>` behind a headless Service.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KubernetesSection {
    /// The pod name (default: the `HOSTNAME` environment variable, which Kubernetes sets to it).
    #[serde(default)]
    pub pod_name: Option<String>,
    /// The headless Service that gives each pod a DNS name.
    pub service: String,
    /// The pod's namespace (default: `POD_NAMESPACE`, else the service account's namespace file
    /// Kubernetes mounts in every pod).
    #[serde(default)]
    pub namespace: Option<String>,
    #[serde(default = "KubernetesSection::default_cluster_domain")]
    pub cluster_domain: String,
    /// The gRPC port peers use (default: `grpc_listen`'s port).
    #[serde(default)]
    pub port: Option<u16>,
    /// The largest the StatefulSet may be scaled to: a new member looks for the cluster among
    /// ordinals `0..max_members`.
    #[serde(default = "KubernetesSection::default_max_members")]
    pub max_members: u64,
    /// Members whose ordinal the StatefulSet no longer has (scale-down) leave the membership,
    /// `spec.replicas` checked every `membership_check_ms` (needs `get` on statefulsets): by
    /// the leader for the members' set, by ordinal 0 for a learner set.
    #[serde(default = "KubernetesSection::default_manage")]
    pub manage_membership: bool,
    #[serde(default = "KubernetesSection::default_check_ms")]
    pub membership_check_ms: u64,
    /// The address the other members reach this pod at, when not its headless-Service name:
    /// `{pod}`, `{ordinal}` and `{port}` are replaced (e.g.
    /// `"{pod}.cluster-b.kvplane.example:{port}"`, a name published for each pod of a learner
    /// set in another cluster, whose Service names do not resolve where the members run).
    #[serde(default)]
    pub advertise_addr: Option<String>,
}

impl KubernetesSection {
    fn default_cluster_domain() -> String {
        "cluster.local".into()
    }
    fn default_max_members() -> u64 {
        7
    }
    fn default_manage() -> bool {
        true
    }
    fn default_check_ms() -> u64 {
        10_000
    }

    fn pod_name(&self) -> Result<String, SectionError> {
        match &self.pod_name {
            Some(p) => Ok(p.clone()),
            None => std::env::var("HOSTNAME").map_err(|_| SectionError::NoPodName),
        }
    }

    /// The namespace, from the section or the pod's environment.
    pub fn namespace(&self) -> Result<String, SectionError> {
        const MOUNTED: &str = "/var/run/secrets/kubernetes.io/serviceaccount/namespace";
        if let Some(n) = &self.namespace {
            return Ok(n.clone());
        }
        if let Ok(n) = std::env::var("POD_NAMESPACE")
            && !n.is_empty()
        {
            return Ok(n);
        }
        std::fs::read_to_string(MOUNTED)
            .map(|n| n.trim().to_owned())
            .map_err(|_| SectionError::NoNamespace(MOUNTED))
    }

    fn addr(&self, pod: &str, namespace: &str, port: u16) -> String {
        format!(
            "{pod}.{}.{namespace}.svc.{}:{port}",
            self.service, self.cluster_domain
        )
    }

    /// This pod's own address: `advertise_addr` filled in, else its headless-Service name.
    fn own_addr(&self, (pod, ordinal): (&str, u64), namespace: &str, port: u16) -> String {
        match &self.advertise_addr {
            Some(t) => t
                .replace("{pod}", pod)
                .replace("{ordinal}", &ordinal.to_string())
                .replace("{port}", &port.to_string()),
            None => self.addr(pod, namespace, port),
        }
    }
}

/// Who this member is and how it enters the cluster, resolved from the section.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Membership {
    pub id: u64,
    /// The address peers reach this node at.
    pub addr: String,
    /// Members of a new cluster this node initializes when its log is empty (empty: never).
    pub initial: Vec<PeerSection>,
    /// Addresses to ask for membership when the log is empty and nothing is initialized.
    pub join: Vec<String>,
    /// A StatefulSet member: its set and ordinal (its id is then chosen once per volume, see
    /// [`crate::identity`]).
    pub pod: Option<Pod>,
    /// Asks to be added as a learner, and stays one.
    pub learner: bool,
    /// Reaches the leader through `join` (see [`RaftSection::relay_through_join`]).
    pub relay_through_join: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pod {
    pub set: String,
    pub ordinal: u64,
    /// The address of every ordinal of its set below `max_members` (and its own), as it
    /// records its own: where a scaled-down ordinal's member is found in the membership.
    pub ordinals: Vec<String>,
}

impl Membership {
    /// The same member under `id` (a Kubernetes member's persisted id).
    pub fn with_id(mut self, id: u64) -> Self {
        for p in &mut self.initial {
            if p.id == self.id {
                p.id = id;
            }
        }
        self.id = id;
        self
    }
}

impl Default for RaftSection {
    fn default() -> Self {
        Self {
            id: None,
            peers: Vec::new(),
            bootstrap: false,
            join: Vec::new(),
            learner: false,
            relay_through_join: false,
            advertise_addr: None,
            kubernetes: None,
            fault_injection: false,
            forward_timeout_ms: Self::default_forward_timeout_ms(),
            rpc_timeout_floor_ms: Self::default_rpc_timeout_floor_ms(),
            heartbeat_ms: Self::default_heartbeat_ms(),
            election_timeout_min_ms: Self::default_election_min_ms(),
            election_timeout_max_ms: Self::default_election_max_ms(),
            snapshot_logs: Self::default_snapshot_logs(),
            keep_logs_after_snapshot: Self::default_keep_logs(),
            ready_max_lag_entries: Self::default_ready_max_lag(),
        }
    }
}

impl RaftSection {
    /// A node of its own: no peers to start with, none to join, no StatefulSet, and either no
    /// id or `bootstrap`. A node that names only its `id` waits to be added
    /// (`kvplane cluster add`) instead of starting a cluster of its own.
    pub fn is_single(&self) -> bool {
        self.kubernetes.is_none()
            && self.peers.is_empty()
            && self.join.is_empty()
            && (self.id.is_none() || self.bootstrap)
    }

    fn default_forward_timeout_ms() -> u64 {
        5_000
    }
    fn default_rpc_timeout_floor_ms() -> u64 {
        1_000
    }
    fn default_heartbeat_ms() -> u64 {
        100
    }
    fn default_election_min_ms() -> u64 {
        500
    }
    fn default_election_max_ms() -> u64 {
        1000
    }
    fn default_ready_max_lag() -> u64 {
        1_000
    }
    fn default_snapshot_logs() -> u64 {
        10_000
    }
    fn default_keep_logs() -> u64 {
        1_000
    }

    /// Resolves this member's identity. With `kubernetes`, pod `<set>-<n>` looks for the cluster
    /// among the other ordinals below `max_members`; ordinal 0 may initialize a one-member
    /// cluster (only once every other existing pod said it has none, see
    /// [`crate::identity`]). Its id here is `n + 1`, replaced at start by the id kept on its
    /// volume. A learner pod (a learner set in another cluster) asks `join` - the members'
    /// published names - and never initializes anything.
    pub fn membership(&self, grpc_listen: &str) -> Result<Membership, SectionError> {
        if let Some(k) = &self.kubernetes {
            let pod = k.pod_name()?;
            let (set, ordinal) = pod
                .rsplit_once('-')
                .and_then(|(set, n)| Some((set, n.parse::<u64>().ok()?)))
                .ok_or_else(|| SectionError::PodName(pod.clone()))?;
            let port = match k.port {
                Some(p) => p,
                None => grpc_listen
                    .parse::<SocketAddr>()
                    .map(|a| a.port())
                    .map_err(|_| SectionError::NoPort(grpc_listen.to_owned()))?,
            };
            let namespace = k.namespace()?;
            let id = ordinal + 1;
            let addr = k.own_addr((&pod, ordinal), &namespace, port);
            let ordinals: Vec<String> = (0..k.max_members.max(ordinal + 1))
                .map(|o| k.own_addr((&format!("{set}-{o}"), o), &namespace, port))
                .collect();
            if self.learner {
                return Ok(Membership {
                    id,
                    addr,
                    initial: Vec::new(),
                    join: self.join.clone(),
                    pod: Some(Pod {
                        set: set.to_owned(),
                        ordinal,
                        ordinals,
                    }),
                    learner: true,
                    relay_through_join: self.relay_through_join,
                });
            }
            return Ok(Membership {
                id,
                initial: if ordinal == 0 {
                    vec![PeerSection {
                        id,
                        addr: addr.clone(),
                    }]
                } else {
                    Vec::new()
                },
                join: (0..k.max_members.max(ordinal + 1))
                    .filter(|o| *o != ordinal)
                    .map(|o| k.addr(&format!("{set}-{o}"), &namespace, port))
                    .collect(),
                addr,
                pod: Some(Pod {
                    set: set.to_owned(),
                    ordinal,
                    ordinals,
                }),
                learner: false,
                relay_through_join: false,
            });
        }
        let id = match self.id {
            Some(id) => id,
            None if self.is_single() => 1,
            None => return Err(SectionError::NoId),
        };
        let addr = self
            .advertise_addr
            .clone()
            .or_else(|| {
                self.peers
                    .iter()
                    .find(|p| p.id == id)
                    .map(|p| p.addr.clone())
            })
            .unwrap_or_else(|| grpc_listen.to_owned());
        let initial = if self.bootstrap || self.is_single() {
            let mut peers = self.peers.clone();
            if !peers.iter().any(|p| p.id == id) {
                peers.push(PeerSection {
                    id,
                    addr: addr.clone(),
                });
            }
            peers
        } else {
            Vec::new()
        };
        Ok(Membership {
            id,
            addr,
            initial,
            join: self.join.clone(),
            pod: None,
            learner: self.learner,
            relay_through_join: self.relay_through_join,
        })
    }

    pub fn problems(&self, grpc_listen: &str, p: &mut Vec<String>) {
        if self.kubernetes.is_some()
            && (self.id.is_some()
                || !self.peers.is_empty()
                || self.bootstrap
                || (!self.join.is_empty() && !self.learner))
        {
            p.push(
                "raft.kubernetes derives id, peers, bootstrap and join (a learner's join is the members it asks): set none of them".into(),
            );
        }
        if let Err(e) = self.membership(grpc_listen) {
            p.push(e.to_string());
        }
        if let Some(id) = self.id
            && !self.peers.is_empty()
            && !self.peers.iter().any(|m| m.id == id)
        {
            p.push(format!("raft.id {id} is not among raft.peers"));
        }
        let mut ids = std::collections::BTreeSet::new();
        for (i, m) in self.peers.iter().enumerate() {
            if !ids.insert(m.id) {
                p.push(format!("raft.peers[{i}].id {} is listed twice", m.id));
            }
            if !is_host_port(&m.addr) {
                p.push(format!(
                    "raft.peers[{i}].addr {:?} is not host:port",
                    m.addr
                ));
            }
        }
        for (i, a) in self.join.iter().enumerate() {
            if !is_host_port(a) {
                p.push(format!("raft.join[{i}] {a:?} is not host:port"));
            }
        }
        if self.learner {
            if self.bootstrap {
                p.push("raft.learner cannot bootstrap a cluster: it never votes".into());
            }
            if self.join.is_empty() {
                p.push("raft.learner needs raft.join: the members that add it".into());
            }
        }
        if self.relay_through_join {
            if !self.learner {
                p.push(
                    "raft.relay_through_join is for a learner (raft.learner): voters reach each other at their recorded addresses"
                        .into(),
                );
            }
            if self.join.is_empty() && self.kubernetes.is_none() {
                p.push(
                    "raft.relay_through_join needs raft.join: the members to relay through".into(),
                );
            }
        }
        if self.forward_timeout_ms == 0 {
            p.push("raft.forward_timeout_ms must be at least 1".into());
        }
        if self.heartbeat_ms == 0 || self.election_timeout_min_ms <= self.heartbeat_ms {
            p.push("raft.election_timeout_min_ms must exceed raft.heartbeat_ms (> 0)".into());
        }
        if self.election_timeout_max_ms <= self.election_timeout_min_ms {
            p.push("raft.election_timeout_max_ms must exceed raft.election_timeout_min_ms".into());
        }
        if self.snapshot_logs == 0 {
            p.push("raft.snapshot_logs must be at least 1".into());
        }
        if let Some(k) = &self.kubernetes {
            if self.advertise_addr.is_some() {
                p.push(
                    "raft.advertise_addr is not read with raft.kubernetes: set raft.kubernetes.advertise_addr"
                        .into(),
                );
            }
            if let Some(t) = &k.advertise_addr {
                if !t.contains("{pod}") && !t.contains("{ordinal}") {
                    p.push(format!(
                        "raft.kubernetes.advertise_addr {t:?} names no {{pod}} or {{ordinal}}: every pod would have one address"
                    ));
                }
                let filled = t
                    .replace("{pod}", "pod-0")
                    .replace("{ordinal}", "0")
                    .replace("{port}", "7070");
                if !is_host_port(&filled) {
                    p.push(format!(
                        "raft.kubernetes.advertise_addr {t:?} is not host:port"
                    ));
                }
            }
            if k.max_members == 0 {
                p.push("raft.kubernetes.max_members must be at least 1".into());
            }
            if k.membership_check_ms == 0 {
                p.push("raft.kubernetes.membership_check_ms must be at least 1".into());
            }
        }
    }
}

fn is_host_port(a: &str) -> bool {
    a.parse::<SocketAddr>().is_ok()
        || a.rsplit_once(':')
            .is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok())
}

/// Why a `[raft]` section names no membership for this member.
#[derive(Debug, thiserror::Error)]
pub enum SectionError {
    #[error("raft.kubernetes.pod_name is not set and HOSTNAME is not in the environment")]
    NoPodName,
    #[error("pod name {0:?} is not <statefulset>-<ordinal>")]
    PodName(String),
    #[error("grpc_listen {0:?} has no port")]
    NoPort(String),
    #[error("raft.kubernetes.namespace is not set, nor POD_NAMESPACE, nor {0}")]
    NoNamespace(&'static str),
    #[error("raft.id is required with raft.peers or raft.join")]
    NoId,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn section(toml_text: &str) -> RaftSection {
        toml::from_str(toml_text).unwrap()
    }

    fn k8s(pod: &str) -> RaftSection {
        section(&format!(
            "[kubernetes]\npod_name = \"{pod}\"\nservice = \"kvplane-peers\"\nnamespace = \"infra\"\n"
        ))
    }

    #[test]
    fn a_learner_joins_and_can_neither_bootstrap_nor_go_without_members_to_ask() {
        let m = section("id = 5\njoin = [\"10.0.0.1:7070\"]\nlearner = true\n")
            .membership("10.1.0.5:7070")
            .unwrap();
        assert!(m.learner && m.initial.is_empty());
        let mut p = Vec::new();
        section("id = 5\nbootstrap = true\nlearner = true\n").problems("10.1.0.5:7070", &mut p);
        assert_eq!(
            p,
            [
                "raft.learner cannot bootstrap a cluster: it never votes",
                "raft.learner needs raft.join: the members that add it",
            ]
        );
    }

    #[test]
    fn relaying_through_join_needs_members_to_relay_through() {
        let m = section(
            "id = 5\njoin = [\"a.example:7070\"]\nlearner = true\nrelay_through_join = true\n",
        )
        .membership("10.1.0.5:7070")
        .unwrap();
        assert!(m.relay_through_join && m.join == ["a.example:7070"]);
        let mut p = Vec::new();
        section("id = 5\nrelay_through_join = true\n").problems("10.1.0.5:7070", &mut p);
        assert_eq!(
            p,
            [
                "raft.relay_through_join is for a learner (raft.learner): voters reach each other at their recorded addresses",
                "raft.relay_through_join needs raft.join: the members to relay through"
            ]
        );
    }

    #[test]
    fn a_learner_set_asks_the_members_it_is_given_under_its_published_names() {
        let s = section(
            "learner = true\nrelay_through_join = true\njoin = [\"a.example:443\"]\n[kubernetes]\npod_name = \"kvplane-b-1\"\nservice = \"kvplane-peers\"\nnamespace = \"infra\"\nadvertise_addr = \"{pod}.b.example:{port}\"\nport = 7443\n",
        );
        let mut p = Vec::new();
        s.problems("0.0.0.0:7070", &mut p);
        assert!(p.is_empty(), "{p:?}");
        let m = s.membership("0.0.0.0:7070").unwrap();
        assert_eq!(m.addr, "kvplane-b-1.b.example:7443");
        assert_eq!(m.join, ["a.example:443"], "the members, not its own set");
        assert!(m.learner && m.relay_through_join && m.initial.is_empty());
        assert_eq!(
            m.pod,
            Some(Pod {
                set: "kvplane-b".into(),
                ordinal: 1,
                ordinals: (0..7)
                    .map(|o| format!("kvplane-b-{o}.b.example:7443"))
                    .collect(),
            })
        );
        // Ordinal 0 of a learner set initializes nothing either.
        let zero = section(
            "learner = true\njoin = [\"a.example:443\"]\n[kubernetes]\npod_name = \"kvplane-b-0\"\nservice = \"kvplane-peers\"\nnamespace = \"infra\"\n",
        )
        .membership("0.0.0.0:7070")
        .unwrap();
        assert!(zero.initial.is_empty());
        assert_eq!(
            zero.addr,
            "kvplane-b-0.kvplane-peers.infra.svc.cluster.local:7070"
        );
        // Without members to ask, a learner set is a problem; a voter set takes no join.
        let mut p = Vec::new();
        section("learner = true\n[kubernetes]\npod_name = \"kvplane-b-0\"\nservice = \"s\"\nnamespace = \"n\"\n")
            .problems("0.0.0.0:7070", &mut p);
        assert_eq!(p, ["raft.learner needs raft.join: the members that add it"]);
        // `{ordinal}` fills in too; a template naming neither, or not host:port, or the static
        // advertise_addr beside kubernetes, is a problem.
        let by_ordinal = section(
            "learner = true\njoin = [\"a:1\"]\n[kubernetes]\npod_name = \"kvplane-b-3\"\nservice = \"s\"\nnamespace = \"n\"\nadvertise_addr = \"b{ordinal}.example:{port}\"\n",
        )
        .membership("0.0.0.0:7070")
        .unwrap();
        assert_eq!(by_ordinal.addr, "b3.example:7070");
        for (extra, problem) in [
            (
                "advertise_addr = \"b.example:7070\"",
                "names no {pod} or {ordinal}",
            ),
            ("advertise_addr = \"{pod}\"", "is not host:port"),
        ] {
            let mut p = Vec::new();
            section(&format!("learner = true\njoin = [\"a:1\"]\n[kubernetes]\npod_name = \"kvplane-b-0\"\nservice = \"s\"\nnamespace = \"n\"\n{extra}\n"))
                .problems("0.0.0.0:7070", &mut p);
            assert!(p.len() == 1 && p[0].contains(problem), "{p:?}");
        }
        let mut p = Vec::new();
        section("learner = true\njoin = [\"a:1\"]\nadvertise_addr = \"b.example:1\"\n[kubernetes]\npod_name = \"kvplane-b-0\"\nservice = \"s\"\nnamespace = \"n\"\n")
            .problems("0.0.0.0:7070", &mut p);
        assert!(
            p.iter()
                .any(|m| m.contains("raft.advertise_addr is not read")),
            "{p:?}"
        );
        let mut p = Vec::new();
        section("join = [\"a:1\"]\n[kubernetes]\npod_name = \"kvplane-0\"\nservice = \"s\"\nnamespace = \"n\"\n")
            .problems("0.0.0.0:7070", &mut p);
        assert_eq!(p.len(), 1, "{p:?}");
    }

    #[test]
    fn ordinal_zero_may_initialize_a_one_member_cluster_but_looks_for_one_first() {
        let m = k8s("kvplane-0").membership("0.0.0.0:7070").unwrap();
        let addr = "kvplane-0.kvplane-peers.infra.svc.cluster.local:7070";
        assert_eq!(m.id, 1);
        assert_eq!(m.addr, addr);
        assert_eq!(
            m.initial,
            vec![PeerSection {
                id: 1,
                addr: addr.into()
            }]
        );
        assert_eq!(m.join.len(), 6);
        assert_eq!(
            m.join[0],
            "kvplane-1.kvplane-peers.infra.svc.cluster.local:7070"
        );
        assert_eq!(m.with_id(77).initial[0].id, 77);
    }

    #[test]
    fn other_ordinals_join_through_every_other_one() {
        let m = k8s("kvplane-2").membership("0.0.0.0:7070").unwrap();
        assert_eq!(m.id, 3);
        assert!(m.initial.is_empty());
        assert_eq!(
            m.pod,
            Some(Pod {
                set: "kvplane".into(),
                ordinal: 2,
                ordinals: (0..7)
                    .map(|o| format!("kvplane-{o}.kvplane-peers.infra.svc.cluster.local:7070"))
                    .collect(),
            })
        );
        let others: Vec<String> = [0, 1, 3, 4, 5, 6]
            .iter()
            .map(|o| format!("kvplane-{o}.kvplane-peers.infra.svc.cluster.local:7070"))
            .collect();
        assert_eq!(m.join, others);
    }

    #[test]
    fn a_pod_name_without_an_ordinal_is_a_config_problem() {
        let mut p = Vec::new();
        k8s("kvplane").problems("0.0.0.0:7070", &mut p);
        assert_eq!(p.len(), 1, "{p:?}");
        assert!(p[0].contains("<statefulset>-<ordinal>"), "{p:?}");
    }

    #[test]
    fn static_bootstrap_uses_the_peer_list() {
        let s = section(
            "id = 2\nbootstrap = true\npeers = [{ id = 1, addr = \"a:1\" }, { id = 2, addr = \"b:2\" }]\n",
        );
        let m = s.membership("0.0.0.0:7070").unwrap();
        assert_eq!((m.id, m.addr.as_str(), m.initial.len()), (2, "b:2", 2));
    }

    #[test]
    fn a_node_naming_no_peers_is_a_one_member_cluster_that_initializes_itself() {
        for s in [RaftSection::default(), section("snapshot_logs = 5\n")] {
            let mut p = Vec::new();
            s.problems("127.0.0.1:7070", &mut p);
            assert!(p.is_empty(), "{p:?}");
            let m = s.membership("127.0.0.1:7070").unwrap();
            assert_eq!(m.id, 1);
            assert_eq!(
                m.initial,
                vec![PeerSection {
                    id: 1,
                    addr: "127.0.0.1:7070".into()
                }]
            );
            assert!(m.join.is_empty());
        }
        // A node naming only its id waits to be added; with bootstrap it starts its own.
        let waits = section("id = 4\n").membership("127.0.0.1:7070").unwrap();
        assert_eq!((waits.id, waits.initial.len()), (4, 0));
        let own = section("id = 4\nbootstrap = true\n")
            .membership("127.0.0.1:7070")
            .unwrap();
        assert_eq!(own.initial.len(), 1);
        // With peers or join addresses, the id is the operator's to give.
        let mut p = Vec::new();
        section("join = [\"a:1\"]\n").problems("127.0.0.1:7070", &mut p);
        assert!(p.iter().any(|e| e.contains("raft.id is required")), "{p:?}");
    }

    #[test]
    fn kubernetes_and_static_settings_are_not_mixed() {
        let mut s = k8s("kvplane-1");
        s.id = Some(4);
        let mut p = Vec::new();
        s.problems("0.0.0.0:7070", &mut p);
        assert!(p.iter().any(|e| e.contains("set none of them")), "{p:?}");
    }
}
