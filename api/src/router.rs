//! The `kvplane.v1.Router` gRPC service.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvplane_proto::v1::{
    self as pb, ExplainResponse, ReadConsistency, RouteRequest, RouteResponse, UsageAck,
    UsageReport,
};
use kvplane_state::StateHandle;
use tonic::{Request, Response, Status};
use tracing::Instrument;
use tracing::field::Empty;

use crate::pipeline::Mode;
use crate::predict::Predictor;
use crate::quota::Escrow;
use crate::usage::{Routed, Start, UsageBook, served_elsewhere};
use crate::{ApiMetrics, Consistency, CostModel};

/// Serves Route, Explain and ReportUsage from the local state.
#[derive(Debug, Clone)]
pub struct RouterService {
    pub(crate) state: StateHandle,
    pub(crate) cost: CostModel,
    pub(crate) metrics: Arc<ApiMetrics>,
    usage: Arc<UsageBook>,
    consistency: Option<Arc<dyn Consistency>>,
    escrow: Option<Arc<Escrow>>,
    pub(crate) predictor: Arc<Predictor>,
    routed_sink: Option<crate::predict::RoutedSink>,
    pub(crate) tokenizers: Arc<crate::Tokenizers>,
    forwarder: Option<Arc<crate::usage_forward::Forwarder>>,
    access: Option<crate::Access>,
    pub(crate) limits: crate::Limits,
    /// Where this replica's gateways are (see [`kvplane_policy::locality`]).
    pub(crate) origin: kvplane_policy::Origin,
    /// Round trips measured from reports (`measure_rtt`): the origin decisions use.
    pub(crate) rtt: Option<Arc<crate::rtt::RttMeter>>,
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
            forwarder: None,
            access: None,
            limits: crate::Limits::default(),
            origin: kvplane_policy::Origin::default(),
            rtt: None,
        }
    }

    /// Where the gateways that ask this replica are, and the round trip from there to other
    /// clusters' engines: what a decision adds to a remote candidate's predicted TTFT and what
    /// `filter.sameLocality` compares with.
    pub fn with_origin(mut self, origin: kvplane_policy::Origin) -> Self {
        self.origin = origin;
        self
    }

    /// Measures the round trips to other clusters from reported TTFTs (`measure_rtt`): made
    /// with this replica's origin, it is what decisions use from then on.
    pub fn with_rtt_meter(mut self, meter: Arc<crate::rtt::RttMeter>) -> Self {
        self.rtt = Some(meter);
        self
    }

    /// Bounds on what a call may carry (and on the requests remembered as routed).
    pub fn with_limits(mut self, limits: crate::Limits) -> Self {
        self.limits = limits;
        self.usage = Arc::new(
            UsageBook::new(limits.in_flight_requests, Duration::from_secs(600))
                .counting(self.metrics.clone()),
        );
        self
    }

    /// A cluster member: Route answers name this replica (`routed_by`), and a report for a
    /// request another replica routed is forwarded there.
    /// Checks that each caller may route for its request's tenant (the other rights are the
    /// gRPC port's [`crate::AccessLayer`]).
    pub fn with_access(mut self, access: crate::Access) -> Self {
        self.access = Some(access);
        self
    }

    pub fn with_cluster(mut self, cluster: Arc<dyn crate::ClusterControl>) -> Self {
        self.forwarder = Some(Arc::new(crate::usage_forward::Forwarder::new(cluster)));
        self
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

    /// Serves linearizable reads through `c` (without it, the local state is all there is, as in
    /// tests of routing semantics).
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
}

#[tonic::async_trait]
impl pb::router_server::Router for RouterService {
    async fn route(
        &self,
        request: Request<RouteRequest>,
    ) -> Result<Response<RouteResponse>, Status> {
        let caller = request.extensions().get::<crate::Caller>().cloned();
        self.route_traced(&request.into_inner(), caller.as_ref())
            .await
    }

    async fn report_usage(
        &self,
        request: Request<UsageReport>,
    ) -> Result<Response<UsageAck>, Status> {
        if let Err(e) = self.limits.check_report(request.get_ref()) {
            self.metrics.limit_hit(e.name);
            return Err(Status::invalid_argument(e.to_string()));
        }
        let mut on_behalf_of = None;
        if let Some(access) = &self.access {
            // A member forwarding a report names whom it forwards it for.
            let caller = access.on_behalf_of(
                request.extensions().get::<crate::Caller>(),
                request.metadata(),
            );
            let report = request.get_ref();
            // A ticket's charges name the tenants whose quota the report gives back, and a
            // request routed here the tenant it was routed for.
            let charged = report.ticket.iter().flat_map(|t| &t.charges);
            for c in charged.filter(|c| c.provider.is_empty()) {
                access.check_tenant(Some(&caller), &c.tenant)?;
            }
            if let Some(t) = self.usage.tenant_of(&report.request_id) {
                access.check_request_id(Some(&caller), &t, &report.request_id)?;
            }
            on_behalf_of = caller.identity().map(str::to_owned);
        }
        self.report_usage_in(request, on_behalf_of.as_deref()).await
    }

    async fn explain(
        &self,
        request: Request<RouteRequest>,
    ) -> Result<Response<ExplainResponse>, Status> {
        self.explain_in(request).await
    }

    async fn models(
        &self,
        _request: Request<pb::ModelsRequest>,
    ) -> Result<Response<pb::ModelsResponse>, Status> {
        let view = self.state.load();
        Ok(Response::new(pb::ModelsResponse {
            models: view
                .catalog
                .model_names()
                .into_iter()
                .map(|(id, kind)| pb::ModelInfo {
                    id: id.to_owned(),
                    kind: kind.to_owned(),
                })
                .collect(),
            applied_index: view.applied_index,
        }))
    }
}

impl RouterService {
    /// Route, in its span (every front's decision: the gRPC call, the endpoint picker).
    pub(crate) async fn route_traced(
        &self,
        req: &RouteRequest,
        caller: Option<&crate::Caller>,
    ) -> Result<Response<RouteResponse>, Status> {
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
        let answer = self.route_in(req, caller).instrument(span.clone()).await;
        if !span.is_disabled() {
            crate::trace::record_route(&span, &answer);
        }
        answer
    }

    async fn route_in(
        &self,
        req: &RouteRequest,
        caller: Option<&crate::Caller>,
    ) -> Result<Response<RouteResponse>, Status> {
        let started = Instant::now();
        self.fresh_enough(req).await?;
        // A request id in flight for a tenant this caller may not route for is not taken over:
        // its entry (and the report that settles it) stays the other tenant's.
        if let Some(access) = &self.access
            && let Some(t) = self.usage.tenant_of(&req.request_id)
        {
            access.check_request_id(caller, &t, &req.request_id)?;
        }
        let view = self.state.load();
        let mut d = self.decide(&view, req, Mode::Route);
        // Before anything is reserved: a caller may spend only the quota of its own tenants,
        // and learns nothing of another's (a refusal that came before the tenant was known
        // depends on no tenant).
        if let Some(access) = &self.access
            && (!d.tenant.is_empty() || d.chosen().is_some())
        {
            access.check_tenant(caller, &d.tenant)?;
        }
        let reservations = crate::pipeline::admit(self.escrow.as_deref(), &mut d).await;
        if let Some(c) = d.chosen() {
            let mut worker = None;
            let mut remote_cluster = None;
            if let Some((worker_set, state)) = c.worker() {
                remote_cluster = self.measured_cluster(req, d.view, worker_set);
                if let Some(spec) = d.view.catalog.worker_sets.get(worker_set) {
                    // What its first token can teach the engine model (one more predictor
                    // lock: only when learning).
                    let learning = self.cost.learn.then(|| {
                        let (calibration, typical_ms) = self.predictor.factors(worker_set);
                        crate::predict::Learning {
                            inputs: c.prediction.inputs,
                            ahead_ms: state.pending_ms,
                            prior: crate::pipeline::signals::prior(spec, &self.cost, typical_ms),
                            calibration,
                            pending: state.pending,
                        }
                    });
                    let mut note = self.predictor.routed(
                        worker_set,
                        state.worker,
                        &req.request_id,
                        crate::pipeline::signals::uncached(
                            d.prompted.total_tokens(),
                            spec,
                            state,
                            &self.cost,
                        ),
                        c.prediction.ttft_ms,
                        learning,
                    );
                    // Here, only what this replica's index does not show already; the
                    // others get every anchor (their index may be behind this one).
                    let held = d.anchors.partition_point(|a| a.blocks <= d.anchors_held);
                    self.predictor.place(
                        worker_set,
                        state.worker,
                        state.dp_rank,
                        &d.anchors[held..],
                        (note.at_ms, note.due_ms),
                    );
                    if let Some(sink) = &self.routed_sink {
                        note.dp_rank = state.dp_rank;
                        note.anchors.clone_from(&d.anchors);
                        (sink.0)(note);
                    }
                }
                worker = Some((worker_set.to_owned(), state.worker.to_string()));
            }
            self.usage.insert(
                &req.request_id,
                Routed {
                    target: kvplane_policy::target_name(&c.target),
                    tenant: d.tenant.clone(),
                    predicted_ttft_ms: c.prediction.ttft_ms,
                    network_ms: c.prediction.network_ms,
                    at: Instant::now(),
                    reservations: reservations.clone(),
                    worker,
                    started: false,
                    remote_cluster,
                },
            );
        }
        self.metrics
            .decision(d.outcome.label(), started.elapsed().as_secs_f64());
        self.metrics.stages(&d);
        let mut answer = crate::pipeline::response(&d, &req.body, &reservations);
        answer.routed_by = self.forwarder.as_ref().map_or(0, |f| f.self_id);
        if matches!(
            answer.decision,
            Some(kvplane_proto::v1::route_response::Decision::Endpoint(_))
        ) {
            answer.ticket = Some(crate::usage_forward::ticket(
                answer.routed_by,
                self.incarnation(),
                &reservations,
            ));
        }
        Ok(Response::new(answer))
    }

    /// Settles a report here, or forwards it to the replica that routed it (saying whom for:
    /// `on_behalf_of`, the identity of a caller whose rights the other replica checks).
    pub(crate) async fn report_usage_in(
        &self,
        request: Request<UsageReport>,
        on_behalf_of: Option<&str>,
    ) -> Result<Response<UsageAck>, Status> {
        let report = request.into_inner();
        if let Some(f) = &self.forwarder
            && f.elsewhere(&report)
        {
            let routed_by = crate::usage_forward::routed_by(&report);
            match f.forward(report.clone(), on_behalf_of).await {
                Ok(ack) => {
                    self.metrics.usage("forwarded");
                    return Ok(Response::new(ack));
                }
                Err(e) => {
                    tracing::warn!(request_id = report.request_id, routed_by, error = %e, "usage report not forwarded");
                    self.metrics.usage("not_forwarded");
                    // Surely not delivered (the routing process is not running): its ticket
                    // settles through the ledger, given back once that process is known to be
                    // gone. Otherwise the reservation stays charged, as an unreported one does.
                    if e.not_delivered()
                        && let Some(ack) = self.settle_by_ledger(&report)
                    {
                        return Ok(Response::new(ack));
                    }
                }
            }
        }
        let applied_index = self.state.load().applied_index;
        if report.first_token {
            // The request started: it leaves its worker's queue here now; what tenant limits
            // hold for it stays until the final report.
            let start = self.usage.start(&report.request_id);
            self.metrics.usage(match start {
                Start::Unknown => "unknown",
                Start::Again | Start::First { .. } => "first_token",
            });
            if let Start::First {
                worker: Some((ws, w)),
                predicted_ttft_ms,
                network_ms,
                remote_cluster,
            } = &start
            {
                match served_elsewhere(report.served.as_ref(), (ws, w), &self.state) {
                    None => {
                        if *network_ms > 0.0
                            && report.observed_ttft_ms > 0.0
                            && report.observed_ttft_ms <= *network_ms
                        {
                            // The round trip taken for the link is longer than the whole wait
                            // the gateway saw: the engine's own time is unknown.
                            self.metrics.below_round_trip();
                        }
                        self.predictor.observed(
                            ws,
                            w,
                            &report.request_id,
                            *predicted_ttft_ms,
                            report.observed_ttft_ms - network_ms,
                        );
                        self.measure_rtt((ws, w), remote_cluster.as_deref(), &report);
                        self.predictor.decoding(ws, w, &report.request_id);
                    }
                    Some(served) => {
                        // Its time to first token is another engine's: nothing to learn here.
                        self.predictor.forget(ws, w, &report.request_id);
                        if let Some((sws, sw)) = &served {
                            self.predictor.decoding(sws, sw, &report.request_id);
                        }
                        self.usage.moved(&report.request_id, served);
                    }
                }
            }
            return Ok(Response::new(UsageAck {
                known: start != Start::Unknown,
                applied_index,
                settled_by_ledger: false,
            }));
        }
        let routed = self.usage.take(&report.request_id);
        let self_id = self.forwarder.as_ref().map_or(0, |f| f.self_id);
        if routed.is_none()
            && report
                .ticket
                .as_ref()
                .is_some_and(|t| t.routed_by == self_id && t.incarnation != self.incarnation())
            && let Some(ack) = self.settle_by_ledger(&report)
        {
            // Routed by this replica's earlier process, which took its reservation along.
            return Ok(Response::new(ack));
        }
        self.metrics
            .usage(if routed.is_some() { "known" } else { "unknown" });
        if let (Some(r), Some(escrow)) = (&routed, &self.escrow) {
            // Usage not seen: the request keeps what was reserved for it.
            let used = if report.usage_unknown {
                u64::MAX
            } else {
                u64::from(report.prompt_tokens) + u64::from(report.completion_tokens)
            };
            escrow.settle(&r.reservations, used);
        }
        if let Some(Routed {
            worker: Some((ws, w)),
            predicted_ttft_ms,
            network_ms,
            started,
            ..
        }) = &routed
        {
            if *started {
                // Where it ran (where it was served, when a first-token report said so).
                self.predictor.finished(ws, w, &report.request_id);
            } else if served_elsewhere(report.served.as_ref(), (ws, w), &self.state).is_some() {
                self.predictor.forget(ws, w, &report.request_id);
            } else {
                self.predictor.observed(
                    ws,
                    w,
                    &report.request_id,
                    *predicted_ttft_ms,
                    report.observed_ttft_ms - network_ms,
                );
                // No round trip measured from it: a final report's time may be the whole
                // answer's (a gateway sees the first token of an answer not streamed at its end).
            }
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
            applied_index,
            settled_by_ledger: false,
        }))
    }

    /// The cluster of `worker_set` when round trips are measured, it is another than this
    /// replica's, and `req` was decided from here (its gateway named no other place).
    fn measured_cluster(
        &self,
        req: &RouteRequest,
        view: &kvplane_state::View,
        worker_set: &str,
    ) -> Option<String> {
        self.rtt.as_ref()?;
        let here = self.origin.cluster.as_deref()?;
        let from_here = req
            .origin
            .as_ref()
            .is_none_or(|p| p.cluster.is_empty() || p.cluster == here);
        let there = view
            .catalog
            .worker_sets
            .get(worker_set)?
            .labels
            .get(kvplane_policy::locality::CLUSTER_LABEL)?;
        (from_here && there != here).then(|| there.clone())
    }

    /// Feeds a remote worker's observed time to first token, with its engine's histogram now,
    /// to the round-trip meter.
    fn measure_rtt(&self, (ws, w): (&str, &str), cluster: Option<&str>, report: &UsageReport) {
        let (Some(meter), Some(cluster)) = (&self.rtt, cluster) else {
            return;
        };
        let view = self.state.load();
        let Some(m) = view
            .pools
            .get(ws)
            .and_then(|p| p.workers.iter().find(|x| &*x.name == w))
            .map(|x| &x.metrics)
        else {
            return;
        };
        meter.observed(
            (ws, w),
            cluster,
            report.observed_ttft_ms,
            (m.ttft_sum_s, m.ttft_count),
        );
    }

    /// This process's incarnation (0 without tenant limits).
    fn incarnation(&self) -> u64 {
        self.escrow.as_ref().map_or(0, |e| e.config().incarnation)
    }

    /// Settles `report` through the ledger from its ticket, when it gives anything back.
    fn settle_by_ledger(&self, report: &UsageReport) -> Option<UsageAck> {
        let escrow = self.escrow.as_ref()?;
        let settles = crate::usage_forward::ledger_settles(report);
        let view = self.state.load();
        // A process that stopped in order settled what it acknowledged: this may be a retry of
        // a report it settled, which the ledger would give back a second time.
        if settles.is_empty()
            || settles.iter().any(|s| {
                view.quota
                    .closed
                    .contains(&(s.ticket.replica, s.ticket.incarnation))
            })
        {
            return None;
        }
        escrow.settle_elsewhere(settles);
        self.metrics.usage("ledger");
        Some(UsageAck {
            known: false,
            applied_index: self.state.load().applied_index,
            settled_by_ledger: true,
        })
    }

    async fn explain_in(
        &self,
        request: Request<RouteRequest>,
    ) -> Result<Response<ExplainResponse>, Status> {
        let caller = request.extensions().get::<crate::Caller>().cloned();
        let req = request.into_inner();
        self.fresh_enough(&req).await?;
        let view = self.state.load();
        let mut d = self.decide(&view, &req, Mode::Explain);
        if let Some(c) = caller.filter(|c| *c != crate::Caller::Unchecked) {
            // As Route checks it: once the tenant is known, or when it would be served.
            let tenant =
                (!d.tenant.is_empty() || d.chosen().is_some()).then_some(d.tenant.as_str());
            d.steps.extend(crate::access::explain(&c, tenant));
        }
        if let Some((p, o)) = self.predictor.outcome(&req.request_id) {
            d.steps.push(format!(
                "request {:?} was routed here: predicted {p:.1} ms to first token, observed {o:.1} ms",
                req.request_id
            ));
        }
        for m in d.view.catalog.limits_for(&d.tenant, &d.prompted.model) {
            d.steps.push(crate::quota::explain_limit(
                d.view,
                &m,
                self.escrow.as_deref(),
            ));
        }
        Ok(Response::new(crate::pipeline::explanation(&d, &req.body)))
    }
}
