//! A consistent set of policy objects, and every way it can be inconsistent.

use std::collections::{BTreeMap, BTreeSet};

use crate::kinds::{
    AccessPolicySpec, EmptyAction, GatewayBackendSpec, InferencePolicySpec, InferencePoolSpec,
    InferenceProviderSpec, InferenceWorkerSetSpec, Rule, Targets,
};
use crate::object::{Kind, Object, Spec};

/// Every object by kind and name (sorted: iteration is deterministic).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Catalog {
    pub worker_sets: BTreeMap<String, InferenceWorkerSetSpec>,
    pub pools: BTreeMap<String, InferencePoolSpec>,
    pub providers: BTreeMap<String, InferenceProviderSpec>,
    pub policies: BTreeMap<String, InferencePolicySpec>,
    pub backends: BTreeMap<String, GatewayBackendSpec>,
    /// Who may call what (no routing object: [`Catalog::is_empty`] leaves them out).
    pub access: BTreeMap<String, AccessPolicySpec>,
    /// Worker sets that are pools of the nodes' own config (`[[pools]]`, `Admin.PutConfig` of
    /// a `pool`), with the models each serves (empty: every model). They route like any worker
    /// set but are no policy objects: [`Catalog::objects`] leaves them out, so the policy
    /// sources never see them.
    pub config_pools: BTreeMap<String, Vec<String>>,
}

/// One inconsistency, located by object and field path.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Problem {
    pub kind: Kind,
    pub name: String,
    pub path: String,
    pub message: String,
}

impl std::fmt::Display for Problem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}/{} {}: {}",
            self.kind, self.name, self.path, self.message
        )
    }
}

pub struct Check<'a> {
    pub(crate) kind: Kind,
    pub(crate) name: &'a str,
    pub(crate) out: &'a mut Vec<Problem>,
}

impl Check<'_> {
    pub fn fail(&mut self, path: impl Into<String>, message: impl Into<String>) {
        self.out.push(Problem {
            kind: self.kind,
            name: self.name.to_owned(),
            path: path.into(),
            message: message.into(),
        });
    }

    fn positive(&mut self, path: &str, v: f64) {
        if !(v.is_finite() && v > 0.0) {
            self.fail(path, format!("must be a positive number, got {v}"));
        }
    }

    fn fraction(&mut self, path: &str, v: f64) {
        if !(0.0..=1.0).contains(&v) {
            self.fail(path, format!("must be within 0..1, got {v}"));
        }
    }
}

impl Catalog {
    /// Whether it holds no policy object (config pools aside).
    pub fn is_empty(&self) -> bool {
        self.worker_sets.len() == self.config_pools.len()
            && self.pools.is_empty()
            && self.providers.is_empty()
            && self.policies.is_empty()
            && self.backends.is_empty()
    }

    /// Adds `o`, replacing an object of the same kind and name; returns whether it replaced one.
    pub fn insert(&mut self, o: Object) -> bool {
        let name = o.name;
        match o.spec {
            Spec::WorkerSet(s) => self.worker_sets.insert(name, s).is_some(),
            Spec::Pool(s) => self.pools.insert(name, s).is_some(),
            Spec::Provider(s) => self.providers.insert(name, s).is_some(),
            Spec::Policy(s) => self.policies.insert(name, s).is_some(),
            Spec::Backend(s) => self.backends.insert(name, s).is_some(),
            Spec::Access(s) => self.access.insert(name, s).is_some(),
        }
    }

    /// The object of `kind` named `name`.
    pub fn get(&self, kind: Kind, name: &str) -> Option<Object> {
        let spec = match kind {
            Kind::WorkerSet => self.worker_sets.get(name).cloned().map(Spec::WorkerSet),
            Kind::Pool => self.pools.get(name).cloned().map(Spec::Pool),
            Kind::Provider => self.providers.get(name).cloned().map(Spec::Provider),
            Kind::Policy => self.policies.get(name).cloned().map(Spec::Policy),
            Kind::Backend => self.backends.get(name).cloned().map(Spec::Backend),
            Kind::Access => self.access.get(name).cloned().map(Spec::Access),
        }?;
        Some(Object {
            name: name.to_owned(),
            spec,
        })
    }

    pub fn remove(&mut self, kind: Kind, name: &str) -> bool {
        match kind {
            Kind::WorkerSet => self.worker_sets.remove(name).is_some(),
            Kind::Pool => self.pools.remove(name).is_some(),
            Kind::Provider => self.providers.remove(name).is_some(),
            Kind::Policy => self.policies.remove(name).is_some(),
            Kind::Backend => self.backends.remove(name).is_some(),
            Kind::Access => self.access.remove(name).is_some(),
        }
    }

    /// Adds a config pool: a worker set of this block size serving `models` (empty: every
    /// model), with these LoRA adapters.
    pub fn put_config_pool(
        &mut self,
        name: &str,
        block_size: u32,
        models: &[String],
        lora_adapters: &[String],
    ) {
        self.worker_sets.insert(
            name.to_owned(),
            InferenceWorkerSetSpec {
                model: models.first().cloned().unwrap_or_default(),
                block_size,
                endpoints: Vec::new(),
                selector: None,
                inference_pool_ref: None,
                labels: Default::default(),
                cost: None,
                prefill_tokens_per_second: None,
                tokenizer: None,
                lora_adapters: lora_adapters.to_vec(),
            },
        );
        self.config_pools.insert(name.to_owned(), models.to_vec());
    }

    pub fn remove_config_pool(&mut self, name: &str) -> bool {
        let had = self.config_pools.remove(name).is_some();
        if had {
            self.worker_sets.remove(name);
        }
        had
    }

    /// Whether worker set `name` serves requests for `model`.
    pub fn set_serves(&self, name: &str, model: &str) -> bool {
        let Some(ws) = self.worker_sets.get(name) else {
            return false;
        };
        match self.config_pools.get(name) {
            Some(models) => {
                models.is_empty()
                    || models.iter().any(|m| m == model)
                    || ws.lora_adapters.iter().any(|a| a == model)
            }
            None => ws.serves(model),
        }
    }

    /// The models a client may name, each with its kind (`public`: a backend's public model;
    /// `served`: what a worker set, or a config pool listing its models, runs; `adapter`: a
    /// worker set's LoRA adapter), sorted; a name of several kinds has the first of these.
    pub fn model_names(&self) -> BTreeMap<&str, &'static str> {
        let mut out = BTreeMap::new();
        for b in self.backends.values() {
            out.insert(b.public_model.as_str(), "public");
        }
        for (name, ws) in &self.worker_sets {
            match self.config_pools.get(name) {
                Some(models) => {
                    for m in models {
                        out.entry(m.as_str()).or_insert("served");
                    }
                }
                None => {
                    out.entry(ws.model.as_str()).or_insert("served");
                }
            }
            for a in &ws.lora_adapters {
                out.entry(a.as_str()).or_insert("adapter");
            }
        }
        out
    }

    /// The model worker set `name` runs for a request naming `requested` (the body names it
    /// when it differs).
    pub fn served_model(&self, name: &str, requested: &str) -> String {
        let Some(ws) = self.worker_sets.get(name) else {
            return String::new();
        };
        if !requested.is_empty()
            && (ws.lora_adapters.iter().any(|a| a == requested)
                || self
                    .config_pools
                    .get(name)
                    .is_some_and(|m| m.is_empty() || m.iter().any(|m| m == requested)))
        {
            return requested.to_owned();
        }
        ws.model.clone()
    }

    /// Every object, kinds in dependency order (worker sets first), names sorted; config
    /// pools are left out.
    pub fn objects(&self) -> Vec<Object> {
        let mut out = Vec::new();
        for (n, s) in self
            .worker_sets
            .iter()
            .filter(|(n, _)| !self.config_pools.contains_key(*n))
        {
            out.push(Object {
                name: n.clone(),
                spec: Spec::WorkerSet(s.clone()),
            });
        }
        for (n, s) in &self.pools {
            out.push(Object {
                name: n.clone(),
                spec: Spec::Pool(s.clone()),
            });
        }
        for (n, s) in &self.providers {
            out.push(Object {
                name: n.clone(),
                spec: Spec::Provider(s.clone()),
            });
        }
        for (n, s) in &self.policies {
            out.push(Object {
                name: n.clone(),
                spec: Spec::Policy(s.clone()),
            });
        }
        for (n, s) in &self.backends {
            out.push(Object {
                name: n.clone(),
                spec: Spec::Backend(s.clone()),
            });
        }
        for (n, s) in &self.access {
            out.push(Object {
                name: n.clone(),
                spec: Spec::Access(s.clone()),
            });
        }
        out
    }

    /// What turns `self` into `desired`: objects to put (new or changed) and to delete.
    pub fn diff(&self, desired: &Catalog) -> (Vec<Object>, Vec<(Kind, String)>) {
        let mine = self.objects();
        let theirs = desired.objects();
        let puts = theirs
            .iter()
            .filter(|o| !mine.contains(o))
            .cloned()
            .collect();
        let deletes = mine
            .iter()
            .filter(|o| {
                !theirs
                    .iter()
                    .any(|t| t.kind() == o.kind() && t.name == o.name)
            })
            .map(|o| (o.kind(), o.name.clone()))
            .collect();
        (puts, deletes)
    }

    /// The backend whose public name is `model`.
    pub fn backend_for(&self, model: &str) -> Option<(&str, &GatewayBackendSpec)> {
        self.backends
            .iter()
            .find(|(_, b)| b.public_model == model)
            .map(|(n, b)| (n.as_str(), b))
    }

    /// Whether some worker set serves `model`, or some backend publishes it.
    pub fn knows_model(&self, model: &str) -> bool {
        self.worker_sets.keys().any(|n| self.set_serves(n, model))
            || self.backend_for(model).is_some()
    }

    /// Every inconsistency: values out of range, references that do not resolve, alias cycles,
    /// rules that can never apply. Sorted.
    pub fn problems(&self) -> Vec<Problem> {
        let mut out = Vec::new();
        for (name, ws) in self
            .worker_sets
            .iter()
            .filter(|(n, _)| !self.config_pools.contains_key(*n))
        {
            self.check_worker_set(
                &mut Check {
                    kind: Kind::WorkerSet,
                    name,
                    out: &mut out,
                },
                ws,
            );
        }
        for (name, p) in &self.pools {
            let mut c = Check {
                kind: Kind::Pool,
                name,
                out: &mut out,
            };
            if p.worker_sets.is_empty() {
                c.fail("spec.workerSets", "a pool needs at least one worker set");
            }
            for (i, ws) in p.worker_sets.iter().enumerate() {
                if !self.worker_sets.contains_key(ws) {
                    c.fail(
                        format!("spec.workerSets[{i}]"),
                        format!("InferenceWorkerSet {ws:?} does not exist"),
                    );
                }
            }
        }
        for (name, p) in &self.providers {
            let mut c = Check {
                kind: Kind::Provider,
                name,
                out: &mut out,
            };
            if !(p.endpoint.starts_with("http://") || p.endpoint.starts_with("https://")) {
                c.fail(
                    "spec.endpoint",
                    format!("{:?} is not an http(s) URL", p.endpoint),
                );
            }
            if p.model.is_empty() {
                c.fail("spec.model", "must not be empty");
            }
            c.positive("spec.expectedTtftMs", p.expected_ttft_ms);
            if p.region.as_deref().is_some_and(str::is_empty) {
                c.fail("spec.region", "must not be empty");
            }
            if p.api == crate::kinds::ProviderApi::Bedrock {
                if p.region().is_none() {
                    c.fail(
                        "spec.region",
                        "a Bedrock provider needs its AWS region (or an endpoint such as https://bedrock-runtime.us-east-1.amazonaws.com)",
                    );
                }
                if p.credentials.is_none() {
                    c.fail(
                        "spec.credentials",
                        "a Bedrock provider needs the Secret holding its AWS keys",
                    );
                }
            }
            if let Some(r) = &p.rate_limit {
                if r.requests_per_minute == Some(0) {
                    c.fail("spec.rateLimit.requestsPerMinute", "must be at least 1");
                }
                if r.tokens_per_minute == Some(0) {
                    c.fail("spec.rateLimit.tokensPerMinute", "must be at least 1");
                }
            }
            if let Some(cost) = &p.cost {
                cost_problems(&mut c, cost);
            }
        }
        for (name, p) in &self.policies {
            self.check_policy(
                &mut Check {
                    kind: Kind::Policy,
                    name,
                    out: &mut out,
                },
                p,
            );
        }
        self.check_limits(&mut out);
        self.check_access(&mut out);
        for (name, b) in &self.backends {
            self.check_backend(
                &mut Check {
                    kind: Kind::Backend,
                    name,
                    out: &mut out,
                },
                name,
                b,
            );
        }
        out.sort();
        out
    }

    fn check_worker_set(&self, c: &mut Check<'_>, ws: &InferenceWorkerSetSpec) {
        if ws.model.is_empty() {
            c.fail("spec.model", "must not be empty");
        }
        if !(1..=1024).contains(&ws.block_size) {
            c.fail(
                "spec.blockSize",
                format!("must be within 1..=1024, got {}", ws.block_size),
            );
        }
        let mut adapters = BTreeSet::new();
        for (i, a) in ws.lora_adapters.iter().enumerate() {
            if a.is_empty() || *a == ws.model {
                c.fail(
                    format!("spec.loraAdapters[{i}]"),
                    "must be a name other than the base model's",
                );
            }
            if !adapters.insert(a) {
                c.fail(
                    format!("spec.loraAdapters[{i}]"),
                    format!("{a:?} is listed twice"),
                );
            }
        }
        if ws.tokenizer.as_deref().is_some_and(str::is_empty) {
            c.fail("spec.tokenizer", "must be a directory path");
        }
        let mut seen = BTreeSet::new();
        for (i, e) in ws.endpoints.iter().enumerate() {
            if !crate::valid_object_name(&e.worker) {
                c.fail(
                    format!("spec.endpoints[{i}].worker"),
                    format!("{:?} is not a valid worker id", e.worker),
                );
            }
            if !seen.insert(&e.worker) {
                c.fail(
                    format!("spec.endpoints[{i}].worker"),
                    format!("{:?} is listed twice", e.worker),
                );
            }
            if !is_http_url(&e.address) {
                c.fail(
                    format!("spec.endpoints[{i}].address"),
                    format!(
                        "{:?} is not an http(s) URL such as http://10.0.0.7:8000",
                        e.address
                    ),
                );
            }
        }
        if let Some(s) = &ws.selector {
            if s.match_labels.is_empty() {
                c.fail(
                    "spec.selector.matchLabels",
                    "must hold a label (an empty selector would take every pod)",
                );
            }
            if s.port == 0 {
                c.fail("spec.selector.port", "must be a port number");
            }
        }
        if let Some(p) = &ws.inference_pool_ref
            && !crate::valid_object_name(p)
        {
            c.fail(
                "spec.inferencePoolRef",
                format!("{p:?} is not a valid object name"),
            );
        }
        if let Some(r) = ws.prefill_tokens_per_second {
            c.positive("spec.prefillTokensPerSecond", r);
        }
        if let Some(cost) = &ws.cost {
            cost_problems(c, cost);
        }
        let sources = [
            !ws.endpoints.is_empty(),
            ws.selector.is_some(),
            ws.inference_pool_ref.is_some(),
        ];
        if sources.into_iter().filter(|s| *s).count() > 1 {
            c.fail(
                "spec",
                "give one of endpoints, selector and inferencePoolRef (where the engines are)",
            );
        }
    }

    fn check_targets(&self, c: &mut Check<'_>, path: &str, t: &Targets) {
        for (i, p) in t.pools.iter().enumerate() {
            if !self.pools.contains_key(p) {
                c.fail(
                    format!("{path}.pools[{i}]"),
                    format!("InferencePool {p:?} does not exist"),
                );
            }
        }
        for (i, w) in t.worker_sets.iter().enumerate() {
            if !self.worker_sets.contains_key(w) {
                c.fail(
                    format!("{path}.workerSets[{i}]"),
                    format!("InferenceWorkerSet {w:?} does not exist"),
                );
            }
        }
        for (i, p) in t.providers.iter().enumerate() {
            if !self.providers.contains_key(p) {
                c.fail(
                    format!("{path}.providers[{i}]"),
                    format!("InferenceProvider {p:?} does not exist"),
                );
            }
        }
    }

    fn check_policy(&self, c: &mut Check<'_>, p: &InferencePolicySpec) {
        if p.rules.is_empty() && p.limits.is_empty() {
            c.fail("spec.rules", "a policy needs at least one rule or limit");
        }
        for (i, l) in p.limits.iter().enumerate() {
            crate::limits::check(c, i, l);
        }
        let mut names = BTreeSet::new();
        for (i, r) in p.rules.iter().enumerate() {
            let at = format!("spec.rules[{i}]");
            if r.name.is_empty() {
                c.fail(format!("{at}.name"), "must not be empty");
            } else if !names.insert(r.name.as_str()) {
                c.fail(
                    format!("{at}.name"),
                    format!("rule {:?} is defined twice", r.name),
                );
            }
            self.check_rule(c, &at, r);
            // A rule after one that matches every request, or after one with the very same
            // match, can never apply.
            if let Some(earlier) = p.rules[..i]
                .iter()
                .find(|e| e.matches.is_catch_all() || e.matches == r.matches)
            {
                c.fail(
                    format!("{at}.match"),
                    format!(
                        "unreachable: rule {:?} before it matches every request this one matches",
                        earlier.name
                    ),
                );
            }
        }
    }

    fn check_rule(&self, c: &mut Check<'_>, at: &str, r: &Rule) {
        self.check_targets(c, &format!("{at}.candidates"), &r.candidates);
        for (j, cond) in r.matches.pool_state.iter().enumerate() {
            let p = format!("{at}.match.poolState[{j}]");
            if !self.pools.contains_key(&cond.pool) {
                c.fail(
                    format!("{p}.pool"),
                    format!("InferencePool {:?} does not exist", cond.pool),
                );
            }
            if let Some(v) = cond.max_average_waiting
                && !(v.is_finite() && v >= 0.0)
            {
                c.fail(
                    format!("{p}.maxAverageWaiting"),
                    format!("must be zero or more, got {v}"),
                );
            }
            if let Some(v) = cond.max_average_kv_cache_usage {
                c.fraction(&format!("{p}.maxAverageKvCacheUsage"), v);
            }
        }
        crate::filters::problems(&r.filter, &format!("{at}.filter"), c);
        match r.on_empty.action {
            EmptyAction::Fallback if r.on_empty.fallback.is_empty() => {
                c.fail(
                    format!("{at}.onEmpty.fallback"),
                    "Fallback needs fallback targets",
                );
            }
            EmptyAction::Reject if !r.on_empty.fallback.is_empty() => {
                c.fail(
                    format!("{at}.onEmpty.fallback"),
                    "fallback targets are only used with action Fallback",
                );
            }
            _ => {}
        }
        self.check_targets(c, &format!("{at}.onEmpty.fallback"), &r.on_empty.fallback);
    }

    fn check_backend(&self, c: &mut Check<'_>, name: &str, b: &GatewayBackendSpec) {
        if b.public_model.is_empty() {
            c.fail("spec.publicModel", "must not be empty");
        }
        if let Some((other, _)) = self
            .backends
            .iter()
            .find(|(n, o)| n.as_str() < name && o.public_model == b.public_model)
        {
            c.fail(
                "spec.publicModel",
                format!(
                    "{:?} is already published by GatewayBackend {other:?}",
                    b.public_model
                ),
            );
        }
        if b.backends.is_empty() {
            c.fail("spec.backends", "a backend needs at least one target");
        }
        for (i, t) in b.backends.iter().enumerate() {
            let at = format!("spec.backends[{i}]");
            let set = [t.pool.is_some(), t.worker_set.is_some(), t.model.is_some()];
            if set.iter().filter(|s| **s).count() != 1 {
                c.fail(at.clone(), "give exactly one of pool, workerSet or model");
            }
            c.positive(&format!("{at}.weight"), t.weight);
            if let Some(p) = &t.pool
                && !self.pools.contains_key(p)
            {
                c.fail(
                    format!("{at}.pool"),
                    format!("InferencePool {p:?} does not exist"),
                );
            }
            if let Some(w) = &t.worker_set
                && !self.worker_sets.contains_key(w)
            {
                c.fail(
                    format!("{at}.workerSet"),
                    format!("InferenceWorkerSet {w:?} does not exist"),
                );
            }
            if let Some(m) = &t.model
                && !self.knows_model(m)
            {
                c.fail(
                    format!("{at}.model"),
                    format!("no worker set serves and no backend publishes {m:?}"),
                );
            }
        }
        if let Some(cycle) = self.alias_cycle(&b.public_model) {
            c.fail(
                "spec.backends",
                format!("model aliases form a cycle: {}", cycle.join(" -> ")),
            );
        }
        for (i, p) in b.policies.iter().enumerate() {
            if !self.policies.contains_key(p) {
                c.fail(
                    format!("spec.policies[{i}]"),
                    format!("InferencePolicy {p:?} does not exist"),
                );
            }
        }
        for (i, t) in b.tag_headers.iter().enumerate() {
            if t.header.is_empty() {
                c.fail(format!("spec.tagHeaders[{i}].header"), "must not be empty");
            }
            if b.tag_headers[..i]
                .iter()
                .any(|e| e.header.eq_ignore_ascii_case(&t.header))
            {
                c.fail(
                    format!("spec.tagHeaders[{i}].header"),
                    format!("{:?} is listed twice", t.header),
                );
            }
        }
        if let Some(k) = &b.classify {
            if k.pii.as_ref().is_some_and(|p| p.tag.is_empty()) {
                c.fail("spec.classify.pii.tag", "must not be empty");
            }
            if let Some(x) = &k.complexity
                && x.low_max_prompt_tokens >= x.high_min_prompt_tokens
            {
                c.fail(
                    "spec.classify.complexity.lowMaxPromptTokens",
                    format!(
                        "must be below highMinPromptTokens ({}), got {}",
                        x.high_min_prompt_tokens, x.low_max_prompt_tokens
                    ),
                );
            }
        }
    }

    /// [`Self::problems`] and what validation advises besides: rules no request can reach
    /// across a backend's ordered policies, policies that apply nowhere or name unknown
    /// models. `kvplane validate` and the policy directory refuse these; the state machine
    /// checks only [`Self::problems`] (a log written before an advice existed replays as it
    /// applied).
    pub fn lint(&self) -> Vec<Problem> {
        let mut out = self.problems();
        for (name, p) in &self.policies {
            let mut c = Check {
                kind: Kind::Policy,
                name,
                out: &mut out,
            };
            let listed = self
                .backends
                .values()
                .any(|b| b.policies.iter().any(|n| n == name));
            if !p.rules.is_empty() && !listed && p.applies_to_models.is_empty() {
                c.fail(
                    "spec.rules",
                    "its rules apply to no request: no GatewayBackend lists this policy and spec.appliesToModels is empty",
                );
            }
            for (i, m) in p.applies_to_models.iter().enumerate() {
                if !self.knows_model(m) {
                    c.fail(
                        format!("spec.appliesToModels[{i}]"),
                        format!("no worker set serves and no backend publishes {m:?}"),
                    );
                }
            }
        }
        // Within a policy, an earlier rule whose match is wider (the state machine refuses only
        // a catch-all or the very same match before a rule).
        for (name, p) in &self.policies {
            for (i, r) in p.rules.iter().enumerate() {
                let earlier = &p.rules[..i];
                // `problems()` already reports a rule after a catch-all or an identical match.
                if earlier
                    .iter()
                    .any(|e| e.matches.is_catch_all() || e.matches == r.matches)
                {
                    continue;
                }
                if let Some(e) = earlier.iter().find(|e| e.matches.covers(&r.matches)) {
                    out.push(Problem {
                        kind: Kind::Policy,
                        name: name.clone(),
                        path: format!("spec.rules[{i}].match"),
                        message: format!(
                            "unreachable: rule {:?} before it matches every request this one matches",
                            e.name
                        ),
                    });
                }
            }
        }
        for (name, b) in &self.backends {
            self.check_unreachable_across(
                &mut Check {
                    kind: Kind::Backend,
                    name,
                    out: &mut out,
                },
                b,
            );
        }
        out.sort();
        out
    }

    /// A rule of a later policy that an earlier policy's rule always pre-empts, for this
    /// backend's order (within one policy: [`Self::check_policy`] and [`Self::lint`]).
    fn check_unreachable_across(&self, c: &mut Check<'_>, b: &GatewayBackendSpec) {
        let mut earlier: Vec<(&str, &Rule)> = Vec::new();
        for (i, pname) in b.policies.iter().enumerate() {
            let Some(p) = self.policies.get(pname) else {
                continue;
            };
            for (j, r) in p.rules.iter().enumerate() {
                if let Some((ep, er)) = earlier.iter().find(|(_, e)| e.matches.covers(&r.matches)) {
                    c.fail(
                        format!("spec.policies[{i}]"),
                        format!(
                            "rule {pname}/{} (spec.rules[{j}]) is unreachable here: rule {ep}/{} of an earlier policy matches every request it matches",
                            r.name, er.name
                        ),
                    );
                }
            }
            earlier.extend(p.rules.iter().map(|r| (pname.as_str(), r)));
        }
    }

    /// The chain of public names that leads from `model` back to itself, if any.
    fn alias_cycle(&self, model: &str) -> Option<Vec<String>> {
        fn walk(cat: &Catalog, start: &str, at: &str, path: &mut Vec<String>) -> bool {
            let Some((_, b)) = cat.backend_for(at) else {
                return false;
            };
            for t in &b.backends {
                let Some(next) = &t.model else { continue };
                if next == start {
                    path.push(next.clone());
                    return true;
                }
                if path.contains(next) {
                    continue;
                }
                path.push(next.clone());
                if walk(cat, start, next, path) {
                    return true;
                }
                path.pop();
            }
            false
        }
        let mut path = vec![model.to_owned()];
        walk(self, model, model, &mut path).then_some(path)
    }
}

fn cost_problems(c: &mut Check<'_>, cost: &crate::kinds::TokenCost) {
    for (p, v) in [
        ("spec.cost.inputPerMillion", cost.input_per_million),
        ("spec.cost.outputPerMillion", cost.output_per_million),
    ] {
        if !(v.is_finite() && v >= 0.0) {
            c.fail(p, format!("must be zero or more, got {v}"));
        }
    }
}

/// Whether `s` is an `http://` or `https://` URL with a host.
fn is_http_url(s: &str) -> bool {
    let rest = s
        .strip_prefix("http://")
        .or_else(|| s.strip_prefix("https://"));
    rest.is_some_and(|r| {
        let host = r.split(['/', '?', '#']).next().unwrap_or("");
        !host.is_empty() && !host.starts_with(':') && !r.contains(char::is_whitespace)
    })
}
