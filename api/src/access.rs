//! Who may do what on the gRPC port: each call's caller ([`Caller`], from the identity of its
//! client certificate) checked against the right its method needs, before the method runs;
//! `route`'s tenants checked once the pipeline knows the request's tenant.
//!
//! Without TLS the port has no identities: every caller may do everything ([`Caller::Unchecked`]).
//! With TLS: members (by identity, default the node's own) and the node's configured
//! administrators hold every right; anyone else holds what the `AccessPolicy` objects of the
//! replicated state grant its identity; a caller without a certificate holds nothing.

use std::sync::Arc;
use std::task::{Context, Poll};

use futures::future::{Either, Ready};
use kvplane_policy::access::{Grants, names};
use kvplane_policy::kinds::Right;
use kvplane_state::StateHandle;
use kvplane_tls::Peer;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use tonic::Status;

/// What a call needs: a right, membership of the cluster, or nothing (health, reflection).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Needs {
    Nothing,
    Right(Right),
    /// Raft RPCs: only the cluster's members.
    Member,
}

impl Needs {
    fn label(self) -> &'static str {
        match self {
            Needs::Nothing => "",
            Needs::Right(r) => r.as_str(),
            Needs::Member => "member",
        }
    }
}

/// The right the gRPC method at `path` (`/package.Service/Method`) needs.
pub fn needs(path: &str) -> Needs {
    let mut parts = path.trim_start_matches('/').splitn(2, '/');
    let (service, method) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    match (service, method) {
        ("kvplane.v1.Raft", _) => Needs::Member,
        ("kvplane.v1.Router", "Explain") => Needs::Right(Right::Read),
        ("kvplane.v1.Router", _) | ("envoy.service.ext_proc.v3.ExternalProcessor", _) => {
            Needs::Right(Right::Route)
        }
        ("kvplane.v1.Admin", "Status" | "ClusterStatus" | "ExportState") => {
            Needs::Right(Right::Read)
        }
        ("kvplane.v1.Admin", "PutConfig" | "DeleteConfig") => Needs::Right(Right::Config),
        ("kvplane.v1.Admin", _) => Needs::Right(Right::Membership),
        // Health checks and reflection: a proxy's health checks carry no identity.
        _ => Needs::Nothing,
    }
}

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

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DeniedLabel {
    identity: String,
    right: &'static str,
}

/// Refusals by identity and the right it lacked.
#[derive(Debug, Clone, Default)]
pub struct AccessMetrics {
    denied: Family<DeniedLabel, Counter>,
}

impl AccessMetrics {
    pub fn register(&self, r: &mut Registry) {
        r.register(
            "kvplane_access_denied",
            "Calls refused PERMISSION_DENIED, by the caller's identity and the right it lacked (route_tenant: route for the request's tenant)",
            self.denied.clone(),
        );
    }

    pub(crate) fn denied(&self, caller: &Caller, right: &'static str) {
        self.denied
            .get_or_create(&DeniedLabel {
                identity: caller.name().to_owned(),
                right,
            })
            .inc();
    }
}

/// The node's access settings and what it needs to apply them.
#[derive(Debug, Clone)]
pub struct Access {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    /// TLS on: identities are checked.
    enforced: bool,
    /// Identities (or prefixes ending in `*`) of the cluster's members.
    members: Vec<String>,
    /// Identities that hold every right whatever the replicated state says (who writes the
    /// first `AccessPolicy`).
    admins: Vec<String>,
    state: StateHandle,
    metrics: AccessMetrics,
}

impl Access {
    /// Nothing checked: a plaintext port.
    pub fn unchecked(state: StateHandle, metrics: AccessMetrics) -> Access {
        Access::new(false, Vec::new(), Vec::new(), state, metrics)
    }

    pub fn new(
        enforced: bool,
        members: Vec<String>,
        admins: Vec<String>,
        state: StateHandle,
        metrics: AccessMetrics,
    ) -> Access {
        Access {
            inner: Arc::new(Inner {
                enforced,
                members,
                admins,
                state,
                metrics,
            }),
        }
    }

    pub fn metrics(&self) -> &AccessMetrics {
        &self.inner.metrics
    }

    /// Who the caller on a connection `peer` describes is.
    pub fn caller(&self, peer: Option<&Peer>) -> Caller {
        let i = &self.inner;
        if !i.enforced {
            return Caller::Unchecked;
        }
        let Some(identity) = peer.and_then(|p| p.identity.as_ref()) else {
            return Caller::Anonymous;
        };
        let id = identity.0.as_str();
        let member = i.members.iter().any(|m| names(m, id));
        if member || i.admins.iter().any(|a| names(a, id)) {
            return Caller::Trusted {
                identity: id.to_owned(),
                member,
            };
        }
        Caller::Granted {
            identity: id.to_owned(),
            grants: i.state.load().catalog.grants(id),
        }
    }

    /// Refuses, counted, a route for `tenant` the caller may not route for.
    pub fn check_tenant(&self, caller: Option<&Caller>, tenant: &str) -> Result<(), Status> {
        let caller = caller.unwrap_or(&Caller::Unchecked);
        if caller.may_route_for(tenant) {
            return Ok(());
        }
        self.inner.metrics.denied(caller, "route_tenant");
        Err(caller.tenant_refusal(tenant))
    }
}

/// The tower layer that checks every call on the gRPC port.
#[derive(Debug, Clone)]
pub struct AccessLayer(pub Access);

impl<S> tower::Layer<S> for AccessLayer {
    type Service = Checked<S>;
    fn layer(&self, inner: S) -> Checked<S> {
        Checked {
            inner,
            access: self.0.clone(),
        }
    }
}

#[derive(Debug, Clone)]
pub struct Checked<S> {
    inner: S,
    access: Access,
}

impl<S, B> tower::Service<http::Request<B>> for Checked<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<tonic::body::Body>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Either<S::Future, Ready<Result<S::Response, S::Error>>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: http::Request<B>) -> Self::Future {
        let caller = self.access.caller(req.extensions().get::<Peer>());
        let needs = needs(req.uri().path());
        if !caller.satisfies(needs) {
            self.access.inner.metrics.denied(&caller, needs.label());
            tracing::debug!(caller = caller.name(), path = req.uri().path(), "refused");
            return Either::Right(futures::future::ready(Ok(caller
                .refusal(needs)
                .into_http())));
        }
        req.extensions_mut().insert(caller);
        Either::Left(self.inner.call(req))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_method_needs_the_right_its_kind_of_call_does() {
        for (path, want) in [
            ("/kvplane.v1.Raft/AppendEntries", Needs::Member),
            ("/kvplane.v1.Router/Route", Needs::Right(Right::Route)),
            ("/kvplane.v1.Router/ReportUsage", Needs::Right(Right::Route)),
            ("/kvplane.v1.Router/Models", Needs::Right(Right::Route)),
            ("/kvplane.v1.Router/Explain", Needs::Right(Right::Read)),
            (
                "/envoy.service.ext_proc.v3.ExternalProcessor/Process",
                Needs::Right(Right::Route),
            ),
            ("/kvplane.v1.Admin/Status", Needs::Right(Right::Read)),
            ("/kvplane.v1.Admin/ExportState", Needs::Right(Right::Read)),
            ("/kvplane.v1.Admin/PutConfig", Needs::Right(Right::Config)),
            (
                "/kvplane.v1.Admin/DeleteConfig",
                Needs::Right(Right::Config),
            ),
            (
                "/kvplane.v1.Admin/AddMember",
                Needs::Right(Right::Membership),
            ),
            (
                "/kvplane.v1.Admin/SetFaults",
                Needs::Right(Right::Membership),
            ),
            ("/grpc.health.v1.Health/Check", Needs::Nothing),
            (
                "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
                Needs::Nothing,
            ),
        ] {
            assert_eq!(needs(path), want, "{path}");
        }
    }

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
