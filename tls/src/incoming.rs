//! The server side: accepted connections, TLS when the process has a `[tls]` section, each
//! named by the caller's certificate.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::server::Connected;

use crate::Tls;
use crate::identity::{Identity, Peer};

/// One accepted connection.
#[derive(Debug)]
pub struct Conn {
    io: Io,
    peer: Peer,
}

#[derive(Debug)]
enum Io {
    Plain(TcpStream),
    Tls(Box<TlsStream<TcpStream>>),
}

impl Connected for Conn {
    type ConnectInfo = Peer;

    fn connect_info(&self) -> Peer {
        self.peer.clone()
    }
}

impl AsyncRead for Conn {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match &mut self.get_mut().io {
            Io::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Conn {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match &mut self.get_mut().io {
            Io::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match &mut self.get_mut().io {
            Io::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match &self.io {
            Io::Plain(s) => s.is_write_vectored(),
            Io::Tls(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match &mut self.get_mut().io {
            Io::Plain(s) => Pin::new(s).poll_flush(cx),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match &mut self.get_mut().io {
            Io::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}

/// Handshakes in progress at once; past it, accepting waits for one to end.
const MAX_HANDSHAKES: usize = 512;

/// The connections `listener` accepts, without Nagle (answers are small writes), for
/// `serve_with_incoming`. With `tls`, each handshake runs on its own task under the section's
/// handshake timeout (at most [`MAX_HANDSHAKES`] at once), so a slow or silent caller holds up
/// no one else; failed handshakes (a plaintext caller's too) are counted and dropped. Accepting
/// stops when the stream is dropped.
pub fn incoming(listener: TcpListener, tls: Option<Tls>) -> ReceiverStream<io::Result<Conn>> {
    accept(listener, tls, Protocol::H2)
}

/// What a listener's TLS handshake offers (ALPN).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Protocol {
    /// gRPC.
    H2,
    /// The HTTP listeners ([`crate::serve_http`]).
    Http1,
}

/// [`incoming`], offering `protocol`.
pub(crate) fn accept(
    listener: TcpListener,
    tls: Option<Tls>,
    protocol: Protocol,
) -> ReceiverStream<io::Result<Conn>> {
    let (tx, rx) = mpsc::channel(64);
    let handshakes = std::sync::Arc::new(tokio::sync::Semaphore::new(MAX_HANDSHAKES));
    tokio::spawn(async move {
        loop {
            let accepted = tokio::select! {
                a = listener.accept() => a,
                () = tx.closed() => return,
            };
            let (tcp, remote) = match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Out of file descriptors and the like: the listener itself stays good.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    continue;
                }
            };
            let _ = tcp.set_nodelay(true);
            let Some(tls) = tls.clone() else {
                let peer = Peer {
                    remote: Some(remote),
                    tls: false,
                    identity: None,
                };
                let conn = Conn {
                    io: Io::Plain(tcp),
                    peer,
                };
                if tx.send(Ok(conn)).await.is_err() {
                    return;
                }
                continue;
            };
            let tx = tx.clone();
            let Ok(permit) = handshakes.clone().acquire_owned().await else {
                return;
            };
            tokio::spawn(async move {
                let _permit = permit;
                let acceptor = TlsAcceptor::from(match protocol {
                    Protocol::H2 => tls.server_config(),
                    Protocol::Http1 => tls.http1_server_config(),
                });
                let shake = tokio::time::timeout(tls.handshake_timeout(), acceptor.accept(tcp));
                let stream = match shake.await {
                    Ok(Ok(s)) => s,
                    Ok(Err(e)) => {
                        tls.metrics().handshake_failed();
                        tracing::debug!(%remote, error = %e, "tls handshake failed");
                        return;
                    }
                    Err(_) => {
                        tls.metrics().handshake_failed();
                        tracing::debug!(%remote, "tls handshake timed out");
                        return;
                    }
                };
                let identity = stream
                    .get_ref()
                    .1
                    .peer_certificates()
                    .and_then(|c| c.first())
                    .and_then(|c| Identity::of_certificate(c));
                let peer = Peer {
                    remote: Some(remote),
                    tls: true,
                    identity,
                };
                let conn = Conn {
                    io: Io::Tls(Box::new(stream)),
                    peer,
                };
                let _ = tx.send(Ok(conn)).await;
            });
        }
    });
    ReceiverStream::new(rx)
}
