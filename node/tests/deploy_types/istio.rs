//! The Istio kind deploy/ holds (`networking.istio.io/v1` DestinationRule), typed strictly from
//! Istio's DestinationRule reference: only the fields the manifests may use, so a typo or a
//! field at the wrong level fails.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::{Deserialize, Serialize};

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct DestinationRule {
    pub api_version: String,
    pub kind: String,
    pub metadata: ObjectMeta,
    pub spec: DestinationRuleSpec,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct DestinationRuleSpec {
    pub host: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub workload_selector: Option<WorkloadSelector>,
    pub traffic_policy: TrafficPolicy,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct WorkloadSelector {
    pub match_labels: BTreeMap<String, String>,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct TrafficPolicy {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub port_level_settings: Vec<PortTrafficPolicy>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls: Option<ClientTlsSettings>,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PortTrafficPolicy {
    pub port: PortSelector,
    pub tls: ClientTlsSettings,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PortSelector {
    pub number: u16,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ClientTlsSettings {
    pub mode: TlsMode,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub credential_name: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sni: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub subject_alt_names: Vec<String>,
}

#[derive(Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum TlsMode {
    Disable,
    Simple,
    Mutual,
    IstioMutual,
}
