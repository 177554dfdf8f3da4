//! Stage 2, resolve: the requested model to its backend, the worker sets behind it and the
//! policies attached to it (see [`kvplane_policy::Resolved`]); the tenant (the request's, else
//! the header its backend names).

use kvplane_policy::{Catalog, RejectKind, Resolved, Via};
use kvplane_proto::v1::RouteRequest;

pub(crate) fn resolve<'a>(
    catalog: &'a Catalog,
    model: &str,
) -> Result<Resolved<'a>, (RejectKind, String)> {
    catalog.resolve(model)
}

/// The request's tenant: `RouteRequest.tenant`, else the backend's tenant header.
pub(crate) fn tenant(req: &RouteRequest, resolved: &Resolved<'_>) -> String {
    if !req.tenant.is_empty() {
        return req.tenant.clone();
    }
    let header = resolved
        .backend
        .map_or("x-tenant", |(_, b)| b.tenant_header.as_str());
    req.headers
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case(header))
        .map(|(_, v)| v.clone())
        .unwrap_or_default()
}

/// Explain's words for the resolution.
pub(crate) fn describe(model: &str, r: &Resolved<'_>) -> Vec<String> {
    let sets: Vec<&String> = r.sets.keys().collect();
    let mut out = vec![match r.backend {
        Some((name, _)) if r.published => {
            format!("model {model:?} is published by GatewayBackend {name}: worker sets {sets:?}")
        }
        Some((name, _)) => format!(
            "model {model:?} is served by worker sets {sets:?}, behind GatewayBackend {name} (its policies, tags and tenant header apply)"
        ),
        None => format!("model {model:?} is served by worker sets {sets:?}"),
    }];
    if r.policies.is_empty() {
        out.push("no policy is attached".into());
    } else {
        let list: Vec<String> = r
            .policies
            .iter()
            .map(|a| match a.via {
                Via::Backend(b) => format!("{} (GatewayBackend {b})", a.name),
                Via::Model => format!("{} (appliesToModels)", a.name),
            })
            .collect();
        out.push(format!("policies in order: {}", list.join(", ")));
    }
    out
}
