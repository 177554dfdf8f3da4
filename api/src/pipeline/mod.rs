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

use std::sync::Arc;

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

/// One request's decision and how it was reached.
#[derive(Debug, Clone)]
pub struct Decision {
    pub view: Arc<View>,
    pub prompted: Prompted,
    pub tenant: String,
    pub tags: Tags,
    pub backend: Option<String>,
    /// `policy/rule` of the rule that applied (`None`: the default rule).
    pub rule: Option<String>,
    pub objective: Objective,
    pub candidates: Vec<Candidate>,
    pub outcome: Outcome,
    /// The model the body must name, when it differs from the requested one.
    pub rewrite_model: Option<String>,
    /// Each stage's words (Explain only).
    pub steps: Vec<String>,
}

impl Decision {
    pub fn chosen(&self) -> Option<&Candidate> {
        match self.outcome {
            Outcome::Routed(i) => self.candidates.get(i),
            Outcome::Rejected { .. } => None,
        }
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
    /// Runs stages 1-8 for `req` (admission is the caller's, Route only).
    pub(crate) fn decide(&self, req: &RouteRequest, mode: Mode) -> Decision {
        let explain = mode == Mode::Explain;
        let view = self.state.load();
        let mut d = Decision {
            view: view.clone(),
            prompted: Prompted::unreadable(req),
            tenant: req.tenant.clone(),
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
            rewrite_model: None,
            steps: Vec::new(),
        };
        // Explain's words, formatted only for Explain.
        let step = |d: &mut Decision, s: &dyn Fn() -> String| {
            if explain {
                d.steps.push(s());
            }
        };
        // 1. prompt: what the request says; its tokens once its model resolved
        let fields = match prompt::fields(req) {
            Ok(f) => f,
            Err(e) => return d.refuse(Reject::InvalidRequest, e.to_string(), explain),
        };
        d.prompted.model = fields.model.clone();
        // 2. resolve
        let catalog = view.catalog.as_ref();
        let resolved = match resolve::resolve(catalog, &fields.model) {
            Ok(r) => r,
            Err((kind, reason)) => return d.refuse(kind.into(), reason, explain),
        };
        d.prompted = match prompt::prompt(
            req,
            fields,
            &view,
            &self.tokenizers,
            &resolved.sets,
            explain,
        ) {
            Ok(p) => p,
            Err(e) => return d.refuse(Reject::InvalidRequest, e.to_string(), explain),
        };
        let p = d.prompted.clone();
        step(&mut d, &|| {
            format!(
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
            )
        });
        if explain {
            d.steps.extend(resolve::describe(&p.model, &resolved));
        }
        d.backend = resolved.backend.map(|(n, _)| n.to_owned());
        let tenant = resolve::tenant(req, &resolved);
        d.tenant = tenant.clone();
        // 3. classify
        let read: Vec<&str> = kvplane_policy::Catalog::tags_read(&resolved).collect();
        let tags = classify::classify(
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
        for (t, s) in tags.tags.iter().zip(&tags.sources) {
            step(&mut d, &|| format!("tag {t} from {s}"));
        }
        d.tags = tags.clone();
        let preq = kvplane_policy::Request {
            tenant: &tenant,
            model: &p.model,
            tags: &tags.tags,
            prompt_tokens: p.prompt_tokens(),
            max_output_tokens: req.max_output_tokens,
            tie_break: pick::tie_break(&req.request_id),
        };
        let fleet = signals::ViewFleet::new(
            &view,
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
            tenant = %tenant,
            model = %p.model,
            rule = tracing::field::Empty,
            candidates = tracing::field::Empty
        );
        let _in = span.enter();
        let choice = rule::rule(catalog, &resolved, &fleet, &preq);
        let rule = choice.rule;
        d.rule = choice.id.map(|_| choice.name());
        d.objective = rule.minimize;
        if let Some(r) = &d.rule {
            span.record("rule", tracing::field::display(r));
        }
        step(&mut d, &|| rule::describe(&choice));
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
        if cands.is_empty() && rule.on_empty.action != kvplane_policy::kinds::EmptyAction::Fallback
        {
            d.candidates = cands;
            return d.refuse(
                Reject::NoCapacity,
                format!("model {:?} has no workers", p.model),
                explain,
            );
        }
        // 6. filter
        let words = filter::filter(catalog, &fleet, &preq, &resolved, rule, signals, &mut cands);
        if explain {
            d.steps.extend(words);
        }
        // 7. score, 8. pick
        score::score(rule.minimize, &mut cands);
        let picked = pick::pick(&mut cands, &req.request_id);
        if let Some(i) = picked
            && !signals.prediction
        {
            // The rule read no prediction, but the predictor's queues and the answer need the
            // chosen worker's: computed for it alone.
            signals::complete(&fleet, catalog, &mut cands[i]);
        }
        drop(_in);
        d.candidates = cands;
        match picked {
            Some(i) => {
                if explain {
                    let c = &d.candidates[i];
                    let line = format!(
                        "chose {} (minimize {:?}: {:.3})",
                        kvplane_policy::target_name(&c.target),
                        rule.minimize,
                        c.objective
                    );
                    d.steps.push(line);
                }
                let c = &d.candidates[i];
                d.rewrite_model =
                    (!c.model.is_empty() && *c.model != *p.model).then(|| c.model.to_string());
                if explain && let Some(m) = &d.rewrite_model {
                    d.steps.push(format!("body model rewritten to {m:?}"));
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
                if no_worker_up && choice.id.is_none() {
                    let reason = format!("model {:?} has no worker that is up", p.model);
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
