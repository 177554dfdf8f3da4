//! Workers' leases: an `ExpireLeases` entry takes down exactly the workers that are up and were
//! last heard from more than the lease before the entry's timestamp, clears their blocks like
//! a worker's own "down" would, and replays the same from a snapshot.

#![allow(clippy::unwrap_used)]

mod support;

use support::{apply_at, two_blocks};

use kvplane_state::{Command, IngestPayload, StateMachine, WorkerMetrics};

fn message(sm: &StateMachine, worker: &str, payload: IngestPayload) -> Command {
    support::message(sm, "p", worker, payload)
}

/// (up, indexed blocks) of each worker, by name.
fn workers(sm: &StateMachine) -> Vec<(String, bool, u64)> {
    sm.handle()
        .load()
        .workers()
        .map(|w| (w.name.to_string(), w.up, w.indexed_blocks))
        .collect()
}

/// Pool `p`; w0 stores two blocks at 1,000 ms; w1 reports metrics at 1,000 and 1,800 ms.
fn fleet() -> StateMachine {
    let mut sm = StateMachine::new();
    let pool = support::pool("p", 4);
    apply_at(&mut sm, 1, pool);
    let m = message(&sm, "w0", two_blocks());
    apply_at(&mut sm, 1_000, m);
    let metrics = IngestPayload::Metrics(WorkerMetrics::default());
    let m = message(&sm, "w1", metrics.clone());
    apply_at(&mut sm, 1_000, m);
    let m = message(&sm, "w1", metrics);
    apply_at(&mut sm, 1_800, m);
    sm
}

const LEASE: Command = Command::ExpireLeases { lease_ms: 500 };

#[test]
fn only_workers_silent_for_longer_than_the_lease_go_down_and_lose_their_blocks() {
    let mut sm = fleet();
    assert_eq!(
        workers(&sm),
        [("w0".into(), true, 2), ("w1".into(), true, 0)]
    );
    // 1,000 + 500 is not before 1,500: nobody yet.
    assert!(apply_at(&mut sm, 1_500, LEASE).expired.is_empty());
    assert_eq!(workers(&sm)[0], ("w0".into(), true, 2));

    let out = apply_at(&mut sm, 2_000, LEASE);
    assert_eq!(out.expired, [("p".to_owned(), "w0".to_owned())]);
    assert_eq!(
        workers(&sm),
        [("w0".into(), false, 0), ("w1".into(), true, 0)]
    );
    assert_eq!(sm.indexed_blocks(), 0);

    // A worker that is down is not expired again; w1's lease (1,800 + 500) runs out after 2,300.
    let out = apply_at(&mut sm, 2_300, LEASE);
    assert!(out.expired.is_empty(), "{:?}", out.expired);
    let out = apply_at(&mut sm, 2_301, LEASE);
    assert_eq!(out.expired, [("p".to_owned(), "w1".to_owned())]);
}

#[test]
fn a_worker_heard_again_keeps_its_lease_and_one_that_announces_itself_comes_back() {
    let mut sm = fleet();
    let m = message(&sm, "w0", IngestPayload::Metrics(WorkerMetrics::default()));
    apply_at(&mut sm, 1_900, m);
    assert!(apply_at(&mut sm, 2_000, LEASE).expired.is_empty());
    assert_eq!(workers(&sm)[0], ("w0".into(), true, 2));

    assert_eq!(apply_at(&mut sm, 3_000, LEASE).expired.len(), 2);
    let up = IngestPayload::Worker {
        up: true,
        address: None,
    };
    let m = message(&sm, "w0", up);
    apply_at(&mut sm, 3_100, m);
    let m = message(&sm, "w0", two_blocks());
    apply_at(&mut sm, 3_100, m);
    assert_eq!(workers(&sm)[0], ("w0".into(), true, 2));
}

#[test]
fn a_restored_snapshot_expires_the_same_workers_at_the_same_entry() {
    let mut original = fleet();
    let mut restored = StateMachine::restore(&original.snapshot().unwrap()).unwrap();
    let a = apply_at(&mut original, 2_000, LEASE);
    let b = apply_at(&mut restored, 2_000, LEASE);
    assert_eq!(a.expired, b.expired);
    assert_eq!(a.expired.len(), 1);
    assert_eq!(original.digest(), restored.digest());
}
