//! `/metrics` in the Prometheus text format (OpenMetrics), through `prometheus-client`, and the
//! access log: one `tracing` event per request when its response body ends.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::{MatchedPath, Request, State};
use axum::http::header::CONTENT_TYPE;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use super::AppState;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabels {
    /// The route's pattern (`/v1/models/{id}`), or `unmatched`: bounded cardinality.
    path: String,
    status: u16,
}

/// The server's metrics; the engine's gauges are read at each scrape.
pub struct Metrics {
    registry: Registry,
    requests: Family<RequestLabels, Counter>,
    ttft: Histogram,
    tpot: Histogram,
    prompt_tokens: Counter,
    generated_tokens: Counter,
    running: Gauge,
    waiting: Gauge,
    pool_blocks_used: Gauge,
    pool_blocks_total: Gauge,
    preemptions: Gauge,
    prefix: PrefixGauges,
}

/// The prefix cache's figures (since the engine started, read at each scrape).
struct PrefixGauges {
    hit_rate: Gauge<f64, AtomicU64>,
    prompt_tokens: Gauge,
    hit_tokens: Gauge,
    blocks: Gauge,
}

impl PrefixGauges {
    fn register(registry: &mut Registry) -> Self {
        let g = PrefixGauges {
            hit_rate: Gauge::default(),
            prompt_tokens: Gauge::default(),
            hit_tokens: Gauge::default(),
            blocks: Gauge::default(),
        };
        let r = registry;
        r.register(
            "prefix_cache_hit_rate",
            "Of the prompt tokens looked up, the fraction found cached",
            g.hit_rate.clone(),
        );
        r.register(
            "prefix_cache_lookup_tokens",
            "Prompt tokens looked up in the prefix cache",
            g.prompt_tokens.clone(),
        );
        r.register("prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache", g.hit_tokens.clone());
        r.register("prefix_cache_blocks", "KV blocks the prefix cache holds", g.blocks.clone());
        g
    }

    fn set(&self, stats: vt::engine::PrefixStats, blocks: usize) {
        self.hit_rate.set(stats.hit_tokens as f64 / stats.prompt_tokens.max(1) as f64);
        self.prompt_tokens.set(stats.prompt_tokens as i64);
        self.hit_tokens.set(stats.hit_tokens as i64);
        self.blocks.set(blocks as i64);
    }
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("vt");
        let requests = Family::<RequestLabels, Counter>::default();
        // 1 ms to ~65 s, and 0.1 ms to ~3 s.
        let ttft = Histogram::new(exponential_buckets(0.001, 2.0, 17));
        let tpot = Histogram::new(exponential_buckets(0.0001, 2.0, 15));
        let (prompt_tokens, generated_tokens) = (Counter::default(), Counter::default());
        let (running, waiting) = (Gauge::default(), Gauge::default());
        let (pool_blocks_used, pool_blocks_total, preemptions) = (Gauge::default(), Gauge::default(), Gauge::default());
        registry.register("http_requests", "HTTP requests answered, by route and status", requests.clone());
        registry.register("time_to_first_token_seconds", "From submission to the first generated token", ttft.clone());
        registry.register("time_per_output_token_seconds", "Between consecutive generated tokens", tpot.clone());
        registry.register("prompt_tokens", "Prompt tokens of requests started", prompt_tokens.clone());
        registry.register("generated_tokens", "Tokens generated", generated_tokens.clone());
        registry.register("running_sequences", "Sequences running in the engine", running.clone());
        registry.register("waiting_requests", "Requests submitted and not yet started", waiting.clone());
        registry.register("kv_pool_blocks_used", "KV blocks of the pool held by sequences", pool_blocks_used.clone());
        registry.register("kv_pool_blocks", "KV blocks in the pool", pool_blocks_total.clone());
        registry.register(
            "preempted_sequences",
            "Sequences whose blocks were freed for older ones (recomputed later)",
            preemptions.clone(),
        );
        let prefix = PrefixGauges::register(&mut registry);
        Metrics {
            registry,
            requests,
            ttft,
            tpot,
            prompt_tokens,
            generated_tokens,
            running,
            waiting,
            pool_blocks_used,
            pool_blocks_total,
            preemptions,
            prefix,
        }
    }
}

/// One request's token counts, filled as it runs (all its choices), read by the access log when
/// its response ends.
#[derive(Default, Debug)]
pub struct Usage {
    prompt: AtomicUsize,
    completion: AtomicUsize,
}

tokio::task_local! {
    /// The request the handler on this task serves (set by `access_log` around it).
    static REQUEST_USAGE: Arc<Usage>;
}

impl Usage {
    /// The current request's counts, its prompt length set; detached outside a request.
    pub fn current(prompt: usize) -> Arc<Usage> {
        let u = REQUEST_USAGE.try_with(Arc::clone).unwrap_or_default();
        u.prompt.store(prompt, Ordering::Relaxed);
        u
    }

    pub fn token(&self) {
        self.completion.fetch_add(1, Ordering::Relaxed);
    }
}

/// Times one generation's tokens into the histograms.
pub struct TokenClock<'a> {
    metrics: &'a Metrics,
    last: Instant,
    first: bool,
}

impl Metrics {
    /// A clock started at submission of a request of `prompt` tokens.
    pub fn start_request(&self, prompt: usize) -> TokenClock<'_> {
        self.prompt_tokens.inc_by(prompt as u64);
        TokenClock { metrics: self, last: Instant::now(), first: true }
    }
}

impl TokenClock<'_> {
    pub fn token(&mut self) {
        let now = Instant::now();
        let h = if std::mem::take(&mut self.first) { &self.metrics.ttft } else { &self.metrics.tpot };
        h.observe(now.duration_since(self.last).as_secs_f64());
        self.last = now;
        self.metrics.generated_tokens.inc();
    }
}

pub async fn render(State(s): State<Arc<AppState>>) -> Response {
    let m = &s.metrics;
    m.running.set(s.engine.running() as i64);
    m.waiting.set(s.engine.queued() as i64);
    let (used, total) = s.engine.pool_blocks();
    m.pool_blocks_used.set(used as i64);
    m.pool_blocks_total.set(total as i64);
    m.preemptions.set(s.engine.preemptions() as i64);
    let (stats, blocks) = s.engine.prefix_cache();
    m.prefix.set(stats, blocks);
    let mut text = String::new();
    if let Err(e) = prometheus_client::encoding::text::encode(&mut text, &m.registry) {
        return super::error::ApiError::internal(format!("encoding metrics: {e}")).into_response();
    }
    ([(CONTENT_TYPE, "application/openmetrics-text; version=1.0.0; charset=utf-8")], text).into_response()
}

/// Counts each response and logs it (method, path, status, tokens, latency) when its body ends,
/// streamed or not, finished or cut off by the client.
pub async fn access_log(State(s): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let started = Instant::now();
    let method = req.method().clone();
    let uri_path = req.uri().path().to_owned();
    let route = req.extensions().get::<MatchedPath>().map_or("unmatched", |p| p.as_str()).to_owned();
    let usage = Arc::new(Usage::default());
    let response = REQUEST_USAGE.scope(usage.clone(), next.run(req)).await;
    let status = response.status().as_u16();
    s.metrics.requests.get_or_create(&RequestLabels { path: route, status }).inc();
    let line = LogOnDrop { method, path: uri_path, status, usage, started };
    super::transport::keep_until_body_ends(response, line)
}

struct LogOnDrop {
    method: axum::http::Method,
    path: String,
    status: u16,
    usage: Arc<Usage>,
    started: Instant,
}

impl Drop for LogOnDrop {
    fn drop(&mut self) {
        let tokens = |f: fn(&Usage) -> &AtomicUsize| f(&self.usage).load(Ordering::Relaxed);
        let latency: Duration = self.started.elapsed();
        tracing::info!(
            target: "vt::access",
            method = %self.method,
            path = %self.path,
            status = self.status,
            prompt_tokens = tokens(|u| &u.prompt),
            completion_tokens = tokens(|u| &u.completion),
            latency_ms = latency.as_secs_f64() * 1e3,
        );
    }
}
