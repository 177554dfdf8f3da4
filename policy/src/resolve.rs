//! From the requested model to what may serve it: the backend that publishes it, the worker
//! sets behind it (with their weights), the policies attached to it in order, the rule that
//! applies, and that rule's candidates. Pure: the live fleet comes in through [`Fleet`].
//!
//! Attachment: a request for a public model is under its backend's policies, in order, and its
//! backend's tag headers, taggers and tenant header. A request naming a served model directly
//! (or no model) is under the one backend that serves it, as if it had named the backend's
//! public model; when several backends serve it the request is ambiguous and refused - unless
//! the operator attached policies to that model itself (`appliesToModels`), which then decide.
//! Either way, the policies whose `appliesToModels` names the requested model follow the
//! backend's. No other policy applies, so naming the model never escapes a backend's policies.

use std::collections::BTreeMap;
use std::sync::LazyLock;

use crate::candidate::{Candidate, Fleet, Prediction, RejectKind, Signals, Target, WorkerState};
use crate::catalog::Catalog;
use crate::kinds::{GatewayBackendSpec, InferencePolicySpec, Match, Objective, Rule, Targets};

/// What a decision knows about the request.
#[derive(Debug, Clone, Copy)]
pub struct Request<'a> {
    pub tenant: &'a str,
    /// The model the client asked for (possibly a public alias).
    pub model: &'a str,
    /// Its tags: the request's own, mapped headers', and the taggers'.
    pub tags: &'a [String],
    pub prompt_tokens: u32,
    pub max_output_tokens: u32,
    /// Spreads near-equal candidates (see [`crate::pick`]): a hash of the request id.
    pub tie_break: u64,
    /// Only workers at these `host:port` endpoints may be chosen (empty: any); see
    /// [`crate::filters::ENDPOINT_SUBSET`].
    pub endpoint_subset: &'a [String],
    /// Where the asking gateway is, and the network time from there (see [`crate::locality`]).
    pub origin: &'a crate::Origin,
}

#[cfg(test)]
static NOWHERE: crate::Origin = crate::Origin {
    cluster: None,
    region: None,
    zone: None,
    rtt_ms: BTreeMap::new(),
    default_rtt_ms: 0.0,
    measure_rtt: false,
};

#[cfg(test)]
impl Request<'static> {
    /// A request for model `m` with nothing else said, for tests.
    pub(crate) fn for_tests() -> Self {
        Self {
            tenant: "",
            model: "m",
            tags: &[],
            prompt_tokens: 0,
            max_output_tokens: 0,
            tie_break: 0,
            endpoint_subset: &[],
            origin: &NOWHERE,
        }
    }
}

/// Why a policy applies to a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Via<'a> {
    /// The backend lists it.
    Backend(&'a str),
    /// Its `appliesToModels` names the requested model.
    Model,
}

#[derive(Debug, Clone, Copy)]
pub struct Attached<'a> {
    pub name: &'a str,
    pub spec: &'a InferencePolicySpec,
    pub via: Via<'a>,
}

/// A worker set behind the requested model.
#[derive(Debug, Clone, PartialEq)]
pub struct SetRef {
    /// The backend weight its candidates' objective is divided by.
    pub weight: f64,
    /// The model it runs the request as: the last name of the alias chain that led to it (a
    /// LoRA adapter keeps its name), or the requested one.
    pub model: String,
}

/// The requested model, resolved.
#[derive(Debug, Clone)]
pub struct Resolved<'a> {
    /// The backend whose policies, taggers and tenant header apply: the one publishing the
    /// requested model, or the only one serving it.
    pub backend: Option<(&'a str, &'a GatewayBackendSpec)>,
    /// Whether the request named `backend`'s public model (not a model it serves).
    pub published: bool,
    /// The worker sets behind the model.
    pub sets: BTreeMap<String, SetRef>,
    /// The policies that apply, in order.
    pub policies: Vec<Attached<'a>>,
}

/// The rule that applies: `policy/rule`, or the default rule.
#[derive(Debug, Clone, Copy)]
pub struct RuleChoice<'a> {
    pub id: Option<(&'a str, &'a str)>,
    pub rule: &'a Rule,
}

impl RuleChoice<'_> {
    /// `policy/rule`, or `default`.
    pub fn name(&self) -> String {
        match self.id {
            Some((p, r)) => format!("{p}/{r}"),
            None => "default".into(),
        }
    }
}

static DEFAULT_RULE: LazyLock<Rule> = LazyLock::new(|| Rule {
    name: "default".into(),
    matches: Match::default(),
    candidates: Targets::default(),
    filter: Default::default(),
    on_empty: Default::default(),
    minimize: Objective::PredictedTTFT,
});

impl Catalog {
    /// Worker sets behind a requested model: a backend's targets (aliases followed), else the
    /// worker sets serving it.
    fn model_sets(&self, model: &str, weight: f64, depth: u32, out: &mut BTreeMap<String, SetRef>) {
        if depth > 16 {
            return;
        }
        fn add(out: &mut BTreeMap<String, SetRef>, ws: &str, weight: f64, model: String) {
            out.entry(ws.to_owned()).or_insert(SetRef { weight, model });
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
                        add(out, ws, w, self.served_model(ws, ""));
                    }
                }
                if let Some(ws) = &t.worker_set {
                    add(out, ws, w, self.served_model(ws, ""));
                }
                if let Some(m) = &t.model {
                    self.model_sets(m, w, depth + 1, out);
                }
            }
            return;
        }
        for name in self.worker_sets.keys() {
            if model.is_empty() || self.set_serves(name, model) {
                add(out, name, weight, self.served_model(name, model));
            }
        }
    }

    /// The backends whose targets serve `model` (every backend for no model).
    fn serving_backends(&self, model: &str) -> Vec<(&str, &GatewayBackendSpec)> {
        self.backends
            .iter()
            .filter(|(_, b)| {
                model.is_empty() || {
                    let mut behind = BTreeMap::new();
                    self.model_sets(&b.public_model, 1.0, 0, &mut behind);
                    behind.keys().any(|ws| self.set_serves(ws, model))
                }
            })
            .map(|(n, b)| (n.as_str(), b))
            .collect()
    }

    /// Resolves `model`; refuses a model nobody publishes or serves.
    pub fn resolve(&self, model: &str) -> Result<Resolved<'_>, (RejectKind, String)> {
        if !model.is_empty() && !self.knows_model(model) {
            return Err((
                RejectKind::UnknownModel,
                format!("no backend publishes and no worker set serves model {model:?}"),
            ));
        }
        let explicit = !model.is_empty()
            && self
                .policies
                .values()
                .any(|p| p.applies_to_models.iter().any(|m| m == model));
        let published = self.backend_for(model);
        let backend = match published {
            Some(b) => Some(b),
            None => match self.serving_backends(model).as_slice() {
                [] => None,
                [one] => Some(*one),
                _ if explicit => None,
                many => {
                    let names: Vec<&str> = many.iter().map(|(n, _)| *n).collect();
                    let what = if model.is_empty() {
                        "a request that names no model".to_owned()
                    } else {
                        format!("model {model:?}")
                    };
                    return Err((
                        RejectKind::Policy,
                        format!(
                            "{what} is served behind GatewayBackends {}: ask for one of their public models (or attach policies to the model with appliesToModels)",
                            names.join(", ")
                        ),
                    ));
                }
            },
        };
        let mut sets = BTreeMap::new();
        self.model_sets(model, 1.0, 0, &mut sets);
        let mut policies: Vec<Attached<'_>> = Vec::new();
        if let Some((bname, b)) = backend {
            for p in &b.policies {
                if let Some((n, spec)) = self.policies.get_key_value(p)
                    && !policies.iter().any(|a| a.name == n)
                {
                    policies.push(Attached {
                        name: n,
                        spec,
                        via: Via::Backend(bname),
                    });
                }
            }
        }
        for (n, spec) in &self.policies {
            if !model.is_empty()
                && spec.applies_to_models.iter().any(|m| m == model)
                && !policies.iter().any(|a| a.name == n)
            {
                policies.push(Attached {
                    name: n,
                    spec,
                    via: Via::Model,
                });
            }
        }
        Ok(Resolved {
            backend,
            published: published.is_some(),
            sets,
            policies,
        })
    }

    fn pool_state_holds<'v>(&self, fleet: &dyn Fleet<'v>, m: &Match) -> bool {
        m.pool_state.iter().all(|c| {
            let mut up: Vec<WorkerState<'v>> = Vec::new();
            for ws in self
                .pools
                .get(&c.pool)
                .map(|p| p.worker_sets.as_slice())
                .unwrap_or(&[])
            {
                fleet.workers(ws, Signals::NONE, &mut up);
            }
            up.retain(|w| w.up);
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

    fn rule_matches<'v>(&self, fleet: &dyn Fleet<'v>, req: &Request<'_>, m: &Match) -> bool {
        (m.tenants.is_empty() || m.tenants.iter().any(|t| t == req.tenant))
            && (m.models.is_empty() || m.models.iter().any(|x| x == req.model))
            && m.tags.iter().all(|t| req.tags.contains(t))
            && self.pool_state_holds(fleet, m)
    }

    /// The first rule of the attached policies whose `match` holds, else the default rule.
    pub fn select_rule<'a, 'v>(
        &'a self,
        resolved: &Resolved<'a>,
        fleet: &dyn Fleet<'v>,
        req: &Request<'_>,
    ) -> RuleChoice<'a> {
        for a in &resolved.policies {
            for r in &a.spec.rules {
                if self.rule_matches(fleet, req, &r.matches) {
                    return RuleChoice {
                        id: Some((a.name, r.name.as_str())),
                        rule: r,
                    };
                }
            }
        }
        RuleChoice {
            id: None,
            rule: &DEFAULT_RULE,
        }
    }

    /// The tags any rule of these policies matches on (taggers whose tags no rule reads need
    /// not run).
    pub fn tags_read<'a>(resolved: &Resolved<'a>) -> impl Iterator<Item = &'a str> + 'a {
        let policies = resolved.policies.clone();
        policies.into_iter().flat_map(|a| {
            a.spec
                .rules
                .iter()
                .flat_map(|r| r.matches.tags.iter().map(String::as_str))
        })
    }

    /// The worker sets of `targets`, each once, pools first.
    fn target_sets<'a>(&'a self, targets: &'a Targets) -> Vec<&'a str> {
        let mut sets: Vec<&str> = Vec::new();
        for p in &targets.pools {
            for ws in self
                .pools
                .get(p)
                .map(|p| p.worker_sets.as_slice())
                .unwrap_or(&[])
            {
                if !sets.contains(&ws.as_str()) {
                    sets.push(ws);
                }
            }
        }
        for ws in &targets.worker_sets {
            if !sets.contains(&ws.as_str()) {
                sets.push(ws);
            }
        }
        sets
    }

    /// The candidates of a rule (its `candidates`, else the model's worker sets), or of its
    /// fallback, with the signals asked for. Their names are the catalog's and the fleet's.
    pub fn candidates<'v>(
        &'v self,
        fleet: &dyn Fleet<'v>,
        req: &Request<'_>,
        resolved: &Resolved<'_>,
        targets: &Targets,
        fallback: bool,
        signals: Signals,
    ) -> Vec<Candidate<'v>> {
        let sets = if targets.is_empty() && !fallback {
            resolved.sets.keys().map(String::as_str).collect()
        } else {
            self.target_sets(targets)
        };
        let mut out = Vec::new();
        let mut workers = Vec::new();
        for name in sets {
            let Some((name, spec)) = self.worker_sets.get_key_value(name) else {
                continue;
            };
            let weight = resolved.sets.get(name).map_or(1.0, |s| s.weight);
            let price = spec
                .cost
                .map_or(0.0, |c| c.of(req.prompt_tokens, req.max_output_tokens));
            let network_ms = req.origin.network_ms(&spec.labels);
            fleet.workers(name, signals, &mut workers);
            out.reserve(workers.len());
            for w in workers.drain(..) {
                let prediction = Prediction {
                    network_ms,
                    ..if signals.prediction {
                        fleet.predict(name, spec, &w)
                    } else {
                        Prediction::default()
                    }
                };
                out.push(Candidate {
                    external: false,
                    prediction,
                    price,
                    load: w.waiting + w.running,
                    weight,
                    objective: 0.0,
                    filtered: None,
                    fallback,
                    chosen: false,
                    target: Target::Worker {
                        worker_set: name,
                        state: w,
                    },
                });
            }
        }
        for name in &targets.providers {
            let Some((name, p)) = self.providers.get_key_value(name) else {
                continue;
            };
            out.push(Candidate {
                target: Target::Provider {
                    name,
                    endpoint: &p.endpoint,
                },
                external: true,
                prediction: Prediction {
                    ttft_ms: p.expected_ttft_ms,
                    ..Prediction::default()
                },
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

    /// The model `c` serves the request as (what the body must name when it wins): for a
    /// worker, the one its set runs the request as (see [`SetRef::model`]), else what the set
    /// serves `requested` as; for a provider, the provider's.
    pub fn model_of(&self, c: &Candidate<'_>, resolved: &Resolved<'_>, requested: &str) -> String {
        match &c.target {
            Target::Worker { worker_set, .. } => resolved.sets.get(*worker_set).map_or_else(
                || self.served_model(worker_set, requested),
                |s| s.model.clone(),
            ),
            Target::Provider { name, .. } => self
                .providers
                .get(*name)
                .map(|p| p.model.clone())
                .unwrap_or_default(),
        }
    }
}
