//! `AccessPolicy`: what callers of kvplane's gRPC API may do, by the identity their client
//! certificate names.

use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::common::ObjectStatus;

/// Rights granted to callers named by their certificates. A caller holds the union of every
/// policy naming it; a caller no policy names may do nothing but health checks.
#[derive(CustomResource, Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "kvplane.io",
    version = "v1alpha1",
    kind = "AccessPolicy",
    namespaced,
    status = "ObjectStatus",
    shortname = "kvaccess"
)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AccessPolicySpec {
    /// Callers by the identity of their client certificate: its URI name (a SPIFFE id such as
    /// `spiffe://cluster-a/ns/gateways/sa/gateway`), else its DNS name. A trailing `*` matches
    /// any rest (`spiffe://cluster-a/*`).
    pub identities: Vec<String>,
    /// What they may do.
    pub rights: Vec<Right>,
    /// The tenants `route` lets them route for and spend quota of (`*`: every tenant).
    /// Required with `route`, refused without it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tenants: Vec<String>,
}

/// One thing a caller may do.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, JsonSchema,
)]
#[serde(rename_all = "camelCase")]
pub enum Right {
    /// `Router.Route`, `ReportUsage` and `Models`, and the endpoint picker, for the policy's
    /// `tenants`.
    Route,
    /// `Router.Explain`, `Admin.Status`, `ClusterStatus` and `ExportState`.
    Read,
    /// `Admin.PutConfig` and `DeleteConfig`.
    Config,
    /// `Admin.AddMember`, `RemoveMember`, `SetFaults` and `SetFailpoints`.
    Membership,
}

impl Right {
    pub const ALL: [Right; 4] = [Right::Route, Right::Read, Right::Config, Right::Membership];

    pub fn as_str(self) -> &'static str {
        match self {
            Right::Route => "route",
            Right::Read => "read",
            Right::Config => "config",
            Right::Membership => "membership",
        }
    }
}

impl std::fmt::Display for Right {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}
