//! The one routing pipeline. Every front (Route, Explain; the gateways and, later, the
//! endpoint picker) decides through the same stages, in this order:
//!
//! 1. [`prompt`]: body to tokens, model, salt, output limit (once);
//! 2. [`resolve`]: requested model to backend, worker sets and the attached policies; tenant;
//! 3. [`classify`]: tags from the request, its headers and the built-in taggers;
//! 4. [`rule`]: the first of the attached policies' rules whose `match` holds;
//! 5. [`signals`]: per-candidate inputs, only those a filter or the objective reads;
//! 6. [`filter`]: eligibility, each refusal with its filter's id; the fallback;
//! 7. [`score`]: the rule's objective;
//! 8. [`pick`]: the lowest, near-ties spread;
//! 9. [`admit`]: tenant limits (Route only);
//! 10. [`answer`]: the Route or Explain answer.
//!
//! Explain runs the same stages with every signal computed, records each stage's words and
//! changes nothing (no predictor update, no escrow, no usage record).

mod admit;
mod answer;
mod classify;
mod filter;
mod pick;
pub(crate) mod prompt;
mod resolve;
mod rule;
mod score;
pub(crate) mod signals;

use kvplane_policy::kinds::Objective;
use kvplane_policy::{Candidate, RejectKind, Signals, filters};
use kvplane_proto::v1::{RejectCode, RouteRequest};
use kvplane_state::View;

pub(crate) use admit::admit;
pub(crate) use answer::{explanation, response};
pub use classify::{TagSource, Tags};
pub use prompt::{PromptError, Prompted};

use crate::RouterService;

/// Route or Explain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    Route,
    Explain,
}

/// Why a request was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reject {
    InvalidRequest,
    UnknownModel,
    NoCapacity,
    Policy,
    RateLimited,
}

impl Reject {
    /// Its metric label (`kvplane_route_decisions_total{outcome}`).
    pub fn label(self) -> &'static str {
        match self {
            Self::InvalidRequest => "invalid_request",
            Self::UnknownModel => RejectKind::UnknownModel.label(),
            Self::NoCapacity => RejectKind::NoCapacity.label(),
            Self::Policy => RejectKind::Policy.label(),
            Self::RateLimited => "rate_limited",
        }
    }

    /// The refusal a Route answer's code stands for (an unspecified one: no capacity).
    pub fn from_code(code: RejectCode) -> Self {
        match code {
            RejectCode::InvalidRequest => Self::InvalidRequest,
            RejectCode::UnknownModel => Self::UnknownModel,
            RejectCode::Policy => Self::Policy,
            RejectCode::RateLimited => Self::RateLimited,
            RejectCode::NoCapacity | RejectCode::Unspecified => Self::NoCapacity,
        }
    }

    pub fn code(self) -> RejectCode {
        match self {
            Self::InvalidRequest => RejectCode::InvalidRequest,
            Self::UnknownModel => RejectCode::UnknownModel,
            Self::NoCapacity => RejectCode::NoCapacity,
            Self::Policy => RejectCode::Policy,
            Self::RateLimited => RejectCode::RateLimited,
        }
    }
}

impl From<RejectKind> for Reject {
    fn from(k: RejectKind) -> Self {
        match k {
            RejectKind::UnknownModel => Self::UnknownModel,
            RejectKind::NoCapacity => Self::NoCapacity,
            RejectKind::Policy => Self::Policy,
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// The index of the chosen candidate.
    Routed(usize),
    Rejected {
        kind: Reject,
        reason: String,
        retry_after_ms: u64,
    },
}

impl Outcome {
    pub fn label(&self) -> &'static str {
        match self {
            Self::Routed(_) => "routed",
            Self::Rejected { kind, .. } => kind.label(),
        }
    }
}

/// One request's decision and how it was reached. It borrows the state it was decided on
/// and the request (`'v`): its candidates' names are the view's.
#[derive(Debug, Clone)]
pub struct Decision<'v> {
    pub view: &'v View,
    pub prompted: Prompted<'v>,
    pub tenant: String,
    pub tags: Tags,
    pub backend: Option<String>,
    /// `policy/rule` of the rule that applied (`None`: the default rule).
    pub rule: Option<String>,
    pub objective: Objective,
    pub candidates: Vec<Candidate<'v>>,
    pub outcome: Outcome,
    /// The model the chosen candidate serves the request as (empty when none was chosen).
    pub model: String,
    /// Other candidates that passed every filter, best first, with the model each serves the
    /// request as: where a gateway may retry.
    pub alternatives: Vec<(usize, String)>,
    /// Each stage's words (Explain only).
    pub steps: Vec<String>,
    /// The prompt's anchors in the chosen worker's set (see [`crate::placed`]), and how many
    /// of its blocks the index shows the chosen worker holding.
    pub anchors: Vec<kvplane_state::Anchor>,
    pub anchors_held: u32,
}

impl<'v> Decision<'v> {
    pub fn chosen(&self) -> Option<&Candidate<'v>> {
        match self.outcome {
            Outcome::Routed(i) => self.candidates.get(i),
            Outcome::Rejected { .. } => None,
        }
    }

    /// The model the body must name, when it differs from the requested one.
    pub fn rewrite_model(&self) -> Option<&str> {
        (!self.model.is_empty() && self.model != self.prompted.model).then_some(&*self.model)
    }

    fn refuse(mut self, kind: Reject, reason: String, explain: bool) -> Self {
        if explain {
            self.steps.push(format!("rejected: {reason}"));
        }
        self.outcome = Outcome::Rejected {
            kind,
            reason,
            retry_after_ms: 0,
        };
        self
    }
}

impl RouterService {
    /// Runs stages 1-8 for `req` on `view` (admission is the caller's, Route only).
    pub(crate) fn decide<'v>(
        &self,
        view: &'v View,
        req: &'v RouteRequest,
        mode: Mode,
    ) -> Decision<'v> {
        let explain = mode == Mode::Explain;
        let mut d = Decision {
            view,
            prompted: Prompted::unreadable(req),
            tenant: String::new(),
            tags: Tags::default(),
            backend: None,
            rule: None,
            objective: Objective::PredictedTTFT,
            candidates: Vec::new(),
            outcome: Outcome::Rejected {
                kind: Reject::InvalidRequest,
                reason: String::new(),
                retry_after_ms: 0,
            },
            model: String::new(),
            alternatives: Vec::new(),
            steps: Vec::new(),
            anchors: Vec::new(),
            anchors_held: 0,
        };
        // 0. bounds: nothing over a limit is read further
        if let Err(e) = self.limits.check_route(req) {
            self.metrics.limit_hit(e.name);
            return d.refuse(Reject::InvalidRequest, e.to_string(), explain);
        }
        // 1. prompt: what the request says; its tokens once its model resolved
        let fields = match prompt::fields(req) {
            Ok(f) => f,
            Err(e) => return d.refuse(Reject::InvalidRequest, e.to_string(), explain),
        };
        d.prompted.model.clone_from(&fields.model);
        // 2. resolve
        let catalog: &'v kvplane_policy::Catalog = &view.catalog;
        let resolved = match resolve::resolve(catalog, &fields.model) {
            Ok(r) => r,
            Err((kind, reason)) => return d.refuse(kind.into(), reason, explain),
        };
        d.prompted =
            match prompt::prompt(req, fields, view, &self.tokenizers, &resolved.sets, explain) {
                Ok(p) => p,
                Err(e) => return d.refuse(Reject::InvalidRequest, e.to_string(), explain),
            };
        let p = &d.prompted;
        if explain {
            d.steps.push(format!(
                "prompt: {} tokens ({}{}), model {:?}",
                p.total_tokens(),
                p.source.as_str(),
                if p.estimated_rest > 0 {
                    format!(
                        "; the last {} estimated: no engine caches the prompt that far",
                        p.estimated_rest
                    )
                } else {
                    String::new()
                },
                p.model
            ));
            d.steps.extend(resolve::describe(&p.model, &resolved));
        }
        d.backend = resolved.backend.map(|(n, _)| n.to_owned());
        d.tenant = resolve::tenant(req, &resolved);
        // 3. classify
        let read: Vec<&str> = kvplane_policy::Catalog::tags_read(&resolved).collect();
        d.tags = classify::classify(
            &req.tags,
            &req.headers,
            resolved.backend.map(|(_, b)| b),
            &req.body,
            p.prompt_tokens(),
            |t| {
                read.iter()
                    .any(|r| *r == t || (t.ends_with('=') && r.starts_with(t)))
            },
        );
        if explain {
            for (t, s) in d.tags.tags.iter().zip(&d.tags.sources) {
                d.steps.push(format!("tag {t} from {s}"));
            }
        }
        // Decided as from where the gateway says it runs, else from this replica's place (with
        // the round trips measured so far, when measured).
        let measured = self.rtt.as_ref().map(|m| m.origin());
        let here = measured.as_deref().unwrap_or(&self.origin);
        let origin = req
            .origin
            .as_ref()
            .map_or(std::borrow::Cow::Borrowed(here), |p| {
                here.seen_from(kvplane_policy::Place {
                    cluster: &p.cluster,
                    region: &p.region,
                    zone: &p.zone,
                })
            });
        if explain && origin.cluster != here.cluster {
            d.steps.push(format!(
                "decided as from cluster {} (where the gateway runs)",
                origin.cluster.as_deref().unwrap_or_default()
            ));
        }
        let preq = kvplane_policy::Request {
            tenant: &d.tenant,
            model: &p.model,
            tags: &d.tags.tags,
            prompt_tokens: p.prompt_tokens(),
            max_output_tokens: req.max_output_tokens,
            tie_break: pick::tie_break(&req.request_id),
            endpoint_subset: &req.endpoint_subset,
            origin: &origin,
        };
        let fleet = signals::ViewFleet::new(
            view,
            &p.tokens,
            p.total_tokens(),
            signals::HashKeys {
                model: &p.model,
                sets: &resolved.sets,
                cache_salt: p.cache_salt.as_deref(),
            },
            &self.cost,
            &self.predictor,
            explain,
        );
        // 4. the rule
        let span = tracing::debug_span!(
            "policy.evaluate",
            tenant = %d.tenant,
            model = %p.model,
            rule = tracing::field::Empty,
            candidates = tracing::field::Empty
        );
        let _in = span.enter();
        let choice = rule::rule(catalog, &resolved, &fleet, &preq);
        let rule = choice.rule;
        let rule_name = choice.id.map(|_| choice.name());
        if let Some(r) = &rule_name {
            span.record("rule", tracing::field::display(r));
        }
        let mut steps = Vec::new();
        if explain {
            steps.push(rule::describe(&choice));
        }
        // 5. signals
        let signals = if explain {
            Signals::ALL
        } else {
            filters::needs(&rule.filter).union(score::needs(rule.minimize))
        };
        let mut cands =
            catalog.candidates(&fleet, &preq, &resolved, &rule.candidates, false, signals);
        span.record("candidates", cands.len());
        // No worker at all: a rule that falls back still gets its fallback (the filter stage).
        let no_workers = cands.is_empty()
            && rule.on_empty.action != kvplane_policy::kinds::EmptyAction::Fallback;
        let mut picked = None;
        if !no_workers {
            // 6. filter
            let words = filter::filter(
                catalog, &fleet, &preq, &resolved, rule, signals, explain, &mut cands,
            );
            steps.extend(words);
            // 7. score, 8. pick
            score::score(rule.minimize, &mut cands);
            picked = pick::pick(&mut cands, preq.tie_break);
            if let Some(i) = picked
                && !signals.prediction
            {
                // The rule read no prediction, but the predictor's queues and the answer need
                // the chosen worker's: computed for it alone.
                signals::complete(&fleet, catalog, &mut cands[i]);
            }
        }
        let model = picked.map(|i| catalog.model_of(&cands[i], &resolved, &p.model));
        let alternatives: Vec<(usize, String)> = picked.map_or_else(Vec::new, |i| {
            pick::alternatives(&cands, i)
                .into_iter()
                .map(|j| (j, catalog.model_of(&cands[j], &resolved, &p.model)))
                .collect()
        });
        let budgeted_pick = picked.is_some_and(|i| {
            matches!(cands[i].target, kvplane_policy::Target::Provider { name, .. }
                if catalog.provider_limited(name))
        });
        if !signals.prediction && budgeted_pick {
            // Admission may move the decision to an alternative (the provider has no budget
            // left): each needs its prediction as the pick does.
            for (j, _) in &alternatives {
                signals::complete(&fleet, catalog, &mut cands[*j]);
            }
        }
        drop(_in);
        if let Some(i) = picked
            && !explain
            && let Some((set, state)) = cands[i].worker()
        {
            (d.anchors, d.anchors_held) = fleet.anchors_of(set, state.worker);
        }
        d.rule = rule_name;
        d.objective = rule.minimize;
        d.alternatives = alternatives;
        d.steps.append(&mut steps);
        d.candidates = cands;
        if no_workers {
            let reason = format!("model {:?} has no workers", d.prompted.model);
            return d.refuse(Reject::NoCapacity, reason, explain);
        }
        match picked {
            Some(i) => {
                d.model = model.unwrap_or_default();
                if explain {
                    let c = &d.candidates[i];
                    let line = format!(
                        "chose {} (minimize {:?}: {:.3})",
                        kvplane_policy::target_name(&c.target),
                        rule.minimize,
                        c.objective
                    );
                    d.steps.push(line);
                    if let Some(m) = d.rewrite_model() {
                        let line = format!("body model rewritten to {m:?}");
                        d.steps.push(line);
                    }
                }
                d.outcome = Outcome::Routed(i);
                d
            }
            None => {
                let no_worker_up = d.candidates.iter().all(|c| {
                    c.filtered
                        .as_ref()
                        .is_some_and(|f| f.by == filters::WORKER_DOWN)
                });
                // The proxy named the endpoints it can reach: none of them eligible is no
                // capacity, whatever the rule says (the endpoint picker protocol's 503).
                let outside_subset = !req.endpoint_subset.is_empty()
                    && d.candidates.iter().all(|c| {
                        c.filtered.as_ref().is_some_and(|f| {
                            f.by == filters::ENDPOINT_SUBSET || f.by == filters::WORKER_DOWN
                        })
                    });
                if no_worker_up && choice.id.is_none() {
                    let reason = format!("model {:?} has no worker that is up", d.prompted.model);
                    d.refuse(Reject::NoCapacity, reason, explain)
                } else if outside_subset {
                    let reason = format!(
                        "model {:?} has no eligible worker among the request's {} endpoints",
                        d.prompted.model,
                        req.endpoint_subset.len()
                    );
                    d.refuse(Reject::NoCapacity, reason, explain)
                } else {
                    let reason = rule
                        .on_empty
                        .reason
                        .clone()
                        .unwrap_or_else(|| format!("rule {} left no candidate", choice.name()));
                    d.refuse(Reject::Policy, reason, explain)
                }
            }
        }
    }
}
