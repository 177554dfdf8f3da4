//! The cert-manager kinds deploy/ holds (`cert-manager.io/v1` Issuer and Certificate), typed
//! strictly from cert-manager's v1 API reference: only the fields the manifests may use, so a
//! typo or a field at the wrong level fails.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::{Deserialize, Serialize};

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Issuer {
    pub api_version: String,
    pub kind: String,
    pub metadata: ObjectMeta,
    pub spec: IssuerSpec,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct IssuerSpec {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub self_signed: Option<SelfSigned>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ca: Option<CaIssuer>,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SelfSigned {}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct CaIssuer {
    pub secret_name: String,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Certificate {
    pub api_version: String,
    pub kind: String,
    pub metadata: ObjectMeta,
    pub spec: CertificateSpec,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct CertificateSpec {
    pub secret_name: String,
    pub issuer_ref: IssuerRef,
    #[serde(default, skip_serializing_if = "Option::is_none", rename = "isCA")]
    pub is_ca: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub common_name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub duration: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub renew_before: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub uris: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub dns_names: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub usages: Vec<KeyUsage>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub private_key: Option<PrivateKey>,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IssuerRef {
    pub name: String,
    pub kind: String,
    pub group: String,
}

/// The key usages cert-manager accepts that these manifests use.
#[derive(Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum KeyUsage {
    #[serde(rename = "server auth")]
    ServerAuth,
    #[serde(rename = "client auth")]
    ClientAuth,
    #[serde(rename = "digital signature")]
    DigitalSignature,
    #[serde(rename = "key encipherment")]
    KeyEncipherment,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct PrivateKey {
    pub algorithm: KeyAlgorithm,
    pub size: u32,
    /// PKCS1 (cert-manager's default) or PKCS8.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub encoding: Option<KeyEncoding>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rotation_policy: Option<RotationPolicy>,
}

#[derive(Debug, Serialize, Deserialize)]
pub enum KeyAlgorithm {
    #[serde(rename = "RSA")]
    Rsa,
    #[serde(rename = "ECDSA")]
    Ecdsa,
    Ed25519,
}

#[derive(Debug, Serialize, Deserialize)]
pub enum KeyEncoding {
    #[serde(rename = "PKCS1")]
    Pkcs1,
    #[serde(rename = "PKCS8")]
    Pkcs8,
}

#[derive(Debug, Serialize, Deserialize)]
pub enum RotationPolicy {
    Never,
    Always,
}
