//! Tenant limits across a 3-node Raft cluster: concurrent clients on every node send each
//! tenant's traffic well above its limit; in every window the tokens admitted over all nodes
//! never exceed the limit (from the nodes' own records and from the clients' count), and at
//! least 90% of it is used - also while a node is partitioned away and after the leader is
//! killed.

#![allow(clippy::unwrap_used)]

mod harness;

use std::collections::BTreeMap;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use harness::{Cluster, eventually, prompt};
use kvplane_proto::v1::{RejectCode, RouteRequest, route_response::Decision};

/// Budgets per 2 s window: acme 20,000 tokens, beta 10,000.
const LIMITS: &str = concat!(
    "    - {tenant: acme, tokensPerMinute: 600000, burst: 2000, windowSeconds: 2}\n",
    "    - {tenant: beta, tokensPerMinute: 300000, burst: 1000, windowSeconds: 2}\n",
);
const WINDOW_MS: u64 = 2000;

fn budget(tenant: &str) -> u64 {
    match tenant {
        "acme" => 20_000,
        _ => 10_000,
    }
}

fn now_ms() -> u64 {
    u64::try_from(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_millis(),
    )
    .unwrap()
}

/// What one client saw.
#[derive(Default)]
struct Seen {
    /// Tokens admitted, by (tenant, window start).
    admitted: BTreeMap<(String, u64), u64>,
    limited: u64,
    /// Rate-limit refusals by kind ("exhausted", "share", "fails closed"), with one reason of
    /// each.
    reasons: BTreeMap<&'static str, (u64, String)>,
    errors: u64,
}

impl Seen {
    fn merge(&mut self, o: Seen) {
        for (k, v) in o.admitted {
            *self.admitted.entry(k).or_default() += v;
        }
        self.limited += o.limited;
        for (k, (n, r)) in o.reasons {
            self.reasons.entry(k).or_insert((0, r)).0 += n;
        }
        self.errors += o.errors;
    }
}

/// Tokens a client reserves per request: 100 prompt tokens and at most 100 output.
const PER_REQUEST: u64 = 200;

/// One Route of `tenant`'s, counted in `seen` by the client itself: `PER_REQUEST` tokens
/// into the window the answer names.
async fn send_one(
    router: &mut kvplane_proto::v1::router_client::RouterClient<tonic::transport::Channel>,
    tenant: &str,
    seen: &mut Seen,
) {
    let req = RouteRequest {
        tenant: tenant.into(),
        model: "m".into(),
        token_ids: prompt(1).into_iter().cycle().take(100).collect(),
        max_output_tokens: 100,
        ..Default::default()
    };
    match router.route(req).await {
        Ok(r) => {
            let r = r.into_inner();
            match &r.decision {
                Some(Decision::Endpoint(_)) => {
                    assert_eq!(r.charges.len(), 1);
                    let c = &r.charges[0];
                    *seen
                        .admitted
                        .entry((c.tenant.clone(), c.window_start_ms))
                        .or_default() += PER_REQUEST;
                }
                Some(Decision::Rejection(j)) if j.code == i32::from(RejectCode::RateLimited) => {
                    assert!(j.retry_after_ms > 0);
                    seen.limited += 1;
                    let kind = if j.reason.contains("fails closed") {
                        "fails closed"
                    } else if j.reason.contains("kept for other replicas") {
                        assert!(
                            j.reason.contains("until the window's last tenth"),
                            "{}",
                            j.reason
                        );
                        "share"
                    } else {
                        assert!(j.reason.contains("reached"), "{}", j.reason);
                        "exhausted"
                    };
                    seen.reasons.entry(kind).or_insert((0, j.reason.clone())).0 += 1;
                    // Pacing, so that refused clients leave the nodes some CPU.
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                other => panic!("{other:?}"),
            }
        }
        Err(_) => {
            seen.errors += 1;
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// Sends `tenant`'s requests to `addr`, as fast as they are answered, until `until`.
async fn client(addr: String, tenant: &'static str, until: Instant) -> Seen {
    let mut seen = Seen::default();
    let mut router = kvplane_proto::v1::router_client::RouterClient::connect(addr)
        .await
        .unwrap();
    while Instant::now() < until {
        send_one(&mut router, tenant, &mut seen).await;
    }
    seen
}

/// Starts `per_node` clients per tenant on every node for `for_`; resolves to what they saw.
fn spawn_clients(
    cluster: &Cluster,
    tenants: &[&'static str],
    per_node: usize,
    for_: Duration,
) -> tokio::task::JoinHandle<Seen> {
    let until = Instant::now() + for_;
    let tasks: Vec<_> = cluster
        .nodes
        .iter()
        .flat_map(|n| {
            tenants.iter().flat_map(move |&t| {
                (0..per_node).map(move |_| tokio::spawn(client(n.endpoint(), t, until)))
            })
        })
        .collect();
    tokio::spawn(async move {
        let mut all = Seen::default();
        for t in tasks {
            all.merge(t.await.unwrap());
        }
        all
    })
}

/// Tokens each node admitted, by (tenant, window start), from their Status.
async fn node_records(cluster: &Cluster, nodes: &[usize]) -> BTreeMap<(String, u64), u64> {
    let mut out = BTreeMap::new();
    for &i in nodes {
        for q in cluster.nodes[i].status().await.quota {
            *out.entry((q.tenant, q.window_start_ms)).or_default() += q.spent_tokens;
        }
    }
    out
}

/// Never above the budget in any window; at least 90% of it in every window the run covered
/// whole, for the tenants in `full`.
fn check_windows(
    what: &str,
    admitted: &BTreeMap<(String, u64), u64>,
    run: (u64, u64),
    full: &[&str],
) {
    for ((tenant, start), tokens) in admitted {
        eprintln!(
            "{what}: {tenant} window {start}: {tokens} of {}",
            budget(tenant)
        );
        assert!(
            *tokens <= budget(tenant),
            "{what}: {tenant} window {start}: {tokens} tokens admitted, budget {}",
            budget(tenant)
        );
    }
    for tenant in full {
        let mut whole = 0;
        let mut start = run.0 - run.0 % WINDOW_MS + WINDOW_MS;
        while start + WINDOW_MS <= run.1 {
            let used = admitted
                .get(&((*tenant).to_owned(), start))
                .copied()
                .unwrap_or(0);
            assert!(
                used * 10 >= budget(tenant) * 9,
                "{what}: {tenant} window {start}: only {used} of {} used",
                budget(tenant)
            );
            whole += 1;
            start += WINDOW_MS;
        }
        assert!(whole >= 1, "{what}: no whole window in the run");
    }
}

async fn started() -> (Cluster, tempfile::TempDir) {
    harness::started_with_limits(LIMITS, Vec::new()).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_tenants_share_the_workers_and_neither_exceeds_its_limit() {
    let (cluster, _dir) = started().await;
    let all = [0, 1, 2];
    let run = (now_ms(), 0);
    let seen = spawn_clients(&cluster, &["acme", "beta"], 2, Duration::from_millis(7000))
        .await
        .unwrap();
    let run = (run.0, now_ms());
    assert_eq!(seen.errors, 0);
    assert!(seen.limited > 0, "the load must exceed the limits");
    let records = node_records(&cluster, &all).await;
    check_windows("clients", &seen.admitted, run, &["acme", "beta"]);
    check_windows("nodes", &records, run, &["acme", "beta"]);
    // Exactly: what the nodes recorded is what the clients were told.
    assert_eq!(records, seen.admitted);
    let exhausted = &seen.reasons["exhausted"].1;
    assert!(
        exhausted.contains("limit of 20000 per 2 s window reached")
            || exhausted.contains("limit of 10000 per 2 s window reached"),
        "{exhausted}"
    );
    // Per-tenant series on /metrics.
    let m = cluster.nodes[0].metrics().await;
    assert!(
        m.contains("kvplane_quota_admitted_requests_total{tenant=\"beta\"}"),
        "{m}"
    );
    assert!(
        m.contains("kvplane_quota_rejected_requests_total{tenant=\"acme\",reason=\"exhausted\"}"),
        "{m}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_limit_holds_with_a_node_partitioned_and_after_the_leader_is_killed() {
    let (mut cluster, _dir) = started().await;
    let all = [0, 1, 2];
    let leader = cluster.leader(&all).await.unwrap();
    let cut = (leader + 1) % 3;

    // A follower cut off mid-run spends what it holds, then refuses: fail closed.
    let run = (now_ms(), 0);
    let clients = spawn_clients(&cluster, &["acme"], 2, Duration::from_millis(6000));
    eventually(
        "the first window's grants",
        Duration::from_secs(10),
        || async { (!node_records(&cluster, &all).await.is_empty()).then_some(()) },
    )
    .await;
    cluster.isolate(cut).await;
    let seen = clients.await.unwrap();
    let run = (run.0, now_ms());
    let records = node_records(&cluster, &all).await;
    check_windows("partition, clients", &seen.admitted, run, &[]);
    check_windows("partition, nodes", &records, run, &[]);
    assert_eq!(records, seen.admitted);
    assert!(
        seen.reasons.contains_key("fails closed"),
        "{:?}",
        seen.reasons
    );
    cluster.heal().await;

    // The leader killed mid-run: the others carry on from the ledger the new leader has.
    let run = (now_ms(), 0);
    let survivors: Vec<usize> = all.iter().copied().filter(|&i| i != leader).collect();
    let clients = spawn_clients(&cluster, &["acme"], 2, Duration::from_millis(7000));
    eventually("grants in this run", Duration::from_secs(10), || async {
        let r = node_records(&cluster, &survivors).await;
        r.keys()
            .any(|(_, w)| *w >= run.0 - run.0 % WINDOW_MS)
            .then_some(())
    })
    .await;
    cluster.nodes[leader].kill();
    let seen = clients.await.unwrap();
    let run = (run.0, now_ms());
    // The killed node's own records died with it: the clients' count covers every node.
    check_windows("leader killed, clients", &seen.admitted, run, &[]);
    let records = node_records(&cluster, &survivors).await;
    check_windows("leader killed, survivors", &records, run, &[]);
    let after = run.1 - WINDOW_MS;
    assert!(
        seen.admitted
            .iter()
            .any(|((_, w), t)| *w >= after - WINDOW_MS && *t > 0),
        "admission resumed under the new leader: {:?}",
        seen.admitted
    );
}

/// The race the escrow's set-aside closes, on three processes. A follower holds most of a
/// grant unspent; the window's rest is spent by the other replicas' clients; the follower,
/// idle for `quota.idle_release_ms`, releases what it holds while its path to the leader is
/// cut (the release stays in flight), a burst arrives on it, then the path heals, the release
/// applies and the others take the released tokens. Before the set-aside the follower admitted
/// the burst against what it was releasing: 21,200 of 20,000 with this schedule (measured with
/// the set-aside switched off).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_burst_on_a_replica_releasing_its_escrow_never_takes_the_window_over_its_budget() {
    const WINDOW: u64 = 10_000;
    let (cluster, _dir) = harness::started_with_limits_and(
        "    - {tenant: acme, tokensPerMinute: 120000, burst: 2000, windowSeconds: 10}\n",
        Vec::new(),
        "[quota]\nidle_release_ms = 1000\n".into(),
    )
    .await;
    let leader = cluster.leader(&[0, 1, 2]).await.unwrap();
    let f = (leader + 1) % 3;
    let follower = &cluster.nodes[f];
    let mut router = follower.router().await;
    // The schedule needs most of one window: start at the beginning of one.
    eventually("a window to begin", Duration::from_secs(12), || async {
        (now_ms() % WINDOW < 300).then_some(())
    })
    .await;
    let window = now_ms() - now_ms() % WINDOW;
    let until = Instant::now() + Duration::from_millis(WINDOW - 1_000);
    // The follower's one request: it is granted 2,000 and spends 200.
    let mut seen = Seen::default();
    send_one(&mut router, "acme", &mut seen).await;
    assert_eq!(seen.admitted.values().sum::<u64>(), PER_REQUEST);
    // The others take the rest of the window.
    let mut tasks = Vec::new();
    for (_, n) in cluster.nodes.iter().enumerate().filter(|(i, _)| *i != f) {
        for _ in 0..2 {
            tasks.push(tokio::spawn(client(n.endpoint(), "acme", until)));
        }
    }
    // Cut the follower's path to the leader; once it has proposed its release, the burst.
    follower
        .block(vec![cluster.nodes[leader].raft_id.unwrap()])
        .await;
    eventually("the follower's release", Duration::from_secs(5), || async {
        let m = follower.metrics().await;
        (harness::metric_value(&m, "kvplane_quota_released_tokens_total") > 0.0).then_some(())
    })
    .await;
    let burst: Vec<_> = (0..9)
        .map(|_| {
            let mut r = router.clone();
            tokio::spawn(async move {
                let mut seen = Seen::default();
                send_one(&mut r, "acme", &mut seen).await;
                seen
            })
        })
        .collect();
    for b in burst {
        seen.merge(b.await.unwrap());
    }
    // Healed: the release applies, and the others may take what it returned.
    follower.block(Vec::new()).await;
    for t in tasks {
        seen.merge(t.await.unwrap());
    }
    assert_eq!(seen.errors, 0);
    assert!(seen.limited > 0, "the load must exceed the limit");
    let in_window = seen
        .admitted
        .get(&("acme".to_owned(), window))
        .copied()
        .unwrap_or(0);
    eprintln!("admitted in the window: {in_window} of 20000");
    assert!(in_window <= 20_000, "{in_window} tokens admitted of 20,000");
    assert!(in_window >= 17_000, "only {in_window} of 20,000 used");
    let records = node_records(&cluster, &[0, 1, 2]).await;
    assert_eq!(
        records, seen.admitted,
        "the nodes' records are the clients' counts"
    );
}

/// A gateway that fails over between Route and ReportUsage reports to a replica that never
/// saw the request: that replica forwards the report to the one that routed it (named in the
/// answer, `routed_by`), where the tenant's reservation is settled as if reported there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_report_to_another_replica_settles_where_the_request_was_routed() {
    let (cluster, _dir) = harness::started_with_limits(
        "    - {tenant: acme, tokensPerMinute: 600000, windowSeconds: 60}\n",
        Vec::new(),
    )
    .await;
    let spent = |i: usize| {
        let c = &cluster;
        async move {
            c.nodes[i]
                .status()
                .await
                .quota
                .iter()
                .filter(|q| q.tenant == "acme")
                .map(|q| q.spent_tokens)
                .sum::<u64>()
        }
    };
    let routed = route_acme(&cluster.nodes[0], "failover-1").await;
    assert!(
        matches!(routed.decision, Some(Decision::Endpoint(_))),
        "{routed:?}"
    );
    assert_eq!(routed.routed_by, cluster.nodes[0].raft_id.unwrap());
    let reserved = spent(0).await;
    assert!(
        reserved >= 500,
        "prompt and the output limit are held: {reserved}"
    );
    // Reported to node 1, which never saw it.
    let ack = cluster.nodes[1]
        .router()
        .await
        .report_usage(kvplane_proto::v1::UsageReport {
            request_id: "failover-1".into(),
            prompt_tokens: 40,
            completion_tokens: 10,
            routed_by: routed.routed_by,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert!(ack.known, "the routing replica knew it");
    assert_eq!(
        spent(0).await,
        50,
        "settled at what it used, on the replica that holds it"
    );
    assert_eq!(spent(1).await, 0);
    let m = cluster.nodes[1].metrics().await;
    assert!(
        m.contains(r#"kvplane_usage_reports_total{outcome="forwarded"} 1"#),
        "{m}"
    );
}

/// One of acme's requests (its prompt, at most 500 output tokens) routed by `node`.
async fn route_acme(node: &harness::Node, request_id: &str) -> kvplane_proto::v1::RouteResponse {
    node.router()
        .await
        .route(RouteRequest {
            request_id: request_id.into(),
            tenant: "acme".into(),
            model: "m".into(),
            token_ids: prompt(1),
            max_output_tokens: 500,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
}

/// A three-member cluster where acme has an hour's window and escrow is never released for
/// idleness: what the ledger holds moves only with what the test does.
async fn hour_window() -> (Cluster, tempfile::TempDir) {
    harness::started_with_limits_and(
        "    - {tenant: acme, tokensPerMinute: 600000, windowSeconds: 3600}\n",
        Vec::new(),
        "[quota]\nidle_release_ms = 3600000\n".into(),
    )
    .await
}

/// The final report of `request_id` (50 tokens used) with its ticket.
fn used_50(request_id: &str, ticket: &kvplane_proto::v1::Ticket) -> kvplane_proto::v1::UsageReport {
    kvplane_proto::v1::UsageReport {
        request_id: request_id.into(),
        prompt_tokens: 40,
        completion_tokens: 10,
        ticket: Some(ticket.clone()),
        ..Default::default()
    }
}

async fn report_to(
    node: &harness::Node,
    report: &kvplane_proto::v1::UsageReport,
) -> kvplane_proto::v1::UsageAck {
    let mut c = node.router().await;
    c.report_usage(report.clone()).await.unwrap().into_inner()
}

/// The tenant's book in `node`'s ledger (read from its exported state).
async fn acme_book(node: &harness::Node) -> kvplane_state::Book {
    acme_ledger(node).await.0
}

/// The leader, and two followers: one that routes, one that a report goes to.
async fn roles(cluster: &Cluster) -> (usize, usize, usize) {
    let leader = cluster.leader(&[0, 1, 2]).await.unwrap();
    let followers: Vec<usize> = (0..3).filter(|i| *i != leader).collect();
    (leader, followers[0], followers[1])
}

/// Kills the member that routed `report`'s request and sends the report to another: settled
/// through the ledger, its ticket waits there. The leader's book with it waiting.
async fn killed_then_reported(
    cluster: &mut Cluster,
    (leader, router, reporter): (usize, usize, usize),
    report: &kvplane_proto::v1::UsageReport,
) -> kvplane_state::Book {
    cluster.nodes[router].kill();
    let ack = report_to(&cluster.nodes[reporter], report).await;
    assert!(ack.settled_by_ledger && !ack.known, "{ack:?}");
    eventually(
        "the ticket in the ledger",
        Duration::from_secs(20),
        || async {
            let b = acme_book(&cluster.nodes[leader]).await;
            (!b.pending.is_empty()).then_some(b)
        },
    )
    .await
}

/// The tenant's book once no ticket waits in `node`'s ledger (within 30 s).
async fn ticket_given_back(node: &harness::Node) -> kvplane_state::Book {
    eventually("the ticket given back", Duration::from_secs(30), || async {
        let b = acme_book(node).await;
        b.pending.is_empty().then_some(b)
    })
    .await
}

/// The tenant's book and the processes the ledger knows stopped in order, in `node`'s state.
async fn acme_ledger(node: &harness::Node) -> (kvplane_state::Book, Vec<(u64, u64)>) {
    let sm = harness::exported_state(node).await;
    let key = kvplane_policy::LimitKey {
        tenant: "acme".into(),
        model: String::new(),
        provider: String::new(),
    };
    let q = sm.handle().load().quota.clone();
    (q.books[&key].clone(), q.closed.iter().copied().collect())
}

/// A report the routing replica settled itself, retried by a gateway after that replica
/// stopped in order (SIGTERM): the retry settles nothing, neither forwarded to the stopped
/// replica nor at its next process, and the tenant's window keeps what the request used.
/// (Found by the chaos runner: the ledger gave the unused tokens back a second time.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_report_settled_before_its_replica_stopped_is_not_settled_again_through_the_ledger() {
    let (mut cluster, _dir) = hour_window().await;
    let (leader, router, reporter) = roles(&cluster).await;
    let routed = route_acme(&cluster.nodes[router], "stops-1").await;
    let ticket = routed.ticket.clone().unwrap();
    let report = used_50("stops-1", &ticket);
    let first = report_to(&cluster.nodes[router], &report).await;
    assert!(first.known && !first.settled_by_ledger, "{first:?}");

    assert!(cluster.nodes[router].terminate().success());
    let process = (ticket.routed_by, ticket.incarnation);
    // Where the retry lands, the ledger knows the process stopped.
    let (stopped, _) = eventually(
        "the stopped process closed in the ledger",
        Duration::from_secs(20),
        || async {
            let l = acme_ledger(&cluster.nodes[reporter]).await;
            l.1.contains(&process).then_some(l)
        },
    )
    .await;
    let ack = report_to(&cluster.nodes[reporter], &report).await;
    assert!(!ack.known && !ack.settled_by_ledger, "{ack:?}");

    cluster.nodes[router].restart();
    eventually(
        "the replica's next process heard",
        Duration::from_secs(30),
        || async {
            let (b, _) = acme_ledger(&cluster.nodes[router]).await;
            b.left_behind.contains_key(&process).then_some(())
        },
    )
    .await;
    let ack = report_to(&cluster.nodes[router], &report).await;
    assert!(!ack.known && !ack.settled_by_ledger, "{ack:?}");
    // Nothing given back: the window keeps what it granted once the stopped process released
    // what it did not spend, and no ticket waits.
    let (after, _) = acme_ledger(&cluster.nodes[leader]).await;
    assert_eq!(after.granted, stopped.granted, "{after:?}");
    assert!(
        after.pending.is_empty() && after.settled.is_empty(),
        "{after:?}"
    );
    let m = cluster.nodes[reporter].metrics().await;
    assert!(
        m.contains(r#"kvplane_usage_reports_total{outcome="ledger"} 0"#),
        "{m}"
    );
}

/// A gateway that fails over between Route and ReportUsage while the replica that routed the
/// request is dead: the report's ticket settles it through the ledger. What the request did not
/// use comes back to the tenant's window once that replica's process is known to be gone (its
/// next process speaks).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_report_whose_routing_replica_died_settles_through_the_ledger() {
    let (mut cluster, _dir) = hour_window().await;
    let (leader, router, reporter) = roles(&cluster).await;
    let routed = route_acme(&cluster.nodes[router], "dies-1").await;
    let ticket = routed.ticket.clone().unwrap();
    assert_eq!(ticket.routed_by, cluster.nodes[router].raft_id.unwrap());
    let reserved = ticket.charges[0].tokens;
    assert!(reserved >= 500, "{ticket:?}");
    let before = acme_book(&cluster.nodes[leader]).await;
    assert!(before.holders.contains_key(&ticket.routed_by));

    let report = used_50("dies-1", &ticket);
    let waiting = killed_then_reported(&mut cluster, (leader, router, reporter), &report).await;
    // Its process may be alive behind a partition: the ticket waits, nothing comes back yet.
    assert_eq!(waiting.granted, before.granted);

    // Its next process speaks: the holdings of the old one are no one's, and what the request
    // did not use of them comes back.
    cluster.nodes[router].restart();
    let after = ticket_given_back(&cluster.nodes[leader]).await;
    assert_eq!(
        after.granted.tokens,
        before.granted.tokens - (reserved - 50)
    );
    assert!(!after.holders.contains_key(&ticket.routed_by));

    // Reported again, to the restarted replica itself: it knows the ticket for its earlier
    // process's (the ledger takes each ticket once: state/src/quota_settle.rs).
    let ack = report_to(&cluster.nodes[router], &report).await;
    assert!(ack.settled_by_ledger && !ack.known, "{ack:?}");
    let m = cluster.nodes[reporter].metrics().await;
    assert!(
        m.contains(r#"kvplane_usage_reports_total{outcome="ledger"} 1"#),
        "{m}"
    );
}

/// The same failover through the reference gateway and an engine: the gateway's replica that
/// routed a streamed request is killed -9 after the answer's first chunk. The gateway's final
/// report (the ticket it echoes, the usage the engine's last event gave) goes to its other
/// replica, which cannot forward it and settles it through the ledger; once the killed replica
/// is back, the tenant's window is charged exactly what the engine said the request used, as if
/// the report had reached the replica that routed it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_failing_over_mid_answer_still_settles_the_tenant_at_what_the_engine_used() {
    use futures::StreamExt;
    let dir = tempfile::tempdir().unwrap();
    // Its answers end after 200 tokens whatever the request's maximum (1,500): what the
    // request did not use of its reservation is what the ledger must give back. A token every
    // 25 ms: the answer is still streaming (5 s) when its routing replica is killed.
    let engine = harness::Engine::sim(
        &dir.path().join("fleet"),
        "e0",
        [0; 3],
        &[
            "--answer-tokens".into(),
            "200".into(),
            "--step-base-ms".into(),
            "250".into(),
        ],
    );
    let policies = dir.path().join("policies");
    std::fs::create_dir_all(&policies).unwrap();
    std::fs::write(
        policies.join("fleet.yaml"),
        format!(
            "apiVersion: kvplane.io/v1alpha1\nkind: InferenceWorkerSet\nmetadata: {{name: gpu}}\nspec:\n  model: sim-8b\n  endpoints:\n  - {{worker: e0, address: 'http://{}'}}\n---\napiVersion: kvplane.io/v1alpha1\nkind: InferencePolicy\nmetadata: {{name: tenants}}\nspec:\n  limits:\n    - {{tenant: acme, tokensPerMinute: 600000, windowSeconds: 3600}}\n",
            engine.field("http")
        ),
    )
    .unwrap();
    let (mut cluster, _js) = harness::started(&harness::NodeOptions {
        policy_dir: Some(policies),
        pools: vec![],
        extra_toml: "[quota]\nidle_release_ms = 3600000\n".into(),
        ..Default::default()
    })
    .await;
    for n in &cluster.nodes {
        eventually(
            "the policies and the engine",
            Duration::from_secs(30),
            || async {
                let s = n.status().await;
                (s.policy_objects.get("InferencePolicy") == Some(&1)
                    && s.workers.iter().any(|w| w.up))
                .then_some(())
            },
        )
        .await;
    }
    let (leader, router, reporter) = roles(&cluster).await;
    // The gateway asks the router first, the reporter when the router does not answer.
    let gateway = harness::gateway(
        &format!(
            "{},{}",
            cluster.nodes[router].endpoint(),
            cluster.nodes[reporter].endpoint()
        ),
        dir.path().join("gateway.log"),
    );
    let answer = reqwest::Client::new()
        .post(format!("http://{}/v1/completions", gateway.field("http")))
        .header("x-tenant", "acme")
        .json(&serde_json::json!({
            "model": "sim-8b", "prompt": "a prompt for the failover", "max_tokens": 1500,
            "stream": true, "stream_options": {"include_usage": true}}))
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), 200);
    let mut chunks = answer.bytes_stream();
    let mut sse = chunks.next().await.unwrap().unwrap().to_vec();
    // In flight: what the router holds for it is its reservation (prompt and max_tokens).
    let reserved: u64 = cluster.nodes[router]
        .status()
        .await
        .quota
        .iter()
        .filter(|q| q.tenant == "acme")
        .map(|q| q.spent_tokens)
        .sum();
    assert!(reserved >= 1500, "{reserved}");
    let before = acme_book(&cluster.nodes[leader]).await;
    cluster.nodes[router].kill();
    while let Some(c) = chunks.next().await {
        sse.extend_from_slice(&c.unwrap());
    }
    let text = String::from_utf8(sse).unwrap();
    let usage = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<serde_json::Value>(d).ok())
        .find_map(|v| v.get("usage").filter(|u| !u.is_null()).cloned())
        .unwrap_or_else(|| panic!("no usage in the answer: {text}"));
    let used =
        usage["prompt_tokens"].as_u64().unwrap() + usage["completion_tokens"].as_u64().unwrap();
    assert_eq!(usage["completion_tokens"], 200);
    assert!(text.contains(r#""finish_reason":"stop""#), "{text}");
    // The gateway's report reached the reporter, which settled it through the ledger.
    eventually(
        "the report settled by the ledger",
        Duration::from_secs(20),
        || async {
            let m = cluster.nodes[reporter].metrics().await;
            m.lines()
                .any(|l| l == r#"kvplane_usage_reports_total{outcome="ledger"} 1"#)
                .then_some(())
        },
    )
    .await;
    cluster.nodes[router].restart();
    let after = ticket_given_back(&cluster.nodes[leader]).await;
    assert_eq!(
        after.granted.tokens,
        before.granted.tokens - (reserved - used),
        "the window keeps what the engine said the request used: {before:?} -> {after:?}"
    );
}

/// As `a_report_whose_routing_replica_died_settles_through_the_ledger`, but the dead replica
/// never comes back: it is removed from the cluster. The leader retires it in the ledger
/// (`QuotaRetire`), and the ticket gives back what the request did not use without waiting for
/// a process that will never start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_report_whose_routing_replica_was_removed_for_good_still_gives_back() {
    let (mut cluster, _dir) = hour_window().await;
    let (leader, router, reporter) = roles(&cluster).await;
    let routed = route_acme(&cluster.nodes[router], "removed-1").await;
    let ticket = routed.ticket.clone().unwrap();
    let reserved = ticket.charges[0].tokens;
    let before = acme_book(&cluster.nodes[leader]).await;

    let report = used_50("removed-1", &ticket);
    killed_then_reported(&mut cluster, (leader, router, reporter), &report).await;
    cluster.nodes[leader]
        .admin()
        .await
        .remove_member(kvplane_proto::v1::RemoveMemberRequest {
            id: ticket.routed_by,
            ..Default::default()
        })
        .await
        .unwrap();
    let after = ticket_given_back(&cluster.nodes[leader]).await;
    assert_eq!(
        after.granted.tokens,
        before.granted.tokens - (reserved - 50)
    );
    assert!(!after.holders.contains_key(&ticket.routed_by));
    let sm = harness::exported_state(&cluster.nodes[leader]).await;
    assert!(sm.handle().load().quota.is_retired(ticket.routed_by));
}

/// A replica's figure from its `/metrics` text: the sample `name` (with its labels), 0 when
/// absent.
fn sample(metrics: &str, name: &str) -> f64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
        .unwrap_or(0.0)
}

/// Learners in two other clusters, one 50 ms and one 100 ms round trip from the members: each
/// reaches them only through a link that delays every byte (25 and 50 ms each way), and the
/// leader reaches each through another such link; their quota asks are relayed by a member.
/// Clients on all five replicas send acme's traffic well above its limit: in every window the
/// tokens admitted over all five never exceed the budget (the clients' own count, and the
/// replicas' records), the budget is used, and each learner's clients get at least 40% of an
/// equal share (8% of the tokens; one learner 50 ms away got 7.9% of four replicas' tokens,
/// 32% of an equal share, before the ledger kept each replica what it wanted of the window
/// before until the last tenth). Prints each learner's grant latency and each replica's share.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn learners_behind_wan_links_admit_within_the_one_limit_and_get_their_share() {
    let (mut cluster, dir) = started().await;
    let leader = cluster.leader(&[0, 1, 2]).await.unwrap();
    let follower = (leader + 1) % 3;
    let voters: Vec<u64> = (0..3).map(|i| cluster.nodes[i].raft_id.unwrap()).collect();
    let delays = [Duration::from_millis(25), Duration::from_millis(50)];
    let mut links = Vec::new();
    for (i, one_way) in delays.iter().enumerate() {
        let id = 4 + i as u64;
        let base = harness::NodeOptions {
            policy_dir: Some(dir.path().to_owned()),
            ..Default::default()
        };
        let (o, to_learner, to_members) =
            harness::remote_learner(id, cluster.nodes[follower].grpc.port(), *one_way, base).await;
        cluster.add_node(&format!("learner-{id}"), &o);
        cluster.nodes[3 + i].block(voters.clone()).await;
        links.push((to_members, to_learner));
    }
    for i in [3, 4] {
        eventually(
            "the learner holds the limits",
            Duration::from_secs(30),
            || async {
                let s = cluster.nodes[i].status().await;
                (s.policy_objects.get("InferencePolicy") == Some(&1)
                    && s.workers.iter().any(|w| w.up))
                .then_some(())
            },
        )
        .await;
    }

    let run = (now_ms(), 0);
    let seen = spawn_clients(&cluster, &["acme"], 2, Duration::from_millis(9000))
        .await
        .unwrap();
    let run = (run.0, now_ms());
    assert_eq!(seen.errors, 0);
    assert!(seen.limited > 0, "the load must exceed the limit");
    let all = [0, 1, 2, 3, 4];
    let records = node_records(&cluster, &all).await;
    check_windows("clients", &seen.admitted, run, &["acme"]);
    check_windows("nodes", &records, run, &["acme"]);
    assert_eq!(records, seen.admitted);

    let mut shares = Vec::new();
    for i in all {
        let tokens: u64 = node_records(&cluster, &[i]).await.values().sum();
        shares.push(tokens);
    }
    let total: u64 = shares.iter().sum();
    for (i, one_way) in delays.iter().enumerate() {
        let m = cluster.nodes[3 + i].metrics().await;
        let grants = sample(&m, "kvplane_quota_grant_duration_seconds_count");
        let grant_s = sample(&m, "kvplane_quota_grant_duration_seconds_sum");
        eprintln!(
            "learner behind {} ms round trip: {grants} grants, mean grant latency {:.1} ms, {:.1}% of the tokens (an equal share is 20%)",
            2 * one_way.as_millis(),
            grant_s / grants.max(1.0) * 1000.0,
            shares[3 + i] as f64 * 100.0 / total.max(1) as f64
        );
        assert!(grants > 0.0, "the learner asked for grants over the link");
        assert!(
            grant_s / grants.max(1.0) >= 2.0 * one_way.as_secs_f64(),
            "a grant takes at least the link's round trip"
        );
        assert!(
            shares[3 + i] * 100 >= total * 8,
            "a learner's clients got less than 40% of an equal share: {shares:?}"
        );
    }
    eprintln!("tokens admitted by replica: {shares:?} of {total}");

    // The far learner cut off both ways mid-run, as a cluster whose WAN link is lost: it
    // spends what it holds, then refuses (fails closed), as a cut-off voter does, and admits
    // nothing in a window that began after the cut; the others keep the limit and, from the
    // second window after the cut on (the first keeps the learner what it wanted of the last),
    // use the budget again.
    let far = 4;
    let (to_members, to_learner) = &links[1];
    // Long enough that, however long the far learner takes to admit before the cut (at most
    // 8 s), a whole window two windows after the cut ends before the clients stop.
    let until = Instant::now() + Duration::from_millis(16_000);
    let spawn = |i: usize| -> Vec<tokio::task::JoinHandle<Seen>> {
        (0..2)
            .map(|_| tokio::spawn(client(cluster.nodes[i].endpoint(), "acme", until)))
            .collect()
    };
    let (on_far, on_others): (Vec<_>, Vec<_>) = (
        spawn(far),
        [0, 1, 2, 3].into_iter().flat_map(spawn).collect(),
    );
    let run_start = now_ms();
    let held_now = || async {
        let now = now_ms();
        cluster.nodes[far]
            .status()
            .await
            .quota
            .into_iter()
            .find(|q| {
                q.tenant == "acme"
                    && q.window_start_ms <= now
                    && now < q.window_start_ms + q.window_ms
            })
            .map(|q| (q.window_start_ms, q.held_tokens, q.spent_tokens))
    };
    eventually(
        "the far learner admitting in a window begun in this run",
        Duration::from_secs(8),
        || async {
            held_now()
                .await
                .filter(|(w, _, spent)| *w > run_start && *spent > 0)
        },
    )
    .await;
    to_members.cut();
    to_learner.cut();
    let cut_at = now_ms();
    // What it spent of its window by the cut (none listed: a window just begun, nothing spent).
    let spent = held_now().await.map_or(0, |(_, _, spent)| spent);
    let (mut far_seen, mut others) = (Seen::default(), Seen::default());
    for t in on_far {
        far_seen.merge(t.await.unwrap());
    }
    for t in on_others {
        others.merge(t.await.unwrap());
    }
    let run = (run_start, now_ms());
    let mut all = Seen::default();
    for admitted in [&far_seen.admitted, &others.admitted] {
        all.merge(Seen {
            admitted: admitted.clone(),
            ..Default::default()
        });
    }
    check_windows("learner cut off, all clients", &all.admitted, run, &[]);
    check_windows(
        "learner cut off, the others' clients",
        &others.admitted,
        (cut_at + WINDOW_MS, run.1),
        &["acme"],
    );
    assert!(
        far_seen.reasons.contains_key("fails closed"),
        "{:?}",
        far_seen.reasons
    );
    // Its last grant, as its state holds it: cut off, it applied no entry since the cut, so
    // what it holds of that window is what it held then.
    let (window, held) = cluster.nodes[far]
        .status()
        .await
        .quota
        .into_iter()
        .filter(|q| q.tenant == "acme" && q.window_ms > 0)
        .map(|q| (q.window_start_ms, q.held_tokens))
        .max()
        .unwrap();
    assert!(
        window <= cut_at,
        "a grant in window {window}, begun after the cut at {cut_at}"
    );
    let in_window = far_seen
        .admitted
        .get(&("acme".to_owned(), window))
        .copied()
        .unwrap_or(0);
    assert!(
        spent <= in_window && in_window <= held,
        "the cut learner admitted {in_window} in its last granted window, holding {held}"
    );
    let late: u64 = far_seen
        .admitted
        .iter()
        .filter(|((_, w), _)| *w > window)
        .map(|(_, t)| t)
        .sum();
    assert_eq!(
        late, 0,
        "the cut learner admitted in a window it was never granted"
    );
    eprintln!(
        "learner cut off holding {held} tokens of its window ({spent} spent): {in_window} admitted in that window, then {} refusals ({:?})",
        far_seen.limited,
        far_seen.reasons.keys().collect::<Vec<_>>()
    );

    // Healed: it is granted again.
    to_members.heal();
    to_learner.heal();
    eventually(
        "the healed learner admits",
        Duration::from_secs(30),
        || async {
            let mut router = kvplane_proto::v1::router_client::RouterClient::connect(
                cluster.nodes[far].endpoint(),
            )
            .await
            .ok()?;
            let mut seen = Seen::default();
            send_one(&mut router, "acme", &mut seen).await;
            (!seen.admitted.is_empty()).then_some(())
        },
    )
    .await;
}
