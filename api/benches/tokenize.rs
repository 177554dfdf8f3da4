//! `cargo bench -p kvplane-api --bench tokenize`: what tokenizing a chat request with the
//! model's own tokenizer and chat template costs, at 1k, 8k and 32k prompt tokens, next to the
//! whole Route decision for the same requests in the same run (Route includes it). Prints one
//! JSON object.
//!
//! Setup: the ChatML-style fixture tokenizer of `tokenize/tests/fixtures` (byte-level BPE),
//! an InferenceWorkerSet naming it, 16 workers each holding a different system prompt of the
//! size measured (as KV events of its real tokens); each request is one of those system prompts
//! plus its own question, so Route finds a worker with most of the prompt cached.
//!
//! It checks its own consistency as it goes (the piece cache gives the whole encoding's ids;
//! every request finds its system prompt cached). `-- --small` runs a few requests per size:
//! CI runs it to check the output and those assertions, never the timings.

#![allow(clippy::unwrap_used, clippy::print_stdout)]

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use kvplane_api::{CostModel, RouterService, Tokenizers};
use kvplane_proto::v1::RouteRequest;
use kvplane_proto::v1::router_server::Router;
use kvplane_state::{
    Command, ConfigObject, Entry, IngestBatch, IngestItem, IngestPayload, KvBatch, KvEvent,
    StateMachine, Tier,
};
use kvplane_tokenize::ModelTokenizer;
use serde_json::json;

const WORKERS: usize = 16;
const BS: u32 = 16;
const MODEL: &str = "chatml-style";

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tokenize/tests/fixtures/chatml-style")
}

const TEXT: &str = "Routing a request to the engine that already holds its system prompt avoids \
    recomputing thousands of tokens. Les modèles répondent en français; 東京は日本の首都です. \
    def route(request): return min(engines, key=cost) ";

/// A system prompt of about `tokens` tokens, distinct per `variant`.
fn system_prompt(tok: &ModelTokenizer, tokens: usize, variant: usize) -> String {
    let per_chunk = tok.encode_completion(&TEXT.repeat(10)).unwrap().len() as f64 / 10.0;
    let chunks = (tokens as f64 / per_chunk).ceil() as usize;
    format!("Assistant number {variant}. {}", TEXT.repeat(chunks))
}

fn body(system: &str, question: usize) -> Vec<u8> {
    serde_json::to_vec(&json!({
        "model": MODEL,
        "max_tokens": 64,
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": format!("Question {question}: what does this mean for latency?")},
        ],
    }))
    .unwrap()
}

fn percentile(sorted: &[u64], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i] as f64 / 1000.0
}

fn stats(mut ns: Vec<u64>) -> serde_json::Value {
    ns.sort_unstable();
    json!({"p50_us": percentile(&ns, 0.5), "p99_us": percentile(&ns, 0.99)})
}

/// A state holding the worker set and `systems[w]` cached on worker `w`.
fn state(tok: &ModelTokenizer, systems: &[String]) -> StateMachine {
    let mut sm = StateMachine::new();
    let set = kvplane_policy::Object {
        name: "chatml".into(),
        spec: kvplane_policy::Spec::WorkerSet(
            serde_json::from_value(json!({
                "model": MODEL, "blockSize": BS, "tokenizer": fixture().display().to_string(),
            }))
            .unwrap(),
        ),
    };
    let mut commands = vec![Command::ConfigApply {
        owner: Some(kvplane_state::Owner::Admin),
        puts: vec![ConfigObject::policy(&set)],
        deletes: Vec::new(),
    }];
    let mut items = Vec::new();
    for (w, system) in systems.iter().enumerate() {
        let tokens = tok.encode_chat(&body(system, 0)).unwrap();
        let blocks = tokens.len() / BS as usize;
        items.push(IngestPayload::Worker {
            up: true,
            address: Some(format!("http://w{w}:8000")),
        });
        items.push(IngestPayload::Kv(KvBatch {
            dp_rank: 0,
            events: vec![
                KvEvent::Stored {
                    block_hashes: (0..blocks as u64).map(|b| (w as u64) << 32 | b).collect(),
                    parent_hash: None,
                    token_ids: tokens[..blocks * BS as usize].to_vec(),
                    block_size: BS,
                    lora_name: None,
                    cache_salt: None,
                    tier: Tier::Gpu,
                }
                .compact(),
            ],
        }));
    }
    let items: Vec<IngestItem> = items
        .into_iter()
        .enumerate()
        .map(|(i, payload)| IngestItem {
            seq: i as u64 + 1,
            pool: "chatml".into(),
            worker: format!("w{}", i / 2),
            payload,
        })
        .collect();
    commands.push(Command::Ingest(IngestBatch {
        source: Default::default(),
        first_seq: 1,
        last_seq: items.len() as u64,
        items,
    }));
    for (i, command) in commands.into_iter().enumerate() {
        let a = sm
            .apply(&Entry {
                index: i as u64 + 1,
                timestamp_ms: 0,
                command,
            })
            .unwrap();
        assert!(a.rejected.is_none(), "{:?}", a.rejected);
    }
    sm
}

fn main() {
    let tok = Arc::new(ModelTokenizer::load(&fixture()).unwrap());
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut sizes = Vec::new();
    let small = std::env::args().any(|a| a == "--small");
    let plan: [(usize, usize); 3] = if small {
        [(1_000, 24), (8_000, 20), (32_000, 17)]
    } else {
        [(1_000, 400), (8_000, 100), (32_000, 30)]
    };
    for (target, rounds) in plan {
        let systems: Vec<String> = (0..WORKERS)
            .map(|w| system_prompt(&tok, target, w))
            .collect();
        let sm = state(&tok, &systems);
        let service_with = |tokenizers: Arc<Tokenizers>| {
            RouterService::new(sm.handle(), CostModel::default(), Default::default())
                .with_tokenizers(tokenizers)
        };
        let fresh = || Arc::new(Tokenizers::with_models(&[(MODEL.to_owned(), fixture())]).unwrap());
        let warm = service_with(fresh());
        let bodies: Vec<Vec<u8>> = (0..rounds)
            .map(|i| body(&systems[i % WORKERS], i))
            .collect();
        let prompt_tokens = tok.encode_chat(&bodies[0]).unwrap().len();
        let route = |service: &RouterService, req: RouteRequest| {
            rt.block_on(service.route(tonic::Request::new(req)))
                .unwrap()
                .into_inner()
        };
        let by_body = |i: usize, b: &[u8]| RouteRequest {
            request_id: format!("r{i}"),
            body: b.to_vec(),
            ..Default::default()
        };
        // Warm: every system prompt seen once (the piece cache holds it).
        for (i, b) in bodies.iter().take(WORKERS).enumerate() {
            tok.encode_chat(b).unwrap();
            route(&warm, by_body(i, b));
        }
        // Interleaved, request by request: the template alone; template and tokenizer on a
        // prompt never seen (by a tokenizer just loaded: no piece or pre-token seen; and, for
        // reference, the `tokenizers` crate's encode of the whole text) and on one whose system
        // prompt was seen; the whole
        // Route decision from the body, on a node that never saw the system prompt (cold) and
        // on one that did (warm); the Route decision given the same token ids.
        let mut ns: [Vec<u64>; 9] = Default::default();
        let pii = kvplane_policy::kinds::PiiTagger::default();
        let complexity = kvplane_policy::kinds::ComplexityTagger::default();
        let mut matched = 0u64;
        for (i, b) in bodies.iter().enumerate() {
            let t = Instant::now();
            std::hint::black_box(tok.render_chat(b).unwrap());
            ns[0].push(t.elapsed().as_nanos() as u64);
            let t = Instant::now();
            let ids = std::hint::black_box(tok.encode_chat_whole(b).unwrap());
            ns[8].push(t.elapsed().as_nanos() as u64);
            // kvplane's own path on a tokenizer that never saw a word of it (cold caches).
            let cold_tok = ModelTokenizer::load(&fixture()).unwrap();
            let t = Instant::now();
            let new_ids = std::hint::black_box(cold_tok.encode_chat(b).unwrap());
            ns[1].push(t.elapsed().as_nanos() as u64);
            assert_eq!(
                new_ids, ids,
                "pre-token by pre-token gives the tokenizer's own ids"
            );
            let t = Instant::now();
            let pieces = std::hint::black_box(tok.encode_chat(b).unwrap());
            ns[2].push(t.elapsed().as_nanos() as u64);
            assert_eq!(pieces, ids, "the piece cache gives the tokenizer's own ids");
            let cold = service_with(fresh());
            let t = Instant::now();
            route(&cold, by_body(i, b));
            ns[3].push(t.elapsed().as_nanos() as u64);
            let t = Instant::now();
            let r = route(&warm, by_body(i, b));
            ns[4].push(t.elapsed().as_nanos() as u64);
            matched += u64::from(r.matched_blocks);
            assert!(
                u64::from(r.matched_blocks * BS) * 10 >= prompt_tokens as u64 * 8,
                "request {i} finds its system prompt cached: {} blocks of {prompt_tokens} tokens",
                r.matched_blocks
            );
            let req = RouteRequest {
                request_id: format!("t{i}"),
                model: MODEL.into(),
                token_ids: ids,
                ..Default::default()
            };
            let t = Instant::now();
            route(&warm, req);
            ns[5].push(t.elapsed().as_nanos() as u64);
            // A system prompt no engine caches and no replica saw: tokenized only until no
            // index can hold it, the rest counted.
            let unseen = body(&system_prompt(&tok, target, WORKERS + 1 + i), i);
            let cold = service_with(fresh());
            let t = Instant::now();
            let r = route(&cold, by_body(i, &unseen));
            ns[6].push(t.elapsed().as_nanos() as u64);
            assert!(
                r.matched_blocks <= 2,
                "at most the template's first tokens are shared"
            );
            assert!(
                r.prompt_tokens as usize * 2 > prompt_tokens,
                "the estimate is of the prompt's size: {} for about {prompt_tokens}",
                r.prompt_tokens
            );
            // Every built-in tagger on the body as sent.
            let t = Instant::now();
            std::hint::black_box(kvplane_policy::classify::pii_rule_found(&unseen, &pii));
            std::hint::black_box(kvplane_policy::classify::complexity(
                &unseen,
                r.prompt_tokens,
                &complexity,
            ));
            ns[7].push(t.elapsed().as_nanos() as u64);
        }
        let [
            template,
            cold_tok,
            warm_tok,
            cold_route,
            warm_route,
            ids_route,
            unseen_route,
            taggers,
            crate_whole,
        ] = ns.map(stats);
        let share = |a: &serde_json::Value, b: &serde_json::Value| {
            a["p50_us"].as_f64().unwrap() / b["p50_us"].as_f64().unwrap()
        };
        sizes.push(json!({
            "target_tokens": target,
            "prompt_tokens": prompt_tokens,
            "body_bytes": bodies[0].len(),
            "requests": rounds,
            "template": template,
            "tokenize_new_prompt": cold_tok,
            "tokenizers_crate_on_the_whole_text": crate_whole,
            "tokenize_seen_system_prompt": warm_tok,
            "route_new_prompt": cold_route,
            "route_seen_system_prompt": warm_route,
            "route_given_token_ids": ids_route,
            "route_prompt_no_engine_caches": unseen_route,
            "taggers_pii_and_complexity": taggers,
            "tokenize_share_of_route_new_prompt": share(&cold_tok, &cold_route),
            "tokenize_share_of_route_seen_system_prompt": share(&warm_tok, &warm_route),
            "mean_matched_blocks": matched as f64 / rounds as f64,
        }));
    }
    println!(
        "{}",
        serde_json::to_string_pretty(
            &json!({"tokenizer": "chatml-style fixture (byte-level BPE)", "sizes": sizes})
        )
        .unwrap()
    );
}
