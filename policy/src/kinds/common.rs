//! Types shared by the kinds.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// The API group of every kvplane kind (not the Gateway API Inference Extension's, so that
/// both can be installed in one cluster).
pub const GROUP: &str = "kvplane.io";
pub const VERSION: &str = "v1alpha1";

/// Labels on a worker set or provider, matched by rule filters.
pub type Labels = BTreeMap<String, String>;

/// Price of tokens, in any currency unit per million tokens.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, JsonSchema, Default)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TokenCost {
    #[serde(default)]
    pub input_per_million: f64,
    #[serde(default)]
    pub output_per_million: f64,
}

impl TokenCost {
    /// The cost of a request with these token counts.
    pub fn of(&self, input_tokens: u32, output_tokens: u32) -> f64 {
        (f64::from(input_tokens) * self.input_per_million
            + f64::from(output_tokens) * self.output_per_million)
            / 1e6
    }
}

/// What kvplane reports on every object it watches.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema, Default)]
#[serde(rename_all = "camelCase")]
pub struct ObjectStatus {
    /// `Accepted`: True once the object is in the replicated state, False with the reason when
    /// validation refused it.
    #[serde(default)]
    pub conditions: Vec<Condition>,
    /// The log index at which the object took effect.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub applied_index: Option<u64>,
}
