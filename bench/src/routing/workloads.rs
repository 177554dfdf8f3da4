//! The workloads of `kvplane bench routing`, as token ids with arrival times. Each is seeded
//! and deterministic; sizes are in tokens (block size 16).
//!
//! - `shared-prefix` (the article's case): 64 system prompts of 2,000 tokens, each request one
//!   of them plus a 64-token question, 64 output tokens, Poisson arrivals at 22/s (more than the
//!   fleet can prefill without the cache). The prompts
//!   (8,000 blocks) do not fit one engine's cache (4,096 blocks) but do fit three.
//! - `no-prefix`: every prompt unique, 1,000 tokens, 64 output, 20/s.
//! - `multi-turn`: 150 conversations of 6 turns behind one 400-token system prompt; each turn
//!   resends the whole conversation (previous prompt, the 64-token answer, a new 80-token
//!   question), turns 2-8 s apart.
//! - `two-tenants`: tenant `a` sends the shared-prefix mix (32 prompts) at 7/s, tenant `b`
//!   unique 1,000-token prompts at 8/s, on the same workers.
//! - `bursts`: the shared-prefix mix arriving in bursts: 2 s at 30/s, then 4 s at 5/s.

use kvplane_sim::rng::Rng;

/// One request of a workload.
#[derive(Debug, Clone)]
pub struct Req {
    pub at_ms: f64,
    pub tenant: &'static str,
    pub tokens: Vec<u32>,
    pub max_tokens: u32,
}

pub const NAMES: [&str; 5] = [
    "shared-prefix",
    "no-prefix",
    "multi-turn",
    "two-tenants",
    "bursts",
];

fn words(rng: &mut Rng, n: usize, tag: u32) -> Vec<u32> {
    // Token ids of a 32k vocabulary; `tag` keeps different texts apart from the first token.
    std::iter::once(tag)
        .chain((1..n).map(|_| u32::try_from(rng.below(32_000)).unwrap_or(0) + 100))
        .collect()
}

fn shared(rng: &mut Rng, prompts: usize, len: usize) -> Vec<Vec<u32>> {
    (0..prompts)
        .map(|i| words(rng, len, 40_000 + u32::try_from(i).unwrap_or(0)))
        .collect()
}

/// Poisson arrivals at `rate_per_s`, `n` of them, from `start_ms`.
fn arrivals(rng: &mut Rng, n: usize, rate_per_s: f64, start_ms: f64) -> Vec<f64> {
    let mut t = start_ms;
    (0..n)
        .map(|_| {
            t += rng.exp(1000.0 / rate_per_s);
            t
        })
        .collect()
}

fn shared_prefix_mix(
    rng: &mut Rng,
    at: &[f64],
    prompts: usize,
    tenant: &'static str,
    salt: u32,
) -> Vec<Req> {
    let systems = shared(rng, prompts, 2_000);
    at.iter()
        .enumerate()
        .map(|(i, &at_ms)| {
            let s = &systems[rng.below(systems.len() as u64) as usize];
            let mut tokens = s.clone();
            tokens.extend(words(rng, 64, salt + u32::try_from(i).unwrap_or(0)));
            Req {
                at_ms,
                tenant,
                tokens,
                max_tokens: 64,
            }
        })
        .collect()
}

fn unique(rng: &mut Rng, at: &[f64], tenant: &'static str, salt: u32) -> Vec<Req> {
    at.iter()
        .enumerate()
        .map(|(i, &at_ms)| Req {
            at_ms,
            tenant,
            tokens: words(rng, 1_000, salt + u32::try_from(i).unwrap_or(0)),
            max_tokens: 64,
        })
        .collect()
}

/// The requests of workload `name`, `n` of them (about), sorted by arrival.
pub fn generate(name: &str, n: usize, seed: u64) -> Vec<Req> {
    let mut rng = Rng::new(seed);
    let mut out = match name {
        "shared-prefix" => {
            let at = arrivals(&mut rng, n, 22.0, 0.0);
            shared_prefix_mix(&mut rng, &at, 64, "default", 1_000_000)
        }
        "no-prefix" => {
            let at = arrivals(&mut rng, n, 20.0, 0.0);
            unique(&mut rng, &at, "default", 1_000_000)
        }
        "multi-turn" => multi_turn(&mut rng, n),
        "two-tenants" => {
            let at = arrivals(&mut rng, n / 2, 7.0, 0.0);
            let mut a = shared_prefix_mix(&mut rng, &at, 32, "a", 1_000_000);
            let at = arrivals(&mut rng, n - n / 2, 8.0, 0.0);
            a.extend(unique(&mut rng, &at, "b", 2_000_000));
            a
        }
        "bursts" => {
            // Cycles of 2 s at 30/s, then 4 s at 5/s (Poisson within each phase).
            let mut at = Vec::with_capacity(n);
            let mut start = 0.0;
            while at.len() < n {
                for (rate, len) in [(30.0, 2_000.0), (5.0, 4_000.0)] {
                    let end = start + len;
                    let mut t = start;
                    loop {
                        t += rng.exp(1000.0 / rate);
                        if t >= end || at.len() >= n {
                            break;
                        }
                        at.push(t);
                    }
                    start = end;
                }
            }
            shared_prefix_mix(&mut rng, &at, 64, "default", 1_000_000)
        }
        _ => Vec::new(),
    };
    out.sort_by(|a, b| a.at_ms.total_cmp(&b.at_ms));
    out
}

fn multi_turn(rng: &mut Rng, n: usize) -> Vec<Req> {
    let system = words(rng, 400, 39_999);
    let turns = 6;
    let conversations = n.div_ceil(turns);
    let starts = arrivals(rng, conversations, 4.0, 0.0);
    let mut out = Vec::with_capacity(n);
    for (c, start) in starts.into_iter().enumerate() {
        let mut prompt = system.clone();
        let mut t = start;
        for turn in 0..turns {
            let tag = 1_000_000 + u32::try_from(c * turns + turn).unwrap_or(0);
            prompt.extend(words(rng, 80, tag));
            out.push(Req {
                at_ms: t,
                tenant: "default",
                tokens: prompt.clone(),
                max_tokens: 64,
            });
            // The answer becomes part of the next turn's prompt.
            prompt.extend(words(rng, 64, tag + 500_000));
            t += 2_000.0 + rng.below(6_000) as f64;
        }
    }
    out.truncate(n.max(1));
    out
}
