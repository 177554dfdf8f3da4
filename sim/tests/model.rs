//! The engine model behaves like vLLM where routing can tell: TTFT falls with the cached
//! prefix and rises with the queue, and its KV events describe its cache exactly.

#![allow(clippy::unwrap_used)]

use kvplane_ingest::vllm::{decode_batch, encode_batch};
use kvplane_sim::EngineParams;
use kvplane_sim::model::{Engine, Output, SimRequest, Usage};
use kvplane_sim::rng::Rng;
use kvplane_state::{
    Command, Entry, IngestBatch, IngestItem, IngestPayload, KvBatch, POOL_KIND, PoolConfig,
    StateMachine,
};

fn run_all(e: &mut Engine) -> Vec<Output> {
    let mut out = Vec::new();
    while let Some(s) = e.step() {
        out.extend(s.outputs);
    }
    out
}

fn ttft(outputs: &[Output], id: u64) -> f64 {
    outputs
        .iter()
        .find_map(|o| match o {
            Output::FirstToken { id: i, ttft_ms } if *i == id => Some(*ttft_ms),
            _ => None,
        })
        .unwrap()
}

fn usage(outputs: &[Output], id: u64) -> Usage {
    outputs
        .iter()
        .find_map(|o| match o {
            Output::Finished { id: i, usage } if *i == id => Some(*usage),
            _ => None,
        })
        .unwrap()
}

fn req(id: u64, tokens: Vec<u32>) -> SimRequest {
    SimRequest {
        id,
        tokens,
        max_tokens: 8,
        lora_name: None,
        cache_salt: None,
    }
}

#[test]
fn a_cached_prefix_cuts_time_to_first_token() {
    let mut e = Engine::new(EngineParams::default());
    let shared: Vec<u32> = (0..3000).collect();
    let mut a = shared.clone();
    a.extend(10_000..11_000);
    let mut b = shared.clone();
    b.extend(20_000..20_100);
    e.submit(req(1, a)).unwrap();
    let out_a = run_all(&mut e);
    e.submit(req(2, b)).unwrap();
    let out_b = run_all(&mut e);
    assert_eq!(usage(&out_a, 1).cached_tokens, 0);
    assert_eq!(
        usage(&out_b, 2).cached_tokens,
        2992,
        "187 full blocks of the shared 3000 tokens"
    );
    assert!(
        ttft(&out_b, 2) * 4.0 < ttft(&out_a, 1),
        "{} vs {}",
        ttft(&out_b, 2),
        ttft(&out_a, 1)
    );
}

#[test]
fn a_longer_queue_means_a_later_first_token() {
    let mut e = Engine::new(EngineParams::default());
    for i in 0..6u32 {
        e.submit(req(u64::from(i), (i * 10_000..i * 10_000 + 4000).collect()))
            .unwrap();
    }
    let out = run_all(&mut e);
    let t: Vec<f64> = (0..6).map(|i| ttft(&out, i)).collect();
    assert!(t.windows(2).all(|w| w[0] < w[1]), "{t:?}");
    // Prefill is 10k tokens/s: the sixth request waits for about 24k tokens of prefill.
    assert!(t[5] > 2000.0, "{t:?}");
}

#[test]
fn requests_larger_than_the_cache_are_refused() {
    let mut e = Engine::new(EngineParams {
        num_gpu_blocks: 10,
        ..Default::default()
    });
    assert!(e.submit(req(1, (0..1000).collect())).is_err());
}

/// Applies one engine step's events to kvplane's state, through the wire format.
fn apply_step(sm: &mut StateMachine, seq: &mut u64, events: Vec<kvplane_state::KvEvent>) {
    if events.is_empty() {
        return;
    }
    let payload = encode_batch(0.0, &KvBatch { dp_rank: 0, events });
    let batch = decode_batch(&payload).unwrap().batch;
    *seq += 1;
    sm.apply(&Entry {
        index: *seq + 1,
        timestamp_ms: 0,
        command: Command::Ingest(IngestBatch {
            source: Default::default(),
            first_seq: *seq,
            last_seq: *seq,
            items: vec![IngestItem {
                seq: *seq,
                pool: "p".into(),
                worker: "e".into(),
                payload: IngestPayload::Kv(batch),
            }],
        }),
    })
    .unwrap();
}

#[test]
fn kvplane_state_from_the_events_matches_the_engine_cache_under_eviction() {
    let params = EngineParams {
        num_gpu_blocks: 300,
        max_num_seqs: 8,
        ..Default::default()
    };
    for seed in 0..8 {
        let mut e = Engine::new(params);
        let mut sm = StateMachine::new();
        sm.apply(&Entry {
            index: 1,
            timestamp_ms: 0,
            command: Command::ConfigPut {
                owner: Some(kvplane_state::Owner::Admin),
                kind: POOL_KIND.into(),
                name: "p".into(),
                value: PoolConfig {
                    block_size: 16,
                    models: vec![],
                    lora_adapters: Vec::new(),
                }
                .to_json(),
            },
        })
        .unwrap();
        let mut rng = Rng::new(seed);
        let families: Vec<Vec<u32>> = (0..12u32)
            .map(|f| (f * 100_000..f * 100_000 + 16 * 20).collect())
            .collect();
        let mut seq = 0;
        let mut prompts = Vec::new();
        for id in 0..120u64 {
            let f = rng.below(families.len() as u64) as usize;
            let mut t = families[f].clone();
            let extra = rng.below(80) as u32;
            t.extend(5_000_000 + id as u32 * 1000..5_000_000 + id as u32 * 1000 + 16 + extra);
            prompts.push(t.clone());
            e.submit(SimRequest {
                id,
                tokens: t,
                max_tokens: 1 + rng.below(20) as u32,
                lora_name: None,
                cache_salt: None,
            })
            .unwrap();
            for _ in 0..rng.below(4) {
                if let Some(s) = e.step() {
                    apply_step(&mut sm, &mut seq, s.events);
                }
            }
        }
        while let Some(s) = e.step() {
            apply_step(&mut sm, &mut seq, s.events);
        }
        let view = sm.handle().load();
        let pool = &view.pools["p"];
        let wid = pool.workers[0].id;
        for p in prompts.iter().chain(families.iter()) {
            let state_blocks = pool.index.overlaps(p, None).best_for(wid).0;
            assert_eq!(
                state_blocks * 16,
                e.cached_prefix_tokens(p, None),
                "seed {seed}"
            );
        }
        let dropped: u64 = view.dropped.values().sum();
        assert_eq!(dropped, 0, "seed {seed}: {:?}", view.dropped);
    }
}

#[test]
fn the_same_requests_give_the_same_run() {
    let run = || {
        let mut e = Engine::new(EngineParams {
            num_gpu_blocks: 400,
            ..Default::default()
        });
        let mut rng = Rng::new(42);
        let mut all = Vec::new();
        for id in 0..50u64 {
            let n = 100 + rng.below(900) as u32;
            let base = rng.below(3) as u32 * 1_000_000;
            e.submit(req(id, (base..base + n).collect())).unwrap();
            if let Some(s) = e.step() {
                all.push(s);
            }
        }
        while let Some(s) = e.step() {
            all.push(s);
        }
        all
    };
    assert_eq!(run(), run());
}

#[test]
fn a_convex_prefill_adds_its_square_to_each_step() {
    // One prompt of 6,000 tokens in steps of at most 4,096: a step of 4,096 prefill tokens,
    // then one of 1,904 (the first token). Every term is in the step's time, as its params say.
    let params = EngineParams {
        max_num_batched_tokens: 4_096,
        prefill_tokens_per_s: 20_000.0,
        step_base_ms: 10.0,
        per_seq_ms: 0.5,
        prefill_ms_per_ktoken_squared: 2.0,
        ..Default::default()
    };
    let step = |tokens: f64| 10.0 + 0.5 + tokens / 20.0 + 2.0 * (tokens / 1000.0).powi(2);
    let mut e = Engine::new(params);
    e.submit(req(1, (0..6_000).collect())).unwrap();
    let t = ttft(&run_all(&mut e), 1);
    let expected = step(4_096.0) + step(1_904.0);
    assert!((t - expected).abs() < 1e-6, "{t} vs {expected}");
    // Linear (the default): the same prompt without the squares.
    let mut e = Engine::new(EngineParams {
        prefill_ms_per_ktoken_squared: 0.0,
        ..params
    });
    e.submit(req(1, (0..6_000).collect())).unwrap();
    let linear = ttft(&run_all(&mut e), 1);
    let squares = 2.0 * (4.096f64.powi(2) + 1.904f64.powi(2));
    assert!((t - linear - squares).abs() < 1e-6, "{t} vs {linear}");
}
