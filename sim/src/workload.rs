//! Seeded request workloads.
//!
//! `shared-prefix`: a few long system prompts and many distinct questions; every request is
//! one system prompt followed by its own question (the article's workload).
//! `no-prefix`: every prompt is unique text of the same length distribution.

use serde::Serialize;

use crate::rng::Rng;

/// Words the workloads are written in (the shared tokenizer makes each one token).
const WORDS: &[&str] = &[
    "the",
    "model",
    "cache",
    "prefix",
    "token",
    "engine",
    "router",
    "request",
    "policy",
    "tenant",
    "worker",
    "queue",
    "latency",
    "first",
    "block",
    "memory",
    "state",
    "cluster",
    "replica",
    "stream",
    "event",
    "batch",
    "prompt",
    "answer",
    "system",
    "user",
    "assistant",
    "context",
    "window",
    "kernel",
    "tensor",
    "weight",
    "decode",
    "prefill",
    "schedule",
    "throughput",
    "gateway",
    "limit",
    "quota",
    "metric",
    "trace",
    "digest",
    "index",
    "leader",
    "follower",
    "commit",
    "apply",
    "snapshot",
    "node",
    "fleet",
];

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Kind {
    SharedPrefix,
    NoPrefix,
}

/// One request of a workload.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct WorkItem {
    /// When to send it, in ms from the start.
    pub at_ms: f64,
    /// Which system prompt it uses (shared-prefix) or `None`.
    pub family: Option<usize>,
    pub system: String,
    pub question: String,
    pub max_tokens: u32,
}

impl WorkItem {
    /// The OpenAI chat body for this item.
    pub fn chat_body(&self, model: &str) -> serde_json::Value {
        let mut messages = Vec::new();
        if !self.system.is_empty() {
            messages.push(serde_json::json!({"role": "system", "content": self.system}));
        }
        messages.push(serde_json::json!({"role": "user", "content": self.question}));
        serde_json::json!({"model": model, "messages": messages, "max_tokens": self.max_tokens})
    }
}

/// Workload shape.
#[derive(Debug, Clone, Copy)]
pub struct Spec {
    pub kind: Kind,
    pub requests: usize,
    /// Mean arrival rate (Poisson).
    pub rate_per_s: f64,
    pub system_prompts: usize,
    pub system_words: usize,
    pub question_words: usize,
    pub max_tokens: u32,
    pub seed: u64,
}

fn text(rng: &mut Rng, words: usize, tag: &str) -> String {
    let mut out = String::with_capacity(words * 8);
    out.push_str(tag);
    for _ in 0..words {
        out.push(' ');
        out.push_str(WORDS[rng.below(WORDS.len() as u64) as usize]);
    }
    out
}

/// Generates the requests of `spec`, deterministic in its seed.
pub fn generate(spec: &Spec) -> Vec<WorkItem> {
    let mut rng = Rng::new(spec.seed);
    let systems: Vec<String> = (0..spec.system_prompts.max(1))
        .map(|i| text(&mut rng, spec.system_words, &format!("system{i}")))
        .collect();
    let mut t = 0.0;
    (0..spec.requests)
        .map(|i| {
            t += rng.exp(1000.0 / spec.rate_per_s);
            let question = text(&mut rng, spec.question_words, &format!("question{i}"));
            match spec.kind {
                Kind::SharedPrefix => {
                    let f = rng.below(systems.len() as u64) as usize;
                    WorkItem {
                        at_ms: t,
                        family: Some(f),
                        system: systems[f].clone(),
                        question,
                        max_tokens: spec.max_tokens,
                    }
                }
                Kind::NoPrefix => WorkItem {
                    at_ms: t,
                    family: None,
                    system: text(&mut rng, spec.system_words, &format!("unique{i}")),
                    question,
                    max_tokens: spec.max_tokens,
                },
            }
        })
        .collect()
}
