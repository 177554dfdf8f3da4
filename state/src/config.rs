//! Configuration objects held in the state besides the policy kinds: `pool`, a group of
//! workers that share a block size and serve some models (the node config's `[[pools]]`). The
//! catalog holds each as a worker set, so it routes like one.

use serde::{Deserialize, Serialize};

use crate::ApplyError;

/// The config kind of a [`PoolConfig`].
pub const POOL_KIND: &str = "pool";

/// A pool of workers that share routing.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolConfig {
    /// Tokens per KV block on every engine of the pool (vLLM's `--block-size`).
    pub block_size: u32,
    /// Model names this pool serves; a Route for one of them considers the pool.
    /// An empty list serves any model.
    #[serde(default)]
    pub models: Vec<String>,
    /// LoRA adapters the pool's engines load (vLLM `--lora-modules` names): a request naming
    /// one is served here and matches only blocks cached under it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub lora_adapters: Vec<String>,
}

impl PoolConfig {
    pub const MAX_BLOCK_SIZE: u32 = 1024;

    /// Parses and checks a pool object.
    pub fn parse(name: &str, value: &[u8]) -> Result<Self, ApplyError> {
        let cfg: PoolConfig =
            serde_json::from_slice(value).map_err(|e| ApplyError::InvalidConfig {
                kind: POOL_KIND.into(),
                name: name.into(),
                reason: e.to_string(),
            })?;
        if cfg.block_size == 0 || cfg.block_size > Self::MAX_BLOCK_SIZE {
            return Err(ApplyError::InvalidConfig {
                kind: POOL_KIND.into(),
                name: name.into(),
                reason: format!(
                    "block_size must be in 1..={}, got {}",
                    Self::MAX_BLOCK_SIZE,
                    cfg.block_size
                ),
            });
        }
        if !valid_name(name) {
            return Err(ApplyError::InvalidConfig {
                kind: POOL_KIND.into(),
                name: name.into(),
                reason: "pool names are 1-63 characters of [a-z0-9-_]".into(),
            });
        }
        Ok(cfg)
    }

    /// Whether a request for `model` may go to this pool.
    pub fn serves(&self, model: &str) -> bool {
        model.is_empty() || self.models.is_empty() || self.models.iter().any(|m| m == model)
    }

    pub fn to_json(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }
}

/// The index an `InferenceWorkerSet` owns: its block size, serving its model.
pub fn worker_set_pool(ws: &kvplane_policy::kinds::InferenceWorkerSetSpec) -> PoolConfig {
    PoolConfig {
        block_size: ws.block_size,
        models: vec![ws.model.clone()],
        lora_adapters: ws.lora_adapters.clone(),
    }
}

/// Pool, worker and node names appear as NATS subject tokens: 1-63 characters of
/// `[a-z0-9-_]`. The one check every boundary uses.
pub fn valid_name(name: &str) -> bool {
    (1..=63).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
}
