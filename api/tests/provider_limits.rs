//! A provider's `rateLimit`, kept by the same ledger as tenant limits: requests that go to it
//! are charged to its one budget (every tenant together); when it has none left they go to the
//! next alternative, and are refused when there is none; what a request did not use comes back
//! with its usage report. On the real service over a real state, with the ledger's grants
//! committed as the refiller would commit them.

#![allow(clippy::unwrap_used)]

mod support;

use kvplane_api::RouterService;
use kvplane_policy::LimitKey;
use kvplane_proto::v1::router_server::Router as _;
use kvplane_proto::v1::{RouteResponse, UsageReport};
use kvplane_state::{Command, QuotaAsk, QuotaBatch};
use support::{TestFleet, apply_policies, escrowed_service, request, route, target, tokens};

const FLEET: &str = "apiVersion: kvplane.io/v1alpha1
kind: InferenceWorkerSet
metadata: {name: local}
spec: {model: m}
---
apiVersion: kvplane.io/v1alpha1
kind: InferenceProvider
metadata: {name: cloud-a}
spec: {endpoint: 'https://a.example/v1', model: a-model, expectedTtftMs: 100, rateLimit: {tokensPerMinute: 1000}}
---
apiVersion: kvplane.io/v1alpha1
kind: InferenceProvider
metadata: {name: cloud-b}
spec: {endpoint: 'https://b.example/v1', model: b-model, expectedTtftMs: 500}
---
apiVersion: kvplane.io/v1alpha1
kind: InferenceProvider
metadata: {name: cloud-slow}
spec: {endpoint: 'https://slow.example/v1', model: slow-model, expectedTtftMs: 900, rateLimit: {requestsPerMinute: 10}}
---
apiVersion: kvplane.io/v1alpha1
kind: InferencePolicy
metadata: {name: out}
spec:
  appliesToModels: [m]
  limits: [{tenant: acme, tokensPerMinute: 100000, requestsPerMinute: 600}]
  rules:
    - name: b-first
      match: {tags: [b-first]}
      candidates: {providers: [cloud-b, cloud-slow]}
    - name: both
      match: {tags: [both]}
      candidates: {providers: [cloud-a, cloud-b]}
    - name: only-a
      candidates: {providers: [cloud-a]}
";

/// The fleet above, this replica holding all of cloud-a's window (1,000 tokens, in grants of
/// 100) and a grant of tenant acme's, and the service admitting through that escrow.
fn fleet() -> (
    TestFleet,
    RouterService,
    std::sync::Arc<kvplane_api::Escrow>,
) {
    support::well_inside_a_minute();
    let mut f = TestFleet::new();
    // Windows are the wall clock's: the entries are stamped with it.
    f.at(kvplane_api::wall_ms());
    apply_policies(&mut f, FLEET);
    let ask = QuotaAsk {
        key: LimitKey::provider("cloud-a"),
        tokens: 100,
        requests: 0,
    };
    let mut asks = vec![ask; 10];
    asks.push(QuotaAsk {
        key: LimitKey {
            tenant: "acme".into(),
            ..LimitKey::default()
        },
        tokens: 10_000,
        requests: 60,
    });
    f.command(Command::Quota(QuotaBatch {
        replica: 1,
        incarnation: 1,
        seq: 1,
        asks,
        releases: Vec::new(),
        settles: Vec::new(),
    }));
    let (svc, escrow, _) = escrowed_service(&f);
    (f, svc, escrow)
}

/// Tenant acme's: 392 prompt tokens and at most 8 output tokens, 400 reserved.
fn ask(svc: &RouterService, id: &str, tags: &[&str]) -> RouteResponse {
    let mut req = request(id, "m", tags, tokens(1, 392));
    req.tenant = "acme".into();
    route(svc, req)
}

/// Requests the tenant's window has admitted on this replica.
fn tenant_requests(escrow: &kvplane_api::Escrow) -> u64 {
    escrow
        .status()
        .iter()
        .filter(|s| s.tenant == "acme")
        .map(|s| s.spent_requests)
        .sum()
}

#[test]
fn a_provider_without_capacity_left_passes_its_requests_to_the_next_alternative() {
    let (_f, svc, escrow) = fleet();
    let first = ask(&svc, "r1", &["both"]);
    assert_eq!(target(&first), "provider:cloud-a");
    let charges = &first.ticket.as_ref().unwrap().charges;
    assert_eq!(charges.len(), 2, "the tenant's and the provider's");
    let charge = charges.iter().find(|c| !c.provider.is_empty()).unwrap();
    assert_eq!(
        (
            charge.provider.as_str(),
            charge.tenant.as_str(),
            charge.tokens
        ),
        ("cloud-a", "", 400)
    );
    assert_eq!(target(&ask(&svc, "r2", &["both"])), "provider:cloud-a");
    // 200 of the window's 1,000 left: the next request goes to cloud-b, whose model it names.
    let third = ask(&svc, "r3", &["both"]);
    assert_eq!(target(&third), "provider:cloud-b");
    assert_eq!(third.model, "b-model");
    let charged: Vec<&str> = third
        .ticket
        .as_ref()
        .unwrap()
        .charges
        .iter()
        .map(|c| c.tenant.as_str())
        .collect();
    assert_eq!(charged, ["acme"], "the tenant once, no provider");
    assert!(
        third.alternatives.iter().all(|a| a.provider != "cloud-a"),
        "a provider with a budget is no alternative to retry on uncharged"
    );
    assert_eq!(tenant_requests(&escrow), 3);
    // With cloud-a alone, refused as rate limited, naming the provider.
    let refused = ask(&svc, "r4", &[]);
    let t = target(&refused);
    assert!(
        t.starts_with(
            "rejected(REJECT_CODE_RATE_LIMITED): provider \"cloud-a\" has no capacity left"
        ),
        "{t}"
    );
    assert_eq!(
        tenant_requests(&escrow),
        3,
        "a refused request costs the tenant nothing"
    );
    // r1 used 100 of its 400: 300 come back, and cloud-a takes a request again.
    futures::executor::block_on(svc.report_usage(tonic::Request::new(UsageReport {
        request_id: "r1".into(),
        prompt_tokens: 90,
        completion_tokens: 10,
        ..Default::default()
    })))
    .unwrap();
    assert_eq!(target(&ask(&svc, "r5", &[])), "provider:cloud-a");
}

#[test]
fn a_provider_with_a_budget_is_no_alternative_even_for_a_request_no_limit_charges() {
    let (_f, svc, _) = fleet();
    // No tenant: no tenant limit; cloud-b (no budget) picked, cloud-slow (a budget) behind it.
    let r = route(&svc, request("n1", "m", &["b-first"], tokens(2, 64)));
    assert_eq!(target(&r), "provider:cloud-b");
    assert!(r.ticket.unwrap().charges.is_empty());
    assert!(r.alternatives.is_empty(), "{:?}", r.alternatives);
}
