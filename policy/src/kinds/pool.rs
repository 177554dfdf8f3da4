//! `InferencePool`: worker sets that share routing.

use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::common::{Labels, ObjectStatus};

/// A named group of worker sets (possibly in several clusters) that rules select together.
#[derive(CustomResource, Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "kvplane.io",
    version = "v1alpha1",
    kind = "InferencePool",
    namespaced,
    status = "ObjectStatus",
    shortname = "ipool"
)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct InferencePoolSpec {
    /// `InferenceWorkerSet` names.
    pub worker_sets: Vec<String>,
    #[serde(default, skip_serializing_if = "Labels::is_empty")]
    pub labels: Labels,
}
