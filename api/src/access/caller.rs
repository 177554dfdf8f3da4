//! Who a call's caller is, and what Explain says of it.

use kvplane_policy::access::Grants;
use kvplane_policy::kinds::Right;
use tonic::Status;

use super::Needs;

/// The caller of one call, in its request's extensions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Caller {
    /// A plaintext port: nothing is checked.
    Unchecked,
    /// A member, or one of the node's configured administrators: every right.
    Trusted { identity: String, member: bool },
    /// What the `AccessPolicy` objects grant this identity.
    Granted { identity: String, grants: Grants },
    /// TLS without a client certificate.
    Anonymous,
}

impl Caller {
    /// How refusals and metrics name it.
    pub fn name(&self) -> &str {
        match self {
            Caller::Unchecked => "plaintext",
            Caller::Trusted { identity, .. } | Caller::Granted { identity, .. } => identity,
            Caller::Anonymous => "anonymous",
        }
    }

    pub fn satisfies(&self, needs: Needs) -> bool {
        match (self, needs) {
            (_, Needs::Nothing) | (Caller::Unchecked, _) => true,
            (Caller::Trusted { member, .. }, Needs::Member) => *member,
            (Caller::Trusted { .. }, Needs::Right(_)) => true,
            (Caller::Granted { grants, .. }, Needs::Right(r)) => grants.has(r),
            (Caller::Granted { .. } | Caller::Anonymous, _) => false,
        }
    }

    /// The identity a certificate gave it (`None`: plaintext or no certificate).
    pub fn identity(&self) -> Option<&str> {
        match self {
            Caller::Trusted { identity, .. } | Caller::Granted { identity, .. } => Some(identity),
            Caller::Unchecked | Caller::Anonymous => None,
        }
    }

    /// Whether it may route for (and spend the quota of) `tenant`.
    pub fn may_route_for(&self, tenant: &str) -> bool {
        match self {
            Caller::Unchecked | Caller::Trusted { .. } => true,
            Caller::Granted { grants, .. } => grants.may_route_for(tenant),
            Caller::Anonymous => false,
        }
    }

    /// The refusal of a call that needs `needs`.
    pub fn refusal(&self, needs: Needs) -> Status {
        Status::permission_denied(format!(
            "{} lacks the {} right{}",
            self.name(),
            needs.label(),
            match needs {
                Needs::Member => " (only the cluster's members make raft calls)",
                _ => " (no AccessPolicy grants it)",
            }
        ))
    }

    /// The refusal of a route for `tenant`: names only the tenant the request asked for.
    pub fn tenant_refusal(&self, tenant: &str) -> Status {
        Status::permission_denied(format!(
            "{} lacks the route right for tenant {tenant:?} (no AccessPolicy grants it)",
            self.name()
        ))
    }
}

/// Explain's lines on what `caller` may do, and whether it may route for `tenant` (when the
/// request's tenant is known).
pub fn explain(caller: &Caller, tenant: Option<&str>) -> Vec<String> {
    let name = caller.name();
    let mut out = vec![match caller {
        Caller::Unchecked => format!("access: {name}: nothing is checked"),
        Caller::Trusted { member: true, .. } => {
            format!("access: {name} is a member ([access] members): every right")
        }
        Caller::Trusted { .. } => {
            format!("access: {name} is an administrator ([access] admins): every right but raft's")
        }
        Caller::Anonymous => format!("access: {name} (no client certificate): no right"),
        Caller::Granted { grants, .. } if grants.from.is_empty() => {
            format!("access: {name}: no AccessPolicy names it, no right")
        }
        Caller::Granted { grants, .. } => {
            let rights: Vec<&str> = grants.rights.iter().map(|r| r.as_str()).collect();
            let tenants = match &grants.tenants {
                _ if !grants.has(Right::Route) => String::new(),
                None => ", route for every tenant".to_owned(),
                Some(t) => format!(
                    ", route for tenants {:?}",
                    t.iter().map(String::as_str).collect::<Vec<_>>()
                ),
            };
            format!(
                "access: {name} holds {} (AccessPolicy {}){tenants}",
                rights.join(", "),
                grants.from.join(", ")
            )
        }
    }];
    if let Some(tenant) = tenant {
        out.push(if caller.may_route_for(tenant) {
            format!("access: {name} may route for tenant {tenant:?}")
        } else {
            format!("access: {name} may not route for tenant {tenant:?}: Route would be refused PERMISSION_DENIED")
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_administrator_holds_every_right_but_raft_and_a_member_every_one() {
        let admin = Caller::Trusted {
            identity: "op".into(),
            member: false,
        };
        let member = Caller::Trusted {
            identity: "m".into(),
            member: true,
        };
        assert!(admin.satisfies(Needs::Right(Right::Config)));
        assert!(!admin.satisfies(Needs::Member));
        assert!(member.satisfies(Needs::Member) && member.may_route_for("any"));
        assert!(!Caller::Anonymous.satisfies(Needs::Right(Right::Route)));
        assert!(Caller::Anonymous.satisfies(Needs::Nothing));
        assert!(Caller::Unchecked.satisfies(Needs::Member));
    }
}
