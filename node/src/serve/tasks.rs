//! The node's components as tasks: each runs until the one stop signal, and stopping waits
//! for all of them.

use std::future::Future;

use tokio::sync::watch;
use tokio::task::JoinSet;

/// The running components of a node, by name.
pub(super) struct Tasks {
    stop: watch::Sender<bool>,
    set: JoinSet<&'static str>,
    /// Those the node is nothing without (its ports): one ending early stops the node.
    critical: JoinSet<&'static str>,
}

impl Tasks {
    pub(super) fn new() -> Self {
        Self {
            stop: watch::channel(false).0,
            set: JoinSet::new(),
            critical: JoinSet::new(),
        }
    }

    /// As [`Tasks::spawn`], for a component whose end before the stop signal stops the node.
    pub(super) fn spawn_critical<F>(
        &mut self,
        name: &'static str,
        start: impl FnOnce(watch::Receiver<bool>) -> F,
    ) where
        F: Future<Output = ()> + Send + 'static,
    {
        self.critical
            .spawn(named(name, start(self.stop.subscribe())));
    }

    /// Resolves when a critical component has ended (never, while all run), with its name.
    pub(super) async fn critical_ended(&mut self) -> &'static str {
        match self.critical.join_next().await {
            Some(Ok(name)) => name,
            Some(Err(_)) => "a critical component",
            None => std::future::pending().await,
        }
    }

    /// Runs the component `start` makes of the stop signal (it must end soon after the
    /// signal) as `name`.
    pub(super) fn spawn<F>(
        &mut self,
        name: &'static str,
        start: impl FnOnce(watch::Receiver<bool>) -> F,
    ) where
        F: Future<Output = ()> + Send + 'static,
    {
        self.set.spawn(named(name, start(self.stop.subscribe())));
    }

    /// Signals every component to stop and waits until all have.
    pub(super) async fn stop(mut self) {
        let _ = self.stop.send(true);
        for set in [&mut self.set, &mut self.critical] {
            while let Some(done) = set.join_next().await {
                match done {
                    Ok(name) => tracing::debug!(component = name, "stopped"),
                    Err(e) => tracing::error!(error = %e, "a component failed"),
                }
            }
        }
    }
}

/// `component`, answering its name when it ends.
async fn named(name: &'static str, component: impl Future<Output = ()>) -> &'static str {
    component.await;
    name
}
