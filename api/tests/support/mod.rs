//! In-process routing tests: the fleet in a state is `kvplane-testkit`'s [`TestFleet`]; what
//! is here calls the service and reads its answers.

#![allow(dead_code, unused_imports, clippy::unwrap_used)]

use kvplane_api::RouterService;
use kvplane_proto::v1::router_server::Router as _;
use kvplane_proto::v1::{ExplainResponse, RouteRequest, RouteResponse, UsageAck, UsageReport};
pub use kvplane_testkit::state::{TestFleet, tokens};

/// A node with only a `[[pools]]` pool: `default`, block size 16, every model, these adapters,
/// workers `w0` and `w1` up.
pub fn pools_node(lora: &[&str]) -> TestFleet {
    let mut f = TestFleet::new();
    f.command(kvplane_state::Command::ConfigPut {
        owner: Some(kvplane_state::Owner::Admin),
        kind: kvplane_state::POOL_KIND.into(),
        name: "default".into(),
        value: kvplane_state::PoolConfig {
            block_size: 16,
            models: Vec::new(),
            lora_adapters: lora.iter().map(|a| (*a).to_owned()).collect(),
        }
        .to_json(),
    });
    f.up("default", &["w0", "w1"]);
    f
}

/// A limits-only policy: tenant `acme`, 100,000 tokens a minute.
pub const ACME_LIMIT: &str = "apiVersion: kvplane.io/v1alpha1\nkind: InferencePolicy\nmetadata: {name: limits}\nspec:\n  limits: [{tenant: acme, tokensPerMinute: 100000}]\n";

/// Applies the policy documents `yaml` to `f` (checked as `kvplane validate` checks them).
pub fn apply_policies(f: &mut TestFleet, yaml: &str) {
    let mut docs = kvplane_policy::Documents::default();
    docs.add_file("policies.yaml", yaml);
    let (catalog, problems) = docs.check();
    assert!(problems.is_empty(), "{problems:?}");
    f.command(kvplane_state::Command::ConfigApply {
        owner: Some(kvplane_state::Owner::Admin),
        puts: catalog
            .objects()
            .iter()
            .map(kvplane_state::ConfigObject::policy)
            .collect(),
        deletes: Vec::new(),
    });
}

/// Returns once at least 10 s are left of the wall clock's minute: tests whose grants are for
/// the current one-minute window then finish inside it (the escrow's windows are the wall
/// clock's).
pub fn well_inside_a_minute() {
    while kvplane_api::wall_ms() % 60_000 > 50_000 {
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

/// The service over `f`'s state admitting through an escrow of replica 1's process 1 (which
/// `f`'s committed quota batches, if any, granted to), with its metrics.
pub fn escrowed_service(
    f: &TestFleet,
) -> (
    RouterService,
    std::sync::Arc<kvplane_api::Escrow>,
    std::sync::Arc<kvplane_api::ApiMetrics>,
) {
    let escrow = std::sync::Arc::new(kvplane_api::Escrow::new(
        kvplane_api::QuotaConfig {
            incarnation: 1,
            grant_wait: std::time::Duration::from_millis(20),
            ..kvplane_api::QuotaConfig::default()
        },
        f.sm.handle(),
        kvplane_api::QuotaMetrics::default(),
    ));
    let metrics = std::sync::Arc::new(kvplane_api::ApiMetrics::default());
    let svc = RouterService::new(
        f.sm.handle(),
        kvplane_api::CostModel::default(),
        metrics.clone(),
    )
    .with_quota(escrow.clone());
    (svc, escrow, metrics)
}

pub const EXAMPLES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/policies");

pub fn route(s: &RouterService, req: RouteRequest) -> RouteResponse {
    futures::executor::block_on(s.route(tonic::Request::new(req)))
        .unwrap()
        .into_inner()
}

pub fn explain(s: &RouterService, req: RouteRequest) -> ExplainResponse {
    futures::executor::block_on(s.explain(tonic::Request::new(req)))
        .unwrap()
        .into_inner()
}

pub fn report(s: &RouterService, request_id: &str) -> UsageAck {
    futures::executor::block_on(s.report_usage(tonic::Request::new(UsageReport {
        request_id: request_id.into(),
        prompt_tokens: 1,
        ..Default::default()
    })))
    .unwrap()
    .into_inner()
}

/// A usage report at the request's first token, observed after `ttft_ms`.
pub fn report_first_token(s: &RouterService, request_id: &str, ttft_ms: f64) -> UsageAck {
    futures::executor::block_on(s.report_usage(tonic::Request::new(UsageReport {
        request_id: request_id.into(),
        observed_ttft_ms: ttft_ms,
        first_token: true,
        ..Default::default()
    })))
    .unwrap()
    .into_inner()
}

/// A request for `model` with these tags and token ids, and a body naming the model.
pub fn request(id: &str, model: &str, tags: &[&str], token_ids: Vec<u32>) -> RouteRequest {
    RouteRequest {
        request_id: id.into(),
        model: model.into(),
        tags: tags.iter().map(|t| (*t).to_owned()).collect(),
        token_ids,
        body: format!(r#"{{"model":"{model}","prompt":"hello","max_tokens":8}}"#).into_bytes(),
        ..Default::default()
    }
}

/// `worker_set/worker`, `provider:name`, or `rejected(CODE): reason`.
pub fn target(r: &RouteResponse) -> String {
    use kvplane_proto::v1::route_response::Decision;
    match &r.decision {
        Some(Decision::Endpoint(e)) if !e.provider.is_empty() => format!("provider:{}", e.provider),
        Some(Decision::Endpoint(e)) => format!("{}/{}", e.pool, e.worker_id),
        Some(Decision::Rejection(x)) => format!(
            "rejected({}): {}",
            kvplane_proto::v1::RejectCode::try_from(x.code)
                .map(|c| c.as_str_name())
                .unwrap_or("?"),
            x.reason
        ),
        None => "none".into(),
    }
}
