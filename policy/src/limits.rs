//! Which tenant limits apply to a request, and their validation.

use std::collections::BTreeMap;

use crate::catalog::Check;
use crate::kinds::TenantLimit;
use crate::{Catalog, Kind, Problem};

/// What one budget is kept for: a tenant, and a model or every model (`""`); or an
/// `InferenceProvider`'s `rateLimit` (`provider` its name, the other two empty), one budget for
/// every tenant.
#[derive(
    Debug,
    Clone,
    Default,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    serde::Serialize,
    serde::Deserialize,
)]
pub struct LimitKey {
    pub tenant: String,
    pub model: String,
    /// Empty for a tenant's budget (keys from before provider limits have none).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub provider: String,
}

impl LimitKey {
    /// Whose budget it is, for metrics' `tenant` label: the tenant, or `provider:<name>`.
    pub fn budget(&self) -> std::borrow::Cow<'_, str> {
        if self.provider.is_empty() {
            std::borrow::Cow::Borrowed(&self.tenant)
        } else {
            std::borrow::Cow::Owned(format!("provider:{}", self.provider))
        }
    }

    /// The budget of provider `name`'s `rateLimit`.
    pub fn provider(name: &str) -> Self {
        Self {
            provider: name.to_owned(),
            ..Self::default()
        }
    }
}

impl std::fmt::Display for LimitKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if !self.provider.is_empty() {
            write!(f, "provider {:?}", self.provider)
        } else if self.model.is_empty() {
            write!(f, "tenant {:?}", self.tenant)
        } else {
            write!(f, "tenant {:?} model {:?}", self.tenant, self.model)
        }
    }
}

/// A limit that applies to a request, with the budget it is counted in.
#[derive(Debug, Clone, PartialEq)]
pub struct MatchedLimit<'a> {
    pub key: LimitKey,
    pub limit: &'a TenantLimit,
}

impl Catalog {
    /// Every limit of every policy, in a fixed order (policy name, then position).
    fn all_limits(&self) -> impl Iterator<Item = (&str, usize, &TenantLimit)> {
        self.policies.iter().flat_map(|(name, p)| {
            p.limits
                .iter()
                .enumerate()
                .map(move |(i, l)| (name.as_str(), i, l))
        })
    }

    /// The limits that apply to `tenant` asking for `model`: the tenant's own (tenant-wide and
    /// for this model), or for each scope the tenant has no limit of its own in, the `*` one.
    pub fn limits_for(&self, tenant: &str, model: &str) -> Vec<MatchedLimit<'_>> {
        let mut out: BTreeMap<String, (bool, &TenantLimit)> = BTreeMap::new();
        for (_, _, l) in self.all_limits() {
            let scope = match &l.model {
                None => "",
                Some(m) if m == model => m.as_str(),
                Some(_) => continue,
            };
            let own = l.tenant == tenant;
            if !own && l.tenant != "*" {
                continue;
            }
            match out.get(scope) {
                Some((true, _)) => {}
                Some((false, _)) if !own => {}
                _ => {
                    out.insert(scope.to_owned(), (own, l));
                }
            }
        }
        out.into_iter()
            .map(|(scope, (_, limit))| MatchedLimit {
                key: LimitKey {
                    tenant: tenant.to_owned(),
                    model: scope,
                    provider: String::new(),
                },
                limit,
            })
            .collect()
    }

    /// The limit a ledger key is counted against (a provider's `rateLimit` as a limit of
    /// one-minute windows).
    pub fn limit_of(&self, key: &LimitKey) -> Option<std::borrow::Cow<'_, TenantLimit>> {
        if !key.provider.is_empty() {
            return self
                .provider_limit(&key.provider)
                .map(std::borrow::Cow::Owned);
        }
        self.limits_for(&key.tenant, &key.model)
            .into_iter()
            .find(|m| m.key == *key)
            .map(|m| std::borrow::Cow::Borrowed(m.limit))
    }

    /// Whether provider `name` has a `rateLimit` (what [`Self::provider_limit`] makes a limit of).
    pub fn provider_limited(&self, name: &str) -> bool {
        self.providers
            .get(name)
            .and_then(|p| p.rate_limit)
            .is_some_and(|r| r.tokens_per_minute.is_some() || r.requests_per_minute.is_some())
    }

    /// Provider `name`'s `rateLimit`, if it has one, as a limit on every tenant together.
    pub fn provider_limit(&self, name: &str) -> Option<TenantLimit> {
        if !self.provider_limited(name) {
            return None;
        }
        let r = self.providers.get(name)?.rate_limit?;
        Some(TenantLimit {
            tenant: "*".into(),
            model: None,
            tokens_per_minute: r.tokens_per_minute,
            requests_per_minute: r.requests_per_minute,
            burst: None,
            window_seconds: 60,
            fail_open_tokens_per_minute: None,
        })
    }

    pub(crate) fn check_limits(&self, out: &mut Vec<Problem>) {
        let mut seen: BTreeMap<(&str, Option<&str>), (&str, usize)> = BTreeMap::new();
        for (policy, i, l) in self.all_limits() {
            let key = (l.tenant.as_str(), l.model.as_deref());
            if let Some((first, j)) = seen.get(&key) {
                Check {
                    kind: Kind::Policy,
                    name: policy,
                    out,
                }
                .fail(
                    format!("spec.limits[{i}]"),
                    format!(
                        "the same tenant and model as InferencePolicy/{first} spec.limits[{j}]"
                    ),
                );
            } else {
                seen.insert(key, (policy, i));
            }
        }
    }
}

/// The problems of one limit, on its own.
pub(crate) fn check(c: &mut Check<'_>, i: usize, l: &TenantLimit) {
    let at = format!("spec.limits[{i}]");
    if l.tenant.is_empty() {
        c.fail(
            format!("{at}.tenant"),
            "must not be empty (`*` for every tenant)",
        );
    }
    if l.tokens_per_minute.is_none() && l.requests_per_minute.is_none() {
        c.fail(
            at.clone(),
            "a limit needs tokensPerMinute or requestsPerMinute",
        );
    }
    if !(1..=3600).contains(&l.window_seconds) {
        c.fail(
            format!("{at}.windowSeconds"),
            format!("must be within 1..=3600, got {}", l.window_seconds),
        );
    }
    for (field, v) in [
        ("tokensPerMinute", l.tokens_per_minute),
        ("requestsPerMinute", l.requests_per_minute),
        ("burst", l.burst),
    ] {
        if v == Some(0) {
            c.fail(format!("{at}.{field}"), "must be at least 1");
        }
    }
    if let (Some(w), Some(b)) = (l.window_tokens(), l.burst)
        && b > w
    {
        c.fail(
            format!("{at}.burst"),
            format!("{b} is more than the window's budget of {w} tokens"),
        );
    }
    if l.window_tokens() == Some(0) {
        c.fail(
            format!("{at}.tokensPerMinute"),
            "gives no token in a window this short",
        );
    }
}
