//! Asking a member how it is, out of band: `/readyz`, `/metrics`, `Admin.Status`, and its
//! failpoints; `None` or an error while it does not answer, never a panic.

use std::time::Duration;

use anyhow::Context;
use kvplane_proto::v1::admin_client::AdminClient;

/// Sets `node`'s failpoints (`name=actions;...`; empty clears them).
pub async fn failpoints(node: &kvplane_testkit::Node, spec: &str) -> anyhow::Result<()> {
    let set = async {
        AdminClient::connect(node.endpoint())
            .await?
            .set_failpoints(kvplane_proto::v1::SetFailpointsRequest {
                failpoints: spec.to_owned(),
            })
            .await
            .map_err(anyhow::Error::from)
    };
    tokio::time::timeout(Duration::from_secs(10), set)
        .await
        .map_err(|_| anyhow::anyhow!("{} did not answer SetFailpoints within 10 s", node.name))?
        .with_context(|| format!("failpoints {spec:?} on {}", node.name))?;
    Ok(())
}

/// Whether `node` answers `/readyz` with 200 (false while it does not answer at all).
pub async fn ready(node: &kvplane_testkit::Node) -> bool {
    let url = node.http_url("/readyz");
    let r = tokio::time::timeout(Duration::from_secs(2), http_status(&url));
    matches!(r.await, Ok(Some(200)))
}

/// The body of a plaintext `GET url` answered 200, or `None`.
pub async fn http_body(url: &str) -> Option<String> {
    let url: tonic::codegen::http::Uri = url.parse().ok()?;
    let addr = format!("{}:{}", url.host()?, url.port_u16()?);
    let read = async {
        let mut s = tokio::net::TcpStream::connect(addr).await.ok()?;
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        s.write_all(format!("GET {} HTTP/1.0\r\nhost: x\r\n\r\n", url.path()).as_bytes())
            .await
            .ok()?;
        let mut all = Vec::new();
        s.read_to_end(&mut all).await.ok()?;
        let text = String::from_utf8(all).ok()?;
        let (head, body) = text.split_once("\r\n\r\n")?;
        (head.split_whitespace().nth(1) == Some("200")).then(|| body.to_owned())
    };
    tokio::time::timeout(Duration::from_secs(2), read)
        .await
        .ok()
        .flatten()
}

/// The status code of a plaintext `GET url`, or `None` without an answer.
async fn http_status(url: &str) -> Option<u16> {
    let url: tonic::codegen::http::Uri = url.parse().ok()?;
    let addr = format!("{}:{}", url.host()?, url.port_u16()?);
    let mut s = tokio::net::TcpStream::connect(addr).await.ok()?;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    s.write_all(format!("GET {} HTTP/1.0\r\nhost: x\r\n\r\n", url.path()).as_bytes())
        .await
        .ok()?;
    let mut head = [0u8; 12];
    s.read_exact(&mut head).await.ok()?;
    std::str::from_utf8(&head[9..12]).ok()?.parse().ok()
}

/// `node`'s status, or `None` while it does not answer.
pub async fn status(node: &kvplane_testkit::Node) -> Option<kvplane_proto::v1::StatusResponse> {
    let ask = async {
        let mut c = kvplane_proto::v1::admin_client::AdminClient::connect(node.endpoint())
            .await
            .ok()?;
        c.status(kvplane_proto::v1::StatusRequest::default())
            .await
            .ok()
            .map(tonic::Response::into_inner)
    };
    tokio::time::timeout(Duration::from_secs(2), ask)
        .await
        .ok()
        .flatten()
}
