//! A seeded schedule of faults: the same seed gives the same faults, held as long, with the
//! same healthy gaps between them, so a failing run's seed runs the same sequence of faults
//! again (which member leads, and how many steps fit the duration, are the run's own).

/// One kind of fault the runner injects into the fleet.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, clap::ValueEnum)]
pub enum Fault {
    /// SIGKILL the leader, then start it again on its data directory.
    KillLeader,
    KillFollower,
    /// SIGSTOP the leader (its sockets stay open, nothing answers), then SIGCONT.
    PauseLeader,
    PauseFollower,
    /// Cut the leader's Raft traffic with the other members both ways (a minority partition).
    IsolateLeader,
    IsolateFollower,
    /// The leader's Raft traffic to the others cut, theirs to it not (a one-way partition).
    MuteLeader,
    /// Every member cut from every other: no quorum anywhere.
    SplitAll,
    /// SIGKILL nats-server, then start it again on its store.
    RestartNats,
    /// SIGSTOP nats-server (its sockets stay open, nothing answers), then SIGCONT.
    PauseNats,
    /// Every member stopped (SIGTERM) and started again in turn, the leader last, each once
    /// the fleet is healthy again.
    RollingRestart,
    /// A follower killed and its volume lost: it comes back empty at the same address under a
    /// new id, joins, and its old id leaves the membership.
    WipeFollower,
    /// Two new members join (3 -> 5); at the heal they are removed again (5 -> 3).
    ScaleOut,
    /// A follower restarted with its wall clock 1.5 s ahead (libfaketime), then restarted
    /// with the true time at the heal.
    SkewFollower,
    /// The leader's log writes fail (failpoint): it must exit with an error on its own; it is
    /// started again on its data at the heal.
    DiskFailsLeader,
    DiskFailsFollower,
    /// The leader's log rounds take 100 ms more and its snapshots 1 s (failpoints).
    SlowDiskLeader,
    /// Every member's snapshot writes fail (failpoint): a builder keeps its last snapshot, a
    /// follower sent one by the leader stops (and is started again at the heal).
    SnapshotsFail,
    /// SIGKILL an engine's bridge, then start it again: it resumes from the stream's last
    /// batch and the engine's replay.
    KillBridge,
    /// SIGSTOP an engine's bridge, then SIGCONT.
    PauseBridge,
    /// The leader's log rounds made to take a second each, then, once it applied ten more
    /// entries (committed by its followers' disks while its own waited: the last of them are
    /// not on its disk yet), SIGKILL; started again at the heal.
    KillLeaderBehind,
    /// SIGKILL the gateway, then start it again (same port).
    KillGateway,
    /// SIGSTOP the gateway, then SIGCONT.
    PauseGateway,
}

impl Fault {
    pub const ALL: [Fault; 23] = [
        Fault::KillLeader,
        Fault::KillFollower,
        Fault::PauseLeader,
        Fault::PauseFollower,
        Fault::IsolateLeader,
        Fault::IsolateFollower,
        Fault::MuteLeader,
        Fault::SplitAll,
        Fault::RestartNats,
        Fault::RollingRestart,
        Fault::WipeFollower,
        Fault::ScaleOut,
        Fault::SkewFollower,
        Fault::DiskFailsLeader,
        Fault::DiskFailsFollower,
        Fault::SlowDiskLeader,
        Fault::SnapshotsFail,
        Fault::KillBridge,
        Fault::PauseBridge,
        Fault::PauseNats,
        Fault::KillLeaderBehind,
        Fault::KillGateway,
        Fault::PauseGateway,
    ];

    pub fn label(self) -> &'static str {
        match self {
            Fault::KillLeader => "kill -9 leader",
            Fault::KillFollower => "kill -9 follower",
            Fault::PauseLeader => "pause leader",
            Fault::PauseFollower => "pause follower",
            Fault::IsolateLeader => "isolate leader",
            Fault::IsolateFollower => "isolate follower",
            Fault::MuteLeader => "leader's sends cut",
            Fault::SplitAll => "every member isolated",
            Fault::RestartNats => "kill -9 nats-server",
            Fault::RollingRestart => "rolling restart",
            Fault::WipeFollower => "follower wiped, new id",
            Fault::ScaleOut => "scale 3 -> 5 -> 3",
            Fault::SkewFollower => "follower clock +1.5 s",
            Fault::DiskFailsLeader => "leader's disk fails",
            Fault::DiskFailsFollower => "follower's disk fails",
            Fault::SlowDiskLeader => "leader's disk slow",
            Fault::SnapshotsFail => "snapshot writes fail",
            Fault::KillBridge => "kill -9 bridge",
            Fault::PauseBridge => "pause bridge",
            Fault::PauseNats => "pause nats-server",
            Fault::KillLeaderBehind => "kill -9 leader, disk behind",
            Fault::KillGateway => "kill -9 gateway",
            Fault::PauseGateway => "pause gateway",
        }
    }
}

/// One fault, how long it is held, and how long the fleet then runs healthy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Step {
    pub fault: Fault,
    pub hold_ms: u64,
    pub healthy_ms: u64,
    /// Which follower, for the follower faults (taken modulo their number).
    pub pick: u64,
}

/// A named set of faults, several named after the fixed scenarios of `node/tests` that inject
/// them: the runner draws them at random and checks its own invariants (those tests keep
/// their own assertions).
pub const SCENARIOS: [(&str, &[Fault], &str); 10] = [
    (
        "quota-leader-kill",
        &[Fault::IsolateFollower, Fault::KillLeader],
        "tenant limits with a member cut off and the leader killed (node/tests/quota.rs)",
    ),
    (
        "frozen-members",
        &[Fault::PauseLeader, Fault::PauseFollower],
        "a frozen leader replaced, a resumed follower not unseating it (node/tests/cluster_faults.rs)",
    ),
    (
        "partitions",
        &[
            Fault::IsolateLeader,
            Fault::IsolateFollower,
            Fault::MuteLeader,
            Fault::SplitAll,
        ],
        "minority, one-way and total partitions",
    ),
    (
        "membership",
        &[
            Fault::RollingRestart,
            Fault::WipeFollower,
            Fault::ScaleOut,
            Fault::KillFollower,
        ],
        "members restarted, replaced under new ids, added and removed, catching up through snapshots (node/tests/cluster.rs, cluster_faults.rs)",
    ),
    (
        "nats-restart",
        &[Fault::RestartNats, Fault::PauseNats],
        "nats-server killed and restarted on its store, or frozen (node/tests/fleet_faults.rs)",
    ),
    (
        "clock-skew",
        &[Fault::SkewFollower],
        "a follower's wall clock ahead: quota windows",
    ),
    (
        "disks",
        &[
            Fault::DiskFailsLeader,
            Fault::DiskFailsFollower,
            Fault::SlowDiskLeader,
            Fault::SnapshotsFail,
        ],
        "log and snapshot writes that fail or crawl (failpoints; node/tests/cluster_faults.rs)",
    ),
    (
        "bridges",
        &[
            Fault::KillBridge,
            Fault::PauseBridge,
            Fault::RestartNats,
            Fault::PauseNats,
        ],
        "bridges killed and frozen, nats-server killed: every engine batch applied once (node/tests/fleet_faults.rs)",
    ),
    (
        "leader-lost-writes",
        &[Fault::KillLeaderBehind, Fault::KillLeader],
        "a leader killed with committed entries its own disk had not taken: back as a follower, it learns them (the divergence this runner found; node/tests/cluster_faults.rs)",
    ),
    (
        "gateway",
        &[Fault::KillGateway, Fault::PauseGateway],
        "the gateway killed or frozen: its clients fail meanwhile, members and the endpoint picker do not",
    ),
];

/// The faults of scenario `name`.
pub fn scenario(name: &str) -> Option<&'static [Fault]> {
    SCENARIOS
        .iter()
        .find(|(n, ..)| *n == name)
        .map(|(_, f, _)| *f)
}

/// `steps` faults drawn from `seed`, of the kinds in `kinds` (every kind when empty).
pub fn schedule(seed: u64, steps: usize, kinds: &[Fault]) -> Vec<Step> {
    let kinds = if kinds.is_empty() {
        &Fault::ALL[..]
    } else {
        kinds
    };
    let mut rng = SplitMix(seed);
    (0..steps)
        .map(|_| Step {
            fault: kinds[(rng.next() % kinds.len() as u64) as usize],
            hold_ms: 500 + rng.next() % 2_500,
            healthy_ms: 1_000 + rng.next() % 2_000,
            pick: rng.next(),
        })
        .collect()
}

/// SplitMix64: small, seeded, and the same on every machine.
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_seed_replays_the_same_schedule_and_seeds_differ() {
        assert_eq!(schedule(7, 20, &[]), schedule(7, 20, &[]));
        assert_ne!(schedule(7, 20, &[]), schedule(8, 20, &[]));
    }

    #[test]
    fn a_scenario_draws_only_its_faults_and_every_scenario_is_found() {
        for (name, faults, _) in SCENARIOS {
            assert_eq!(scenario(name), Some(faults));
            assert!(
                schedule(3, 50, faults)
                    .iter()
                    .all(|s| faults.contains(&s.fault))
            );
        }
        assert_eq!(scenario("no-such"), None);
    }

    #[test]
    fn every_fault_kind_is_drawn_and_bounds_hold() {
        let s = schedule(1, 200, &[]);
        for f in Fault::ALL {
            assert!(s.iter().any(|st| st.fault == f), "{f:?} never drawn");
        }
        assert!(s.iter().all(|st| (500..3_000).contains(&st.hold_ms)));
        assert!(s.iter().all(|st| (1_000..3_000).contains(&st.healthy_ms)));
    }

    /// SplitMix64's published first outputs for seed 0 (a value we did not compute).
    #[test]
    fn the_generator_is_splitmix64() {
        let mut r = SplitMix(0);
        assert_eq!(r.next(), 0xE220_A839_7B1D_CDAF);
        assert_eq!(r.next(), 0x6E78_9E6A_A1B9_65F4);
    }
}
