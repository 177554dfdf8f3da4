//! The invariants, checked after the last fault healed and the workload stopped, against the
//! clients' own records.

use std::time::{Duration, Instant};

use crate::fleet::{Fleet, TENANTS, status};
use crate::history::History;

/// One invariant's result.
#[derive(Debug)]
pub struct Verdict {
    pub name: &'static str,
    pub held: bool,
    pub detail: String,
}

fn verdict(name: &'static str, held: bool, detail: String) -> Verdict {
    Verdict { name, held, detail }
}

/// Every invariant, in a fixed order.
pub async fn check(fleet: &Fleet, h: &History, healthy: &[(Instant, Instant)]) -> Vec<Verdict> {
    let last = h.published.iter().copied().max().unwrap_or(0);
    let mut out = vec![agreement(fleet, last).await];
    let statuses = statuses(fleet).await;
    let short = statuses
        .iter()
        .filter(|s| s.indexed_blocks != h.blocks)
        .map(|s| format!("{} holds {} blocks", s.node_id, s.indexed_blocks))
        .collect::<Vec<_>>();
    out.push(verdict(
        "every acknowledged batch indexed",
        short.is_empty() && statuses.len() == fleet.cluster.nodes.len(),
        if short.is_empty() {
            format!(
                "{} batches, {} blocks on every member",
                h.published.len(),
                h.blocks
            )
        } else {
            format!("{} blocks published; {}", h.blocks, short.join(", "))
        },
    ));
    let mut missing = Vec::new();
    for s in &statuses {
        for name in &h.config_acked {
            if !s
                .config_objects
                .iter()
                .any(|o| o.kind == "pool" && o.name == *name)
            {
                missing.push(format!("{} lacks {name}", s.node_id));
            }
        }
    }
    out.push(verdict(
        "every acknowledged config write present",
        missing.is_empty(),
        if missing.is_empty() {
            format!("{} writes on every member", h.config_acked.len())
        } else {
            missing.join(", ")
        },
    ));
    let over = over_limit(&h.admitted);
    let fullest = TENANTS
        .iter()
        .map(|(t, budget)| {
            let most = h
                .admitted
                .iter()
                .filter(|((tenant, _), _)| tenant == t)
                .map(|(_, v)| *v)
                .max()
                .unwrap_or(0);
            format!("{t} at most {most} of {budget}")
        })
        .collect::<Vec<_>>()
        .join(", ");
    out.push(verdict(
        "tokens admitted per tenant and window within the limit",
        over.is_empty(),
        if over.is_empty() {
            format!("{} windows; {fullest}", h.admitted.len())
        } else {
            over.join(", ")
        },
    ));
    let failed = failed_while_healthy(&h.route_failures, healthy);
    out.push(verdict(
        "no Route failure while the fleet was healthy",
        failed.is_empty(),
        if failed.is_empty() {
            format!("{} failures, all during faults", h.route_failures.len())
        } else {
            failed.join("; ")
        },
    ));
    out
}

/// The windows in which a tenant was admitted more tokens than its budget.
fn over_limit(admitted: &std::collections::BTreeMap<(String, u64), u64>) -> Vec<String> {
    admitted
        .iter()
        .filter_map(|((tenant, window), tokens)| {
            let budget = TENANTS.iter().find(|(t, _)| t == tenant)?.1;
            (*tokens > budget).then(|| format!("{tenant} window {window}: {tokens} > {budget}"))
        })
        .collect()
}

/// The calls that failed while every member was up and healthy (past a half-second grace
/// after the heal that began the healthy stretch).
fn failed_while_healthy(
    failures: &[(Instant, usize, String)],
    healthy: &[(Instant, Instant)],
) -> Vec<String> {
    let grace = Duration::from_millis(500);
    failures
        .iter()
        .filter(|(at, _, _)| {
            healthy
                .iter()
                .any(|(from, to)| *at > *from + grace && at < to)
        })
        .map(|(_, node, why)| format!("member {node}: {why}"))
        .collect()
}

async fn statuses(fleet: &Fleet) -> Vec<kvplane_proto::v1::StatusResponse> {
    let mut out = Vec::new();
    for n in &fleet.cluster.nodes {
        if let Some(s) = status(n).await {
            out.push(s);
        }
    }
    out
}

/// Every member applied the stream up to `last`, and all report the same applied index and
/// digest in one round (waited for: quota entries may still be landing).
async fn agreement(fleet: &Fleet, last: u64) -> Verdict {
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut seen = String::new();
    while Instant::now() < deadline {
        let all = statuses(fleet).await;
        seen = all
            .iter()
            .map(|s| {
                format!(
                    "{}: index {}, stream {}, digest {}",
                    s.node_id,
                    s.applied_index,
                    s.ingest.as_ref().map_or(0, |i| i.applied_stream_sequence),
                    s.state_digest
                )
            })
            .collect::<Vec<_>>()
            .join("; ");
        let applied = all.iter().all(|s| {
            s.ingest
                .as_ref()
                .is_some_and(|i| i.applied_stream_sequence >= last)
        });
        if all.len() == fleet.cluster.nodes.len()
            && applied
            && all.windows(2).all(|w| {
                w[0].applied_index == w[1].applied_index && w[0].state_digest == w[1].state_digest
            })
        {
            return verdict(
                "members agree (same index, same digest, the whole stream applied)",
                true,
                format!(
                    "index {}, stream {last}",
                    all.first().map_or(0, |s| s.applied_index)
                ),
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    verdict(
        "members agree (same index, same digest, the whole stream applied)",
        false,
        seen,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_window_over_its_budget_is_named_and_one_at_it_is_not() {
        let admitted = [
            (("acme".to_owned(), 0), 20_000),
            (("beta".to_owned(), 0), 10_200),
            (("beta".to_owned(), 2_000), 10_000),
        ]
        .into_iter()
        .collect();
        assert_eq!(over_limit(&admitted), vec!["beta window 0: 10200 > 10000"]);
    }

    #[test]
    fn only_failures_inside_a_healthy_stretch_past_its_grace_count() {
        let t0 = Instant::now();
        let at = |ms| t0 + Duration::from_millis(ms);
        let healthy = [(at(0), at(2_000)), (at(5_000), at(6_000))];
        let failures = [
            (at(100), 0, "just healed".to_owned()),
            (at(1_000), 1, "while healthy".to_owned()),
            (at(3_000), 2, "during a fault".to_owned()),
            (at(5_600), 0, "healthy again".to_owned()),
        ];
        assert_eq!(
            failed_while_healthy(&failures, &healthy),
            vec!["member 1: while healthy", "member 0: healthy again"]
        );
    }
}
