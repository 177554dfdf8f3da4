//! The invariants, checked after the last fault healed and the workload stopped: the clients'
//! records against each other and against what every member answers.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use crate::fleet::{Fleet, MEMBERS, TENANTS, WINDOW_MS, WORKERS};
use crate::history::{Admission, GATEWAY, History, Miss, PICKER, Read, RouteOutcome, who};
use crate::probe::status;
use crate::workload::blocks_after;

/// One invariant's result.
#[derive(Debug)]
pub struct Verdict {
    pub name: &'static str,
    pub held: bool,
    pub detail: String,
}

fn verdict(name: &'static str, problems: Vec<String>, fine: String) -> Verdict {
    Verdict {
        name,
        held: problems.is_empty(),
        detail: if problems.is_empty() {
            fine
        } else {
            problems.join("; ")
        },
    }
}

/// Every invariant, in a fixed order. `faults` is how many were injected; `healthy` the
/// stretches during which every member was up and ready; `last` the stream's last sequence once
/// the bridges had forwarded every batch.
pub async fn check(
    fleet: &Fleet,
    h: &History,
    faults: usize,
    healthy: &[(Instant, Instant)],
    last: u64,
) -> Vec<Verdict> {
    let mut out = vec![exercised(h, faults, fleet.snapshots_never_refused)];
    out.push(agreement(fleet, last).await);
    let statuses = statuses(fleet).await;
    let members = fleet.cluster.nodes.len();
    let mut problems = Vec::new();
    if statuses.len() < members {
        problems.push(format!("{} of {members} members answered", statuses.len()));
    }
    // Per worker: the blocks its engine's batches leave, each applied once and in order.
    let mut batches = [0u64; WORKERS];
    for w in &h.published {
        batches[*w] += 1;
    }
    let want = batches.map(blocks_after);
    for s in &statuses {
        for (w, blocks) in want.iter().enumerate() {
            let held = s
                .workers
                .iter()
                .find(|x| x.worker_id == format!("w{w}"))
                .map_or(0, |x| x.indexed_blocks);
            if held != *blocks {
                problems.push(format!(
                    "{} holds {held} blocks of w{w}, not {blocks}",
                    s.node_id
                ));
            }
        }
    }
    out.push(verdict(
        "every batch the engines published applied once, in order, on its worker",
        problems,
        format!(
            "{} batches, {:?} blocks per worker on every member",
            h.published.len(),
            want
        ),
    ));
    out.push(replayed(fleet, last, want).await);
    let mut problems = Vec::new();
    if statuses.len() < members {
        problems.push(format!("{} of {members} members answered", statuses.len()));
    }
    for s in &statuses {
        let missing = h
            .config_acked
            .iter()
            .filter(|name| {
                !s.config_objects
                    .iter()
                    .any(|o| o.kind == "pool" && o.name == **name)
            })
            .count();
        if missing > 0 {
            problems.push(format!("{} lacks {missing} acknowledged writes", s.node_id));
        }
    }
    out.push(verdict(
        "every acknowledged config write present",
        problems,
        format!("{} writes on every member", h.config_acked.len()),
    ));
    let (over, fullest) = over_limit(&h.admissions);
    out.push(verdict(
        "tokens admitted per tenant and window within the limit (clients' clocks)",
        over,
        fullest,
    ));
    let (over, fullest) = over_charged(&h.admissions);
    out.push(verdict(
        "tokens used per tenant within the limit of the window each answer was charged to",
        over,
        fullest,
    ));
    out.push(verdict(
        "each answer's window is one its call overlapped",
        misfiled(&h.admissions),
        "every charge named a window between the call's send and answer".into(),
    ));
    out.push(verdict(
        "every read at least as new as promised",
        stale(&h.reads),
        reads_seen(&h.reads),
    ));
    out.push(verdict(
        "no usage report settled by its routing member, then through the ledger",
        settled_twice(&h.known_then_ledger, &h.stops),
        format!(
            "{} reports sent twice to two members; {} settled through the ledger after their routing member settled them, each while that member was stopped",
            h.reports_retried,
            h.known_then_ledger.len()
        ),
    ));
    let missed = missed_while_healthy(&h.misses, healthy, &h.gateway_down);
    out.push(verdict(
        "every Route made while the fleet was healthy routed or met the limit",
        missed,
        format!(
            "{} calls failed or refused, all sent during faults",
            h.misses.len()
        ),
    ));
    out
}

/// Reads answered from a state older than they promised.
fn stale(reads: &[Read]) -> Vec<String> {
    reads
        .iter()
        .filter(|r| r.answered.is_some_and(|at| at < r.promised))
        .map(|r| {
            format!(
                "{} read promised index {} answered at {}",
                r.kind,
                r.promised,
                r.answered.unwrap_or(0)
            )
        })
        .take(5)
        .collect()
}

/// Requests settled by their routing member and then through the ledger, while that member
/// was not stopped in between: the ledger takes a ticket only from a process that is gone.
/// (A process stopped in order closes, after which the ledger refuses its tickets, but a
/// member may ask the ledger before it applied the close; a process killed never closes.)
fn settled_twice(
    pairs: &[(String, usize, Instant, Instant)],
    stops: &[(Option<usize>, Instant, Instant)],
) -> Vec<String> {
    pairs
        .iter()
        .filter(|(_, member, first, second)| {
            !stops.iter().any(|(m, from, to)| {
                m.is_none_or(|m| m == *member) && *from <= *second && *to >= *first
            })
        })
        .map(|(id, member, ..)| format!("{id} (member {member} was not stopped)"))
        .take(5)
        .collect()
}

/// How many reads of each kind were answered and refused.
fn reads_seen(reads: &[Read]) -> String {
    let mut by: BTreeMap<&str, (u64, u64)> = BTreeMap::new();
    for r in reads {
        let e = by.entry(r.kind).or_default();
        if r.answered.is_some() {
            e.0 += 1;
        } else {
            e.1 += 1;
        }
    }
    by.iter()
        .map(|(k, (a, f))| format!("{k}: {a} answered, {f} refused"))
        .collect::<Vec<_>>()
        .join("; ")
}

/// The run did what it is for: faults injected, and every member routed for every tenant,
/// took writes and indexed batches.
fn exercised(h: &History, faults: usize, snapshots_never_refused: u64) -> Verdict {
    let mut problems = Vec::new();
    if faults == 0 {
        problems.push("no fault was injected".to_owned());
    }
    problems.extend(h.bad_answers.iter().take(5).cloned());
    if snapshots_never_refused > 0 {
        problems.push(format!(
            "snapshot writes failed {snapshots_never_refused} times for 40 s without a build refused"
        ));
    }
    for m in (0..MEMBERS).chain([GATEWAY, PICKER]) {
        for (tenant, _) in TENANTS {
            if h.routes
                .get(&(m, tenant, RouteOutcome::Routed))
                .is_none_or(|n| *n == 0)
            {
                problems.push(format!("{} routed nothing for {tenant}", who(m)));
            }
        }
    }
    if h.config_acked.is_empty() {
        problems.push("no config write was acknowledged".into());
    }
    for kind in ["min_applied_index", "linearizable"] {
        if !h
            .reads
            .iter()
            .any(|r| r.kind == kind && r.answered.is_some())
        {
            problems.push(format!("no {kind} read was answered"));
        }
    }
    verdict(
        "the run exercised the fleet",
        problems,
        format!(
            "{faults} faults; every member, the gateway and the endpoint picker routed for every tenant"
        ),
    )
}

/// Per tenant and window, the tokens of admissions whose whole call (sent to answered, by the
/// client's clock) fell in the window: a lower bound of what the window admitted, which must
/// not pass the budget. Also says how full the fullest window was.
fn over_limit(admissions: &[Admission]) -> (Vec<String>, String) {
    let mut by: BTreeMap<(&str, u64), u64> = BTreeMap::new();
    for a in admissions {
        let w = a.sent_ms / WINDOW_MS * WINDOW_MS;
        if a.done_ms < w + WINDOW_MS {
            *by.entry((a.tenant, w)).or_default() += a.tokens;
        }
    }
    budget_check(&by)
}

/// Per tenant and the window each admission's answer was charged to (checked against the
/// call's own times by [`misfiled`]), the tokens the requests used: every admission, however
/// long its call took. What a window gives back never exceeds what its requests did not use,
/// so this too is a lower bound of what the window admitted.
fn over_charged(admissions: &[Admission]) -> (Vec<String>, String) {
    let mut by: BTreeMap<(&str, u64), u64> = BTreeMap::new();
    for a in admissions {
        if let Some(w) = a.charged_window_ms {
            *by.entry((a.tenant, w)).or_default() += a.tokens;
        }
    }
    budget_check(&by)
}

/// The windows of `by` over their tenant's budget, and how full the fullest was.
fn budget_check(by: &BTreeMap<(&str, u64), u64>) -> (Vec<String>, String) {
    let budget = |t: &str| TENANTS.iter().find(|(n, _)| *n == t).map_or(0, |(_, b)| *b);
    let over = by
        .iter()
        .filter(|((t, _), tokens)| **tokens > budget(t))
        .map(|((t, w), tokens)| format!("{t} window {w}: {tokens} > {}", budget(t)))
        .collect();
    let fullest = TENANTS
        .iter()
        .map(|(t, b)| {
            let most = by
                .iter()
                .filter(|((x, _), _)| x == t)
                .map(|(_, v)| *v)
                .max()
                .unwrap_or(0);
            format!("{t} at most {most} of {b}")
        })
        .collect::<Vec<_>>()
        .join(", ");
    (over, format!("{} windows; {fullest}", by.len()))
}

/// Admissions whose charge named a window the call did not overlap (a slack of one second
/// either side for the clocks of client and member).
fn misfiled(admissions: &[Admission]) -> Vec<String> {
    let slack = 1_000;
    admissions
        .iter()
        .filter_map(|a| {
            let w = a.charged_window_ms?;
            let overlaps = w + WINDOW_MS + slack > a.sent_ms && w < a.done_ms + slack;
            (!overlaps).then(|| {
                format!(
                    "{}: window {w} for a call from {} to {}",
                    a.tenant, a.sent_ms, a.done_ms
                )
            })
        })
        .take(5)
        .collect()
}

/// The calls sent while every member was up and healthy (past a grace after the stretch
/// began, answered before it ended) that failed or were refused, but for the gateway's calls
/// that overlapped its own faults (`gateway_down`, with the same grace after each).
fn missed_while_healthy(
    misses: &[Miss],
    healthy: &[(Instant, Instant)],
    gateway_down: &[(Instant, Instant)],
) -> Vec<String> {
    let grace = Duration::from_millis(200);
    misses
        .iter()
        .filter(|m| {
            healthy
                .iter()
                .any(|(from, to)| m.sent >= *from + grace && m.done <= *to)
        })
        .filter(|m| {
            m.member != GATEWAY
                || !gateway_down
                    .iter()
                    .any(|(from, to)| m.sent < *to + grace && m.done >= *from)
        })
        .map(|m| format!("{}: {}", who(m.member), m.why))
        .take(10)
        .collect()
}

/// A node of its own cluster, started on the stream alone, reaches `last` holding `want`
/// blocks per worker: what the members hold follows from the stream, not from their history.
async fn replayed(fleet: &Fleet, last: u64, want: [u64; WORKERS]) -> Verdict {
    let name = "a fresh node replaying the stream from its start holds the same blocks";
    let node = fleet.start_replayer();
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut seen = String::from("no status");
    while Instant::now() < deadline {
        if let Some(s) = status(&node).await {
            let held: Vec<u64> = (0..WORKERS)
                .map(|w| {
                    s.workers
                        .iter()
                        .find(|x| x.worker_id == format!("w{w}"))
                        .map_or(0, |x| x.indexed_blocks)
                })
                .collect();
            let at = s.ingest.as_ref().map_or(0, |i| i.applied_stream_sequence);
            if at >= last && held == want {
                return verdict(
                    name,
                    Vec::new(),
                    format!("stream 1..{at} replayed, {held:?} blocks per worker"),
                );
            }
            seen = format!("at stream {at}, {held:?} blocks per worker, not {want:?}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    verdict(name, vec![seen], String::new())
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

/// Every member applied the stream up to `last` (past the engines' last batches), and all report
/// the same applied index and digest in one round (waited for up to a minute: quota entries may
/// still be landing).
async fn agreement(fleet: &Fleet, last: u64) -> Verdict {
    let name = "members agree, a fresh one too (same index, same digest, every batch applied)";
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
            let index = all.first().map_or(0, |s| s.applied_index);
            return verdict(name, Vec::new(), format!("index {index}, stream {last}"));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    verdict(name, vec![seen], String::new())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn admission(tenant: &'static str, sent_ms: u64, done_ms: u64, window: u64) -> Admission {
        Admission {
            tenant,
            tokens: 200,
            sent_ms,
            done_ms,
            charged_window_ms: Some(window),
        }
    }

    #[test]
    fn a_window_over_its_budget_by_the_clients_clocks_is_named() {
        // 51 calls of 200 tokens inside beta's window 2000..4000: 10,200 > 10,000. One more
        // that straddles the window's end is not counted against it.
        let mut a: Vec<Admission> = (0..51)
            .map(|i| admission("beta", 2_000 + i, 2_010 + i, 2_000))
            .collect();
        a.push(admission("beta", 3_990, 4_010, 2_000));
        let (over, _) = over_limit(&a);
        assert_eq!(over, vec!["beta window 2000: 10200 > 10000"]);
        a.truncate(50);
        assert!(over_limit(&a).0.is_empty());
    }

    #[test]
    fn the_charged_windows_count_every_admission_however_long_its_call() {
        // 50 calls of 200 tokens charged to beta's window 2000, one of them answered only at
        // 4,500 (the clients' windows would not count it), and one more charged there: 10,200.
        let mut a: Vec<Admission> = (0..50)
            .map(|i| admission("beta", 2_000 + i, 2_010 + i, 2_000))
            .collect();
        a.push(admission("beta", 3_000, 4_500, 2_000));
        assert_eq!(over_charged(&a).0, vec!["beta window 2000: 10200 > 10000"]);
        assert!(over_limit(&a).0.is_empty());
        a.pop();
        assert!(over_charged(&a).0.is_empty());
    }

    #[test]
    fn a_charge_for_a_window_the_call_did_not_overlap_is_named() {
        let a = [
            admission("acme", 2_100, 2_200, 2_000),
            admission("acme", 2_100, 2_200, 8_000),
        ];
        assert_eq!(misfiled(&a).len(), 1);
    }

    #[test]
    fn only_calls_sent_and_answered_inside_a_healthy_stretch_count() {
        let t0 = Instant::now();
        let at = |ms| t0 + Duration::from_millis(ms);
        let miss = |sent, done, why: &str| Miss {
            sent: at(sent),
            done: at(done),
            member: 1,
            why: why.into(),
        };
        let healthy = [(at(0), at(2_000)), (at(5_000), at(6_000))];
        let misses = [
            miss(100, 150, "just healed"),
            miss(1_000, 1_100, "while healthy"),
            miss(1_900, 2_500, "ran into a fault"),
            miss(3_000, 5_300, "sent during a fault"),
            miss(5_600, 5_700, "healthy again"),
        ];
        assert_eq!(
            missed_while_healthy(&misses, &healthy, &[]),
            vec!["member 1: while healthy", "member 1: healthy again"]
        );
    }

    #[test]
    fn the_gateways_calls_during_its_own_fault_are_excused_and_no_one_elses() {
        let t0 = Instant::now();
        let at = |ms| t0 + Duration::from_millis(ms);
        let miss = |member, sent, done| Miss {
            sent: at(sent),
            done: at(done),
            member,
            why: "refused".into(),
        };
        let healthy = [(at(0), at(10_000))];
        let down = [(at(2_000), at(3_000))];
        let misses = [
            miss(GATEWAY, 1_500, 2_100),
            miss(GATEWAY, 2_500, 2_600),
            miss(GATEWAY, 3_100, 3_150),
            miss(GATEWAY, 4_000, 4_100),
            miss(PICKER, 2_500, 2_600),
            miss(1, 2_500, 2_600),
        ];
        assert_eq!(
            missed_while_healthy(&misses, &healthy, &down),
            vec![
                "the gateway: refused",
                "the endpoint picker: refused",
                "member 1: refused"
            ]
        );
    }

    #[test]
    fn a_read_answered_below_its_promise_is_named_and_a_refusal_is_not() {
        let read = |promised, answered| Read {
            kind: "linearizable",
            promised,
            answered,
        };
        let reads = [
            read(10, Some(10)),
            read(10, Some(12)),
            read(10, None),
            read(10, Some(9)),
        ];
        assert_eq!(
            stale(&reads),
            vec!["linearizable read promised index 10 answered at 9"]
        );
        assert_eq!(reads_seen(&reads), "linearizable: 3 answered, 1 refused");
    }

    #[test]
    fn a_second_settle_counts_only_when_the_routing_member_was_not_stopped_between() {
        let t0 = Instant::now();
        let at = |ms| t0 + Duration::from_millis(ms);
        let pairs = [
            ("a".to_owned(), 1, at(100), at(200)),
            ("b".to_owned(), 1, at(1_000), at(1_100)),
            ("c".to_owned(), 2, at(2_000), at(2_100)),
        ];
        let stops = [(Some(1), at(150), at(900)), (None, at(2_050), at(3_000))];
        assert_eq!(
            settled_twice(&pairs, &stops),
            vec!["b (member 1 was not stopped)"]
        );
    }

    #[test]
    fn a_run_that_routed_nothing_for_a_tenant_or_injected_nothing_fails() {
        let h = History::default();
        let v = exercised(&h, 0, 0);
        assert!(!v.held);
        assert!(v.detail.contains("no fault was injected"), "{}", v.detail);
        assert!(
            v.detail.contains("the gateway routed nothing for acme"),
            "{}",
            v.detail
        );
    }

    #[test]
    fn a_disk_fault_that_never_bit_or_a_changed_answer_fails_the_run() {
        let h = History {
            bad_answers: vec!["an answer's usage said None tokens, not 150".into()],
            ..History::default()
        };
        let v = exercised(&h, 3, 1);
        assert!(!v.held);
        assert!(v.detail.contains("without a build refused"), "{}", v.detail);
        assert!(v.detail.contains("usage said None"), "{}", v.detail);
    }
}
