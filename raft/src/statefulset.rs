//! Scale-down: the leader removes the members whose ordinal the StatefulSet no longer has;
//! a learner set's ordinal 0 has its own set's removed (below).
//!
//! Every `membership_check_ms` the leader reads its StatefulSet's `spec.replicas` and removes,
//! one per round, a member whose address is `<set>-<ordinal>....` with `ordinal >= replicas`
//! (see [`crate::identity::departed`]). A member leaving is a joint-consensus membership
//! change, so the cluster keeps a quorum throughout; scaling up again brings the pod back under
//! a new id when its volume is new, or its old one when the volume was kept (it then joins as
//! a new member again).

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::apps::v1::StatefulSet;

use crate::member::RaftMember;

/// A StatefulSet's `spec.replicas`, read through the API (unset: Kubernetes' default, 1).
struct Replicas {
    api: kube::Api<StatefulSet>,
    set: String,
    failures: u32,
}

impl Replicas {
    fn new(client: kube::Client, namespace: &str, set: String) -> Self {
        Self {
            api: kube::Api::namespaced(client, namespace),
            set,
            failures: 0,
        }
    }

    /// Every `every`, while `active()` holds: the replicas, once read; `None` once `stop`.
    async fn next(
        &mut self,
        every: Duration,
        stop: &mut tokio::sync::watch::Receiver<bool>,
        active: impl Fn() -> bool,
    ) -> Option<i32> {
        loop {
            tokio::select! {
                _ = tokio::time::sleep(every) => {}
                _ = stop.changed() => return None,
            }
            if active()
                && let Some(replicas) = self.read().await
            {
                return Some(replicas);
            }
        }
    }

    /// The replicas now; `None` when they cannot be read (logged on the first failure and
    /// every 30th after it).
    async fn read(&mut self) -> Option<i32> {
        match self.api.get(&self.set).await {
            Ok(s) => Some(s.spec.and_then(|s| s.replicas).unwrap_or(1)),
            Err(e) => {
                if self.failures.is_multiple_of(30) {
                    tracing::warn!(statefulset = self.set, error = %e, "cannot read the statefulset's replicas");
                }
                self.failures += 1;
                None
            }
        }
    }
}

pub async fn run(
    client: kube::Client,
    namespace: String,
    set: String,
    every: Duration,
    member: Arc<RaftMember>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let mut set = Replicas::new(client, &namespace, set);
    while let Some(replicas) = set.next(every, &mut stop, || member.is_leader()).await {
        let members = member.members();
        // What follows the pod's name in its address: the same for every pod of this set.
        let rest = member
            .membership
            .addr
            .find('.')
            .map_or("", |at| &member.membership.addr[at..]);
        let gone = crate::identity::departed(
            members.iter().map(|(i, a)| (*i, a.as_str())),
            (&set.set, rest),
            u64::try_from(replicas).unwrap_or(0),
        );
        if let Some(&id) = gone.first() {
            match member.remove_member(id).await {
                Ok(()) => tracing::info!(id, replicas, "member of a scaled-down ordinal removed"),
                Err(e) => tracing::warn!(id, error = %e, "cannot remove a scaled-down member"),
            }
        }
    }
}

/// A learner set's scale-down, followed by its ordinal 0 (which a scale-down never removes):
/// every `every` it reads its own StatefulSet's `spec.replicas` (in its own cluster, which the
/// voters cannot read) and asks the members it joined through to remove, one per round, a
/// learner recorded at the address of an ordinal the set no longer has (see
/// [`crate::identity::departed_learners`]). The ask is relayed to the leader and refused for a
/// voter. Without it such a member stays in the membership - replicated to in vain, its quota
/// share held - until `kvplane cluster remove`.
pub async fn run_learner_set(
    client: kube::Client,
    namespace: String,
    set: String,
    every: Duration,
    member: Arc<RaftMember>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let Some(pod) = member.membership.pod.clone() else {
        return;
    };
    let mut set = Replicas::new(client, &namespace, set);
    while let Some(replicas) = set.next(every, &mut stop, || member.is_member()).await {
        let members = member.members();
        let gone = crate::identity::departed_learners(
            members.iter().map(|(i, a)| (*i, a.as_str())),
            |id| member.is_voter_id(id),
            &pod.ordinals,
            u64::try_from(replicas).unwrap_or(0),
        );
        let Some(&id) = gone.first() else {
            continue;
        };
        let mut asked = Vec::new();
        for via in &member.membership.join {
            let asked_via = tokio::select! {
                r = crate::member::remove_through(&member.dialer, via, id, true, true) => r,
                _ = stop.changed() => return,
            };
            match asked_via {
                Ok(()) => {
                    tracing::info!(
                        id,
                        replicas,
                        via,
                        "learner of a scaled-down ordinal removed"
                    );
                    asked.clear();
                    break;
                }
                Err(e) => asked.push(format!("{via}: {}", e.message())),
            }
        }
        if !asked.is_empty() {
            tracing::warn!(id, errors = ?asked, "cannot remove a scaled-down learner");
        }
    }
}
