//! `GatewayBackend`: what gateways address.

use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::common::ObjectStatus;

/// A public model name (an alias) backed by models or pools, with the header that names the
/// tenant and the policies that apply, in order.
#[derive(CustomResource, Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "kvplane.io",
    version = "v1alpha1",
    kind = "GatewayBackend",
    namespaced,
    status = "ObjectStatus",
    shortname = "gwb",
    printcolumn = r#"{"name":"Model","type":"string","jsonPath":".spec.publicModel"}"#
)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct GatewayBackendSpec {
    /// The name clients put in `model`.
    pub public_model: String,
    pub backends: Vec<Backend>,
    /// The request header that carries the tenant.
    #[serde(default = "default_tenant_header")]
    pub tenant_header: String,
    /// `InferencePolicy` names, evaluated in order; the first matching rule applies.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub policies: Vec<String>,
    /// Request headers whose values become tags (the gateway passes its headers on).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tag_headers: Vec<super::TagHeader>,
    /// Built-in taggers run on the prompt: `pii`, `complexity`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub classify: Option<super::Classify>,
}

fn default_tenant_header() -> String {
    "x-tenant".into()
}

/// One backing target: exactly one of `pool`, `workerSet` or `model` (a served model, or
/// another public name).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Backend {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub worker_set: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// Preference: a candidate's objective is divided by its target's weight (default 1), so a
    /// target of weight 2 wins over one up to twice as good.
    #[serde(default = "default_weight")]
    pub weight: f64,
}

fn default_weight() -> f64 {
    1.0
}
