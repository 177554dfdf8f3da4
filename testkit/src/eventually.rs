//! Waiting on conditions, never on fixed sleeps: a condition is polled every 20 ms until it
//! holds, and a wait that times out names what it waited for.

use std::future::Future;
use std::time::{Duration, Instant};

const POLL: Duration = Duration::from_millis(20);

/// Polls `f` until it returns `Some`, or panics after `timeout` naming `what`.
pub async fn eventually<T, F, Fut>(what: &str, timeout: Duration, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(POLL).await;
    }
}

/// [`eventually`] for a condition that needs no await.
pub async fn eventually_sync<T>(
    what: &str,
    timeout: Duration,
    mut f: impl FnMut() -> Option<T>,
) -> T {
    eventually(what, timeout, || std::future::ready(f())).await
}
