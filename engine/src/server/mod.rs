//! `pa serve`: an OpenAI-compatible HTTP server on an engine client (axum routes on hyper
//! connections, on tokio).
//!
//! Routes (`routes`): `POST /v1/completions`, `POST /v1/chat/completions` (streaming as
//! server-sent events, `response`), `GET /v1/models`, `GET /health` (200 once the model is
//! compiled), `GET /metrics` (Prometheus text, `crate::metrics`), `GET /debug/kv-cache-blocks`
//! (with KV-cache events, `crate::kv_events`). Every error is OpenAI's error JSON (`openai`).
//!
//! Connections: a request head must arrive within the read timeout, and so must a body; a
//! connection that stalls is closed. SIGINT/SIGTERM starts the drain: new requests (on new
//! connections too) get 503, in-flight ones may finish until the shutdown timeout, then they are
//! ended and the process exits, whatever the clients do.

// A handler's error is its finished response (OpenAI's error JSON), returned as it is.
#![allow(clippy::result_large_err)]

mod openai;
mod response;
mod routes;

use crate::client::EngineClient;
use crate::config::EngineConfig;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use routes::App;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::time::Instant;

/// How the server runs.
#[derive(Clone, Debug)]
pub struct ServeConfig {
    pub host: String,
    pub port: u16,
    /// Bearer key every `/v1/` request must carry (`None`: no key).
    pub api_key: Option<String>,
    /// Requests admitted at once (running, waiting, and being answered); more get 503.
    pub max_queue: usize,
    /// Largest request body.
    pub max_body_bytes: usize,
    /// A request's head, and then its body, must arrive within this.
    pub read_timeout: Duration,
    /// After SIGINT/SIGTERM, in-flight requests may finish for this long; then they are ended.
    pub shutdown_timeout: Duration,
    /// The name `/v1/models` lists and requests must use (and `/metrics`' `model_name` label).
    pub model_name: String,
    /// How `/metrics` spells the names vLLM also has.
    pub metric_names: crate::metrics::Naming,
}

/// After the shutdown timeout, ended requests have this long to send their last events.
const FLUSH_GRACE: Duration = Duration::from_millis(500);

/// Runs the server until SIGINT or SIGTERM; returns once in-flight requests have ended (or
/// were ended at the shutdown timeout).
pub fn serve(dir: PathBuf, engine_cfg: EngineConfig, cfg: ServeConfig) -> Result<(), String> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the async runtime: {e}"))?;
    let (client, loading) = EngineClient::start(&dir, engine_cfg).map_err(|e| e.to_string())?;
    let client = Arc::new(client);
    let app = Arc::new(App {
        cfg,
        client: client.clone(),
        ready: AtomicBool::new(false),
        shutting_down: AtomicBool::new(false),
        in_flight: AtomicUsize::new(0),
    });
    let result = rt.block_on(run(app, loading));
    // Connections still open and a tokenizer still working are not waited for.
    rt.shutdown_background();
    client.stop();
    result
}

async fn run(app: Arc<App>, loading: crate::client::Loading) -> Result<(), String> {
    let addr = format!("{}:{}", app.cfg.host, app.cfg.port);
    let listener = TcpListener::bind(&addr)
        .await
        .map_err(|e| format!("cannot listen on {addr}: {e}"))?;
    eprintln!("pa serve: listening on http://{addr} (loading the model)");
    // The model loads while the port already answers /health with 503.
    let mut loaded = tokio::task::spawn_blocking(move || loading.wait());
    let (drain_tx, drain_rx) = watch::channel(false);
    let router = routes::router(app.clone());
    let accept = |conn: std::io::Result<(tokio::net::TcpStream, std::net::SocketAddr)>| {
        if let Ok((stream, _)) = conn {
            tokio::spawn(connection(
                stream,
                router.clone(),
                app.clone(),
                drain_rx.clone(),
            ));
        }
    };
    let signal = wait_for_signal();
    tokio::pin!(signal);
    let mut loading = true;
    loop {
        tokio::select! {
            conn = listener.accept() => accept(conn),
            r = &mut loaded, if loading => {
                loading = false;
                match r {
                    Ok(Ok(())) => {
                        app.ready.store(true, Ordering::SeqCst);
                        eprintln!("pa serve: ready, model `{}`", app.cfg.model_name);
                    }
                    Ok(Err(e)) => return Err(e),
                    Err(e) => return Err(e.to_string()),
                }
            }
            () = &mut signal => break,
        }
    }
    let timeout = app.cfg.shutdown_timeout;
    eprintln!(
        "pa serve: shutting down: new requests get 503; in-flight ones have {timeout:?} to finish"
    );
    app.shutting_down.store(true, Ordering::SeqCst);
    let _ = drain_tx.send(true);
    // The drain: still accepting (to answer 503), until nothing is in flight or the time is up.
    let deadline = Instant::now() + timeout;
    let mut ended = false;
    let mut tick = tokio::time::interval(Duration::from_millis(20));
    loop {
        tokio::select! {
            conn = listener.accept() => accept(conn),
            _ = tick.tick() => {
                if app.in_flight.load(Ordering::SeqCst) == 0 {
                    return Ok(());
                }
                let now = Instant::now();
                if now >= deadline + FLUSH_GRACE {
                    return Ok(());
                }
                if now >= deadline && !ended {
                    // End whatever still runs, so its streams close with their last events.
                    app.client.abort_all();
                    ended = true;
                }
            }
        }
    }
}

/// Serves one connection: HTTP/1 with a head read timeout; after the drain starts, it closes
/// once its current request is answered.
async fn connection(
    stream: tokio::net::TcpStream,
    router: axum::Router,
    app: Arc<App>,
    mut drain: watch::Receiver<bool>,
) {
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(app.cfg.read_timeout)
        .keep_alive(!app.shutting_down.load(Ordering::SeqCst));
    let conn = builder.serve_connection(TokioIo::new(stream), TowerToHyperService::new(router));
    tokio::pin!(conn);
    let mut draining = *drain.borrow();
    loop {
        tokio::select! {
            _ = conn.as_mut() => return,
            r = drain.changed(), if !draining => {
                draining = true;
                if r.is_ok() {
                    conn.as_mut().graceful_shutdown();
                }
            }
        }
    }
}

async fn wait_for_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    match (
        signal(SignalKind::interrupt()),
        signal(SignalKind::terminate()),
    ) {
        (Ok(mut i), Ok(mut t)) => {
            tokio::select! {
                _ = i.recv() => {}
                _ = t.recv() => {}
            }
        }
        _ => std::future::pending::<()>().await,
    }
}
