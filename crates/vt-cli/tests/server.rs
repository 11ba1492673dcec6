//! The OpenAI-compatible server over HTTP on 127.0.0.1, with the built-in default model.

use std::path::PathBuf;
use std::sync::Arc;

use serde_json::{json, Value};
use tokio::sync::oneshot;
use vt::{CpuBackend, EngineConfig, EngineHandle, Model, Tokenizer};
use vt_cli::server::{serve, AppState};

struct Server {
    url: String,
    shutdown: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
}

fn model_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models/default")
}

async fn start(config: EngineConfig) -> Server {
    let dir = model_dir();
    let model = Model::load(&CpuBackend::new(), &dir).unwrap();
    let state = Arc::new(AppState::new(
        EngineHandle::spawn(model, config).unwrap(),
        Tokenizer::load(&dir).unwrap(),
        "default".into(),
    ));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let (tx, rx) = oneshot::channel();
    let task = tokio::spawn(serve(listener, state, async {
        let _ = rx.await;
    }));
    Server { url, shutdown: Some(tx), task }
}

async fn post(s: &Server, path: &str, body: &Value) -> (u16, Value) {
    post_url(s.url.clone(), path, body.clone()).await
}

async fn post_url(url: String, path: &str, body: Value) -> (u16, Value) {
    let r = reqwest::Client::new().post(format!("{url}{path}")).json(&body).send().await.unwrap();
    (r.status().as_u16(), r.json().await.unwrap())
}

/// The `data:` payloads of an SSE response, `[DONE]` last.
async fn post_stream(s: &Server, path: &str, body: &Value) -> Vec<String> {
    let r = reqwest::Client::new().post(format!("{}{path}", s.url)).json(body).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let text = r.text().await.unwrap();
    text.lines().filter_map(|l| l.strip_prefix("data: ")).map(str::to_string).collect()
}

fn greedy(prompt: &str, max_tokens: usize) -> Value {
    json!({"model": "default", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_chat_models_and_health() {
    let s = start(EngineConfig::default()).await;
    let health: Value = reqwest::get(format!("{}/health", s.url)).await.unwrap().json().await.unwrap();
    assert_eq!(health["status"], "ok");
    let models: Value = reqwest::get(format!("{}/v1/models", s.url)).await.unwrap().json().await.unwrap();
    assert_eq!(models["data"][0]["id"], "default");

    let (status, full) = post(&s, "/v1/completions", &greedy("def ", 24)).await;
    assert_eq!(status, 200, "{full}");
    let text = full["choices"][0]["text"].as_str().unwrap().to_string();
    assert!(!text.is_empty());
    assert_eq!(full["usage"]["completion_tokens"].as_u64().unwrap(), 24);
    assert_eq!(full["choices"][0]["finish_reason"], "length");

    // Streaming gives the same greedy text, chunk by chunk.
    let chunks = post_stream(
        &s,
        "/v1/completions",
        &json!({"prompt": "def ", "max_tokens": 24, "temperature": 0, "stream": true}),
    )
    .await;
    assert_eq!(chunks.last().unwrap(), "[DONE]");
    let streamed: String = chunks[..chunks.len() - 1]
        .iter()
        .map(|c| serde_json::from_str::<Value>(c).unwrap()["choices"][0]["text"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(streamed, text);

    // A stop string cuts the text before it.
    let stop = text.chars().skip(3).take(2).collect::<String>();
    let (_, cut) =
        post(&s, "/v1/completions", &json!({"prompt": "def ", "max_tokens": 24, "temperature": 0, "stop": [stop]}))
            .await;
    assert_eq!(cut["choices"][0]["finish_reason"], "stop");
    assert!(
        text.starts_with(cut["choices"][0]["text"].as_str().unwrap())
            && cut["choices"][0]["text"].as_str().unwrap().len() < text.len()
    );

    let chat = json!({"messages": [{"role": "user", "content": "import os"}], "max_tokens": 12, "temperature": 0});
    let (status, reply) = post(&s, "/v1/chat/completions", &chat).await;
    assert_eq!(status, 200, "{reply}");
    assert_eq!(reply["object"], "chat.completion");
    let content = reply["choices"][0]["message"]["content"].as_str().unwrap().to_string();
    let mut stream_chat = chat.clone();
    stream_chat["stream"] = json!(true);
    let chunks = post_stream(&s, "/v1/chat/completions", &stream_chat).await;
    let first: Value = serde_json::from_str(&chunks[0]).unwrap();
    assert_eq!(first["choices"][0]["delta"]["role"], "assistant");
    let streamed: String = chunks[..chunks.len() - 1]
        .iter()
        .filter_map(|c| {
            serde_json::from_str::<Value>(c).unwrap()["choices"][0]["delta"]["content"].as_str().map(str::to_string)
        })
        .collect();
    assert_eq!(streamed, content);
}

/// Requests sent concurrently (batched by the engine) get what they get alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_batch_and_match_alone() {
    let s = start(EngineConfig::default()).await;
    let prompts = ["def ", "import ", "class Foo", "for i in range(", "    return ", "# ", "if __name__", "x = "];
    let mut alone = Vec::new();
    for p in prompts {
        alone.push(post(&s, "/v1/completions", &greedy(p, 16)).await.1["choices"][0]["text"].clone());
    }
    let tasks: Vec<_> =
        prompts.iter().map(|p| tokio::spawn(post_url(s.url.clone(), "/v1/completions", greedy(p, 16)))).collect();
    for (i, t) in tasks.into_iter().enumerate() {
        let (status, v) = t.await.unwrap();
        assert_eq!(status, 200, "{v}");
        assert_eq!(v["choices"][0]["text"], alone[i], "prompt {:?}", prompts[i]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_requests_get_openai_errors() {
    let s = start(EngineConfig { max_context: 64, ..Default::default() }).await;
    let raw = reqwest::Client::new().post(format!("{}/v1/completions", s.url)).body("{not json").send().await.unwrap();
    assert_eq!(raw.status(), 400);
    let body: Value = raw.json().await.unwrap();
    assert_eq!(body["error"]["type"], "invalid_request_error");
    let long = "x ".repeat(200);
    for (path, body, status, needle) in [
        ("/v1/completions", json!({"max_tokens": 4}), 400, "prompt"),
        ("/v1/completions", json!({"prompt": "def ", "temperature": -1}), 400, "temperature"),
        ("/v1/completions", json!({"prompt": "def ", "max_tokens": 0}), 400, "max_tokens"),
        ("/v1/completions", json!({"prompt": "def ", "top_p": 2}), 400, "top_p"),
        ("/v1/completions", json!({"prompt": long, "max_tokens": 4}), 400, "context limit"),
        ("/v1/completions", json!({"prompt": [1, 2, 999999]}), 400, "vocabulary"),
        ("/v1/completions", json!({"prompt": "def ", "model": "gpt-4"}), 404, "gpt-4"),
        ("/v1/completions", json!({"prompt": "def ", "n": 0}), 400, "n must be"),
        ("/v1/completions", json!({"prompt": "def ", "suffix": "x"}), 400, "`suffix`"),
        ("/v1/completions", json!({"prompt": "def ", "logprobs": 21}), 400, "logprobs"),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "x"}], "functions": []}),
            400,
            "`functions`",
        ),
        ("/v1/chat/completions", json!({"messages": []}), 400, "messages"),
        ("/v1/chat/completions", json!({"messages": [{"role": "user"}]}), 400, "content"),
    ] {
        let (got, v) = post(&s, path, &body).await;
        assert_eq!(got, status, "{body} -> {v}");
        let msg = v["error"]["message"].as_str().unwrap();
        assert!(msg.contains(needle), "{body} -> {msg}");
    }
    // The server is still fine afterwards.
    assert_eq!(post(&s, "/v1/completions", &greedy("def ", 2)).await.0, 200);
}

/// A full queue answers 429 at once; admitted requests still complete.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_queue_gets_429() {
    let s = start(EngineConfig { max_seqs: 1, max_queue: 1, ..Default::default() }).await;
    let tasks: Vec<_> =
        (0..6).map(|_| tokio::spawn(post_url(s.url.clone(), "/v1/completions", greedy("def ", 48)))).collect();
    let mut statuses = Vec::new();
    for t in tasks {
        let (status, v) = t.await.unwrap();
        if status == 429 {
            assert_eq!(v["error"]["type"], "rate_limit_error");
        }
        statuses.push(status);
    }
    assert!(statuses.contains(&429) && statuses.contains(&200), "{statuses:?}");
    assert!(statuses.iter().all(|s| *s == 200 || *s == 429), "{statuses:?}");
}

/// Shutdown stops new connections but lets a streaming request finish.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_shutdown_finishes_in_flight_streams() {
    let mut s = start(EngineConfig::default()).await;
    let body = json!({"prompt": "def ", "max_tokens": 64, "temperature": 0, "stream": true});
    let resp = reqwest::Client::new().post(format!("{}/v1/completions", s.url)).json(&body).send().await.unwrap();
    assert_eq!(resp.status(), 200);
    s.shutdown.take().unwrap().send(()).unwrap();
    let text = resp.text().await.unwrap();
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    s.task.await.unwrap().unwrap();
}
