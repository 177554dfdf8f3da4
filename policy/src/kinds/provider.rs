//! `InferenceProvider`: an external model API.

use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::common::{Labels, ObjectStatus, TokenCost};

/// An external model API: OpenAI-compatible, or Amazon Bedrock (its Converse API, requests
/// signed with SigV4). Always external: `excludeExternal` filters remove it.
#[derive(CustomResource, Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "kvplane.io",
    version = "v1alpha1",
    kind = "InferenceProvider",
    namespaced,
    status = "ObjectStatus",
    shortname = "iprov"
)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct InferenceProviderSpec {
    /// Base URL, e.g. `https://api.openai.com/v1`.
    pub endpoint: String,
    #[serde(default)]
    pub api: ProviderApi,
    /// The provider's model name (the body's `model` is rewritten to it).
    pub model: String,
    /// Where the gateway finds the credentials (kvplane never reads them): OpenAI, the API key
    /// under `key`; Bedrock, the Secret's `aws_access_key_id`, `aws_secret_access_key` and
    /// (optional) `aws_session_token` (its `key` is not read).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub credentials: Option<SecretKeyRef>,
    #[serde(default, skip_serializing_if = "Labels::is_empty")]
    pub labels: Labels,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cost: Option<TokenCost>,
    /// Typical time to first token, for `PredictedTTFT` comparisons with local workers.
    #[serde(default = "default_ttft_ms")]
    pub expected_ttft_ms: f64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate_limit: Option<RateLimit>,
    /// Bedrock: the AWS region its requests are signed for (default: the one in the
    /// endpoint's host, `bedrock-runtime.<region>.amazonaws.com`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub region: Option<String>,
}

impl InferenceProviderSpec {
    /// The AWS region of a Bedrock provider: `region`, else the endpoint host's.
    pub fn region(&self) -> Option<String> {
        if let Some(r) = &self.region {
            return Some(r.clone());
        }
        if self.api != ProviderApi::Bedrock {
            return None;
        }
        let host = crate::filters::host_port(&self.endpoint)
            .split(':')
            .next()?;
        let region = host
            .strip_prefix("bedrock-runtime.")?
            .strip_suffix(".amazonaws.com")?;
        (!region.is_empty() && !region.contains('.')).then(|| region.to_owned())
    }
}

fn default_ttft_ms() -> f64 {
    800.0
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema, Default)]
pub enum ProviderApi {
    #[default]
    OpenAI,
    Bedrock,
}

impl ProviderApi {
    /// Its name as the kind's YAML spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::OpenAI => "OpenAI",
            Self::Bedrock => "Bedrock",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SecretKeyRef {
    pub name: String,
    pub key: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RateLimit {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requests_per_minute: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens_per_minute: Option<u64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bedrock(endpoint: &str, region: Option<&str>) -> InferenceProviderSpec {
        serde_json::from_value(serde_json::json!({
            "endpoint": endpoint, "api": "Bedrock", "model": "m", "region": region,
        }))
        .unwrap()
    }

    #[test]
    fn a_bedrock_providers_region_is_its_own_or_its_endpoint_hosts() {
        let at = |e: &str| bedrock(e, None).region();
        assert_eq!(
            at("https://bedrock-runtime.us-east-1.amazonaws.com").as_deref(),
            Some("us-east-1")
        );
        assert_eq!(
            at("https://bedrock-runtime.eu-west-3.amazonaws.com:443/").as_deref(),
            Some("eu-west-3")
        );
        assert_eq!(at("http://127.0.0.1:8080"), None);
        assert_eq!(at("https://bedrock-runtime.amazonaws.com"), None);
        assert_eq!(
            bedrock("http://127.0.0.1:8080", Some("ap-south-1"))
                .region()
                .as_deref(),
            Some("ap-south-1")
        );
    }
}
