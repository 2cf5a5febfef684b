//! The connection layer: our accept loop over hyper's HTTP/1.1 server, with
//! the limits a server facing careless or hostile clients needs
//! (`axum::serve` has none of them; hyper provides the protocol, the rest
//! is here):
//!
//! - **Timeouts per connection phase.** A connection is *reading a head*
//!   from its accept or the first byte of a new request until the request
//!   reaches the application ([`ConnLimits::header_timeout`]), *busy* while
//!   a request is in the application or its response is being sent (no
//!   limit here: the body timeout is in [`crate::body`], and generation has
//!   its own limits), and *idle* between keep-alive requests
//!   ([`ConnLimits::idle_timeout`]). A watchdog closes a connection whose
//!   phase outlasts its limit.
//! - **A connection limit.** At [`ConnLimits::max_connections`] a new
//!   connection closes the longest-waiting connection that has no request
//!   in the application (half-open and idle ones), so a flood of slow or
//!   silent connections cannot lock out real clients or `/health`; when
//!   every connection is busy the new one gets 503 and is closed.
//! - **JSON protocol errors.** hyper answers a request it cannot parse (bad
//!   request line, bad header or `Content-Length`, a head over
//!   [`ConnLimits::max_header_bytes`]) itself with an empty 400/414/431 and
//!   closes the connection. [`ConnIo`] sees that response go out (a final
//!   response head the application did not produce) and sends the API's
//!   JSON error instead.

use std::collections::{HashMap, HashSet};
use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{ready, Context, Poll};
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::http::StatusCode;
use axum::Router;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;
use tower::ServiceExt;

use crate::error::ApiError;
use crate::metrics::Metrics;

/// Limits of the connection layer.
#[derive(Debug, Clone, Copy)]
pub struct ConnLimits {
    /// Most open connections.
    pub max_connections: usize,
    /// Time from a connection's accept, or from the first byte of a
    /// keep-alive request, to the end of the request head.
    pub header_timeout: Duration,
    /// Time a keep-alive connection may wait for its next request.
    pub idle_timeout: Duration,
    /// Largest request head (request line and headers) in bytes.
    pub max_header_bytes: usize,
}

const HEAD: u8 = 0;
const BUSY: u8 = 1;
const IDLE: u8 = 2;

/// Why the server closed a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Closed {
    HeaderTimeout,
    IdleTimeout,
    Evicted,
}

/// One connection's state, shared by its task, its IO and its requests.
struct Conn {
    id: u64,
    /// HEAD, BUSY or IDLE.
    phase: AtomicU8,
    /// When the phase began, in milliseconds since the layer's epoch.
    since_ms: AtomicU64,
    /// Requests in the application or being answered.
    in_flight: AtomicUsize,
    /// Responses the application produced whose head [`ConnIo`] has not
    /// seen go out yet.
    responses_owed: AtomicUsize,
    /// Signalled to close the connection (eviction).
    close: Notify,
}

impl Conn {
    fn set_phase(&self, phase: u8, now_ms: u64) {
        self.since_ms.store(now_ms, Ordering::Relaxed);
        self.phase.store(phase, Ordering::Release);
    }
}

/// What the connection tasks share.
struct Shared {
    epoch: Instant,
    limits: ConnLimits,
    metrics: Arc<Metrics>,
    registry: Mutex<Registry>,
}

#[derive(Default)]
struct Registry {
    conns: HashMap<u64, Arc<Conn>>,
    /// Told to close, not gone yet.
    closing: HashSet<u64>,
    next_id: u64,
}

impl Shared {
    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    /// Registers a new connection, closing the longest-waiting one without
    /// a request in progress when at the limit; None when every connection
    /// is busy.
    fn admit(&self) -> Option<Arc<Conn>> {
        let mut r = self.registry.lock().unwrap_or_else(|e| e.into_inner());
        if r.conns.len() - r.closing.len() >= self.limits.max_connections {
            let victim = r
                .conns
                .values()
                .filter(|c| !r.closing.contains(&c.id))
                .filter(|c| c.phase.load(Ordering::Acquire) != BUSY)
                .min_by_key(|c| c.since_ms.load(Ordering::Relaxed))
                .cloned()?;
            r.closing.insert(victim.id);
            victim.close.notify_one();
        }
        r.next_id += 1;
        let conn = Arc::new(Conn {
            id: r.next_id,
            phase: AtomicU8::new(HEAD),
            since_ms: AtomicU64::new(self.now_ms()),
            in_flight: AtomicUsize::new(0),
            responses_owed: AtomicUsize::new(0),
            close: Notify::new(),
        });
        r.conns.insert(conn.id, conn.clone());
        Some(conn)
    }

    /// Connections registered, closing ones included (they still hold a
    /// file descriptor).
    fn held(&self) -> usize {
        self.registry
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .conns
            .len()
    }

    /// Takes back an eviction (the connection became busy first).
    fn spare(&self, id: u64) {
        let mut r = self.registry.lock().unwrap_or_else(|e| e.into_inner());
        r.closing.remove(&id);
    }

    fn remove(&self, id: u64) {
        let mut r = self.registry.lock().unwrap_or_else(|e| e.into_inner());
        r.conns.remove(&id);
        r.closing.remove(&id);
    }
}

/// Marks a connection busy while a request is in the application and its
/// response is being sent (it lives in the response body).
struct BusyGuard {
    conn: Arc<Conn>,
    shared: Arc<Shared>,
}

impl BusyGuard {
    fn enter(conn: Arc<Conn>, shared: Arc<Shared>) -> BusyGuard {
        conn.in_flight.fetch_add(1, Ordering::AcqRel);
        conn.responses_owed.fetch_add(1, Ordering::AcqRel);
        conn.set_phase(BUSY, shared.now_ms());
        BusyGuard { conn, shared }
    }
}

impl Drop for BusyGuard {
    fn drop(&mut self) {
        if self.conn.in_flight.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.conn.set_phase(IDLE, self.shared.now_ms());
        }
    }
}

/// A response body that keeps its connection busy until it is dropped.
struct GuardedBody {
    inner: Body,
    _guard: BusyGuard,
}

impl http_body::Body for GuardedBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// The TCP stream as hyper sees it: notes the first byte of each request
/// (idle to reading a head) and replaces hyper's own error responses with
/// the API's JSON errors.
struct ConnIo {
    inner: TcpStream,
    conn: Arc<Conn>,
    shared: Arc<Shared>,
    /// The replacement response being written, and how much of it is out.
    pending: Vec<u8>,
    pending_at: usize,
    /// After a replaced response hyper writes nothing that matters (it
    /// closes the connection); anything more is dropped.
    replaced: bool,
}

impl ConnIo {
    fn poll_pending(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while self.pending_at < self.pending.len() {
            let n =
                ready!(Pin::new(&mut self.inner).poll_write(cx, &self.pending[self.pending_at..]))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.pending_at += n;
        }
        Poll::Ready(Ok(()))
    }

    /// The status of a response head at the start of `buf`, if it is one
    /// hyper wrote on its own (no response of the application is owed).
    fn own_error_status(&self, buf: &[u8]) -> Option<StatusCode> {
        let rest = buf.strip_prefix(b"HTTP/1.1 ")?;
        let status = StatusCode::from_bytes(rest.get(..3)?).ok()?;
        if status.is_informational() {
            return None; // 100 Continue, on the application's behalf
        }
        let owed = &self.conn.responses_owed;
        if owed
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1))
            .is_ok()
        {
            return None; // the application's response
        }
        (status.is_client_error() || status.is_server_error()).then_some(status)
    }
}

impl AsyncRead for ConnIo {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        ready!(Pin::new(&mut self.inner).poll_read(cx, buf))?;
        if buf.filled().len() > before && self.conn.phase.load(Ordering::Acquire) == IDLE {
            self.conn.set_phase(HEAD, self.shared.now_ms());
        }
        Poll::Ready(Ok(()))
    }
}

impl AsyncWrite for ConnIo {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        if this.replaced {
            ready!(this.poll_pending(cx))?;
            return Poll::Ready(Ok(buf.len()));
        }
        if let Some(status) = this.own_error_status(buf) {
            this.shared
                .metrics
                .protocol_errors
                .fetch_add(1, Ordering::Relaxed);
            this.pending =
                ApiError::protocol(status, this.shared.limits.max_header_bytes).http_bytes();
            this.pending_at = 0;
            this.replaced = true;
            ready!(this.poll_pending(cx))?;
            return Poll::Ready(Ok(buf.len()));
        }
        Pin::new(&mut this.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        ready!(self.poll_pending(cx))?;
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        ready!(self.poll_pending(cx))?;
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    // Not vectored: hyper then writes each response head as the start of
    // one buffer, which is what `own_error_status` looks at.
    fn is_write_vectored(&self) -> bool {
        false
    }
}

/// Closes the connection when its phase outlasts its limit.
async fn watchdog(conn: &Conn, shared: &Shared) -> Closed {
    loop {
        let phase = conn.phase.load(Ordering::Acquire);
        let since = conn.since_ms.load(Ordering::Relaxed);
        let (limit, reason) = match phase {
            HEAD => (shared.limits.header_timeout, Closed::HeaderTimeout),
            IDLE => (shared.limits.idle_timeout, Closed::IdleTimeout),
            _ => {
                // Busy: look again later (the phase's start moves when it ends).
                tokio::time::sleep(Duration::from_millis(500)).await;
                continue;
            }
        };
        let deadline = shared.epoch + Duration::from_millis(since) + limit;
        if Instant::now() >= deadline {
            return reason;
        }
        tokio::time::sleep_until(deadline.into()).await;
    }
}

/// Serves `app` on `listener` until `shutdown` completes, then lets
/// requests in progress finish for up to `drain` (the caller cancels
/// generation meanwhile) before returning.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: ConnLimits,
    metrics: Arc<Metrics>,
    shutdown: impl Future<Output = ()>,
    drain: Duration,
) {
    let shared = Arc::new(Shared {
        epoch: Instant::now(),
        limits,
        metrics,
        registry: Mutex::new(Registry::default()),
    });
    let mut http = hyper::server::conn::http1::Builder::new();
    http.max_header_size(limits.max_header_bytes)
        // The watchdog times heads (hyper's own timer would also cut idle
        // keep-alive connections at the header timeout).
        .header_read_timeout(None)
        .keep_alive(true);
    let graceful = GracefulShutdown::new();
    // Closing connections still hold a descriptor: wait for them past this.
    let most_held = limits.max_connections + 64;
    let mut last_accept_error: Option<Instant> = None;
    tokio::pin!(shutdown);
    loop {
        while shared.held() >= most_held {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        let (stream, _peer) = tokio::select! {
            r = listener.accept() => match r {
                Ok(s) => s,
                Err(e) => {
                    // Out of descriptors and the like: wait, never stop serving.
                    if last_accept_error.is_none_or(|t| t.elapsed() > Duration::from_secs(5)) {
                        tracing::warn!("accept failed: {e}");
                        last_accept_error = Some(Instant::now());
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                }
            },
            _ = &mut shutdown => break,
        };
        let _ = stream.set_nodelay(true);
        let m = &shared.metrics;
        m.connections_accepted.fetch_add(1, Ordering::Relaxed);
        let Some(conn) = shared.admit() else {
            m.connections_closed.refused.fetch_add(1, Ordering::Relaxed);
            let refusal = ApiError::too_many_connections(limits.max_connections).http_bytes();
            let _ = stream.try_write(&refusal);
            continue;
        };
        m.open_connections.fetch_add(1, Ordering::Relaxed);
        let io = TokioIo::new(ConnIo {
            inner: stream,
            conn: conn.clone(),
            shared: shared.clone(),
            pending: Vec::new(),
            pending_at: 0,
            replaced: false,
        });
        let service = {
            let (conn, shared, app) = (conn.clone(), shared.clone(), app.clone());
            hyper::service::service_fn(move |req: hyper::Request<Incoming>| {
                let guard = BusyGuard::enter(conn.clone(), shared.clone());
                let response = app.clone().oneshot(req.map(Body::new));
                async move {
                    let response = match response.await {
                        Ok(r) => r,
                        Err(never) => match never {},
                    };
                    Ok::<_, Infallible>(response.map(|inner| {
                        Body::new(GuardedBody {
                            inner,
                            _guard: guard,
                        })
                    }))
                }
            })
        };
        let connection = graceful.watch(http.serve_connection(io, service));
        let shared = shared.clone();
        tokio::spawn(async move {
            tokio::pin!(connection);
            let closed = loop {
                tokio::select! {
                    r = &mut connection => {
                        if let Err(e) = r {
                            tracing::debug!("connection ended: {e}");
                        }
                        break None;
                    }
                    reason = watchdog(&conn, &shared) => break Some(reason),
                    _ = conn.close.notified() => {
                        // A request may have reached the application since
                        // this connection was picked: it stays.
                        if conn.phase.load(Ordering::Acquire) == BUSY {
                            shared.spare(conn.id);
                            continue;
                        }
                        break Some(Closed::Evicted);
                    }
                }
            };
            let c = &shared.metrics.connections_closed;
            match closed {
                Some(Closed::HeaderTimeout) => c.header_timeout.fetch_add(1, Ordering::Relaxed),
                Some(Closed::IdleTimeout) => c.idle_timeout.fetch_add(1, Ordering::Relaxed),
                Some(Closed::Evicted) => c.evicted.fetch_add(1, Ordering::Relaxed),
                None => 0,
            };
            shared
                .metrics
                .open_connections
                .fetch_sub(1, Ordering::Relaxed);
            shared.remove(conn.id);
        });
    }
    drop(listener);
    if tokio::time::timeout(drain, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!("connections still open after {drain:?}: closing them");
    }
}
