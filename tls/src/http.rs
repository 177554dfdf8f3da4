//! The HTTP/1.1 listeners (the gateway, a node's metrics and probes): TLS when the process has
//! a section, and bounds on what a client may send before its request is read.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use serde::Deserialize;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpListener;
use tokio::task::JoinSet;
use tokio_stream::StreamExt;

use crate::Tls;
use crate::incoming::{Conn, Protocol, accept};

/// `[http]` of a node, the gateway's `--http-*` flags: one HTTP listener's bounds, and whether
/// it stays plaintext beside a TLS gRPC port.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HttpSection {
    /// Plaintext although the process has TLS: for probes and scrapers without the CA (the port
    /// then serves nothing but metrics and health).
    pub plaintext: bool,
    /// Bytes of a request's start line and headers; more: 431 and the connection closed.
    pub header_bytes: usize,
    /// Headers of one request; more: 431 and the connection closed.
    pub headers: usize,
    /// A connection that has not sent a request's whole head this long after it opened, or
    /// after the answer to its previous request, is closed: a slow client holds no connection
    /// longer, and an idle keep-alive connection is closed then too (counted as a limit hit
    /// only when part of a head had arrived).
    pub header_read_ms: u64,
}

impl Default for HttpSection {
    fn default() -> Self {
        Self {
            plaintext: false,
            header_bytes: 16 << 10,
            headers: 64,
            header_read_ms: 30_000,
        }
    }
}

/// hyper's smallest read buffer: a head limit below it is not kept.
const MIN_HEADER_BYTES: usize = 8192;
/// The most headers a request may be allowed (hyper reserves room for as many per request).
const MAX_HEADERS: usize = 1024;

impl HttpSection {
    /// Every problem with these bounds, each named by `key(field)`.
    pub fn problems(&self, key: impl Fn(&str) -> String) -> Vec<String> {
        let mut p = Vec::new();
        if self.header_bytes < MIN_HEADER_BYTES {
            p.push(format!(
                "{} must be at least {MIN_HEADER_BYTES}",
                key("header_bytes")
            ));
        }
        if !(1..=MAX_HEADERS).contains(&self.headers) {
            p.push(format!("{} must be in 1..={MAX_HEADERS}", key("headers")));
        }
        if self.header_read_ms == 0 {
            p.push(format!("{} must be at least 1", key("header_read_ms")));
        }
        p
    }
}

/// Which bound a connection ended on: `http_headers` (too many or too large) or
/// `http_header_read_ms` (a head that did not come in time).
pub type OnLimit = Arc<dyn Fn(&'static str) + Send + Sync>;

/// Serves `service` on `listener` (TLS with `tls`, HTTP/1.1) until `shutdown`; connections
/// still open then get `drain` to finish their requests. Each connection's bounds are
/// `section`'s; a connection ended by one is reported to `on_limit`.
pub async fn serve_http<S, B>(
    listener: TcpListener,
    tls: Option<Tls>,
    service: S,
    section: HttpSection,
    on_limit: OnLimit,
    shutdown: impl Future<Output = ()> + Send,
    drain: Duration,
) where
    S: tower::Service<http::Request<Incoming>, Response = http::Response<B>, Error = Infallible>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    B: http_body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let tls = tls.filter(|_| !section.plaintext);
    let mut conns = accept(listener, tls, Protocol::Http1);
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(Duration::from_millis(section.header_read_ms))
        .max_headers(section.headers)
        .max_header_size(section.header_bytes.max(MIN_HEADER_BYTES));
    let mut open = JoinSet::new();
    tokio::pin!(shutdown);
    loop {
        let conn = tokio::select! {
            c = conns.next() => c,
            () = &mut shutdown => break,
            // Ended connections' tasks are reaped as they go.
            Some(_) = open.join_next(), if !open.is_empty() => continue,
        };
        let Some(Ok(conn)) = conn else {
            break;
        };
        let partial = Arc::new(AtomicBool::new(false));
        let io = Watched {
            inner: conn,
            partial: partial.clone(),
        };
        let served = builder.serve_connection(
            TokioIo::new(io),
            hyper_util::service::TowerToHyperService::new(service.clone()),
        );
        let served = graceful.watch(served);
        let on_limit = on_limit.clone();
        open.spawn(async move {
            if let Err(e) = served.await {
                if e.is_timeout() {
                    // An idle keep-alive connection closed is no client over a bound.
                    if partial.load(Ordering::Relaxed) {
                        on_limit("http_header_read_ms");
                    }
                } else if e.is_parse_too_large() {
                    on_limit("http_headers");
                }
                tracing::debug!(error = %e, "http connection ended with an error");
            }
        });
    }
    drop(conns);
    if tokio::time::timeout(drain, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!(
            drain_s = drain.as_secs_f64(),
            "requests still open at the drain deadline: cut"
        );
    }
    open.abort_all();
}

/// A connection noting whether bytes came from the client since the server last wrote: a
/// head timing out then was under way, not an idle keep-alive connection's.
struct Watched {
    inner: Conn,
    partial: Arc<AtomicBool>,
}

impl AsyncRead for Watched {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let read = Pin::new(&mut self.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.partial.store(true, Ordering::Relaxed);
        }
        read
    }
}

impl AsyncWrite for Watched {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let wrote = Pin::new(&mut self.inner).poll_write(cx, buf);
        if matches!(wrote, Poll::Ready(Ok(n)) if n > 0) {
            self.partial.store(false, Ordering::Relaxed);
        }
        wrote
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let wrote = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        if matches!(wrote, Poll::Ready(Ok(n)) if n > 0) {
            self.partial.store(false, Ordering::Relaxed);
        }
        wrote
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}
