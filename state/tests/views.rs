//! What a published View shares with the Views before it: a worker's name and address stay
//! the same allocation while the worker and its address stay (readers such as the routing
//! service's predictor tell workers apart by the name's pointer between Views), and the
//! records of pools an entry did not touch are the very ones published before.

#![allow(clippy::unwrap_used)]

mod support;

use std::sync::Arc;

use kvplane_state::{IngestPayload, StateMachine, View, WorkerMetrics};
use support::{apply_checked, message, pool};

fn up(sm: &mut StateMachine, pool: &str, worker: &str, address: &str) {
    let payload = IngestPayload::Worker {
        up: true,
        address: Some(address.into()),
    };
    let command = message(sm, pool, worker, payload);
    assert!(apply_checked(sm, command).is_none());
}

fn metrics(sm: &mut StateMachine, pool: &str, worker: &str, waiting: u32) {
    let payload = IngestPayload::Metrics(WorkerMetrics {
        waiting,
        ..Default::default()
    });
    let command = message(sm, pool, worker, payload);
    assert!(apply_checked(sm, command).is_none());
}

/// (name, address) of every worker of `pool`, as the view holds them.
fn records(view: &View, pool: &str) -> Vec<(Arc<str>, Option<Arc<str>>)> {
    view.pools[pool]
        .workers
        .iter()
        .map(|w| (w.name.clone(), w.address.clone()))
        .collect()
}

fn same(a: &[(Arc<str>, Option<Arc<str>>)], b: &[(Arc<str>, Option<Arc<str>>)]) -> Vec<bool> {
    a.iter()
        .zip(b)
        .map(|((an, aa), (bn, ba))| {
            Arc::ptr_eq(an, bn)
                && match (aa, ba) {
                    (Some(x), Some(y)) => Arc::ptr_eq(x, y),
                    (None, None) => true,
                    _ => false,
                }
        })
        .collect()
}

#[test]
fn a_workers_name_and_address_are_shared_with_the_views_before_it_while_they_stay() {
    let mut sm = StateMachine::new();
    assert!(apply_checked(&mut sm, pool("p", 4)).is_none());
    assert!(apply_checked(&mut sm, pool("q", 4)).is_none());
    for w in ["a", "c", "e"] {
        up(&mut sm, "p", w, &format!("http://{w}:8000"));
    }
    up(&mut sm, "q", "x", "http://x:8000");
    let first = sm.handle().load();
    let before = records(&first, "p");
    // Metrics of one worker republish its pool: every record keeps its allocations.
    metrics(&mut sm, "p", "c", 3);
    let v = sm.handle().load();
    assert_eq!(v.pools["p"].workers[1].metrics.waiting, 3);
    assert_eq!(same(&before, &records(&v, "p")), [true, true, true]);
    // A pool the entry did not touch is the record published before.
    assert!(Arc::ptr_eq(&first.pools["q"], &v.pools["q"]));
    // A worker joins between two others and one moves: the others keep theirs.
    up(&mut sm, "p", "b", "http://b:8000");
    up(&mut sm, "p", "e", "http://e:9000");
    let v = sm.handle().load();
    let now = records(&v, "p");
    let names: Vec<&str> = now.iter().map(|(n, _)| &**n).collect();
    assert_eq!(names, ["a", "b", "c", "e"]);
    assert_eq!(
        same(
            &[before[0].clone(), before[1].clone()],
            &[now[0].clone(), now[2].clone()]
        ),
        [true, true]
    );
    assert!(Arc::ptr_eq(&before[2].0, &now[3].0), "e keeps its name");
    assert_eq!(
        now[3].1.as_deref(),
        Some("http://e:9000"),
        "and has its new address"
    );
}
