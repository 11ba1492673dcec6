//! Issue 28: the server under a new user's and a local attacker's use: connection hygiene and
//! shutdown, queue bounds, JSON errors on every path, auth, CORS, metrics, broken models.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::oneshot;
use vt::{CpuBackend, EngineConfig, EngineHandle, Model, Tokenizer};
use vt_cli::server::{serve_with, AppState, BodyLimits, ServerConfig, Transport};

struct Server {
    url: String,
    addr: std::net::SocketAddr,
    shutdown: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
}

fn default_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models/default")
}

async fn start_on(dir: &Path, engine: EngineConfig, config: ServerConfig, edit: impl FnOnce(&mut AppState)) -> Server {
    let model = Model::load(&CpuBackend::new(), dir).unwrap();
    let mut state =
        AppState::new(EngineHandle::spawn(model, engine).unwrap(), Tokenizer::load(dir).unwrap(), "default".into());
    edit(&mut state);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = oneshot::channel();
    let task = tokio::spawn(async move {
        serve_with(listener, Arc::new(state), &config, async {
            let _ = rx.await;
        })
        .await
    });
    Server { url: format!("http://{addr}"), addr, shutdown: Some(tx), task }
}

async fn start(engine: EngineConfig, config: ServerConfig) -> Server {
    start_on(&default_dir(), engine, config, |_| {}).await
}

fn quick() -> ServerConfig {
    ServerConfig {
        transport: Transport {
            header_timeout: Duration::from_secs(1),
            max_connections: 64,
            drain_timeout: Duration::from_secs(3),
        },
        body: BodyLimits { max_bytes: 4096, timeout: Duration::from_secs(1) },
        ..ServerConfig::default()
    }
}

fn greedy(max_tokens: usize) -> Value {
    json!({"prompt": "def ", "max_tokens": max_tokens, "temperature": 0})
}

async fn post(url: &str, path: &str, body: &Value) -> (u16, reqwest::header::HeaderMap, Value) {
    let r = reqwest::Client::new().post(format!("{url}{path}")).json(body).send().await.unwrap();
    let (status, headers) = (r.status().as_u16(), r.headers().clone());
    (status, headers, r.json().await.unwrap())
}

/// Reads until the peer closes; `None` if it is still open after `within`.
async fn closed_within(stream: &mut TcpStream, within: Duration) -> Option<Vec<u8>> {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    let deadline = Instant::now() + within;
    loop {
        let left = deadline.checked_duration_since(Instant::now())?;
        match tokio::time::timeout(left, stream.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return Some(got),
            Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
            Err(_) => return None,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn half_open_connection_does_not_hold_shutdown() {
    let mut s = start(
        EngineConfig::default(),
        ServerConfig {
            transport: Transport { header_timeout: Duration::from_secs(60), ..quick().transport },
            ..quick()
        },
    )
    .await;
    let mut half = TcpStream::connect(s.addr).await.unwrap();
    half.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-").await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let t = Instant::now();
    s.shutdown.take().unwrap().send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(5), &mut s.task)
        .await
        .expect("shutdown within the drain bound")
        .unwrap()
        .unwrap();
    assert!(t.elapsed() < Duration::from_secs(4), "{:?}", t.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trickled_headers_and_idle_connections_are_closed() {
    let s = start(EngineConfig::default(), quick()).await;
    // A byte every 300 ms never completes a head: closed at the 1 s header timeout.
    let mut trickle = TcpStream::connect(s.addr).await.unwrap();
    let t = Instant::now();
    let mut closed = false;
    for b in b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: aaaaaaaaaaaaaaaaaaaa" {
        if trickle.write_all(&[*b]).await.is_err() {
            closed = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        if t.elapsed() > Duration::from_secs(4) {
            break;
        }
    }
    assert!(closed || closed_within(&mut trickle, Duration::from_secs(1)).await.is_some(), "trickled head kept open");
    assert!(t.elapsed() < Duration::from_secs(4), "{:?}", t.elapsed());
    // An idle kept-alive connection closes after the same timeout.
    let mut idle = TcpStream::connect(s.addr).await.unwrap();
    idle.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n").await.unwrap();
    let got = closed_within(&mut idle, Duration::from_secs(3)).await.expect("idle connection closed");
    assert!(String::from_utf8_lossy(&got).starts_with("HTTP/1.1 200"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trickled_body_gets_408_in_json() {
    let s = start(EngineConfig::default(), quick()).await;
    let mut c = TcpStream::connect(s.addr).await.unwrap();
    c.write_all(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{",
    )
    .await
    .unwrap();
    let t = Instant::now();
    let mut answer = Vec::new();
    let mut buf = [0u8; 4096];
    while t.elapsed() < Duration::from_secs(4) {
        let _ = c.write_all(b" ").await;
        if let Ok(Ok(n)) = tokio::time::timeout(Duration::from_millis(300), c.read(&mut buf)).await {
            answer.extend_from_slice(&buf[..n]);
            if n == 0 || answer.windows(4).any(|w| w == b"\r\n\r\n") && answer.ends_with(b"}") {
                break;
            }
        }
    }
    let text = String::from_utf8_lossy(&answer);
    assert!(text.starts_with("HTTP/1.1 408"), "{text}");
    assert!(text.contains("\"invalid_request_error\""), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_limit_closes_extra_connections_and_health_recovers() {
    let config = ServerConfig { transport: Transport { max_connections: 4, ..quick().transport }, ..quick() };
    let s = start(EngineConfig::default(), config).await;
    let mut idle = Vec::new();
    for _ in 0..4 {
        idle.push(TcpStream::connect(s.addr).await.unwrap());
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    // The fifth is accepted and closed at once.
    let mut extra = TcpStream::connect(s.addr).await.unwrap();
    let _ = extra.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n").await;
    let got = closed_within(&mut extra, Duration::from_millis(900)).await.expect("closed at once");
    assert!(got.is_empty());
    // The idle ones time out; then /health answers.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let health = reqwest::get(format!("{}/health", s.url)).await.unwrap();
    assert_eq!(health.status(), 200);
}

/// `--max-queue 4` with 32 slots: 16 concurrent requests all run (the queue counts waiting ones).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queue_bounds_waiting_requests_beyond_running_ones() {
    let s = start(EngineConfig { max_seqs: 32, max_queue: 4, ..Default::default() }, quick()).await;
    let tasks: Vec<_> = (0..16)
        .map(|_| {
            let url = s.url.clone();
            tokio::spawn(async move { post(&url, "/v1/completions", &greedy(8)).await.0 })
        })
        .collect();
    for t in tasks {
        assert_eq!(t.await.unwrap(), 200);
    }
    // --max-queue 0 serves what fits in the free slots.
    let s0 = start(EngineConfig { max_seqs: 2, max_queue: 0, ..Default::default() }, quick()).await;
    assert_eq!(post(&s0.url, "/v1/completions", &greedy(4)).await.0, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rate_limited_requests_get_retry_after() {
    let s = start(EngineConfig { max_seqs: 1, max_queue: 0, ..Default::default() }, quick()).await;
    let tasks: Vec<_> = (0..6)
        .map(|_| {
            let url = s.url.clone();
            tokio::spawn(async move { post(&url, "/v1/completions", &greedy(64)).await })
        })
        .collect();
    let mut limited = 0;
    for t in tasks {
        let (status, headers, body) = t.await.unwrap();
        if status == 429 {
            limited += 1;
            assert_eq!(headers["retry-after"], "1");
            assert_eq!(body["error"]["type"], "rate_limit_error");
        } else {
            assert_eq!(status, 200, "{body}");
        }
    }
    assert!(limited > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_error_is_a_json_body_and_models_by_id() {
    let s = start(EngineConfig::default(), quick()).await;
    let client = reqwest::Client::new();
    let cases = [
        (client.get(format!("{}/nope", s.url)), 404),
        (client.get(format!("{}/v1/completions", s.url)), 405),
        (client.post(format!("{}/v1/completions", s.url)).body("x".repeat(10_000)), 413),
        (client.get(format!("{}/v1/models/other", s.url)), 404),
    ];
    for (req, status) in cases {
        let r = req.send().await.unwrap();
        assert_eq!(r.status().as_u16(), status);
        assert_eq!(r.headers()["content-type"], "application/json");
        let v: Value = r.json().await.unwrap();
        assert!(v["error"]["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
    }
    let card: Value = client.get(format!("{}/v1/models/default", s.url)).send().await.unwrap().json().await.unwrap();
    assert_eq!(card["id"], "default");
    assert_eq!(card["object"], "model");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_key_and_cors_origins() {
    let config =
        ServerConfig { api_key: Some("sekrit".into()), allowed_origins: vec!["https://ok.example".into()], ..quick() };
    let s = start(EngineConfig::default(), config).await;
    let client = reqwest::Client::new();
    let models = format!("{}/v1/models", s.url);
    assert_eq!(client.get(&models).send().await.unwrap().status(), 401);
    assert_eq!(client.get(&models).bearer_auth("wrong").send().await.unwrap().status(), 401);
    assert_eq!(client.get(format!("{}/metrics", s.url)).send().await.unwrap().status(), 401);
    assert_eq!(client.get(&models).bearer_auth("sekrit").send().await.unwrap().status(), 200);
    assert_eq!(client.get(format!("{}/health", s.url)).send().await.unwrap().status(), 200);
    let cors = |origin: &'static str| {
        client
            .request(reqwest::Method::OPTIONS, &models)
            .header("origin", origin)
            .header("access-control-request-method", "GET")
            .send()
    };
    let ok = cors("https://ok.example").await.unwrap();
    assert_eq!(ok.headers()["access-control-allow-origin"], "https://ok.example");
    assert!(cors("https://evil.example").await.unwrap().headers().get("access-control-allow-origin").is_none());
    // None allowed by default.
    let plain = start(EngineConfig::default(), quick()).await;
    let r = client.get(format!("{}/v1/models", plain.url)).header("origin", "https://ok.example").send().await.unwrap();
    assert!(r.headers().get("access-control-allow-origin").is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_requests_tokens_and_latencies() {
    let s = start(EngineConfig::default(), quick()).await;
    assert_eq!(post(&s.url, "/v1/completions", &greedy(5)).await.0, 200);
    let _ = reqwest::get(format!("{}/nope", s.url)).await.unwrap();
    let text = reqwest::get(format!("{}/metrics", s.url)).await.unwrap().text().await.unwrap();
    for needle in [
        "vt_http_requests_total{path=\"/v1/completions\",status=\"200\"} 1",
        "vt_http_requests_total{path=\"unmatched\",status=\"404\"} 1",
        "vt_generated_tokens_total 5",
        "vt_time_to_first_token_seconds_count 1",
        "vt_time_per_output_token_seconds_count 4",
        "vt_running_sequences 0",
        "vt_waiting_requests 0",
        "vt_kv_pool_blocks_used 0",
        "vt_kv_pool_blocks ",
        "vt_preempted_sequences 0",
    ] {
        assert!(text.contains(needle), "{needle} missing from\n{text}");
    }
}

/// A chat request without `max_tokens` stops at the server's default, not the context.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_without_max_tokens_uses_the_default() {
    let s = start_on(&default_dir(), EngineConfig::default(), quick(), |st| st.chat_max_tokens = 7).await;
    let (status, _, v) = post(
        &s.url,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "hi"}], "temperature": 0}),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    assert!(v["usage"]["completion_tokens"].as_u64().unwrap() <= 7, "{v}");
}

/// A copy of the built-in model with every weight NaN: requests fail with an error naming the
/// cause, greedy or sampled; nothing comes back as tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn non_finite_logits_fail_the_request() {
    let dir = nan_model("all", |_, _| true);
    fails_with_non_finite(&dir, &[]).await;
    let _ = std::fs::remove_dir_all(dir);
}

/// One NaN logit in a row of 3072 (the tied embedding's row of token 3000 is NaN, so its logit
/// is NaN at every step while the other logits stay numbers, and greedy picks never take it):
/// the requests still fail, greedy (picked on the backend, which flags the row), sampled and
/// under a grammar's mask, and `vt generate` too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_non_finite_logit_fails_the_request() {
    let dir = nan_model("one-row", |name, i| name == "model.embed_tokens.weight" && i / 160 == 3000);
    fails_with_non_finite(&dir, &[json!({"type": "json_object"})]).await;
    let _ = std::fs::remove_dir_all(dir);
}

/// Greedy and sampled completions on `dir` fail with a non-finite error, also under each of
/// `formats` (chat `response_format`s), and so does `vt generate`.
async fn fails_with_non_finite(dir: &Path, formats: &[serde_json::Value]) {
    let s = start_on(dir, EngineConfig::default(), quick(), |_| {}).await;
    let non_finite = |status: u16, v: &serde_json::Value| {
        assert_eq!(status, 500, "{v}");
        assert!(v["error"]["message"].as_str().unwrap().contains("non-finite"), "{v}");
    };
    for temperature in [0.0, 1.0] {
        let (status, _, v) =
            post(&s.url, "/v1/completions", &json!({"prompt": [1, 2, 3], "max_tokens": 3, "temperature": temperature}))
                .await;
        non_finite(status, &v);
        for format in formats {
            let body = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                              "temperature": temperature, "response_format": format});
            let (status, _, v) = post(&s.url, "/v1/chat/completions", &body).await;
            non_finite(status, &v);
        }
    }
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_vt"))
        .args(["generate", "--model", dir.to_str().unwrap(), "--prompt-ids", "1,2,3", "--max-new-tokens", "3"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("non-finite"), "{err}");
}

/// The built-in model's directory (under a name with `tag`) with the floating-point weight
/// elements for which `nan_at(tensor, element)` holds set to NaN.
fn nan_model(tag: &str, nan_at: impl Fn(&str, usize) -> bool) -> PathBuf {
    let src = default_dir();
    let dir = std::env::temp_dir().join(format!("vt-nan-model-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for f in ["config.json", "tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(src.join(f), dir.join(f)).unwrap();
    }
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let nan: Vec<(String, Vec<u8>, safetensors::Dtype, Vec<usize>)> = st
        .tensors()
        .into_iter()
        .map(|(name, t)| {
            let set = |width: usize, nan: &[u8]| {
                let mut data = t.data().to_vec();
                for (i, v) in data.chunks_mut(width).enumerate() {
                    if nan_at(&name, i) {
                        v.copy_from_slice(nan);
                    }
                }
                data
            };
            let data = match t.dtype() {
                safetensors::Dtype::BF16 => set(2, &[0xc0, 0x7f]),
                safetensors::Dtype::F32 => set(4, &f32::NAN.to_le_bytes()),
                _ => t.data().to_vec(),
            };
            (name, data, t.dtype(), t.shape().to_vec())
        })
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView)> = nan
        .iter()
        .map(|(n, d, dt, sh)| (n.clone(), safetensors::tensor::TensorView::new(*dt, sh.clone(), d).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
    dir
}
