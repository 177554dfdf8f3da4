//! The `kvplane.v1.Router` gRPC service.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvplane_proto::v1::{
    self as pb, CandidateExplanation, Endpoint, ExplainResponse, ReadConsistency, RejectCode,
    Rejection, RouteRequest, RouteResponse, UsageAck, UsageReport, route_response,
};
use kvplane_state::StateHandle;
use kvplane_tokenize::{PromptSource, prompt_from_body_with};
use tonic::{Request, Response, Status};
use tracing::Instrument;
use tracing::field::Empty;

use crate::decide::{Candidate, Decision, RejectKind};
use crate::predict::Predictor;
use crate::quota::{Escrow, Reservation};
use crate::usage::{Routed, UsageBook};
use crate::{ApiMetrics, Consistency, CostModel, RouteInput, decide};

/// A request's prompt as the service resolved it.
#[derive(Debug, Clone)]
pub struct Prompted {
    pub tokens: Vec<u32>,
    pub source: PromptSource,
    pub model: String,
    /// The most output tokens: the request's, else the body's `max_tokens`.
    pub max_tokens: Option<u32>,
    /// The body's `cache_salt` (vLLM: blocks are shared only among requests with the same).
    pub cache_salt: Option<String>,
}

/// A decision through the policy catalog, before admission.
struct PolicyDecision {
    evaluation: kvplane_policy::Evaluation,
    response: RouteResponse,
    prompted: Prompted,
    tenant: String,
    view: Arc<kvplane_state::View>,
}

/// Serves Route, Explain and ReportUsage from the local state.
#[derive(Debug, Clone)]
pub struct RouterService {
    state: StateHandle,
    cost: CostModel,
    metrics: Arc<ApiMetrics>,
    usage: Arc<UsageBook>,
    consistency: Option<Arc<dyn Consistency>>,
    escrow: Option<Arc<Escrow>>,
    predictor: Arc<Predictor>,
    routed_sink: Option<crate::predict::RoutedSink>,
    tokenizers: Arc<crate::Tokenizers>,
}

impl std::fmt::Debug for dyn Consistency {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Consistency")
    }
}

impl RouterService {
    pub fn new(state: StateHandle, cost: CostModel, metrics: Arc<ApiMetrics>) -> Self {
        Self {
            state,
            cost,
            metrics,
            usage: Arc::new(UsageBook::new(100_000, Duration::from_secs(600))),
            consistency: None,
            escrow: None,
            predictor: Arc::new(Predictor::new(crate::predict::wall_clock())),
            routed_sink: None,
            tokenizers: Arc::default(),
        }
    }

    /// Tells the other replicas where requests went (they count them in those workers' queues).
    pub fn with_routed_sink(mut self, sink: crate::predict::RoutedSink) -> Self {
        self.routed_sink = Some(sink);
        self
    }

    /// Predicts with this clock (a benchmark's virtual time) and these metrics.
    /// The models' own tokenizers (see [`crate::Tokenizers`]).
    pub fn with_tokenizers(mut self, tokenizers: Arc<crate::Tokenizers>) -> Self {
        self.tokenizers = tokenizers;
        self
    }

    pub fn with_predictor(mut self, predictor: Arc<Predictor>) -> Self {
        self.predictor = predictor;
        self
    }

    /// Admits requests against tenant limits through this replica's escrow.
    pub fn with_quota(mut self, escrow: Arc<Escrow>) -> Self {
        self.escrow = Some(escrow);
        self
    }

    /// Serves linearizable reads through `c` (without it, the local state is all there is: a
    /// standalone node applies every entry before acknowledging it).
    pub fn with_consistency(mut self, c: Arc<dyn Consistency>) -> Self {
        self.consistency = Some(c);
        self
    }

    /// Waits for (or refuses) the freshness the request asks for.
    async fn fresh_enough(&self, req: &RouteRequest) -> Result<(), Status> {
        crate::consistency::ensure(
            self.consistency.as_ref(),
            &self.state,
            &ReadConsistency {
                min_applied_index: req.min_applied_index,
                linearizable: req.linearizable,
            },
        )
        .await
    }

    /// Resolves the prompt: token ids from the request, else the body tokenized (with the
    /// model's own tokenizer when one is loaded, see [`crate::Tokenizers`]). The model, output
    /// limit and cache salt come from the request, else from the body.
    pub fn prompt(
        &self,
        req: &RouteRequest,
        view: &kvplane_state::View,
    ) -> Result<Prompted, String> {
        let text = req.token_ids.is_empty();
        if text && req.body.is_empty() {
            return Err("request has neither token_ids nor a body".into());
        }
        let fields = if req.body.is_empty() {
            kvplane_tokenize::BodyFields::default()
        } else {
            match kvplane_tokenize::body_fields(&req.body) {
                Ok(f) => f,
                Err(e) if text => return Err(e.to_string()),
                // Token ids given: a body that is not JSON only lacks the defaults.
                Err(_) => kvplane_tokenize::BodyFields::default(),
            }
        };
        let model = if req.model.is_empty() {
            fields.model.clone().unwrap_or_default()
        } else {
            req.model.clone()
        };
        let max_tokens = (req.max_output_tokens > 0)
            .then_some(req.max_output_tokens)
            .or(fields.max_tokens);
        let cache_salt = (!req.cache_salt.is_empty())
            .then(|| req.cache_salt.clone())
            .or(fields.cache_salt);
        if !text {
            return Ok(Prompted {
                tokens: req.token_ids.clone(),
                source: PromptSource::TokenIds,
                model,
                max_tokens,
                cache_salt,
            });
        }
        let tokenizer = self.tokenizers.for_model(view, &model);
        let p =
            prompt_from_body_with(&req.body, tokenizer.as_deref()).map_err(|e| e.to_string())?;
        Ok(Prompted {
            tokens: p.tokens,
            source: p.source,
            model,
            max_tokens,
            cache_salt,
        })
    }

    /// Decides through the policy catalog when the state holds one (and the prompt is valid).
    fn with_policies(&self, req: &RouteRequest) -> Option<PolicyDecision> {
        let view = self.state.load();
        if view.catalog.is_empty() {
            return None;
        }
        let p = self.prompt(req, &view).ok()?;
        let tenant = if req.tenant.is_empty() {
            view.catalog
                .backend_for(&p.model)
                .and_then(|(_, b)| req.headers.get(&b.tenant_header))
                .map_or("", String::as_str)
        } else {
            req.tenant.as_str()
        };
        let fleet = crate::policy_route::ViewFleet::new(
            &view,
            &p.tokens,
            crate::policy_route::HashKeys {
                model: &p.model,
                cache_salt: p.cache_salt.as_deref(),
            },
            &self.cost,
            &self.predictor,
        );
        let span = tracing::debug_span!(
            "policy.evaluate",
            tenant,
            model = %p.model,
            rule = Empty,
            candidates = Empty
        );
        let _in = span.enter();
        let e = view.catalog.evaluate(
            &fleet,
            &kvplane_policy::Request {
                tenant,
                model: &p.model,
                tags: &req.tags,
                prompt_tokens: u32::try_from(p.tokens.len()).unwrap_or(u32::MAX),
                max_output_tokens: req.max_output_tokens,
                tie_break: xxhash_rust::xxh3::xxh3_64(req.request_id.as_bytes()),
            },
        );
        span.record("candidates", e.candidates.len());
        if let Some(r) = &e.rule {
            span.record("rule", tracing::field::display(r));
        }
        drop(_in);
        let resp = crate::policy_route::response(&e, view.applied_index, p.tokens.len(), &req.body);
        let tenant = tenant.to_owned();
        Some(PolicyDecision {
            evaluation: e,
            response: resp,
            prompted: p,
            tenant,
            view,
        })
    }

    /// Charges an admitted decision to the limits of its tenant; a refusal replaces it.
    async fn admit(&self, d: &mut PolicyDecision) -> Vec<Reservation> {
        let Some(escrow) = &self.escrow else {
            return Vec::new();
        };
        if d.evaluation.chosen().is_none() {
            return Vec::new();
        }
        let limits = d.view.catalog.limits_for(&d.tenant, &d.prompted.model);
        if limits.is_empty() {
            return Vec::new();
        }
        let tokens = escrow.tokens_for(d.prompted.tokens.len(), d.prompted.max_tokens);
        let span = tracing::debug_span!(
            "quota.admit",
            tenant = %d.tenant,
            limits = limits.len(),
            tokens,
            outcome = Empty
        );
        let reserved = escrow
            .reserve(&limits, tokens)
            .instrument(span.clone())
            .await;
        span.record(
            "outcome",
            if reserved.is_ok() {
                "admitted"
            } else {
                "rate_limited"
            },
        );
        match reserved {
            Ok(r) => {
                d.response.charges = r.iter().map(Reservation::charge).collect();
                r
            }
            Err(refusal) => {
                d.response = RouteResponse {
                    applied_index: d.response.applied_index,
                    prompt_tokens: d.response.prompt_tokens,
                    decision: Some(route_response::Decision::Rejection(Rejection {
                        code: RejectCode::RateLimited.into(),
                        reason: refusal.to_string(),
                        retry_after_ms: refusal.retry_after_ms(),
                    })),
                    ..Default::default()
                };
                Vec::new()
            }
        }
    }

    /// Runs the decision for a request (no side effects) and hands it to `f`.
    pub fn with_decision<R>(
        &self,
        req: &RouteRequest,
        explain: bool,
        f: impl FnOnce(&Prompted, &Decision<'_>) -> R,
    ) -> R {
        let view = self.state.load();
        let prompted = match self.prompt(req, &view) {
            Ok(p) => p,
            Err(reason) => {
                let p = Prompted {
                    tokens: Vec::new(),
                    source: PromptSource::TokenIds,
                    model: req.model.clone(),
                    max_tokens: None,
                    cache_salt: None,
                };
                let d = Decision {
                    applied_index: view.applied_index,
                    candidates: Vec::new(),
                    outcome: Err((RejectKind::InvalidRequest, reason)),
                    steps: Vec::new(),
                };
                return f(&p, &d);
            }
        };
        let decision = decide(
            &view,
            RouteInput {
                request_id: &req.request_id,
                model: &prompted.model,
                tokens: &prompted.tokens,
                lora_name: None,
            },
            &self.cost,
            explain,
        );
        f(&prompted, &decision)
    }
}

fn endpoint(c: &Candidate<'_>) -> Endpoint {
    Endpoint {
        address: c.address.unwrap_or_default().to_owned(),
        worker_id: c.worker.to_owned(),
        pool: c.pool.to_owned(),
        dp_rank: c.dp_rank,
        provider: String::new(),
    }
}

fn reject_code(kind: RejectKind) -> RejectCode {
    match kind {
        RejectKind::UnknownModel => RejectCode::UnknownModel,
        RejectKind::NoCapacity => RejectCode::NoCapacity,
        RejectKind::InvalidRequest => RejectCode::InvalidRequest,
    }
}

pub(crate) fn outcome_label(d: &Decision<'_>) -> &'static str {
    match &d.outcome {
        Ok(_) => "routed",
        Err((RejectKind::UnknownModel, _)) => "unknown_model",
        Err((RejectKind::NoCapacity, _)) => "no_capacity",
        Err((RejectKind::InvalidRequest, _)) => "invalid_request",
    }
}

fn response(p: &Prompted, d: &Decision<'_>) -> RouteResponse {
    let mut out = RouteResponse {
        applied_index: d.applied_index,
        prompt_tokens: u32::try_from(p.tokens.len()).unwrap_or(u32::MAX),
        ..Default::default()
    };
    match &d.outcome {
        Ok(i) => {
            let c = &d.candidates[*i];
            out.decision = Some(route_response::Decision::Endpoint(endpoint(c)));
            out.predicted_ttft_ms = c.cost;
            out.matched_blocks = c.overlap_blocks;
            out.prompt_blocks = c.prompt_blocks;
        }
        Err((kind, reason)) => {
            out.decision = Some(route_response::Decision::Rejection(Rejection {
                code: reject_code(*kind).into(),
                reason: reason.clone(),
                retry_after_ms: 0,
            }));
            out.prompt_blocks = d.candidates.first().map_or(0, |c| c.prompt_blocks);
        }
    }
    out
}

#[tonic::async_trait]
impl pb::router_server::Router for RouterService {
    async fn route(
        &self,
        request: Request<RouteRequest>,
    ) -> Result<Response<RouteResponse>, Status> {
        let req = request.into_inner();
        let span = tracing::debug_span!(
            "route",
            request_id = %req.request_id,
            tenant = %req.tenant,
            model = %req.model,
            outcome = Empty,
            pool = Empty,
            endpoint = Empty,
            matched_blocks = Empty,
            predicted_ttft_ms = Empty,
            quota = Empty,
        );
        let answer = self.route_in(req).instrument(span.clone()).await;
        if !span.is_disabled() {
            crate::trace::record_route(&span, &answer);
        }
        answer
    }

    async fn report_usage(
        &self,
        request: Request<UsageReport>,
    ) -> Result<Response<UsageAck>, Status> {
        self.report_usage_in(request).await
    }

    async fn explain(
        &self,
        request: Request<RouteRequest>,
    ) -> Result<Response<ExplainResponse>, Status> {
        self.explain_in(request).await
    }
}

impl RouterService {
    async fn route_in(&self, req: RouteRequest) -> Result<Response<RouteResponse>, Status> {
        let started = Instant::now();
        self.fresh_enough(&req).await?;
        if let Some(mut d) = self.with_policies(&req) {
            let reservations = self.admit(&mut d).await;
            let e = &d.evaluation;
            let limited = matches!(
                &d.response.decision,
                Some(route_response::Decision::Rejection(r)) if r.code == i32::from(RejectCode::RateLimited)
            );
            if let (Some(c), false) = (e.chosen(), limited) {
                let mut worker = None;
                if let kvplane_policy::Target::Worker { worker_set, state } = &c.target {
                    if let Some(spec) = d.view.catalog.worker_sets.get(worker_set) {
                        let note = self.predictor.routed(
                            worker_set,
                            &state.worker,
                            &req.request_id,
                            crate::policy_route::uncached(
                                d.prompted.tokens.len(),
                                spec,
                                state,
                                &self.cost,
                            ),
                            c.predicted_ttft_ms,
                        );
                        if let Some(sink) = &self.routed_sink {
                            (sink.0)(note);
                        }
                    }
                    worker = Some((worker_set.clone(), state.worker.clone()));
                }
                self.usage.insert(
                    &req.request_id,
                    Routed {
                        target: kvplane_policy::target_name(&c.target),
                        predicted_ttft_ms: c.predicted_ttft_ms,
                        at: Instant::now(),
                        reservations,
                        worker,
                    },
                );
            }
            let outcome = match &e.outcome {
                _ if limited => "rate_limited",
                Ok(_) => "routed",
                Err((kvplane_policy::RejectKind::UnknownModel, _)) => "unknown_model",
                Err((kvplane_policy::RejectKind::NoCapacity, _)) => "no_capacity",
                Err((kvplane_policy::RejectKind::Policy, _)) => "policy",
            };
            self.metrics
                .decision(outcome, started.elapsed().as_secs_f64());
            return Ok(Response::new(d.response));
        }
        let (resp, outcome) = self.with_decision(&req, false, |prompted, decision| {
            if let Some(c) = decision.chosen() {
                self.usage.insert(
                    &req.request_id,
                    Routed {
                        target: format!("{}/{}", c.pool, c.worker),
                        predicted_ttft_ms: c.cost,
                        at: Instant::now(),
                        reservations: Vec::new(),
                        worker: None,
                    },
                );
            }
            (response(prompted, decision), outcome_label(decision))
        });
        self.metrics
            .decision(outcome, started.elapsed().as_secs_f64());
        Ok(Response::new(resp))
    }

    async fn report_usage_in(
        &self,
        request: Request<UsageReport>,
    ) -> Result<Response<UsageAck>, Status> {
        let report = request.into_inner();
        let routed = self.usage.take(&report.request_id);
        self.metrics.usage(routed.is_some());
        if let (Some(r), Some(escrow)) = (&routed, &self.escrow) {
            escrow.settle(
                &r.reservations,
                u64::from(report.prompt_tokens) + u64::from(report.completion_tokens),
            );
        }
        if let Some(Routed {
            worker: Some((ws, w)),
            predicted_ttft_ms,
            ..
        }) = &routed
        {
            self.predictor.observed(
                ws,
                w,
                &report.request_id,
                *predicted_ttft_ms,
                report.observed_ttft_ms,
            );
        }
        if let Some(r) = &routed {
            tracing::debug!(
                request_id = report.request_id,
                target = r.target,
                predicted_ttft_ms = r.predicted_ttft_ms,
                observed_ttft_ms = report.observed_ttft_ms,
                "usage reported"
            );
        }
        Ok(Response::new(UsageAck {
            known: routed.is_some(),
            applied_index: self.state.load().applied_index,
        }))
    }

    async fn explain_in(
        &self,
        request: Request<RouteRequest>,
    ) -> Result<Response<ExplainResponse>, Status> {
        let req = request.into_inner();
        self.fresh_enough(&req).await?;
        if let Some(d) = self.with_policies(&req) {
            let e = &d.evaluation;
            let mut steps = e.steps.clone();
            if let Some(rule) = &e.rule {
                steps.insert(
                    0,
                    format!("policy routing (rule {rule}, minimize {:?})", e.objective),
                );
            }
            if let Some((p, o)) = self.predictor.outcome(&req.request_id) {
                steps.push(format!(
                    "request {:?} was routed here: predicted {p:.1} ms to first token, observed {o:.1} ms",
                    req.request_id
                ));
            }
            for m in d.view.catalog.limits_for(&d.tenant, &d.prompted.model) {
                steps.push(crate::quota::explain_limit(
                    &d.view,
                    &m,
                    self.escrow.as_deref(),
                ));
            }
            return Ok(Response::new(ExplainResponse {
                decision: Some(d.response),
                candidates: crate::policy_route::explained(e),
                prompt_source: d.prompted.source.as_str().to_owned(),
                steps,
            }));
        }
        Ok(self.with_decision(&req, true, |prompted, decision| {
            let candidates = decision
                .candidates
                .iter()
                .map(|c| CandidateExplanation {
                    endpoint: Some(endpoint(c)),
                    overlap_blocks: c.overlap_blocks,
                    uncached_blocks: c.prompt_blocks.saturating_sub(c.overlap_blocks),
                    running: c.running,
                    waiting: c.waiting,
                    kv_cache_usage: c.kv_cache_usage,
                    prefill_cost: c.prefill_ms,
                    load_cost: c.load_ms,
                    cost: c.cost,
                    predicted_ttft_ms: c.cost,
                    filtered_reason: c.filtered.unwrap_or_default().to_owned(),
                    chosen: c.chosen,
                })
                .collect();
            Response::new(ExplainResponse {
                decision: Some(response(prompted, decision)),
                candidates,
                prompt_source: prompted.source.as_str().to_owned(),
                steps: decision.steps.clone(),
            })
        }))
    }
}
