//! Issue 28: the `vt` command with arguments out of bounds, broken configs, an installed copy,
//! hub ids from a local Hugging Face cache, `vt chat` interrupted, and `vt serve` under signals.

mod common;

use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::{serve, signal, wait_exit, Served};

fn vt() -> Command {
    Command::new(env!("CARGO_BIN_EXE_vt"))
}

fn default_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models/default")
}

fn temp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("vt-cli-limits-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn fails_with(out: Output, needle: &str) {
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "succeeded: {err}");
    assert!(err.contains(needle), "`{needle}` not in: {err}");
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn numeric_arguments_are_bounded_and_checked_against_the_context() {
    let gen = |extra: &[&str]| vt().args(["generate", "--prompt-ids", "1,2"]).args(extra).output().unwrap();
    fails_with(gen(&["--max-new-tokens", "18446744073709551615"]), "--max-new-tokens");
    fails_with(gen(&["--max-new-tokens", "1000000000000"]), "--max-new-tokens");
    // The built-in model's context is 4096.
    fails_with(gen(&["--max-new-tokens", "4300"]), "context of 4096");
    let long = vec!["1"; 5000].join(",");
    fails_with(vt().args(["generate", "--prompt-ids", &long]).output().unwrap(), "context is 4096");
    let out = std::env::temp_dir().join("vt-cli-limits-never.safetensors");
    fails_with(
        vt().args(["logits", "--prompt-ids", &long, "--out", out.to_str().unwrap()]).output().unwrap(),
        "context is 4096",
    );
    fails_with(vt().args(["chat", "--max-new-tokens", "18446744073709551615"]).output().unwrap(), "--max-new-tokens");
    for (flag, value) in [
        ("--max-queue", "18446744073709551615"),
        ("--memory-budget-mib", "0"),
        ("--memory-budget-mib", "18446744073709551615"),
        ("--max-seqs", "0"),
        ("--max-model-len", "1"),
        ("--max-connections", "0"),
    ] {
        fails_with(vt().args(["serve", flag, value]).output().unwrap(), flag);
    }
    fails_with(
        vt().args(["serve", "--max-model-len", "5000", "--port", "0"]).output().unwrap(),
        "--max-model-len 5000",
    );
}

/// A copy of the built-in model with `edit` applied to its config.json.
fn model_with(name: &str, edit: impl FnOnce(&mut serde_json::Value)) -> PathBuf {
    let dir = temp(name);
    for f in ["model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"] {
        std::fs::copy(default_dir().join(f), dir.join(f)).unwrap();
    }
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(default_dir().join("config.json")).unwrap()).unwrap();
    edit(&mut cfg);
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
    dir
}

#[test]
fn configs_that_cannot_work_are_refused_at_load() {
    for (name, field, edit) in [
        (
            "theta",
            "rope_theta",
            Box::new(|c: &mut serde_json::Value| c["rope_parameters"]["rope_theta"] = 0.0.into())
                as Box<dyn FnOnce(&mut serde_json::Value)>,
        ),
        (
            "ctx",
            "max_position_embeddings",
            Box::new(|c: &mut serde_json::Value| c["max_position_embeddings"] = 0.into()),
        ),
        ("eps", "rms_norm_eps", Box::new(|c: &mut serde_json::Value| c["rms_norm_eps"] = (-1.0).into())),
    ] {
        let dir = model_with(name, edit);
        let out = vt().args(["generate", "--model", dir.to_str().unwrap(), "--prompt-ids", "1,2"]).output().unwrap();
        fails_with(out, field);
        let _ = std::fs::remove_dir_all(dir);
    }
}

/// Serving a checkpoint without tokenizer.json is refused (its responses would be empty text).
#[test]
fn serving_needs_a_tokenizer() {
    let dir = temp("no-tokenizer");
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(default_dir().join(f), dir.join(f)).unwrap();
    }
    fails_with(
        vt().args(["serve", "--port", "0", "--model", dir.to_str().unwrap()]).output().unwrap(),
        "tokenizer.json",
    );
    let _ = std::fs::remove_dir_all(dir);
}

/// A copy of the binary alone, in a fresh directory with a fresh home, runs the built-in model.
#[test]
fn an_installed_copy_finds_the_built_in_model() {
    let root = temp("installed");
    let bin = root.join("vt");
    std::fs::copy(env!("CARGO_BIN_EXE_vt"), &bin).unwrap();
    let home = root.join("home");
    std::fs::create_dir_all(&home).unwrap();
    let run = || {
        Command::new(&bin)
            .args(["generate", "--prompt", "def ", "--max-new-tokens", "4", "--temperature", "0", "--json"])
            .env("HOME", &home)
            .env_remove("XDG_CACHE_HOME")
            .current_dir(&root)
            .output()
            .unwrap()
    };
    let ids = |out: Output| {
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let stdout = String::from_utf8(out.stdout).unwrap();
        let last: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
        last["token_ids"].clone()
    };
    let first = ids(run());
    assert_eq!(first.as_array().unwrap().len(), 4);
    // The second run finds the files the first wrote.
    assert_eq!(ids(run()), first);
    assert!(home.join(".cache/vt").exists());
    let _ = std::fs::remove_dir_all(root);
}

/// `--model owner/name` resolves through a cache laid out as hf-hub's (refs/main -> snapshot).
#[test]
fn hub_ids_resolve_from_the_local_cache() {
    let hub = temp("hub");
    let repo = hub.join("models--acme--tiny-moe");
    let snapshot = repo.join("snapshots/0123abcd");
    std::fs::create_dir_all(&snapshot).unwrap();
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(repo.join("refs/main"), "0123abcd").unwrap();
    for f in ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(default_dir().join(f), snapshot.join(f)).unwrap();
    }
    let gen = |id: &str| {
        vt().args(["generate", "--model", id, "--prompt-ids", "1,2", "--max-new-tokens", "3", "--temperature", "0"])
            .env("HF_HUB_CACHE", &hub)
            .output()
            .unwrap()
    };
    let found = gen("acme/tiny-moe");
    assert!(found.status.success(), "{}", String::from_utf8_lossy(&found.stderr));
    let direct = vt()
        .args(["generate", "--model", default_dir().to_str().unwrap(), "--prompt-ids", "1,2", "--max-new-tokens", "3"])
        .output()
        .unwrap();
    // The ids line (stderr has timings).
    assert_eq!(found.stdout, direct.stdout);
    let _ = std::fs::remove_dir_all(hub);
}

/// `--model owner/name` not in the cache downloads it from the hub (here a loopback server in
/// the hub's URL layout, named by HF_ENDPOINT) into the cache, then runs it; the next run takes
/// the cache without the network; a hub that cannot be reached is an error naming the id, the
/// endpoint and the cache.
#[test]
fn hub_ids_download_into_the_cache() {
    let cache = temp("download");
    let mut files: Vec<(String, Vec<u8>)> =
        ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
            .iter()
            .map(|f| (f.to_string(), std::fs::read(default_dir().join(f)).unwrap()))
            .collect();
    // Files vt does not read stay on the hub.
    files.push(("README.md".into(), b"# tiny".to_vec()));
    files.push(("onnx/model.json".into(), b"{}".to_vec()));
    let endpoint = fake_hub("acme/tiny-moe", files);
    let gen = |id: &str, endpoint: &str| {
        let mut cmd = vt();
        cmd.args(["generate", "--model", id, "--prompt-ids", "1,2", "--max-new-tokens", "3", "--temperature", "0"])
            .env("HF_HUB_CACHE", &cache)
            .env("HF_ENDPOINT", endpoint);
        for proxy in ["ALL_PROXY", "all_proxy", "HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy"] {
            cmd.env_remove(proxy);
        }
        cmd.output().unwrap()
    };
    let direct = vt()
        .args(["generate", "--model", default_dir().to_str().unwrap(), "--prompt-ids", "1,2", "--max-new-tokens", "3"])
        .output()
        .unwrap();
    let downloaded = gen("acme/tiny-moe", &endpoint);
    assert!(downloaded.status.success(), "{}", String::from_utf8_lossy(&downloaded.stderr));
    assert_eq!(downloaded.stdout, direct.stdout);
    let snapshot = cache.join("models--acme--tiny-moe/snapshots").join(HUB_SHA);
    assert!(snapshot.join("model.safetensors").exists());
    assert!(!snapshot.join("README.md").exists() && !snapshot.join("onnx").exists());
    let unreachable = "http://127.0.0.1:1";
    let cached = gen("acme/tiny-moe", unreachable);
    assert_eq!(cached.stdout, direct.stdout, "{}", String::from_utf8_lossy(&cached.stderr));
    for needle in ["acme/absent", unreachable, cache.to_str().unwrap()] {
        fails_with(gen("acme/absent", unreachable), needle);
    }
    let _ = std::fs::remove_dir_all(cache);
}

/// The commit every file of `fake_hub` comes from.
const HUB_SHA: &str = "0123456789abcdef0123456789abcdef01234567";

/// A hub on loopback serving `files` of repository `id` as huggingface.co lays them out (what
/// hf-hub asks for): `GET /api/models/ID/revision/main` lists them; `GET /ID/resolve/main/FILE`
/// with a `Range` answers 206 with the commit and ETag headers. Returns its URL.
fn fake_hub(id: &str, files: Vec<(String, Vec<u8>)>) -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let id = id.to_string();
    std::thread::spawn(move || {
        for mut conn in listener.incoming().flatten() {
            let mut head = Vec::new();
            let mut byte = [0u8; 1];
            while !head.ends_with(b"\r\n\r\n") && conn.read(&mut byte).is_ok_and(|n| n == 1) {
                head.push(byte[0]);
            }
            let head = String::from_utf8_lossy(&head).to_string();
            let path = head.split_whitespace().nth(1).unwrap_or_default().to_string();
            let range = (head.lines())
                .find_map(|l| l.to_lowercase().strip_prefix("range: bytes=").map(|r| r.trim().to_string()));
            let file = files.iter().enumerate().find(|(_, (f, _))| path == format!("/{id}/resolve/main/{f}"));
            let (status, headers, body) = if path == format!("/api/models/{id}/revision/main") {
                let siblings: Vec<_> = files.iter().map(|(f, _)| serde_json::json!({"rfilename": f})).collect();
                (
                    "200 OK",
                    String::new(),
                    serde_json::json!({"sha": HUB_SHA, "siblings": siblings}).to_string().into_bytes(),
                )
            } else if let Some((i, (_, data))) = file {
                let (from, to) = range.as_deref().and_then(|r| r.split_once('-')).unwrap_or(("0", ""));
                let from: usize = from.parse().unwrap_or(0);
                let to: usize = to.parse().map_or(data.len() - 1, |t: usize| t.min(data.len() - 1));
                let headers = format!(
                    "ETag: \"{i:040x}\"\r\nX-Repo-Commit: {HUB_SHA}\r\nContent-Range: bytes {from}-{to}/{}\r\n",
                    data.len()
                );
                ("206 Partial Content", headers, data[from..=to].to_vec())
            } else {
                ("404 Not Found", String::new(), Vec::new())
            };
            let reply =
                format!("HTTP/1.1 {status}\r\n{headers}Content-Length: {}\r\nConnection: close\r\n\r\n", body.len());
            let _ = conn.write_all(reply.as_bytes()).and_then(|_| conn.write_all(&body));
        }
    });
    url
}

/// Ctrl-C (SIGINT) during a reply stops it; the conversation goes on to the next turn.
#[test]
fn chat_interrupt_stops_the_reply_and_keeps_the_conversation() {
    let mut child = vt()
        .args(["chat", "--max-new-tokens", "4000", "--temperature", "1", "--seed", "3"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(b"tell me everything\n").unwrap();
    // Let the reply get going, then interrupt it.
    let mut stdout = child.stdout.take().unwrap();
    let mut first = [0u8; 8];
    stdout.read_exact(&mut first).unwrap();
    signal(&child, "-INT");
    stdin.write_all(b"and again\n").unwrap();
    drop(stdin);
    let t = Instant::now();
    let mut rest = String::new();
    stdout.read_to_string(&mut rest).unwrap();
    let status = child.wait().unwrap();
    assert!(status.success(), "{status:?}");
    assert!(rest.contains("[stopped]"), "{rest}");
    // 4000 tokens of a reply would take far longer than the two turns did.
    assert!(t.elapsed() < Duration::from_secs(60));
}

/// SIGTERM drains like SIGINT: an in-flight stream and a plain request complete, the process
/// exits 0 within the drain bound though a half-open connection stays; a second signal exits at
/// once.
#[test]
fn sigterm_drains_in_flight_requests_and_a_second_signal_exits() {
    let Served { mut child, addr, log } = serve(&["--drain-timeout-secs", "5"]);
    let mut half = std::net::TcpStream::connect(&addr).unwrap();
    half.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n").unwrap();
    let request = |stream: bool| {
        let mut c = std::net::TcpStream::connect(&addr).unwrap();
        let body =
            serde_json::json!({"prompt": "def ", "max_tokens": 200, "temperature": 0, "stream": stream}).to_string();
        let head = format!("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n", body.len());
        c.write_all(head.as_bytes()).unwrap();
        c.write_all(body.as_bytes()).unwrap();
        std::thread::spawn(move || {
            let mut out = String::new();
            let _ = c.read_to_string(&mut out);
            out
        })
    };
    let (streamed, plain) = (request(true), request(false));
    std::thread::sleep(Duration::from_millis(300));
    signal(&child, "-TERM");
    let (status, took) = wait_exit(&mut child, Duration::from_secs(30));
    assert!(status.success(), "{status:?}");
    // Done when the responses are: the half-open connection does not hold it to the 5 s bound.
    assert!(took < Duration::from_secs(5), "{took:?}");
    let (streamed, plain) = (streamed.join().unwrap(), plain.join().unwrap());
    assert!(streamed.contains("data: [DONE]"), "{streamed}");
    assert!(plain.starts_with("HTTP/1.1 200") && plain.contains("\"usage\""), "{plain}");
    drop(half);
    let lines: Vec<String> = log.try_iter().collect();
    // The access log: one line per request when its response ends.
    let access: Vec<&String> = lines.iter().filter(|l| l.contains("vt::access")).collect();
    assert_eq!(access.len(), 2, "{lines:?}");
    for l in access {
        for field in [
            "method=POST",
            "path=/v1/completions",
            "status=200",
            "prompt_tokens=2",
            "completion_tokens=200",
            "latency_ms=",
        ] {
            assert!(l.contains(field), "{field} not in {l}");
        }
    }

    // A second signal: out at once, though a long request is running.
    let Served { mut child, addr, .. } = serve(&["--max-seqs", "1"]);
    let mut c = std::net::TcpStream::connect(&addr).unwrap();
    let body =
        serde_json::json!({"prompt": "def ", "max_tokens": 4000, "temperature": 1.0, "stream": true}).to_string();
    write!(c, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}", body.len()).unwrap();
    // Running: its first streamed token is out (a fixed wait let a loaded machine signal a server
    // with nothing in flight, which then drained at once).
    c.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&got).contains("data: ") {
        let n = c.read(&mut buf).unwrap();
        assert!(n > 0, "the stream ended before its first token: {}", String::from_utf8_lossy(&got));
        got.extend_from_slice(&buf[..n]);
    }
    signal(&child, "-INT");
    std::thread::sleep(Duration::from_millis(200));
    signal(&child, "-INT");
    let (status, _) = wait_exit(&mut child, Duration::from_secs(3));
    assert_eq!(status.code(), Some(130));
}
