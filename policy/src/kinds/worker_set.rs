//! `InferenceWorkerSet`: vLLM engines serving one model.

use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::common::{Labels, ObjectStatus, TokenCost};

/// A set of vLLM engines serving one model. Its name is the `<pool>` token of its engines' NATS
/// subjects (`kvplane.{kv,metrics,worker}.<name>.<worker>`), where their KV events and metrics
/// arrive; each set has its own prefix index.
#[derive(CustomResource, Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "kvplane.io",
    version = "v1alpha1",
    kind = "InferenceWorkerSet",
    namespaced,
    status = "ObjectStatus",
    shortname = "iws",
    printcolumn = r#"{"name":"Model","type":"string","jsonPath":".spec.model"}"#
)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct InferenceWorkerSetSpec {
    /// The model the engines serve (vLLM's `--served-model-name`).
    pub model: String,
    /// Tokens per KV block (vLLM's `--block-size`).
    #[serde(default = "default_block_size")]
    pub block_size: u32,
    /// Engines at fixed addresses: routable from the start, whether or not a bridge streams
    /// for them (otherwise they are found from `selector`, `inferencePoolRef`, or their
    /// bridges' announcements over NATS).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub endpoints: Vec<StaticEndpoint>,
    /// Engines found as the pods with these labels, on this port, in the namespace of the
    /// node's `[kubernetes_engines]`: each pod is the worker of its name, routable while it is
    /// ready.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selector: Option<PodSelector>,
    /// Engines found as the pods of this `InferencePool` of the Gateway API Inference
    /// Extension (`inference.networking.k8s.io/v1`, in the namespace of the node's
    /// `[kubernetes_engines]`): its `selector` and first `targetPorts` entry, so an
    /// InferencePool whose `endpointPickerRef` names kvplane is routed over the pods it selects.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inference_pool_ref: Option<String>,
    /// GPU type, cluster, region...: what rule filters match on.
    #[serde(default, skip_serializing_if = "Labels::is_empty")]
    pub labels: Labels,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cost: Option<TokenCost>,
    /// Prefill speed of one engine, for predicted TTFT (default: the node's cost model).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefill_tokens_per_second: Option<f64>,
    /// A directory on the kvplane nodes holding the model's `tokenizer.json` and
    /// `tokenizer_config.json` (its chat template), e.g. a mounted ConfigMap: text requests
    /// for the model are then tokenized exactly as the engines tokenize them. Never downloaded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokenizer: Option<String>,
    /// The served names of the LoRA adapters these engines load (vLLM `--lora-modules`): a
    /// request naming one is served here, and matches only blocks cached under that adapter
    /// (the engines' KV events carry its name).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub lora_adapters: Vec<String>,
}

impl InferenceWorkerSetSpec {
    /// Whether its engines are the pods Kubernetes reports (its selector's, or its
    /// `InferencePool`'s).
    pub fn finds_engines_in_kubernetes(&self) -> bool {
        self.selector.is_some() || self.inference_pool_ref.is_some()
    }

    /// Whether requests for `model` are served here: the base model or one of its adapters.
    pub fn serves(&self, model: &str) -> bool {
        self.model == model || self.lora_adapters.iter().any(|a| a == model)
    }

    /// The LoRA adapter a request for `model` runs under here, if it names one.
    pub fn adapter_for<'m>(&self, model: &'m str) -> Option<&'m str> {
        self.lora_adapters
            .iter()
            .any(|a| a == model)
            .then_some(model)
    }
}

fn default_block_size() -> u32 {
    16
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct StaticEndpoint {
    /// The worker id in NATS subjects.
    pub worker: String,
    /// Where to send requests, e.g. `http://10.0.0.7:8000`.
    pub address: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PodSelector {
    pub match_labels: Labels,
    pub port: u16,
}
