//! `kvplane route`, `kvplane explain` and `kvplane status`: gRPC clients for people.

use std::path::PathBuf;

use anyhow::Context;
use kvplane_proto::v1::admin_client::AdminClient;
use kvplane_proto::v1::router_client::RouterClient;
use kvplane_proto::v1::{
    ExplainResponse, RejectCode, RouteRequest, RouteResponse, StatusRequest,
    route_response::Decision,
};
use serde_json::{Value, json};

#[derive(Debug, Clone, clap::Args)]
pub struct RouteArgs {
    /// A kvplane node's gRPC address.
    #[arg(long, env = "KVPLANE_ADDR", default_value = "http://127.0.0.1:7070")]
    pub addr: String,
    #[command(flatten)]
    pub tls: crate::dial::TlsArgs,
    #[arg(long, default_value = "")]
    pub model: String,
    #[arg(long, default_value = "")]
    pub tenant: String,
    /// A semantic tag for the policies (repeatable), e.g. `--tag pii --tag complexity=low`.
    #[arg(long = "tag")]
    pub tags: Vec<String>,
    #[arg(long, default_value = "")]
    pub request_id: String,
    /// Prompt text (sent as a /v1/completions body).
    #[arg(long, conflicts_with_all = ["body", "tokens"])]
    pub prompt: Option<String>,
    /// A JSON request body file (/v1/completions or /v1/chat/completions).
    #[arg(long, conflicts_with = "tokens")]
    pub body: Option<PathBuf>,
    /// Prompt token ids, comma separated.
    #[arg(long, value_delimiter = ',')]
    pub tokens: Option<Vec<u32>>,
    #[arg(long, default_value_t = 0)]
    pub max_tokens: u32,
    /// Refuse an answer from a state older than this index.
    #[arg(long, default_value_t = 0)]
    pub min_index: u64,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Clone, clap::Args)]
pub struct StatusArgs {
    #[arg(long, env = "KVPLANE_ADDR", default_value = "http://127.0.0.1:7070")]
    pub addr: String,
    #[command(flatten)]
    pub tls: crate::dial::TlsArgs,
    #[arg(long)]
    pub json: bool,
}

pub(crate) fn request(a: &RouteArgs) -> anyhow::Result<RouteRequest> {
    let body = match (&a.prompt, &a.body) {
        (Some(p), _) => serde_json::to_vec(&json!({"model": a.model, "prompt": p}))?,
        (None, Some(path)) => {
            std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?
        }
        (None, None) => Vec::new(),
    };
    Ok(RouteRequest {
        request_id: a.request_id.clone(),
        tenant: a.tenant.clone(),
        model: a.model.clone(),
        tags: a.tags.clone(),
        body,
        token_ids: a.tokens.clone().unwrap_or_default(),
        max_output_tokens: a.max_tokens,
        min_applied_index: a.min_index,
        ..Default::default()
    })
}

pub(crate) fn decision_json(r: &RouteResponse) -> Value {
    let decision = match &r.decision {
        Some(Decision::Endpoint(e)) => json!({
            "endpoint": {
                "address": e.address, "worker_id": e.worker_id, "pool": e.pool,
                "dp_rank": e.dp_rank, "provider": e.provider,
            }
        }),
        Some(Decision::Rejection(x)) => json!({
            "rejection": {
                "code": RejectCode::try_from(x.code).map(|c| c.as_str_name()).unwrap_or("UNKNOWN"),
                "reason": x.reason,
                "retry_after_ms": x.retry_after_ms,
            }
        }),
        None => json!({}),
    };
    let mut v = decision;
    v["predicted_ttft_ms"] = json!(r.predicted_ttft_ms);
    v["matched_blocks"] = json!(r.matched_blocks);
    v["prompt_blocks"] = json!(r.prompt_blocks);
    v["prompt_tokens"] = json!(r.prompt_tokens);
    v["applied_index"] = json!(r.applied_index);
    v["model"] = json!(r.model);
    v["body_rewritten"] = json!(r.rewritten_body.is_some());
    v
}

fn print_decision(r: &RouteResponse) {
    match &r.decision {
        Some(Decision::Endpoint(e)) => {
            println!("decision     routed");
            println!(
                "endpoint     {}{}",
                target(e),
                if e.address.is_empty() {
                    String::new()
                } else {
                    format!("  {}", e.address)
                }
            );
            if !r.model.is_empty() {
                println!("model        {}", r.model);
            }
            println!(
                "matched      {} of {} blocks",
                r.matched_blocks, r.prompt_blocks
            );
            println!("predicted    {:.1} ms to first token", r.predicted_ttft_ms);
        }
        Some(Decision::Rejection(x)) => {
            let code = RejectCode::try_from(x.code)
                .map(|c| c.as_str_name())
                .unwrap_or("UNKNOWN");
            println!("decision     rejected ({code})");
            println!("reason       {}", x.reason);
        }
        None => println!("decision     none"),
    }
    println!("prompt       {} tokens", r.prompt_tokens);
    println!("state index  {}", r.applied_index);
}

/// `pool/worker`, or `provider NAME` for an external provider.
fn target(e: &kvplane_proto::v1::Endpoint) -> String {
    if e.provider.is_empty() {
        format!("{}/{}", e.pool, e.worker_id)
    } else {
        format!("provider {}", e.provider)
    }
}

pub async fn route(a: RouteArgs, explain: bool) -> anyhow::Result<()> {
    let req = request(&a)?;
    let mut client = RouterClient::new(a.tls.connect(&a.addr).await?);
    if !explain {
        let r = client.route(req).await?.into_inner();
        if a.json {
            println!("{}", serde_json::to_string_pretty(&decision_json(&r))?);
        } else {
            print_decision(&r);
        }
        // A refusal is the command's failure: scripts see it in the exit status.
        if let Some(kvplane_proto::v1::route_response::Decision::Rejection(x)) = &r.decision {
            anyhow::bail!("the request was refused: {}", x.reason);
        }
        return Ok(());
    }
    let x = client.explain(req).await?.into_inner();
    print_explain(&x, a.json)
}

/// Prints an Explain answer: a table and the steps, or JSON.
pub(crate) fn print_explain(x: &ExplainResponse, as_json: bool) -> anyhow::Result<()> {
    if as_json {
        let candidates: Vec<Value> = x
            .candidates
            .iter()
            .map(|c| {
                let e = c.endpoint.clone().unwrap_or_default();
                json!({
                    "pool": e.pool, "worker_id": e.worker_id, "address": e.address,
                    "provider": e.provider, "predicted_ttft_ms": c.predicted_ttft_ms,
                    "overlap_blocks": c.overlap_blocks, "uncached_blocks": c.uncached_blocks,
                    "running": c.running, "waiting": c.waiting, "kv_cache_usage": c.kv_cache_usage,
                    "prefill_cost": c.prefill_cost, "load_cost": c.load_cost, "cost": c.cost,
                    "network_ms": c.network_ms,
                    "filtered_reason": c.filtered_reason, "filtered_by": c.filtered_by,
                    "chosen": c.chosen,
                })
            })
            .collect();
        let out = json!({
            "decision": x.decision.as_ref().map(decision_json),
            "prompt_source": x.prompt_source,
            "candidates": candidates,
            "steps": x.steps,
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    if let Some(d) = &x.decision {
        print_decision(d);
    }
    println!("prompt from  {}", x.prompt_source);
    println!();
    println!(
        "{:<3} {:<24} {:>8} {:>8} {:>5} {:>5} {:>10} {:>10} {:>10} {:>10} {:>10}  filtered",
        "",
        "pool/worker",
        "overlap",
        "uncached",
        "run",
        "wait",
        "prefill_ms",
        "load_ms",
        "network_ms",
        "ttft_ms",
        "objective"
    );
    for c in &x.candidates {
        let e = c.endpoint.clone().unwrap_or_default();
        println!(
            "{:<3} {:<24} {:>8} {:>8} {:>5} {:>5} {:>10.1} {:>10.1} {:>10.1} {:>10.1} {:>10.1}  {}",
            if c.chosen { "->" } else { "" },
            target(&e),
            c.overlap_blocks,
            c.uncached_blocks,
            c.running,
            c.waiting,
            c.prefill_cost,
            c.load_cost,
            c.network_ms,
            c.predicted_ttft_ms,
            c.cost,
            if c.filtered_by.is_empty() {
                String::new()
            } else {
                format!("{}: {}", c.filtered_by, c.filtered_reason)
            }
        );
    }
    println!();
    for s in &x.steps {
        println!("- {s}");
    }
    Ok(())
}

pub async fn status(a: StatusArgs) -> anyhow::Result<()> {
    let mut client = AdminClient::new(a.tls.connect(&a.addr).await?);
    let s = client.status(StatusRequest::default()).await?.into_inner();
    let ingest = s.ingest.clone().unwrap_or_default();
    if a.json {
        let workers: Vec<Value> = s
            .workers
            .iter()
            .map(|w| {
                json!({
                    "pool": w.pool, "worker_id": w.worker_id, "address": w.address, "up": w.up,
                    "indexed_blocks": w.indexed_blocks, "running": w.running, "waiting": w.waiting,
                    "kv_cache_usage": w.kv_cache_usage, "prefix_cache_hit_rate": w.prefix_cache_hit_rate,
                })
            })
            .collect();
        let out = json!({
            "node_id": s.node_id, "role": s.role, "applied_index": s.applied_index,
            "state_digest": s.state_digest, "indexed_blocks": s.indexed_blocks,
            "config_index": s.config_index, "workers": workers,
            "quota": s.quota.iter().map(|q| json!({
                "tenant": q.tenant, "model": q.model, "window_start_ms": q.window_start_ms,
                "window_ms": q.window_ms, "budget_tokens": q.budget_tokens,
                "granted_tokens": q.granted_tokens, "held_tokens": q.held_tokens,
                "spent_tokens": q.spent_tokens, "spent_requests": q.spent_requests,
                "fail_open_tokens": q.fail_open_tokens,
            })).collect::<Vec<_>>(),
            "config_objects": s.config_objects.iter().map(|c| json!({
                "kind": c.kind, "name": c.name, "owner": c.owner,
            })).collect::<Vec<_>>(),
            "ingest": {
                "applied_stream_sequence": ingest.applied_stream_sequence,
                "stream_last_sequence": ingest.stream_last_sequence,
                "rejected": ingest.rejected, "dropped": ingest.dropped,
            },
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    println!("node         {} ({})", s.node_id, s.role);
    println!("applied      index {}", s.applied_index);
    println!("digest       {}", s.state_digest);
    println!("blocks       {}", s.indexed_blocks);
    println!(
        "ingest       stream seq {} applied, {} seen",
        ingest.applied_stream_sequence, ingest.stream_last_sequence
    );
    for (label, counts) in [("rejected", &ingest.rejected), ("dropped", &ingest.dropped)] {
        let mut nonzero: Vec<_> = counts.iter().filter(|(_, v)| **v > 0).collect();
        nonzero.sort();
        if !nonzero.is_empty() {
            let list: Vec<String> = nonzero.iter().map(|(r, n)| format!("{r} {n}")).collect();
            println!("{label:<12} {}", list.join(", "));
        }
    }
    println!();
    println!(
        "{:<24} {:<4} {:>9} {:>5} {:>5} {:>7}  address",
        "pool/worker", "up", "blocks", "run", "wait", "kv_use"
    );
    for w in &s.workers {
        println!(
            "{:<24} {:<4} {:>9} {:>5} {:>5} {:>6.0}%  {}",
            format!("{}/{}", w.pool, w.worker_id),
            if w.up { "yes" } else { "no" },
            w.indexed_blocks,
            w.running,
            w.waiting,
            w.kv_cache_usage * 100.0,
            w.address
        );
    }
    if !s.config_objects.is_empty() {
        println!();
        println!("{:<48} owner", "config object");
        for c in &s.config_objects {
            let owner = if c.owner.is_empty() {
                "(none: written before owners)"
            } else {
                c.owner.as_str()
            };
            println!("{:<48} {owner}", format!("{}/{}", c.kind, c.name));
        }
    }
    if !s.quota.is_empty() {
        println!();
        println!(
            "{:<24} {:>14} {:>10} {:>10} {:>10} {:>10} {:>9}",
            "tenant/model", "window start", "budget", "granted", "held", "spent", "requests"
        );
        for q in &s.quota {
            let scope = if q.model.is_empty() {
                q.tenant.clone()
            } else {
                format!("{}/{}", q.tenant, q.model)
            };
            println!(
                "{:<24} {:>14} {:>10} {:>10} {:>10} {:>10} {:>9}",
                scope,
                q.window_start_ms,
                q.budget_tokens,
                q.granted_tokens,
                q.held_tokens,
                q.spent_tokens,
                q.spent_requests
            );
        }
    }
    Ok(())
}
