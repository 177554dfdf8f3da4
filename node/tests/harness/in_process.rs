//! A node inside the test's own process: `kvplane_node::serve::run` on loopback listeners,
//! over a real NATS and real redb files, with the config a [`Node`] would get. For semantics
//! that need no process boundary; kill -9, SIGSTOP and partitions need a [`Node`].

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use kvplane_node::config::{Config, Overrides};
use kvplane_proto::v1::admin_client::AdminClient;
use kvplane_proto::v1::router_client::RouterClient;
use kvplane_proto::v1::{StatusRequest, StatusResponse};
use tokio::sync::oneshot;
use tonic::transport::Channel;

use super::{Node, NodeOptions, eventually};

pub struct InProcess {
    pub grpc: SocketAddr,
    pub http: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<anyhow::Result<()>>>,
}

impl InProcess {
    /// Starts a node named `name` in `dir` (its config and data) on `nats_url`.
    pub async fn start(name: &str, dir: &Path, nats_url: &str, o: &NodeOptions) -> Self {
        std::fs::create_dir_all(dir).unwrap();
        let path = Node::write_config(name, dir, nats_url, o);
        let cfg = Config::load(&Overrides {
            config: Some(path),
            ..Overrides::default()
        })
        .unwrap();
        let (grpc, http) = kvplane_node::serve::bind(&cfg).await.unwrap();
        let (stop_tx, stop_rx) = oneshot::channel::<()>();
        let (ready_tx, ready_rx) = oneshot::channel();
        let task = tokio::spawn(kvplane_node::serve::run(
            cfg,
            grpc,
            http,
            async move {
                let _ = stop_rx.await;
            },
            move |b| {
                let _ = ready_tx.send(b);
            },
        ));
        let bound = tokio::time::timeout(Duration::from_secs(30), ready_rx)
            .await
            .expect("the in-process node became ready")
            .expect("the in-process node started");
        Self {
            grpc: bound.grpc,
            http: bound.http,
            stop: Some(stop_tx),
            task: Some(task),
        }
    }

    /// Stops it as SIGTERM would (components, then the member's final snapshot).
    pub async fn stop(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.task.take() {
            t.await.unwrap().unwrap();
        }
    }

    pub fn endpoint(&self) -> String {
        format!("http://{}", self.grpc)
    }

    pub async fn router(&self) -> RouterClient<Channel> {
        RouterClient::connect(self.endpoint()).await.unwrap()
    }

    pub async fn admin(&self) -> AdminClient<Channel> {
        AdminClient::connect(self.endpoint()).await.unwrap()
    }

    pub async fn status(&self) -> StatusResponse {
        self.admin()
            .await
            .status(StatusRequest::default())
            .await
            .unwrap()
            .into_inner()
    }

    /// Waits until the node has applied the stream up to `seq`.
    pub async fn wait_applied_seq(&self, seq: u64) -> StatusResponse {
        eventually(
            &format!("the in-process node to apply stream sequence {seq}"),
            Duration::from_secs(30),
            || async {
                let s = self.status().await;
                (s.ingest.as_ref().map_or(0, |i| i.applied_stream_sequence) >= seq).then_some(s)
            },
        )
        .await
    }
}

impl Drop for InProcess {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
    }
}
