//! Stage 10, answer: the decision as the fronts send it - a Route answer (the endpoint, the
//! model it serves and the body rewritten to name it, or a refusal with its code and reason,
//! always the applied index) and Explain's every candidate with its signals and cost parts.

use kvplane_policy::{Catalog, Target};
use kvplane_proto::v1::{
    CandidateExplanation, Endpoint, ExplainResponse, Rejection, RouteResponse, route_response,
};

use super::{Decision, Outcome};
use crate::quota::Reservation;

fn endpoint(t: &Target<'_>, catalog: &Catalog, model: &str) -> Endpoint {
    match t {
        Target::Worker { worker_set, state } => Endpoint {
            address: state.address.unwrap_or_default().to_owned(),
            worker_id: state.worker.to_owned(),
            pool: worker_set.to_string(),
            dp_rank: state.dp_rank,
            model: model.to_owned(),
            ..Default::default()
        },
        Target::Provider { name, endpoint } => {
            let spec = catalog.providers.get(*name);
            let credentials = spec.and_then(|p| p.credentials.as_ref());
            Endpoint {
                address: (*endpoint).to_owned(),
                provider: (*name).to_owned(),
                provider_api: spec.map(|p| p.api.as_str().to_owned()).unwrap_or_default(),
                credentials_name: credentials.map(|c| c.name.clone()).unwrap_or_default(),
                credentials_key: credentials.map(|c| c.key.clone()).unwrap_or_default(),
                provider_region: spec.and_then(|p| p.region()).unwrap_or_default(),
                model: model.to_owned(),
                ..Default::default()
            }
        }
    }
}

/// The body with `model` set to `model`; `None` when the body is not a JSON object.
fn rewrite_body(body: &[u8], model: &str) -> Option<Vec<u8>> {
    let mut v: serde_json::Value = serde_json::from_slice(body).ok()?;
    v.as_object_mut()?
        .insert("model".into(), serde_json::Value::String(model.to_owned()));
    serde_json::to_vec(&v).ok()
}

/// The Route answer.
pub(crate) fn response(
    d: &Decision<'_>,
    body: &[u8],
    reservations: &[Reservation],
) -> RouteResponse {
    let mut out = RouteResponse {
        applied_index: d.view.applied_index,
        // Loaded after every lookup of the decision: an upper bound on what they saw.
        index_through: d.view.index_through(),
        prompt_tokens: d.prompted.prompt_tokens(),
        ..Default::default()
    };
    match &d.outcome {
        Outcome::Routed(i) => {
            let c = &d.candidates[*i];
            out.decision = Some(route_response::Decision::Endpoint(endpoint(
                &c.target,
                &d.view.catalog,
                &d.model,
            )));
            out.predicted_ttft_ms = c.client_ttft_ms();
            out.model.clone_from(&d.model);
            if let Target::Worker { state, .. } = &c.target {
                out.matched_blocks = state.overlap_blocks;
                out.prompt_blocks = state.prompt_blocks;
            }
            if let Some(m) = d.rewrite_model()
                && !body.is_empty()
            {
                out.rewritten_body = rewrite_body(body, m);
            }
            out.charges = reservations.iter().map(Reservation::charge).collect();
            out.alternatives = d
                .alternatives
                .iter()
                .map(|(j, model)| endpoint(&d.candidates[*j].target, &d.view.catalog, model))
                .collect();
        }
        Outcome::Rejected {
            kind,
            reason,
            retry_after_ms,
        } => {
            out.decision = Some(route_response::Decision::Rejection(Rejection {
                code: kind.code().into(),
                reason: reason.clone(),
                retry_after_ms: *retry_after_ms,
            }));
            out.prompt_blocks = d
                .candidates
                .iter()
                .find_map(|c| c.worker().map(|(_, w)| w.prompt_blocks))
                .unwrap_or(0);
        }
    }
    out
}

/// Explain's answer: the Route answer it would give, every candidate, every stage's words.
pub(crate) fn explanation(d: &Decision<'_>, body: &[u8]) -> ExplainResponse {
    let candidates = d
        .candidates
        .iter()
        .map(|c| {
            let (overlap, prompt, running, waiting, kv) = match &c.target {
                Target::Worker { state, .. } => (
                    state.overlap_blocks,
                    state.prompt_blocks,
                    state.running,
                    state.waiting,
                    state.kv_cache_usage,
                ),
                Target::Provider { .. } => (0, 0, 0, 0, 0.0),
            };
            CandidateExplanation {
                endpoint: Some(endpoint(&c.target, &d.view.catalog, "")),
                overlap_blocks: overlap,
                uncached_blocks: prompt.saturating_sub(overlap),
                running,
                waiting,
                kv_cache_usage: kv,
                prefill_cost: c.prediction.prefill_ms,
                load_cost: c.prediction.load_ms,
                cost: c.objective,
                predicted_ttft_ms: c.client_ttft_ms(),
                network_ms: c.prediction.network_ms,
                filtered_reason: c
                    .filtered
                    .as_ref()
                    .map(|f| f.text.clone())
                    .unwrap_or_default(),
                filtered_by: c
                    .filtered
                    .as_ref()
                    .map(|f| f.by.0.to_owned())
                    .unwrap_or_default(),
                chosen: c.chosen,
            }
        })
        .collect();
    ExplainResponse {
        decision: Some(response(d, body, &[])),
        candidates,
        prompt_source: d.prompted.source.as_str().to_owned(),
        steps: d.steps.clone(),
    }
}
