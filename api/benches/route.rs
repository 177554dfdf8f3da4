//! `cargo bench -p kvplane-api --bench route`: ingest and routing cost on 64 workers and about a
//! million indexed blocks, next to dynamo-kv-router's bare indexes on the same data in the same
//! run. Prints one JSON object.
//!
//! Workload: every worker holds 1,500 sequences of 16 blocks (block size 16); each sequence is
//! one of 2,000 shared 8-block "documents" (system prompts) followed by 8 blocks of its own, so
//! the tree has both shared prefixes and long unique tails. Queries are a cached document plus
//! a partly cached tail (hits) or fresh text (misses), 90% / 10%.
//!
//! Every routed request is reported (ReportUsage, untimed), as a gateway does, so the
//! predictor's queues hold only what is in flight. `-- --small` runs a small fleet (8 workers,
//! 2,000 queries) in seconds: CI runs it to check the output and the consistency assertions,
//! never the timings.

#![allow(clippy::unwrap_used, clippy::print_stdout)]

use std::time::Instant;

use dynamo_kv_router::protocols::{
    BlockHashOptions, ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData, KvCacheStoreData,
    KvCacheStoredBlockData, RouterEvent, compute_block_hash_for_seq,
};
use dynamo_kv_router::{ConcurrentRadixTreeCompressed, RadixTree, SyncIndexer, ThreadPoolIndexer};
use kvplane_api::{CostModel, RouterService};
use kvplane_proto::v1::router_server::Router as _;
use kvplane_proto::v1::{RouteRequest, RouteResponse, UsageReport};
use kvplane_state::{
    Command, Entry, IngestBatch, IngestItem, IngestPayload, KvBatch, KvEvent, POOL_KIND,
    PoolConfig, StateMachine, Tier,
};
use serde_json::json;

const DOCS: u64 = 2_000;
const BS: u32 = 16;
const HALF: usize = 8;

/// Workers, sequences per worker and queries: the full run, or `--small`.
struct Size {
    workers: u64,
    seqs: u64,
    queries: usize,
}

fn size() -> &'static Size {
    static SIZE: std::sync::OnceLock<Size> = std::sync::OnceLock::new();
    SIZE.get_or_init(|| {
        if std::env::args().any(|a| a == "--small") {
            Size {
                workers: 8,
                seqs: 200,
                queries: 2_000,
            }
        } else {
            Size {
                workers: 64,
                seqs: 1_500,
                queries: 20_000,
            }
        }
    })
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

fn doc_tokens(d: u64) -> Vec<u32> {
    (0..HALF as u32 * BS)
        .map(|i| (d as u32) * 131 + i * 7 + 1)
        .collect()
}

fn tail_tokens(w: u64, s: u64) -> Vec<u32> {
    (0..HALF as u32 * BS)
        .map(|i| 3_000_000 + (w * size().seqs + s) as u32 * 17 + i)
        .collect()
}

/// vLLM-style chained hashes (content-based, so equal prefixes have equal hashes).
fn chain(parent: u64, tokens: &[u32]) -> Vec<u64> {
    let mut h = parent;
    tokens
        .chunks(BS as usize)
        .map(|b| {
            let mut x = h ^ 0x9e37_79b9_7f4a_7c15;
            for t in b {
                x = (x ^ u64::from(*t)).wrapping_mul(0x100_0000_01b3);
            }
            h = x;
            x
        })
        .collect()
}

/// (worker, stored event) pairs in publication order, and the document of each sequence.
fn workload() -> (Vec<(u64, KvEvent)>, Vec<u64>) {
    let mut rng = Rng(0x5eed);
    let mut out = Vec::new();
    let mut docs = Vec::new();
    for w in 0..size().workers {
        let mut held = std::collections::HashSet::new();
        for s in 0..size().seqs {
            let d = rng.next() % DOCS;
            docs.push(d);
            let doc = doc_tokens(d);
            let doc_h = chain(0, &doc);
            let tail = tail_tokens(w, s);
            let tail_h = chain(doc_h[HALF - 1], &tail);
            let ev = if held.insert(d) {
                KvEvent::Stored {
                    block_hashes: doc_h.iter().chain(&tail_h).copied().collect(),
                    parent_hash: None,
                    token_ids: doc.iter().chain(&tail).copied().collect(),
                    block_size: BS,
                    lora_name: None,
                    cache_salt: None,
                    tier: Tier::Gpu,
                }
            } else {
                KvEvent::Stored {
                    block_hashes: tail_h,
                    parent_hash: Some(doc_h[HALF - 1]),
                    token_ids: tail,
                    block_size: BS,
                    lora_name: None,
                    cache_salt: None,
                    tier: Tier::Gpu,
                }
            };
            out.push((w, ev));
        }
    }
    // Interleave workers the way a fleet's streams interleave.
    let mut rng = Rng(7);
    for i in (1..out.len()).rev() {
        out.swap(i, (rng.next() % (i as u64 + 1)) as usize);
    }
    (out, docs)
}

fn queries(docs: &[u64]) -> Vec<Vec<u32>> {
    let mut rng = Rng(0xabc);
    (0..size().queries)
        .map(|_| {
            if rng.next().is_multiple_of(10) {
                (0..256)
                    .map(|i| 9_000_000 + (rng.next() % 1_000) as u32 + i)
                    .collect()
            } else {
                let w = rng.next() % size().workers;
                let s = rng.next() % size().seqs;
                let mut t = doc_tokens(docs[(w * size().seqs + s) as usize]);
                let tail = tail_tokens(w, s);
                let keep = (rng.next() % (tail.len() as u64 + 1)) as usize;
                t.extend_from_slice(&tail[..keep]);
                t.extend((0..40).map(|i| 8_000_000 + i));
                t
            }
        })
        .collect()
}

/// One in-process Route call.
fn route(service: &RouterService, req: RouteRequest) -> RouteResponse {
    futures::executor::block_on(service.route(tonic::Request::new(req)))
        .unwrap()
        .into_inner()
}

/// Reports query `i` as served (its first token came; no TTFT to learn from), as a gateway
/// reports every request: the predictor's queues then hold only what is in flight.
fn report(service: &RouterService, i: usize) {
    let ack = futures::executor::block_on(service.report_usage(tonic::Request::new(UsageReport {
        request_id: format!("q{i}"),
        prompt_tokens: 1,
        ..Default::default()
    })))
    .unwrap()
    .into_inner();
    assert!(ack.known, "query {i} was routed here");
}

fn wall_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

fn rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}

fn percentile(sorted_ns: &[u64], p: f64) -> f64 {
    let i = ((sorted_ns.len() as f64 - 1.0) * p).round() as usize;
    sorted_ns[i] as f64 / 1000.0
}

fn latency_stats(mut ns: Vec<u64>, total_s: f64) -> serde_json::Value {
    ns.sort_unstable();
    json!({
        "calls": ns.len(),
        "per_s": (ns.len() as f64 / total_s).round(),
        "p50_us": percentile(&ns, 0.5),
        "p99_us": percentile(&ns, 0.99),
    })
}

fn router_event(id: u64, w: u64, ev: &KvEvent) -> RouterEvent {
    let KvEvent::Stored {
        block_hashes,
        parent_hash,
        token_ids,
        ..
    } = ev
    else {
        unreachable!()
    };
    let locals = compute_block_hash_for_seq(token_ids, BS, BlockHashOptions::default());
    RouterEvent::new(
        w,
        KvCacheEvent {
            event_id: id,
            dp_rank: 0,
            data: KvCacheEventData::Stored(KvCacheStoreData {
                parent_hash: parent_hash.map(ExternalSequenceBlockHash),
                start_position: None,
                blocks: block_hashes
                    .iter()
                    .zip(locals)
                    .map(|(h, l)| KvCacheStoredBlockData {
                        block_hash: ExternalSequenceBlockHash(*h),
                        tokens_hash: l,
                        mm_extra_info: None,
                    })
                    .collect(),
            }),
        },
    )
}

/// In a child process of its own (so that allocator reuse between the two measurements cannot
/// blur them): builds one index from the workload and prints its resident memory growth.
fn measure_memory(which: &str) {
    // The workload is generated first and stays alive; log entries and router events are built
    // from it a chunk at a time, so freed workload memory cannot be reused and hide growth.
    let (events, _) = workload();
    let base = rss_bytes();
    if which == "state" {
        let mut sm = state_from(Vec::new(), false);
        let mut index = 2;
        let mut seq = 0;
        for chunk in events.chunks(512) {
            for command in entries_of(chunk, &mut seq) {
                sm.apply(&Entry {
                    index,
                    timestamp_ms: 0,
                    command,
                })
                .unwrap();
                index += 1;
            }
        }
        let blocks = sm.indexed_blocks();
        let grown = rss_bytes().saturating_sub(base);
        println!("{}", json!({"rss_bytes": grown, "indexed_blocks": blocks}));
    } else {
        let bare = ThreadPoolIndexer::new(ConcurrentRadixTreeCompressed::new(), 1, BS);
        for (n, chunk) in events.chunks(512).enumerate() {
            for (i, (w, e)) in chunk.iter().enumerate() {
                bare.enqueue_event(router_event((n * 512 + i) as u64, *w, e))
                    .unwrap();
            }
            futures::executor::block_on(bare.flush());
        }
        let grown = rss_bytes().saturating_sub(base);
        println!("{}", json!({"rss_bytes": grown, "indexed_blocks": 0}));
    }
}

fn child_memory(which: &str) -> serde_json::Value {
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .arg(format!("--memory={which}"))
        .args(std::env::args().skip(1).filter(|a| a == "--small"))
        .output()
        .unwrap();
    serde_json::from_slice(&out.stdout).unwrap_or(serde_json::Value::Null)
}

/// Log entries of 512 stream messages each (one KV event per message), numbering messages
/// after `seq`.
fn entries_of(events: &[(u64, KvEvent)], seq: &mut u64) -> Vec<Command> {
    let mut entries = Vec::new();
    for chunk in events.chunks(512) {
        let mut items = Vec::new();
        for (w, ev) in chunk {
            *seq += 1;
            items.push(IngestItem {
                seq: *seq,
                pool: "p".into(),
                worker: format!("w{w}"),
                // As the leader proposes it: hashed once, compact.
                payload: IngestPayload::Kv(KvBatch {
                    dp_rank: 0,
                    events: vec![ev.clone().compact()],
                }),
            });
        }
        entries.push(Command::Ingest(IngestBatch {
            source: Default::default(),
            first_seq: items[0].seq,
            last_seq: items[items.len() - 1].seq,
            items,
        }));
    }
    entries
}

/// Ten rules: nine that do not match the benchmark's requests (each tests tags), then the one
/// that applies: the worst case, every rule is tried.
const POLICIES: &str = r#"
apiVersion: kvplane.io/v1alpha1
kind: InferenceWorkerSet
metadata: {name: p}
spec: {model: m, blockSize: 16}
---
apiVersion: kvplane.io/v1alpha1
kind: InferencePool
metadata: {name: all}
spec: {workerSets: [p]}
---
apiVersion: kvplane.io/v1alpha1
kind: GatewayBackend
metadata: {name: m}
spec: {publicModel: m, backends: [{pool: all}], policies: [ten-rules]}
---
apiVersion: kvplane.io/v1alpha1
kind: InferencePolicy
metadata: {name: ten-rules}
spec:
  rules:
    - {name: r0, match: {tags: [t0]}, filter: {maxQueued: 1}}
    - {name: r1, match: {tags: [t1]}, filter: {maxQueued: 1}}
    - {name: r2, match: {tags: [t2]}, filter: {maxQueued: 1}}
    - {name: r3, match: {tags: [t3]}, filter: {maxQueued: 1}}
    - {name: r4, match: {tags: [t4]}, filter: {maxQueued: 1}}
    - {name: r5, match: {tags: [t5]}, filter: {maxQueued: 1}}
    - {name: r6, match: {tags: [t6]}, filter: {maxQueued: 1}}
    - {name: r7, match: {tags: [t7]}, filter: {maxQueued: 1}}
    - {name: r8, match: {tags: [t8]}, filter: {maxQueued: 1}}
    - name: last
      filter: {maxQueued: 8, maxKvCacheUsage: 0.95}
      minimize: PredictedTTFT
---
apiVersion: kvplane.io/v1alpha1
kind: InferencePolicy
metadata: {name: tenants}
spec:
  limits:
    - {tenant: t, tokensPerMinute: 1000000000000, burst: 60000000000000, windowSeconds: 3600}
    - {tenant: t, model: m, requestsPerMinute: 1000000000, windowSeconds: 3600}
"#;

/// The first entry: a plain pool `p`, or the same index as worker set `p` behind ten rules.
fn first_entry(policies: bool) -> Command {
    if !policies {
        return Command::ConfigPut {
            owner: Some(kvplane_state::Owner::Admin),
            kind: POOL_KIND.into(),
            name: "p".into(),
            value: PoolConfig {
                block_size: BS,
                models: vec![],
                lora_adapters: Vec::new(),
            }
            .to_json(),
        };
    }
    let mut docs = kvplane_policy::Documents::default();
    docs.add_file("bench.yaml", POLICIES);
    let (catalog, problems) = docs.check();
    assert!(problems.is_empty(), "{problems:?}");
    Command::ConfigApply {
        owner: Some(kvplane_state::Owner::Admin),
        puts: catalog
            .objects()
            .iter()
            .map(kvplane_state::ConfigObject::policy)
            .collect(),
        deletes: Vec::new(),
    }
}

fn state_from(entries: Vec<Command>, policies: bool) -> StateMachine {
    let mut sm = StateMachine::new();
    let first = sm
        .apply(&Entry {
            index: 1,
            timestamp_ms: 0,
            command: first_entry(policies),
        })
        .unwrap();
    assert!(first.rejected.is_none(), "{:?}", first.rejected);
    for (i, command) in entries.into_iter().enumerate() {
        sm.apply(&Entry {
            index: i as u64 + 2,
            timestamp_ms: 0,
            command,
        })
        .unwrap();
    }
    sm
}

fn main() {
    if let Some(which) =
        std::env::args().find_map(|a| a.strip_prefix("--memory=").map(str::to_owned))
    {
        measure_memory(&which);
        return;
    }
    let (events, docs) = workload();
    let queries = queries(&docs);
    let blocks_in_events: usize = events
        .iter()
        .map(|(_, e)| match e {
            KvEvent::Stored { block_hashes, .. } => block_hashes.len(),
            _ => 0,
        })
        .sum();

    // 1. kvplane's state machine: events as they come from the stream, one event per
    //    message, 512 messages per log entry (built before the clock starts).
    let mut seq = 0;
    let entries = entries_of(&events, &mut seq);
    let policy_entries = entries.clone();
    let t = Instant::now();
    let sm = state_from(entries, false);
    let state_apply_s = t.elapsed().as_secs_f64();
    let indexed = sm.indexed_blocks();

    // 2. The bare indexes, same events.
    let router_events: Vec<RouterEvent> = events
        .iter()
        .enumerate()
        .map(|(i, (w, e))| router_event(i as u64, *w, e))
        .collect();
    let bare = ThreadPoolIndexer::new(ConcurrentRadixTreeCompressed::new(), 1, BS);
    let t = Instant::now();
    for ev in router_events.iter().cloned() {
        bare.enqueue_event(ev).unwrap();
    }
    futures::executor::block_on(bare.flush());
    let bare_apply_s = t.elapsed().as_secs_f64();

    let mut radix = RadixTree::new();
    let t = Instant::now();
    for ev in router_events {
        let _ = radix.apply_event(ev);
    }
    let radix_apply_s = t.elapsed().as_secs_f64();

    // 3. Lookups: bare find_matches (hashing included) vs kvplane's decision vs the full
    //    in-process Route call (view load, request handling, decision, response).
    let mut bare_ns = Vec::with_capacity(size().queries);
    let t = Instant::now();
    for q in &queries {
        let s = Instant::now();
        let h = compute_block_hash_for_seq(q, BS, BlockHashOptions::default());
        std::hint::black_box(bare.backend().find_matches(&h, false));
        bare_ns.push(s.elapsed().as_nanos() as u64);
    }
    let bare_lookup_s = t.elapsed().as_secs_f64();

    let mut radix_ns = Vec::with_capacity(size().queries);
    let t = Instant::now();
    for q in &queries {
        let s = Instant::now();
        let h = compute_block_hash_for_seq(q, BS, BlockHashOptions::default());
        std::hint::black_box(radix.find_matches(h, false));
        radix_ns.push(s.elapsed().as_nanos() as u64);
    }
    let radix_lookup_s = t.elapsed().as_secs_f64();

    let handle = sm.handle();
    let cost = CostModel::default();
    let service = RouterService::new(handle.clone(), cost, Default::default());
    let mut route_ns = Vec::with_capacity(size().queries);
    let mut hits = 0usize;
    let t = Instant::now();
    for (i, q) in queries.iter().enumerate() {
        let req = RouteRequest {
            request_id: format!("q{i}"),
            token_ids: q.clone(),
            ..Default::default()
        };
        let s = Instant::now();
        let r = route(&service, req);
        route_ns.push(s.elapsed().as_nanos() as u64);
        if r.matched_blocks > 0 {
            hits += 1;
        }
        report(&service, i);
    }
    let route_s = t.elapsed().as_secs_f64();
    assert!(
        hits * 10 >= size().queries * 8,
        "about 90% of the queries are cache hits: {hits} of {}",
        size().queries
    );

    // 4. The same Route through ten policy rules (same index contents, same queries).
    let psm = state_from(policy_entries, true);
    assert_eq!(psm.indexed_blocks(), indexed);
    let pservice = RouterService::new(psm.handle(), cost, Default::default());
    let mut policy_ns = Vec::with_capacity(size().queries);
    let mut policy_hits = 0usize;
    let t = Instant::now();
    for (i, q) in queries.iter().enumerate() {
        let req = RouteRequest {
            request_id: format!("q{i}"),
            model: "m".into(),
            tags: vec!["batch".into()],
            token_ids: q.clone(),
            ..Default::default()
        };
        let s = Instant::now();
        let r = route(&pservice, req);
        policy_ns.push(s.elapsed().as_nanos() as u64);
        assert!(
            r.decision.is_some() && r.model == "m",
            "ten-rules/last routes every query: {:?}",
            r.decision
        );
        if r.matched_blocks > 0 {
            policy_hits += 1;
        }
        report(&pservice, i);
    }
    let policy_s = t.elapsed().as_secs_f64();
    assert_eq!(
        policy_hits, hits,
        "policy routing finds the same cache hits"
    );

    // 5. The same Route with admission: two limits of the request's tenant (tokens tenant-wide,
    //    requests for the model), spent from this replica's escrow (granted beforehand by one
    //    Quota entry, as the refiller would).
    let mut psm = psm;
    let now = wall_ms();
    let grant = psm
        .apply(&Entry {
            index: psm.applied_index() + 1,
            timestamp_ms: now,
            command: Command::Quota(kvplane_state::QuotaBatch {
                replica: 1,
                incarnation: 1,
                seq: 1,
                asks: [("", u64::MAX, 0), ("m", 0, u64::MAX)]
                    .iter()
                    .map(|(model, tokens, requests)| kvplane_state::QuotaAsk {
                        key: kvplane_policy::LimitKey {
                            tenant: "t".into(),
                            model: (*model).into(),
                            provider: String::new(),
                        },
                        tokens: *tokens,
                        requests: *requests,
                    })
                    .collect(),
                releases: vec![],
                settles: vec![],
            }),
        })
        .unwrap();
    assert!(grant.quota.is_some_and(|q| q.granted.tokens > 0));
    // The process the grant went to (a replica spends only what its own process was granted).
    let escrow = std::sync::Arc::new(kvplane_api::Escrow::new(
        kvplane_api::QuotaConfig {
            incarnation: 1,
            ..Default::default()
        },
        psm.handle(),
        Default::default(),
    ));
    let qservice = RouterService::new(psm.handle(), cost, Default::default()).with_quota(escrow);
    let mut quota_ns = Vec::with_capacity(size().queries);
    let t = Instant::now();
    for (i, q) in queries.iter().enumerate() {
        let req = RouteRequest {
            request_id: format!("q{i}"),
            tenant: "t".into(),
            model: "m".into(),
            tags: vec!["batch".into()],
            token_ids: q.clone(),
            max_output_tokens: 256,
            ..Default::default()
        };
        let s = Instant::now();
        let r = route(&qservice, req);
        quota_ns.push(s.elapsed().as_nanos() as u64);
        report(&qservice, i);
        assert_eq!(
            r.charges.len(),
            2,
            "every request admitted: {:?}",
            r.decision
        );
    }
    let quota_s = t.elapsed().as_secs_f64();

    let bare_p50 = {
        let mut v = bare_ns.clone();
        v.sort_unstable();
        percentile(&v, 0.5)
    };
    let bare_p99 = {
        let mut v = bare_ns.clone();
        v.sort_unstable();
        percentile(&v, 0.99)
    };
    let route_p50 = {
        let mut v = route_ns.clone();
        v.sort_unstable();
        percentile(&v, 0.5)
    };
    let policy_p50 = {
        let mut v = policy_ns.clone();
        v.sort_unstable();
        percentile(&v, 0.5)
    };
    let route_p99 = {
        let mut v = route_ns.clone();
        v.sort_unstable();
        percentile(&v, 0.99)
    };
    let policy_p99 = {
        let mut v = policy_ns.clone();
        v.sort_unstable();
        percentile(&v, 0.99)
    };
    let (quota_p50, quota_p99) = {
        let mut v = quota_ns.clone();
        v.sort_unstable();
        (percentile(&v, 0.5), percentile(&v, 0.99))
    };
    let mem_state = child_memory("state");
    let mem_bare = child_memory("bare");
    let out = json!({
        "workload": {
            "workers": size().workers, "block_size": BS, "kv_events": events.len(),
            "blocks_in_events": blocks_in_events, "indexed_blocks": indexed, "queries": size().queries,
            "queries_routed_to_a_cache_hit": hits,
        },
        "apply": {
            "kvplane_state_events_per_s": (events.len() as f64 / state_apply_s).round(),
            "kvplane_state_blocks_per_s": (blocks_in_events as f64 / state_apply_s).round(),
            "bare_threadpool_crtc_events_per_s": (events.len() as f64 / bare_apply_s).round(),
            "bare_radix_tree_events_per_s": (events.len() as f64 / radix_apply_s).round(),
            "ratio_state_to_bare_threadpool": state_apply_s.recip() / bare_apply_s.recip(),
        },
        "lookup": {
            "bare_threadpool_crtc_find_matches": latency_stats(bare_ns, bare_lookup_s),
            "bare_radix_tree_find_matches": latency_stats(radix_ns, radix_lookup_s),
            "kvplane_route_in_process": latency_stats(route_ns, route_s),
            "ratio_route_p50_to_bare_p50": route_p50 / bare_p50,
            "ratio_route_p99_to_bare_p99": route_p99 / bare_p99,
        },
        "policies": {
            "rules": 10,
            "kvplane_route_through_ten_rules": latency_stats(policy_ns, policy_s),
            "ratio_p50_to_route_without_policies": policy_p50 / route_p50,
            "ratio_p99_to_route_without_policies": policy_p99 / route_p99,
        },
        "limits": {
            "limits_per_request": 2,
            "kvplane_route_through_ten_rules_with_admission": latency_stats(quota_ns, quota_s),
            "added_p50_us": quota_p50 - policy_p50,
            "added_p99_us": quota_p99 - policy_p99,
            "ratio_p50_to_route_without_limits": quota_p50 / policy_p50,
            "ratio_p99_to_route_without_limits": quota_p99 / policy_p99,
        },
        "memory": {
            "measured": "resident set growth while building each index, each in a fresh process",
            "kvplane_state_rss_bytes": mem_state["rss_bytes"],
            "kvplane_state_bytes_per_indexed_block": mem_state["rss_bytes"].as_f64().unwrap_or(0.0) / indexed as f64,
            "bare_threadpool_crtc_rss_bytes": mem_bare["rss_bytes"],
            "bare_threadpool_crtc_bytes_per_block": mem_bare["rss_bytes"].as_f64().unwrap_or(0.0) / indexed as f64,
        },
    });
    println!("{}", serde_json::to_string_pretty(&out).unwrap());
}
