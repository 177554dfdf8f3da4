//! A Route request against the limits: checked before any stage reads it.

use kvplane_proto::v1::RouteRequest;

use super::Limits;

/// The first bound a request is over.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{what} is {found}, over the limit of {limit} (limits.{name})")]
pub struct OverLimit {
    /// The bound's name (`kvplane_limit_hits_total{limit}`).
    pub name: &'static str,
    pub what: String,
    pub found: usize,
    pub limit: usize,
}

/// `found` over `limit`, named (`what` said only then: a request within its limits costs no
/// allocation).
fn over(
    name: &'static str,
    what: impl FnOnce() -> String,
    found: usize,
    limit: usize,
) -> Option<OverLimit> {
    (found > limit).then(|| OverLimit {
        name,
        what: what(),
        found,
        limit,
    })
}

impl Limits {
    /// The first bound a usage report is over, if any: its request id, and its ticket's
    /// charges (how many, and their names).
    pub fn check_report(&self, report: &kvplane_proto::v1::UsageReport) -> Result<(), OverLimit> {
        let charges = report.ticket.iter().flat_map(|t| &t.charges);
        let first = over(
            "name_bytes",
            || "the request_id's length in bytes".into(),
            report.request_id.len(),
            self.name_bytes,
        )
        .or_else(|| {
            over(
                "ticket_charges",
                || "the number of the ticket's charges".into(),
                charges.clone().count(),
                self.ticket_charges,
            )
        })
        .or_else(|| {
            charges
                .flat_map(|c| [&c.tenant, &c.model, &c.provider])
                .find_map(|n| {
                    over(
                        "name_bytes",
                        || "a charge's name's length in bytes".into(),
                        n.len(),
                        self.name_bytes,
                    )
                })
        });
        first.map_or(Ok(()), Err)
    }

    /// The first bound `req` is over, if any. Cheap: lengths only, nothing is parsed.
    pub fn check_route(&self, req: &RouteRequest) -> Result<(), OverLimit> {
        let names = [
            ("request_id", &req.request_id),
            ("tenant", &req.tenant),
            ("model", &req.model),
            ("cache_salt", &req.cache_salt),
        ];
        let first = names
            .iter()
            .find_map(|(field, v)| {
                over(
                    "name_bytes",
                    || format!("the {field}'s length in bytes"),
                    v.len(),
                    self.name_bytes,
                )
            })
            .or_else(|| {
                over(
                    "body_bytes",
                    || "the body's length in bytes".into(),
                    req.body.len(),
                    self.body_bytes,
                )
            })
            .or_else(|| {
                over(
                    "tags",
                    || "the number of tags".into(),
                    req.tags.len(),
                    self.tags,
                )
            })
            .or_else(|| {
                req.tags.iter().enumerate().find_map(|(i, t)| {
                    over(
                        "tag_bytes",
                        || format!("tag {i}'s length in bytes"),
                        t.len(),
                        self.tag_bytes,
                    )
                })
            })
            .or_else(|| {
                over(
                    "headers",
                    || "the number of headers".into(),
                    req.headers.len(),
                    self.headers,
                )
            })
            .or_else(|| {
                // Named by its length alone: a header's name may be anything the caller sent.
                req.headers.iter().find_map(|(k, v)| {
                    over(
                        "header_bytes",
                        || "a header's length in bytes".into(),
                        k.len() + v.len(),
                        self.header_bytes,
                    )
                })
            })
            .or_else(|| {
                over(
                    "token_ids",
                    || "the number of token ids".into(),
                    req.token_ids.len(),
                    self.token_ids,
                )
            })
            .or_else(|| {
                over(
                    "endpoint_subset",
                    || "the number of endpoints in the subset".into(),
                    req.endpoint_subset.len(),
                    self.endpoint_subset,
                )
            })
            .or_else(|| {
                req.endpoint_subset.iter().find_map(|e| {
                    over(
                        "name_bytes",
                        || "an endpoint's length in bytes".into(),
                        e.len(),
                        self.name_bytes,
                    )
                })
            });
        first.map_or(Ok(()), Err)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn small() -> Limits {
        Limits {
            tags: 2,
            tag_bytes: 4,
            name_bytes: 8,
            headers: 1,
            header_bytes: 10,
            body_bytes: 16,
            token_ids: 3,
            endpoint_subset: 1,
            ..Limits::default()
        }
    }

    #[test]
    fn a_request_within_every_bound_passes() {
        let req = RouteRequest {
            request_id: "12345678".into(),
            tags: vec!["pii".into(), "abcd".into()],
            headers: [("x-a".to_owned(), "1234567".to_owned())].into(),
            body: vec![b'x'; 16],
            token_ids: vec![1, 2, 3],
            endpoint_subset: vec!["h:1".into()],
            ..RouteRequest::default()
        };
        assert_eq!(small().check_route(&req), Ok(()));
    }

    #[test]
    fn each_bound_is_named_when_exceeded() {
        let base = RouteRequest::default();
        let cases: Vec<(&str, RouteRequest)> = vec![
            (
                "name_bytes",
                RouteRequest {
                    tenant: "123456789".into(),
                    ..base.clone()
                },
            ),
            (
                "body_bytes",
                RouteRequest {
                    body: vec![0; 17],
                    ..base.clone()
                },
            ),
            (
                "tags",
                RouteRequest {
                    tags: vec!["a".into(); 3],
                    ..base.clone()
                },
            ),
            (
                "tag_bytes",
                RouteRequest {
                    tags: vec!["abcde".into()],
                    ..base.clone()
                },
            ),
            (
                "headers",
                RouteRequest {
                    headers: [("a".into(), "1".into()), ("b".into(), "2".into())].into(),
                    ..base.clone()
                },
            ),
            (
                "header_bytes",
                RouteRequest {
                    headers: [("a".into(), "1234567890".into())].into(),
                    ..base.clone()
                },
            ),
            (
                "token_ids",
                RouteRequest {
                    token_ids: vec![1; 4],
                    ..base.clone()
                },
            ),
            (
                "endpoint_subset",
                RouteRequest {
                    endpoint_subset: vec!["a".into(), "b".into()],
                    ..base.clone()
                },
            ),
        ];
        for (name, req) in cases {
            let e = small().check_route(&req).unwrap_err();
            assert_eq!(e.name, name, "{e}");
            assert!(e.to_string().contains(&format!("limits.{name}")), "{e}");
        }
    }

    #[test]
    fn the_defaults_are_consistent() {
        assert_eq!(Limits::default().problems(), Vec::<String>::new());
    }
}
