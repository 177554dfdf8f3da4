//! `InferencePolicy`: ordered rules.

use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::common::{Labels, ObjectStatus};

/// Ordered rules, the first whose `match` holds decides the request; and tenant limits.
#[derive(CustomResource, Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "kvplane.io",
    version = "v1alpha1",
    kind = "InferencePolicy",
    namespaced,
    status = "ObjectStatus",
    shortname = "ipol"
)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct InferencePolicySpec {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rules: Vec<Rule>,
    /// Token and request budgets of tenants, the same for every replica and gateway.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub limits: Vec<super::TenantLimit>,
    /// Requested models (public or served) whose requests this policy's rules apply to,
    /// besides those of the `GatewayBackend`s that list it. A policy's rules apply nowhere
    /// else: naming a model directly never escapes the policies of a backend serving it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub applies_to_models: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Rule {
    pub name: String,
    /// When the rule applies; empty matches every request.
    #[serde(default, rename = "match")]
    pub matches: Match,
    /// Where the request may go; empty: the backend's targets (or the model's worker sets).
    #[serde(default)]
    pub candidates: Targets,
    #[serde(default)]
    pub filter: Filter,
    /// What happens when the filter leaves nothing.
    #[serde(default)]
    pub on_empty: OnEmpty,
    #[serde(default)]
    pub minimize: Objective,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema, Default)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Match {
    /// Any of these tenants (empty: any tenant).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tenants: Vec<String>,
    /// Any of these requested models, public names included (empty: any).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub models: Vec<String>,
    /// All of these tags (`pii`, `batch`, `complexity=low`, ...).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tags: Vec<String>,
    /// Conditions on pools' live state, all of which must hold.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pool_state: Vec<PoolCondition>,
}

impl Match {
    /// Whether every request `later` matches is matched by `self` too (so a rule with `later`
    /// after one with `self` never applies). Pool-state conditions count only when `self` has
    /// none, or `later` has each of them.
    pub fn covers(&self, later: &Match) -> bool {
        fn within(mine: &[String], theirs: &[String]) -> bool {
            mine.is_empty() || (!theirs.is_empty() && theirs.iter().all(|t| mine.contains(t)))
        }
        within(&self.tenants, &later.tenants)
            && within(&self.models, &later.models)
            && self.tags.iter().all(|t| later.tags.contains(t))
            && self.pool_state.iter().all(|c| later.pool_state.contains(c))
    }

    pub fn is_catch_all(&self) -> bool {
        self.tenants.is_empty()
            && self.models.is_empty()
            && self.tags.is_empty()
            && self.pool_state.is_empty()
    }
}

/// A condition on one pool's workers that are up.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PoolCondition {
    pub pool: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_up_workers: Option<u32>,
    /// Mean waiting requests per up worker at most this.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_average_waiting: Option<f64>,
    /// Mean GPU KV-cache usage (0..1) at most this.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_average_kv_cache_usage: Option<f64>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema, Default)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Targets {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pools: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub worker_sets: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub providers: Vec<String>,
}

impl Targets {
    pub fn is_empty(&self) -> bool {
        self.pools.is_empty() && self.worker_sets.is_empty() && self.providers.is_empty()
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema, Default)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Filter {
    /// Drop workers with more waiting (queued) requests than this.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_queued: Option<u32>,
    /// Drop workers whose GPU KV cache is fuller than this (0..1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_kv_cache_usage: Option<f64>,
    /// Keep only candidates whose labels include all of these.
    #[serde(default, skip_serializing_if = "Labels::is_empty")]
    pub labels: Labels,
    /// Drop external providers.
    #[serde(default)]
    pub exclude_external: bool,
    /// Keep only candidates at the asking gateway's `Cluster`, `Region` or `Zone` (the
    /// replica's `[locality]`; a target's from its labels `kvplane.io/cluster`,
    /// `topology.kubernetes.io/region`, `topology.kubernetes.io/zone`). A target without the
    /// label, and every candidate when the replica's place at that level is not configured,
    /// is dropped: the rule never crosses the boundary by mistake.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub same_locality: Option<crate::locality::Level>,
    /// Local first, spill when local is slow: while a candidate at the asking gateway's
    /// `level` is predicted to give its first token within `spillAboveTtftMs`, candidates
    /// elsewhere are dropped; when none there is (busy, or none eligible), those elsewhere
    /// stay and the objective chooses among all. A preference, not a boundary: a target
    /// without the label is elsewhere, and a replica whose place at that level is not
    /// configured prefers nothing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefer_locality: Option<crate::locality::Preference>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema, Default)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct OnEmpty {
    /// `Reject` (the default: fail closed) or `Fallback`.
    #[serde(default)]
    pub action: EmptyAction,
    /// The fallback targets (only with `Fallback`); the rule's `excludeExternal` and label
    /// filters still apply to them.
    #[serde(default, skip_serializing_if = "Targets::is_empty")]
    pub fallback: Targets,
    /// Shown in the rejection.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema, Default)]
pub enum EmptyAction {
    #[default]
    Reject,
    Fallback,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema, Default)]
pub enum Objective {
    /// Predicted time to first token: uncached prompt tokens and queue (the default).
    #[default]
    PredictedTTFT,
    /// Token price of the request.
    Cost,
    /// Running plus waiting requests.
    Load,
}
