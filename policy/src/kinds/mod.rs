//! The five routing kinds and `AccessPolicy`, as Rust types from which the CRDs are generated.

mod access;
mod backend;
mod classify;
mod common;
mod limit;
mod policy;
mod pool;
mod provider;
mod worker_set;

pub use access::{AccessPolicy, AccessPolicySpec, Right};
pub use backend::{Backend, GatewayBackend, GatewayBackendSpec};
pub use classify::{Classify, ComplexityTagger, PiiRule, PiiTagger, TagHeader};
pub use common::{GROUP, Labels, ObjectStatus, TokenCost, VERSION};
pub use limit::TenantLimit;
pub use policy::{
    EmptyAction, Filter, InferencePolicy, InferencePolicySpec, Match, Objective, OnEmpty,
    PoolCondition, Rule, Targets,
};
pub use pool::{InferencePool, InferencePoolSpec};
pub use provider::{
    InferenceProvider, InferenceProviderSpec, ProviderApi, RateLimit, SecretKeyRef,
};
pub use worker_set::{InferenceWorkerSet, InferenceWorkerSetSpec, PodSelector, StaticEndpoint};
