//! Rule evaluation: which rule applies to a request, which candidates survive its filter, what
//! happens when none does, which one wins, and the model name the body is rewritten to. Pure:
//! the live state comes in through [`Fleet`].

use std::collections::BTreeMap;

use crate::catalog::Catalog;
use crate::kinds::{
    EmptyAction, Filter, InferencePolicySpec, InferenceWorkerSetSpec, Labels, Match, Objective,
    Rule, Targets,
};

/// What evaluation needs to know about the request.
#[derive(Debug, Clone, Copy)]
pub struct Request<'a> {
    pub tenant: &'a str,
    /// The model the client asked for (possibly a public alias).
    pub model: &'a str,
    pub tags: &'a [String],
    pub prompt_tokens: u32,
    pub max_output_tokens: u32,
    /// Spreads near-equal candidates (within 1% of the best): among them the request takes
    /// the one this picks, so that routers deciding from the same state at once do not all
    /// choose the same worker. A hash of the request id.
    pub tie_break: u64,
}

/// Candidates whose objective is within this share of the best one count as equal.
const TIE: f64 = 0.01;

/// One worker of a worker set as the replicated state shows it, with this prompt's overlap.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkerState {
    pub worker: String,
    pub address: Option<String>,
    pub up: bool,
    pub dp_rank: u32,
    pub waiting: u32,
    pub running: u32,
    pub kv_cache_usage: f64,
    pub overlap_blocks: u32,
    pub prompt_blocks: u32,
    /// Requests this replica sent here that have not had their first token yet (counted in
    /// `waiting` too), and how long until the last of them is predicted to have it.
    pub pending: u32,
    pub pending_ms: f64,
}

/// The live fleet, as the caller (the routing service) sees it.
pub trait Fleet {
    /// Every worker of `worker_set`, in a stable order, with the prompt's cached prefix on each.
    fn workers(&self, worker_set: &str) -> Vec<WorkerState>;
    /// Predicted time to first token on `w` of worker set `name`, in milliseconds.
    fn predict_ms(&self, name: &str, set: &InferenceWorkerSetSpec, w: &WorkerState) -> f64;
    /// How much sending the request to `w` would delay the requests that come after it there
    /// (its uncached prefill, which they wait behind). `minimize: PredictedTTFT` minimizes the
    /// sum, so that a cached prefix is not given away for a slightly shorter queue.
    fn displaced_ms(&self, _name: &str, _set: &InferenceWorkerSetSpec, _w: &WorkerState) -> f64 {
        0.0
    }
}

#[derive(Debug, Clone, PartialEq)]
pub enum Target {
    Worker {
        worker_set: String,
        state: WorkerState,
    },
    Provider {
        name: String,
        endpoint: String,
    },
}

/// One candidate and what evaluation made of it.
#[derive(Debug, Clone, PartialEq)]
pub struct Candidate {
    pub target: Target,
    /// The model it serves (what the body is rewritten to when it wins).
    pub model: String,
    pub external: bool,
    pub predicted_ttft_ms: f64,
    /// What it would cost the requests after it there (see [`Fleet::displaced_ms`]).
    pub displaced_ms: f64,
    /// Token price of this request on it.
    pub price: f64,
    pub load: u32,
    /// The backend weight the objective is divided by.
    pub weight: f64,
    pub objective: f64,
    /// Why it was filtered out; `None` when it survived.
    pub filtered: Option<String>,
    pub fallback: bool,
    pub chosen: bool,
}

/// Why no candidate was picked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RejectKind {
    /// No backend publishes and no worker set serves the model.
    UnknownModel,
    /// The model is known but has no worker that is up.
    NoCapacity,
    /// A rule's filter (and its fallback) left nothing, and the rule rejects.
    Policy,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Evaluation {
    /// The backend the requested model resolved through.
    pub backend: Option<String>,
    /// `policy/rule` of the rule that applied (`None`: the default rule).
    pub rule: Option<String>,
    pub objective: Objective,
    pub candidates: Vec<Candidate>,
    pub outcome: Result<usize, (RejectKind, String)>,
    /// The model the body must name, when it differs from the requested one.
    pub rewrite_model: Option<String>,
    pub steps: Vec<String>,
}

impl Evaluation {
    pub fn chosen(&self) -> Option<&Candidate> {
        self.outcome.as_ref().ok().map(|i| &self.candidates[*i])
    }
}

/// A worker set a request may go to, with its backend weight.
type Sets = BTreeMap<String, f64>;

impl Catalog {
    /// Worker sets behind a requested model: a backend's targets (aliases followed), else the
    /// worker sets serving it.
    fn model_sets(&self, model: &str, weight: f64, depth: u32, out: &mut Sets) {
        if depth > 16 {
            return;
        }
        if let Some((_, b)) = self.backend_for(model) {
            for t in &b.backends {
                let w = weight * t.weight;
                if let Some(p) = &t.pool {
                    for ws in self
                        .pools
                        .get(p)
                        .map(|p| p.worker_sets.as_slice())
                        .unwrap_or(&[])
                    {
                        out.entry(ws.clone()).or_insert(w);
                    }
                }
                if let Some(ws) = &t.worker_set {
                    out.entry(ws.clone()).or_insert(w);
                }
                if let Some(m) = &t.model {
                    self.model_sets(m, w, depth + 1, out);
                }
            }
            return;
        }
        for (name, ws) in &self.worker_sets {
            if model.is_empty() || ws.serves(model) {
                out.entry(name.clone()).or_insert(weight);
            }
        }
    }

    fn pool_state_holds(&self, fleet: &dyn Fleet, m: &Match) -> bool {
        m.pool_state.iter().all(|c| {
            let up: Vec<WorkerState> = self
                .pools
                .get(&c.pool)
                .map(|p| p.worker_sets.as_slice())
                .unwrap_or(&[])
                .iter()
                .flat_map(|ws| fleet.workers(ws))
                .filter(|w| w.up)
                .collect();
            let n = up.len() as f64;
            let mean = |f: fn(&WorkerState) -> f64| {
                if up.is_empty() {
                    0.0
                } else {
                    up.iter().map(f).sum::<f64>() / n
                }
            };
            c.min_up_workers.is_none_or(|min| up.len() >= min as usize)
                && c.max_average_waiting
                    .is_none_or(|max| mean(|w| f64::from(w.waiting)) <= max)
                && c.max_average_kv_cache_usage
                    .is_none_or(|max| mean(|w| w.kv_cache_usage) <= max)
        })
    }

    fn rule_matches(&self, fleet: &dyn Fleet, req: &Request<'_>, m: &Match) -> bool {
        (m.tenants.is_empty() || m.tenants.iter().any(|t| t == req.tenant))
            && (m.models.is_empty() || m.models.iter().any(|x| x == req.model))
            && m.tags.iter().all(|t| req.tags.contains(t))
            && self.pool_state_holds(fleet, m)
    }

    /// The policies that apply, in order: a backend's own list (none: the default rule), or,
    /// for a model addressed directly, every policy by name.
    fn policies_for<'a>(
        &'a self,
        backend: Option<&'a crate::kinds::GatewayBackendSpec>,
    ) -> Vec<(&'a str, &'a InferencePolicySpec)> {
        match backend {
            Some(b) => b
                .policies
                .iter()
                .filter_map(|n| self.policies.get_key_value(n))
                .map(|(n, p)| (n.as_str(), p))
                .collect(),
            _ => self.policies.iter().map(|(n, p)| (n.as_str(), p)).collect(),
        }
    }

    fn candidates(
        &self,
        fleet: &dyn Fleet,
        req: &Request<'_>,
        targets: &Targets,
        weights: &Sets,
        fallback: bool,
    ) -> Vec<Candidate> {
        let mut sets: Vec<String> = Vec::new();
        for p in &targets.pools {
            for ws in self
                .pools
                .get(p)
                .map(|p| p.worker_sets.as_slice())
                .unwrap_or(&[])
            {
                if !sets.contains(ws) {
                    sets.push(ws.clone());
                }
            }
        }
        for ws in &targets.worker_sets {
            if !sets.contains(ws) {
                sets.push(ws.clone());
            }
        }
        let mut out = Vec::new();
        for name in &sets {
            let Some(spec) = self.worker_sets.get(name) else {
                continue;
            };
            let weight = weights.get(name).copied().unwrap_or(1.0);
            for w in fleet.workers(name) {
                let predicted = fleet.predict_ms(name, spec, &w);
                let displaced_ms = fleet.displaced_ms(name, spec, &w);
                out.push(Candidate {
                    model: spec.model.clone(),
                    external: false,
                    predicted_ttft_ms: predicted,
                    displaced_ms,
                    price: spec
                        .cost
                        .map_or(0.0, |c| c.of(req.prompt_tokens, req.max_output_tokens)),
                    load: w.waiting + w.running,
                    weight,
                    objective: 0.0,
                    filtered: (!w.up).then(|| "worker is down".to_owned()),
                    fallback,
                    chosen: false,
                    target: Target::Worker {
                        worker_set: name.clone(),
                        state: w,
                    },
                });
            }
        }
        for name in &targets.providers {
            let Some(p) = self.providers.get(name) else {
                continue;
            };
            out.push(Candidate {
                target: Target::Provider {
                    name: name.clone(),
                    endpoint: p.endpoint.clone(),
                },
                model: p.model.clone(),
                external: true,
                predicted_ttft_ms: p.expected_ttft_ms,
                displaced_ms: 0.0,
                price: p
                    .cost
                    .map_or(0.0, |c| c.of(req.prompt_tokens, req.max_output_tokens)),
                load: 0,
                weight: 1.0,
                objective: 0.0,
                filtered: None,
                fallback,
                chosen: false,
            });
        }
        out
    }

    fn labels_of(&self, c: &Candidate) -> Option<&Labels> {
        match &c.target {
            Target::Worker { worker_set, .. } => {
                self.worker_sets.get(worker_set).map(|w| &w.labels)
            }
            Target::Provider { name, .. } => self.providers.get(name).map(|p| &p.labels),
        }
    }

    /// Marks candidates `f` removes; `load_limits` applies the queue and cache filters (not to
    /// fallbacks, which exist for when the fleet is busy).
    fn filter(&self, cands: &mut [Candidate], f: &Filter, load_limits: bool) {
        for c in cands.iter_mut().filter(|c| c.filtered.is_none()) {
            let why = if f.exclude_external && c.external {
                Some("external providers are excluded".to_owned())
            } else if let Some((k, v)) = f
                .labels
                .iter()
                .find(|(k, v)| self.labels_of(c).and_then(|l| l.get(*k)) != Some(*v))
            {
                Some(format!("label {k}={v} does not match"))
            } else if let (true, Target::Worker { state, .. }) = (load_limits, &c.target) {
                if let Some(max) = f.max_queued.filter(|m| state.waiting > *m) {
                    Some(format!("{} queued > maxQueued {max}", state.waiting))
                } else {
                    f.max_kv_cache_usage
                        .filter(|m| state.kv_cache_usage > *m)
                        .map(|max| {
                            format!(
                                "KV cache {:.0}% > maxKvCacheUsage {:.0}%",
                                state.kv_cache_usage * 100.0,
                                max * 100.0
                            )
                        })
                }
            } else {
                None
            };
            c.filtered = why;
        }
    }

    /// Evaluates `req` against this catalog and the live `fleet`.
    pub fn evaluate(&self, fleet: &dyn Fleet, req: &Request<'_>) -> Evaluation {
        let mut steps = Vec::new();
        let backend = self.backend_for(req.model);
        let mut weights = Sets::new();
        self.model_sets(req.model, 1.0, 0, &mut weights);
        match backend {
            Some((name, _)) => steps.push(format!(
                "model {:?} is published by GatewayBackend {name}: worker sets {:?}",
                req.model,
                weights.keys().collect::<Vec<_>>()
            )),
            None => steps.push(format!(
                "model {:?} is served by worker sets {:?}",
                req.model,
                weights.keys().collect::<Vec<_>>()
            )),
        }
        if !req.model.is_empty() && !self.knows_model(req.model) {
            let reason = format!(
                "no backend publishes and no worker set serves model {:?}",
                req.model
            );
            steps.push(reason.clone());
            return Evaluation {
                backend: None,
                rule: None,
                objective: Objective::PredictedTTFT,
                candidates: Vec::new(),
                outcome: Err((RejectKind::UnknownModel, reason)),
                rewrite_model: None,
                steps,
            };
        }
        let default_rule = Rule {
            name: "default".into(),
            matches: Match::default(),
            candidates: Targets::default(),
            filter: Filter::default(),
            on_empty: Default::default(),
            minimize: Objective::PredictedTTFT,
        };
        let mut rule_id = None;
        let mut rule = &default_rule;
        'found: for (pname, p) in self.policies_for(backend.map(|(_, b)| b)) {
            for r in &p.rules {
                if self.rule_matches(fleet, req, &r.matches) {
                    rule_id = Some(format!("{pname}/{}", r.name));
                    rule = r;
                    break 'found;
                }
            }
        }
        match &rule_id {
            Some(id) => steps.push(format!("rule {id} applies")),
            None => steps.push("no rule matches: the default rule (minimize PredictedTTFT)".into()),
        }
        let targets = if rule.candidates.is_empty() {
            Targets {
                worker_sets: weights.keys().cloned().collect(),
                ..Targets::default()
            }
        } else {
            rule.candidates.clone()
        };
        let mut cands = self.candidates(fleet, req, &targets, &weights, false);
        if cands.is_empty() {
            let kind = RejectKind::NoCapacity;
            let reason = format!("model {:?} has no workers", req.model);
            steps.push(reason.clone());
            return Evaluation {
                backend: backend.map(|(n, _)| n.to_owned()),
                rule: rule_id,
                objective: rule.minimize,
                candidates: cands,
                outcome: Err((kind, reason)),
                rewrite_model: None,
                steps,
            };
        }
        self.filter(&mut cands, &rule.filter, true);
        let survivors = cands.iter().filter(|c| c.filtered.is_none()).count();
        steps.push(format!(
            "{survivors} of {} candidates pass the filter",
            cands.len()
        ));
        if survivors == 0 && rule.on_empty.action == EmptyAction::Fallback {
            let mut fb = self.candidates(fleet, req, &rule.on_empty.fallback, &weights, true);
            self.filter(&mut fb, &rule.filter, false);
            steps.push(format!(
                "nothing left: falling back to {} candidates ({} pass)",
                fb.len(),
                fb.iter().filter(|c| c.filtered.is_none()).count()
            ));
            cands.extend(fb);
        }
        for c in &mut cands {
            let raw = match rule.minimize {
                Objective::PredictedTTFT => c.predicted_ttft_ms + c.displaced_ms,
                Objective::Cost => c.price,
                Objective::Load => f64::from(c.load),
            };
            c.objective = raw / c.weight;
        }
        let best = cands
            .iter()
            .filter(|c| c.filtered.is_none())
            .map(|c| c.objective)
            .min_by(f64::total_cmp)
            .and_then(|b| {
                let near: Vec<usize> = cands
                    .iter()
                    .enumerate()
                    .filter(|(_, c)| {
                        c.filtered.is_none()
                            && (c.objective == b || (b > 0.0 && c.objective <= b * (1.0 + TIE)))
                    })
                    .map(|(i, _)| i)
                    .collect();
                let k = usize::try_from(req.tie_break % near.len().max(1) as u64).unwrap_or(0);
                near.get(k).copied()
            });
        let outcome = match best {
            Some(i) => {
                cands[i].chosen = true;
                steps.push(format!(
                    "chose {} (minimize {:?}: {:.3})",
                    target_name(&cands[i].target),
                    rule.minimize,
                    cands[i].objective
                ));
                Ok(i)
            }
            None => {
                let no_worker_up = cands
                    .iter()
                    .all(|c| c.filtered.as_deref() == Some("worker is down"));
                let reason = if no_worker_up && rule_id.is_none() {
                    format!("model {:?} has no worker that is up", req.model)
                } else {
                    rule.on_empty.reason.clone().unwrap_or_else(|| {
                        format!(
                            "rule {} left no candidate",
                            rule_id.as_deref().unwrap_or("default")
                        )
                    })
                };
                steps.push(format!("rejected: {reason}"));
                let kind = if no_worker_up && rule_id.is_none() {
                    RejectKind::NoCapacity
                } else {
                    RejectKind::Policy
                };
                Err((kind, reason))
            }
        };
        let rewrite_model = outcome
            .as_ref()
            .ok()
            .map(|i| &cands[*i].model)
            .filter(|m| m.as_str() != req.model)
            .cloned();
        if let Some(m) = &rewrite_model {
            steps.push(format!("body model rewritten to {m:?}"));
        }
        Evaluation {
            backend: backend.map(|(n, _)| n.to_owned()),
            rule: rule_id,
            objective: rule.minimize,
            candidates: cands,
            outcome,
            rewrite_model,
            steps,
        }
    }
}

/// `worker_set/worker` or `provider:name`.
pub fn target_name(t: &Target) -> String {
    match t {
        Target::Worker { worker_set, state } => format!("{worker_set}/{}", state.worker),
        Target::Provider { name, .. } => format!("provider:{name}"),
    }
}
