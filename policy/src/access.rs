//! What a caller may do: the rights every `AccessPolicy` naming its identity grants, and the
//! policies' validation.

use std::collections::{BTreeMap, BTreeSet};

use crate::catalog::{Catalog, Check, Problem};
use crate::kinds::{AccessPolicySpec, Right};
use crate::object::Kind;

/// The longest identity a policy may name: SPIFFE ids are at most 2,048 bytes.
pub const MAX_IDENTITY_BYTES: usize = 2_048;

/// The rights one identity holds, and the policies that grant them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Grants {
    pub rights: BTreeSet<Right>,
    /// The tenants `route` covers: `None` for every tenant.
    pub tenants: Option<BTreeSet<String>>,
    /// The `AccessPolicy` names that grant anything, sorted.
    pub from: Vec<String>,
}

impl Grants {
    /// Everything, for every tenant (members and the node's configured administrators).
    pub fn all() -> Grants {
        Grants {
            rights: Right::ALL.into_iter().collect(),
            tenants: None,
            from: Vec::new(),
        }
    }

    pub fn has(&self, right: Right) -> bool {
        self.rights.contains(&right)
    }

    /// Whether `route` covers `tenant`.
    pub fn may_route_for(&self, tenant: &str) -> bool {
        self.has(Right::Route) && self.tenants.as_ref().is_none_or(|t| t.contains(tenant))
    }
}

/// Why `pattern` cannot name callers (an `AccessPolicy` identity or a node's `[access]` entry),
/// if it cannot: empty, a lone `*` (every holder of a certificate from the CA), a `*` anywhere
/// but at the end, whitespace, or longer than [`MAX_IDENTITY_BYTES`].
pub fn pattern_problem(pattern: &str) -> Option<String> {
    if pattern.is_empty() || pattern == "*" {
        Some("must name an identity or a prefix of one (a lone * would grant to every holder of a certificate from the CA)".into())
    } else if pattern.len() > MAX_IDENTITY_BYTES {
        Some(format!(
            "is {} bytes, more than {MAX_IDENTITY_BYTES}",
            pattern.len()
        ))
    } else if pattern.strip_suffix('*').unwrap_or(pattern).contains('*') {
        Some("* may only end an identity".into())
    } else if pattern.chars().any(char::is_whitespace) {
        Some("must not contain whitespace".into())
    } else {
        None
    }
}

/// Whether a policy's `pattern` names `identity`: equal, or a prefix of it before a trailing `*`.
pub fn names(pattern: &str, identity: &str) -> bool {
    match pattern.strip_suffix('*') {
        Some(prefix) => identity.starts_with(prefix),
        None => pattern == identity,
    }
}

impl Catalog {
    /// What `identity` may do: the union of every `AccessPolicy` naming it.
    pub fn grants(&self, identity: &str) -> Grants {
        let mut g = Grants {
            tenants: Some(BTreeSet::new()),
            ..Grants::default()
        };
        for (name, p) in &self.access {
            if !p.identities.iter().any(|i| names(i, identity)) {
                continue;
            }
            g.from.push(name.clone());
            g.rights.extend(p.rights.iter().copied());
            if p.rights.contains(&Right::Route) {
                if p.tenants.iter().any(|t| t == "*") {
                    g.tenants = None;
                } else if let Some(t) = &mut g.tenants {
                    t.extend(p.tenants.iter().cloned());
                }
            }
        }
        g
    }

    pub(crate) fn check_access(&self, out: &mut Vec<Problem>) {
        for (name, p) in &self.access {
            check_one(
                &mut Check {
                    kind: Kind::Access,
                    name,
                    out,
                },
                p,
            );
        }
    }
}

fn check_one(c: &mut Check<'_>, p: &AccessPolicySpec) {
    if p.identities.is_empty() {
        c.fail("spec.identities", "must name at least one identity");
    }
    for (i, id) in p.identities.iter().enumerate() {
        if let Some(problem) = pattern_problem(id) {
            c.fail(format!("spec.identities[{i}]"), problem);
        }
    }
    if p.rights.is_empty() {
        c.fail("spec.rights", "must grant at least one right");
    }
    let mut seen = BTreeMap::new();
    for (i, r) in p.rights.iter().enumerate() {
        if let Some(j) = seen.insert(*r, i) {
            c.fail(
                format!("spec.rights[{i}]"),
                format!("repeats spec.rights[{j}] ({r})"),
            );
        }
    }
    let routes = p.rights.contains(&Right::Route);
    if routes && p.tenants.is_empty() {
        c.fail(
            "spec.tenants",
            "route needs the tenants it covers (* for every tenant)",
        );
    }
    if !routes && !p.tenants.is_empty() {
        c.fail("spec.tenants", "only route is granted per tenant");
    }
    for (i, t) in p.tenants.iter().enumerate() {
        if t.is_empty() {
            c.fail(format!("spec.tenants[{i}]"), "must not be empty");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A policy: name, identities, rights, tenants.
    type Policy<'a> = (&'a str, &'a [&'a str], &'a [Right], &'a [&'a str]);

    fn catalog(policies: &[Policy<'_>]) -> Catalog {
        let mut c = Catalog::default();
        for (name, ids, rights, tenants) in policies {
            c.access.insert(
                (*name).to_owned(),
                AccessPolicySpec {
                    identities: ids.iter().map(|s| (*s).to_owned()).collect(),
                    rights: rights.to_vec(),
                    tenants: tenants.iter().map(|s| (*s).to_owned()).collect(),
                },
            );
        }
        c
    }

    #[test]
    fn an_identity_holds_the_union_of_the_policies_naming_it() {
        let c = catalog(&[
            ("a-route", &["spiffe://a/gw"], &[Right::Route], &["acme"]),
            (
                "a-more",
                &["spiffe://a/*"],
                &[Right::Route, Right::Read],
                &["beta"],
            ),
            ("b", &["spiffe://b/gw"], &[Right::Route], &["*"]),
        ]);
        let a = c.grants("spiffe://a/gw");
        assert_eq!(a.from, ["a-more", "a-route"]);
        assert!(a.may_route_for("acme") && a.may_route_for("beta"));
        assert!(!a.may_route_for("globex"));
        assert!(a.has(Right::Read) && !a.has(Right::Config));
        let b = c.grants("spiffe://b/gw");
        assert!(b.may_route_for("anyone") && !b.has(Right::Read));
        let nobody = c.grants("spiffe://c/gw");
        assert!(nobody.rights.is_empty() && nobody.from.is_empty());
        assert!(!nobody.may_route_for("acme"));
    }

    #[test]
    fn a_prefix_ends_with_a_star_and_names_only_what_starts_with_it() {
        assert!(names("spiffe://a/*", "spiffe://a/ns/x"));
        assert!(!names("spiffe://a/*", "spiffe://ab/ns/x"));
        assert!(names("spiffe://a/gw", "spiffe://a/gw"));
        assert!(!names("spiffe://a/gw", "spiffe://a/gw2"));
    }

    #[test]
    fn every_problem_of_a_policy_is_reported() {
        let c = catalog(&[
            (
                "bad",
                &["*", "a*b", ""],
                &[Right::Read, Right::Read],
                &["acme"],
            ),
            ("no-tenants", &["spiffe://a/gw"], &[Right::Route], &[]),
            ("empty", &[], &[], &[]),
        ]);
        let mut out = Vec::new();
        c.check_access(&mut out);
        let text: Vec<String> = out.iter().map(ToString::to_string).collect();
        for want in [
            "AccessPolicy/bad spec.identities[0]",
            "AccessPolicy/bad spec.identities[1]: * may only end",
            "AccessPolicy/bad spec.identities[2]",
            "AccessPolicy/bad spec.rights[1]: repeats spec.rights[0] (read)",
            "AccessPolicy/bad spec.tenants: only route",
            "AccessPolicy/no-tenants spec.tenants: route needs",
            "AccessPolicy/empty spec.identities: must name",
            "AccessPolicy/empty spec.rights: must grant",
        ] {
            assert!(
                text.iter().any(|t| t.starts_with(want)),
                "{want}: {text:#?}"
            );
        }
    }
}
