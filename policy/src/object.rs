//! One policy object of any kind: parsed from a YAML document (errors name the field path),
//! and stored in the replicated state as `(kind, name, spec JSON)`.

use kube::CustomResourceExt;
use serde::de::DeserializeOwned;

use crate::kinds::{
    AccessPolicy, AccessPolicySpec, GROUP, GatewayBackend, GatewayBackendSpec, InferencePolicy,
    InferencePolicySpec, InferencePool, InferencePoolSpec, InferenceProvider,
    InferenceProviderSpec, InferenceWorkerSet, InferenceWorkerSetSpec, VERSION,
};

/// The six kinds, in the order a consistent change applies them (what others refer to first).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Kind {
    WorkerSet,
    Pool,
    Provider,
    Policy,
    Backend,
    Access,
}

impl Kind {
    pub const ALL: [Kind; 6] = [
        Kind::WorkerSet,
        Kind::Pool,
        Kind::Provider,
        Kind::Policy,
        Kind::Backend,
        Kind::Access,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Kind::WorkerSet => "InferenceWorkerSet",
            Kind::Pool => "InferencePool",
            Kind::Provider => "InferenceProvider",
            Kind::Policy => "InferencePolicy",
            Kind::Backend => "GatewayBackend",
            Kind::Access => "AccessPolicy",
        }
    }

    pub fn parse(s: &str) -> Option<Kind> {
        Kind::ALL.into_iter().find(|k| k.as_str() == s)
    }
}

impl std::fmt::Display for Kind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A named object's spec.
#[derive(Debug, Clone, PartialEq)]
pub enum Spec {
    WorkerSet(InferenceWorkerSetSpec),
    Pool(InferencePoolSpec),
    Provider(InferenceProviderSpec),
    Policy(InferencePolicySpec),
    Backend(GatewayBackendSpec),
    Access(AccessPolicySpec),
}

#[derive(Debug, Clone, PartialEq)]
pub struct Object {
    pub name: String,
    pub spec: Spec,
}

/// Why a document is not a valid object; `path` is the field (e.g. `spec.rules[0].filter`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{path}: {message}")]
pub struct ParseError {
    pub path: String,
    pub message: String,
}

impl ParseError {
    pub fn new(path: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            path: path.into(),
            message: message.into(),
        }
    }
}

/// Object names become NATS subject tokens: 1-63 characters of `[a-z0-9-]`, starting and ending
/// with a letter or digit (a Kubernetes DNS label).
pub fn valid_object_name(name: &str) -> bool {
    (1..=63).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !name.starts_with('-')
        && !name.ends_with('-')
}

fn spec<S: DeserializeOwned>(v: serde_yaml_ng::Value) -> Result<S, ParseError> {
    serde_path_to_error::deserialize(v).map_err(|e| {
        let path = e.path().to_string();
        let path = if path == "." {
            "spec".to_owned()
        } else {
            format!("spec.{path}")
        };
        ParseError::new(path, e.into_inner().to_string())
    })
}

impl Object {
    pub fn kind(&self) -> Kind {
        match self.spec {
            Spec::WorkerSet(_) => Kind::WorkerSet,
            Spec::Pool(_) => Kind::Pool,
            Spec::Provider(_) => Kind::Provider,
            Spec::Policy(_) => Kind::Policy,
            Spec::Backend(_) => Kind::Backend,
            Spec::Access(_) => Kind::Access,
        }
    }

    /// Parses one YAML document (`apiVersion`, `kind`, `metadata.name`, `spec`).
    pub fn from_yaml(doc: serde_yaml_ng::Value) -> Result<Object, ParseError> {
        let map = doc
            .as_mapping()
            .ok_or_else(|| ParseError::new("", "a document must be a mapping"))?;
        let field = |k: &str| map.get(serde_yaml_ng::Value::from(k));
        let want = format!("{GROUP}/{VERSION}");
        match field("apiVersion").and_then(|v| v.as_str()) {
            Some(v) if v == want => {}
            Some(v) => {
                return Err(ParseError::new(
                    "apiVersion",
                    format!("{v:?} is not {want:?}"),
                ));
            }
            None => return Err(ParseError::new("apiVersion", "missing")),
        }
        let kind_text = field("kind")
            .and_then(|v| v.as_str())
            .ok_or_else(|| ParseError::new("kind", "missing"))?;
        let kind = Kind::parse(kind_text).ok_or_else(|| {
            ParseError::new(
                "kind",
                format!(
                    "{kind_text:?} is not one of {}",
                    Kind::ALL.map(Kind::as_str).join(", ")
                ),
            )
        })?;
        let name = field("metadata")
            .and_then(|m| m.get("name"))
            .and_then(|v| v.as_str())
            .ok_or_else(|| ParseError::new("metadata.name", "missing"))?
            .to_owned();
        if !valid_object_name(&name) {
            return Err(ParseError::new(
                "metadata.name",
                format!(
                    "{name:?} must be 1-63 characters of [a-z0-9-], not starting or ending with -"
                ),
            ));
        }
        for key in map.keys() {
            match key.as_str() {
                Some("apiVersion" | "kind" | "metadata" | "spec" | "status") => {}
                other => {
                    return Err(ParseError::new(
                        other.unwrap_or("?"),
                        "unknown top-level field",
                    ));
                }
            }
        }
        let spec_value = field("spec")
            .cloned()
            .ok_or_else(|| ParseError::new("spec", "missing"))?;
        let spec = match kind {
            Kind::WorkerSet => Spec::WorkerSet(self::spec(spec_value)?),
            Kind::Pool => Spec::Pool(self::spec(spec_value)?),
            Kind::Provider => Spec::Provider(self::spec(spec_value)?),
            Kind::Policy => Spec::Policy(self::spec(spec_value)?),
            Kind::Backend => Spec::Backend(self::spec(spec_value)?),
            Kind::Access => Spec::Access(self::spec(spec_value)?),
        };
        Ok(Object { name, spec })
    }

    /// The spec as stored in the replicated state.
    pub fn to_json(&self) -> Vec<u8> {
        // Serializing these plain types cannot fail.
        match &self.spec {
            Spec::WorkerSet(s) => serde_json::to_vec(s),
            Spec::Pool(s) => serde_json::to_vec(s),
            Spec::Provider(s) => serde_json::to_vec(s),
            Spec::Policy(s) => serde_json::to_vec(s),
            Spec::Backend(s) => serde_json::to_vec(s),
            Spec::Access(s) => serde_json::to_vec(s),
        }
        .unwrap_or_default()
    }

    /// Reads a stored object back.
    pub fn from_json(kind: Kind, name: &str, json: &[u8]) -> Result<Object, ParseError> {
        let mut d = serde_json::Deserializer::from_slice(json);
        let spec = match kind {
            Kind::WorkerSet => Spec::WorkerSet(json_spec(&mut d)?),
            Kind::Pool => Spec::Pool(json_spec(&mut d)?),
            Kind::Provider => Spec::Provider(json_spec(&mut d)?),
            Kind::Policy => Spec::Policy(json_spec(&mut d)?),
            Kind::Backend => Spec::Backend(json_spec(&mut d)?),
            Kind::Access => Spec::Access(json_spec(&mut d)?),
        };
        if !valid_object_name(name) {
            return Err(ParseError::new(
                "metadata.name",
                format!("{name:?} is not a valid name"),
            ));
        }
        Ok(Object {
            name: name.to_owned(),
            spec,
        })
    }
}

fn json_spec<S: DeserializeOwned>(
    d: &mut serde_json::Deserializer<serde_json::de::SliceRead<'_>>,
) -> Result<S, ParseError> {
    serde_path_to_error::deserialize(d)
        .map_err(|e| ParseError::new(format!("spec.{}", e.path()), e.into_inner().to_string()))
}

/// The CustomResourceDefinitions of the six kinds, as one multi-document YAML.
pub fn crds_yaml() -> String {
    let crds = [
        InferenceWorkerSet::crd(),
        InferencePool::crd(),
        InferenceProvider::crd(),
        InferencePolicy::crd(),
        GatewayBackend::crd(),
        AccessPolicy::crd(),
    ];
    crds.iter()
        .map(|c| serde_yaml_ng::to_string(c).unwrap_or_default())
        .collect::<Vec<_>>()
        .join("---\n")
}
