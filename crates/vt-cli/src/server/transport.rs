//! The HTTP transport under the router: hyper's HTTP/1 server with a header-read timeout (which
//! is also the keep-alive idle timeout: hyper arms it whenever it waits for a request head), a
//! bound on open connections, and a shutdown that drains in-flight requests for a bounded time:
//! it ends when no response is left to send, whatever half-open connections remain.
//!
//! axum's own `serve` has no header timeout, so one half-open connection could hold a shutdown
//! forever and idle connections could exhaust file descriptors.

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::{Request, State};
use axum::middleware::{from_fn_with_state, Next};
use axum::response::Response;
use axum::Router;
use http_body_util::BodyExt;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

/// Connection-level settings.
#[derive(Clone, Debug)]
pub struct Transport {
    /// Longest wait for a complete request head, and for the next request on a kept-alive
    /// connection.
    pub header_timeout: Duration,
    /// Most connections open at once; more are closed as soon as they are accepted.
    pub max_connections: usize,
    /// Longest a shutdown waits for in-flight requests before it closes what is left.
    pub drain_timeout: Duration,
}

impl Default for Transport {
    fn default() -> Self {
        Transport {
            header_timeout: Duration::from_secs(10),
            max_connections: 1024,
            drain_timeout: Duration::from_secs(30),
        }
    }
}

/// Serves `app` on `listener` until `shutdown` resolves, then stops accepting and waits up to
/// `drain_timeout` for open connections to finish their requests (idle ones close at once).
pub async fn serve(
    listener: TcpListener,
    app: Router,
    t: &Transport,
    shutdown: impl Future<Output = ()> + Send,
) -> std::io::Result<()> {
    let in_flight = Arc::new(AtomicUsize::new(0));
    let app = app.layer(from_fn_with_state(in_flight.clone(), count_in_flight));
    let slots = Arc::new(Semaphore::new(t.max_connections.max(1)));
    let graceful = GracefulShutdown::new();
    let mut http = http1::Builder::new();
    http.timer(TokioTimer::new()).header_read_timeout(t.header_timeout);
    tokio::pin!(shutdown);
    loop {
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // Out of file descriptors, or a connection reset before it was accepted:
                    // the listener stays usable; back off so a full table does not spin.
                    tracing::warn!("accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            // At debug level: a flood of connections must not become a flood of log lines.
            tracing::debug!("connection refused: {} connections are open (--max-connections)", t.max_connections);
            continue;
        };
        let _ = stream.set_nodelay(true);
        let conn = graceful.watch(http.serve_connection(TokioIo::new(stream), TowerToHyperService::new(app.clone())));
        tokio::spawn(async move {
            let _ = conn.await;
            drop(slot);
        });
    }
    drop(listener);
    let open = t.max_connections.max(1) - slots.available_permits();
    tracing::info!("shutting down: draining {open} open connections (at most {:?})", t.drain_timeout);
    let started = Instant::now();
    let requests_done = async {
        while in_flight.load(Ordering::Relaxed) > 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    let drained = async {
        // Every connection closed, or no response left to send (half-open ones never send one).
        tokio::select! {
            () = graceful.shutdown() => {}
            () = requests_done => {}
        }
    };
    match tokio::time::timeout(t.drain_timeout, drained).await {
        Ok(()) => tracing::info!("drained in {:.1?}", started.elapsed()),
        Err(_) => {
            let left = t.max_connections.max(1) - slots.available_permits();
            tracing::warn!("drain deadline passed: closing {left} connections still open");
        }
    }
    Ok(())
}

/// Counts a request as in flight until its response body has been sent or dropped.
async fn count_in_flight(State(n): State<Arc<AtomicUsize>>, req: Request, next: Next) -> Response {
    struct Done(Arc<AtomicUsize>);
    impl Drop for Done {
        fn drop(&mut self) {
            self.0.fetch_sub(1, Ordering::Relaxed);
        }
    }
    n.fetch_add(1, Ordering::Relaxed);
    let done = Done(n);
    keep_until_body_ends(next.run(req).await, done)
}

/// `response` holding `guard` until its body ends (sent whole, or dropped with the connection).
pub fn keep_until_body_ends(response: Response, guard: impl Send + Sync + 'static) -> Response {
    let (parts, body) = response.into_parts();
    let body = body.map_frame(move |frame| {
        let _ = &guard;
        frame
    });
    Response::from_parts(parts, Body::new(body))
}

/// Resolves at the first SIGINT or SIGTERM; a second one exits the process at once (status 130).
pub async fn shutdown_signal() {
    let first = next_signal().await;
    tracing::info!("{first}: finishing in-flight requests (again to exit now)");
    tokio::spawn(async {
        let second = next_signal().await;
        tracing::warn!("{second} again: exiting without draining");
        std::process::exit(130);
    });
}

async fn next_signal() -> &'static str {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let mut int = signal(SignalKind::interrupt()).expect("a SIGINT handler (needs a Tokio runtime)");
        let mut term = signal(SignalKind::terminate()).expect("a SIGTERM handler (needs a Tokio runtime)");
        tokio::select! {
            _ = int.recv() => "SIGINT",
            _ = term.recv() => "SIGTERM",
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
        "Ctrl-C"
    }
}
