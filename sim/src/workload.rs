//! Seeded request workloads.
//!
//! `shared-prefix`: a few long system prompts and many distinct questions; every request is
//! one system prompt followed by its own question (the article's workload).
//! `no-prefix`: every prompt is unique text of the same length distribution.
//! `multi-turn`: conversations, each with its own system prompt; a request is the next turn of
//! one of them (its earlier questions and answers before the new question), a conversation
//! ending after [`TURNS`] turns and a new one taking its place.
//! `bursts`: `shared-prefix` arriving in bursts: for the first third of every
//! [`BURST_PERIOD_MS`] at three times the mean rate, then nothing.

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
    MultiTurn,
    Bursts,
}

/// Turns of one `multi-turn` conversation.
pub const TURNS: usize = 6;

/// The cycle of `bursts`: a third of it busy, the rest quiet.
pub const BURST_PERIOD_MS: f64 = 15_000.0;

/// One request of a workload.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct WorkItem {
    /// When to send it, in ms from the start.
    pub at_ms: f64,
    /// Which system prompt it uses (shared-prefix) or `None`.
    pub family: Option<usize>,
    pub system: String,
    /// Earlier turns of its conversation (question, answer), oldest first.
    pub history: Vec<(String, String)>,
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
        for (q, a) in &self.history {
            messages.push(serde_json::json!({"role": "user", "content": q}));
            messages.push(serde_json::json!({"role": "assistant", "content": a}));
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
    // multi-turn: each conversation's system prompt and its turns so far.
    let mut conversations: Vec<(String, Vec<(String, String)>)> =
        systems.iter().map(|s| (s.clone(), Vec::new())).collect();
    let mut started = conversations.len();
    let mut t = 0.0;
    (0..spec.requests)
        .map(|i| {
            let at_ms = match spec.kind {
                Kind::Bursts => {
                    // Poisson at three times the rate over the busy thirds only.
                    let busy = BURST_PERIOD_MS / 3.0;
                    t += rng.exp(1000.0 / (3.0 * spec.rate_per_s));
                    (t / busy).floor() * BURST_PERIOD_MS + t % busy
                }
                _ => {
                    t += rng.exp(1000.0 / spec.rate_per_s);
                    t
                }
            };
            let question = text(&mut rng, spec.question_words, &format!("question{i}"));
            match spec.kind {
                Kind::SharedPrefix | Kind::Bursts => {
                    let f = rng.below(systems.len() as u64) as usize;
                    WorkItem {
                        at_ms,
                        family: Some(f),
                        system: systems[f].clone(),
                        history: Vec::new(),
                        question,
                        max_tokens: spec.max_tokens,
                    }
                }
                Kind::NoPrefix => WorkItem {
                    at_ms,
                    family: None,
                    system: text(&mut rng, spec.system_words, &format!("unique{i}")),
                    history: Vec::new(),
                    question,
                    max_tokens: spec.max_tokens,
                },
                Kind::MultiTurn => {
                    let c = rng.below(conversations.len() as u64) as usize;
                    if conversations[c].1.len() >= TURNS {
                        let system = text(&mut rng, spec.system_words, &format!("system{started}"));
                        conversations[c] = (system, Vec::new());
                        started += 1;
                    }
                    let (system, history) = &conversations[c];
                    let item = WorkItem {
                        at_ms,
                        family: Some(c),
                        system: system.clone(),
                        history: history.clone(),
                        question: question.clone(),
                        max_tokens: spec.max_tokens,
                    };
                    let words = spec.max_tokens as usize;
                    let answer = text(&mut rng, words, &format!("answer{i}"));
                    conversations[c].1.push((question, answer));
                    item
                }
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(kind: Kind) -> Spec {
        Spec {
            kind,
            requests: 300,
            rate_per_s: 10.0,
            system_prompts: 4,
            system_words: 20,
            question_words: 5,
            max_tokens: 8,
            seed: 3,
        }
    }

    #[test]
    fn every_multi_turn_request_repeats_its_conversation_so_far() {
        let items = generate(&spec(Kind::MultiTurn));
        // Per system prompt, the questions its conversation asked so far.
        let mut asked: std::collections::BTreeMap<&str, Vec<&str>> = Default::default();
        for i in &items {
            assert!(i.history.len() < TURNS);
            let questions: Vec<&str> = i.history.iter().map(|(q, _)| q.as_str()).collect();
            let before = asked.entry(i.system.as_str()).or_default();
            assert_eq!(&questions, before);
            assert!(i.history.iter().all(|(_, a)| !a.is_empty()));
            before.push(i.question.as_str());
        }
        assert!(items.iter().any(|i| i.history.len() == TURNS - 1));
        let body = items
            .iter()
            .find(|i| i.history.len() == 2)
            .unwrap()
            .chat_body("m");
        let roles: Vec<&str> = body["messages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["role"].as_str().unwrap())
            .collect();
        assert_eq!(
            roles,
            ["system", "user", "assistant", "user", "assistant", "user"]
        );
    }

    #[test]
    fn bursts_arrive_in_the_first_third_of_each_period_at_the_mean_rate_overall() {
        let items = generate(&Spec {
            requests: 1_200,
            ..spec(Kind::Bursts)
        });
        assert!(items.windows(2).all(|w| w[0].at_ms <= w[1].at_ms));
        assert!(
            items
                .iter()
                .all(|i| i.at_ms % BURST_PERIOD_MS < BURST_PERIOD_MS / 3.0)
        );
        let periods = (items.last().unwrap().at_ms / BURST_PERIOD_MS).ceil();
        let rate = items.len() as f64 / (periods * BURST_PERIOD_MS / 1000.0);
        assert!((7.0..13.0).contains(&rate), "{rate}");
    }
}
