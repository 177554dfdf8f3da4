//! The node's access settings: who a connection's caller is, and the checks the services make
//! beyond the layer's (tenants, request ids, `AccessPolicy` writes).

use std::sync::Arc;

use kvplane_policy::access::names;
use kvplane_state::StateHandle;
use kvplane_tls::Peer;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use tonic::Status;

use super::Caller;

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

/// `AccessPolicy` objects are written through `PutConfig`/`DeleteConfig` only by members and
/// administrators: the `config` right must not grant itself the others.
pub fn check_access_write(extensions: &http::Extensions, kind: &str) -> Result<(), Status> {
    if kind != kvplane_policy::Kind::Access.as_str() {
        return Ok(());
    }
    match extensions.get::<Caller>() {
        None | Some(Caller::Unchecked | Caller::Trusted { .. }) => Ok(()),
        Some(c) => Err(Status::permission_denied(format!(
            "{} may not write AccessPolicy objects: only members and [access] admins do",
            c.name()
        ))),
    }
}

/// The metadata a member sets on a usage report it forwards: the identity of the caller it
/// forwards it for (`anonymous` for none), whose rights the receiving replica checks.
pub const ON_BEHALF_OF: &str = "kvplane-on-behalf-of";

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
        if !self.inner.enforced {
            return Caller::Unchecked;
        }
        match peer.and_then(|p| p.identity.as_ref()) {
            Some(identity) => self.named(&identity.0),
            None => Caller::Anonymous,
        }
    }

    /// The caller a member forwarded a call for (its `ON_BEHALF_OF` metadata), else `caller`
    /// itself (a caller that is no member cannot speak for another).
    pub fn on_behalf_of(
        &self,
        caller: Option<&Caller>,
        metadata: &tonic::metadata::MetadataMap,
    ) -> Caller {
        let caller = self.or_nobody(caller).clone();
        let forwarded = metadata.get(ON_BEHALF_OF).and_then(|v| v.to_str().ok());
        match (&caller, forwarded) {
            (Caller::Trusted { member: true, .. }, Some(id)) => self.named(id),
            _ => caller,
        }
    }

    /// The caller named `id`: a member, an administrator, or what the policies grant it.
    fn named(&self, id: &str) -> Caller {
        let i = &self.inner;
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

    /// `caller`, or for a call that came in without the layer (no caller known): nobody, when
    /// TLS is on.
    fn or_nobody<'a>(&self, caller: Option<&'a Caller>) -> &'a Caller {
        static ANONYMOUS: Caller = Caller::Anonymous;
        static UNCHECKED: Caller = Caller::Unchecked;
        caller.unwrap_or(if self.inner.enforced {
            &ANONYMOUS
        } else {
            &UNCHECKED
        })
    }

    /// Refuses, counted, a call about request `request_id` of `tenant` from a caller that may
    /// not route for `tenant`; the refusal does not name the tenant.
    pub fn check_request_id(
        &self,
        caller: Option<&Caller>,
        tenant: &str,
        request_id: &str,
    ) -> Result<(), Status> {
        let caller = self.or_nobody(caller);
        if caller.may_route_for(tenant) {
            return Ok(());
        }
        self.inner.metrics.denied(caller, "route_tenant");
        Err(Status::permission_denied(format!(
            "{} lacks the route right for the tenant of request {request_id:?}",
            caller.name()
        )))
    }

    /// Refuses, counted, a route for `tenant` the caller may not route for.
    pub fn check_tenant(&self, caller: Option<&Caller>, tenant: &str) -> Result<(), Status> {
        let caller = self.or_nobody(caller);
        if caller.may_route_for(tenant) {
            return Ok(());
        }
        self.inner.metrics.denied(caller, "route_tenant");
        Err(caller.tenant_refusal(tenant))
    }
}
