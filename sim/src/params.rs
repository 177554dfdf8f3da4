//! Engine model parameters (README, "Engine simulator").
//!
//! Defaults resemble Llama-3-8B in bf16 on one L40S (48 GB, 864 GB/s): the weights take 16 GB,
//! and 0.9 of the rest holds about 200k tokens of KV cache (128 KiB per token) = 12,800 blocks
//! of 16; a decode step reads all weights once (about 20 ms) plus each running sequence's KV;
//! prefill runs at about 10k tokens/s in chunks of at most 2,048 tokens per step (vLLM V1's
//! online-serving default on this class of GPU), so decodes and short prefills interleave with
//! long ones.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EngineParams {
    /// Tokens per KV block.
    pub block_size: u32,
    /// KV-cache capacity in blocks.
    pub num_gpu_blocks: u32,
    /// Most sequences running at once.
    pub max_num_seqs: u32,
    /// Token budget of one scheduler step (decode tokens plus prefill chunks).
    pub max_num_batched_tokens: u32,
    /// Prefill throughput.
    pub prefill_tokens_per_s: f64,
    /// Fixed time of one step with any work (reading the weights).
    pub step_base_ms: f64,
    /// Added per running sequence in a step (reading its KV cache).
    pub per_seq_ms: f64,
    /// Added for a step's prefill tokens, per thousand squared: attention over the chunk grows
    /// with its square (0: prefill time is linear in its tokens). NVIDIA Dynamo's mocker, for
    /// one, times a prefill pass as a quadratic in its tokens.
    pub prefill_ms_per_ktoken_squared: f64,
}

impl Default for EngineParams {
    fn default() -> Self {
        Self {
            block_size: 16,
            num_gpu_blocks: 12_800,
            max_num_seqs: 256,
            max_num_batched_tokens: 2_048,
            prefill_tokens_per_s: 10_000.0,
            step_base_ms: 20.0,
            per_seq_ms: 0.1,
            prefill_ms_per_ktoken_squared: 0.0,
        }
    }
}

impl EngineParams {
    /// Every problem with these parameters.
    pub fn problems(&self) -> Vec<String> {
        let mut p = Vec::new();
        if self.block_size == 0 {
            p.push("block_size must be at least 1".into());
        }
        if self.num_gpu_blocks < 2 {
            p.push("num_gpu_blocks must be at least 2".into());
        }
        if self.max_num_seqs == 0 {
            p.push("max_num_seqs must be at least 1".into());
        }
        if self.max_num_batched_tokens < self.block_size {
            p.push("max_num_batched_tokens must be at least block_size".into());
        }
        if !(self.prefill_tokens_per_s.is_finite() && self.prefill_tokens_per_s > 0.0) {
            p.push("prefill_tokens_per_s must be positive".into());
        }
        if !(self.step_base_ms.is_finite() && self.step_base_ms >= 0.0) {
            p.push("step_base_ms must be non-negative".into());
        }
        if !(self.per_seq_ms.is_finite() && self.per_seq_ms >= 0.0) {
            p.push("per_seq_ms must be non-negative".into());
        }
        if !(self.prefill_ms_per_ktoken_squared.is_finite()
            && self.prefill_ms_per_ktoken_squared >= 0.0)
        {
            p.push("prefill_ms_per_ktoken_squared must be non-negative".into());
        }
        p
    }
}
