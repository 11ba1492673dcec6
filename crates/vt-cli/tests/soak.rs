//! Issue 28's soak test: `vt serve` (the built-in model) on loopback, several rounds of
//! 64 concurrent streams (half the clients drop mid-stream), a burst past the queue and 5k idle
//! connections, while `/health` is polled throughout; then a SIGTERM with half-open connections
//! and a stream in flight. Checks: no lost or mixed-up responses, RSS flat across rounds, `/health`
//! always answering, exit within the drain bound. Bounded in count and time; prints its figures.

mod common;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{rss_kib, serve, signal, wait_exit, Served};
use serde_json::{json, Value};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

const ROUNDS: usize = 6;
const STREAMS: usize = 64;
const BURST: usize = 160;
const IDLE: usize = 5000;
const DRAIN_SECS: u64 = 5;
const PROMPTS: [&str; 8] =
    ["def ", "import ", "class Foo", "for i in range(", "    return ", "# ", "if __name__", "x = "];

fn body(prompt: &str, max_tokens: usize, stream: bool) -> Value {
    json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream})
}

/// The text of a streamed completion, or `None` if this client dropped it after `drop_after` chunks.
async fn stream(
    client: &reqwest::Client,
    url: &str,
    prompt: &str,
    max_tokens: usize,
    drop_after: Option<usize>,
) -> Option<String> {
    let mut r =
        client.post(format!("{url}/v1/completions")).json(&body(prompt, max_tokens, true)).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let (mut raw, mut chunks) = (String::new(), 0);
    while let Some(c) = r.chunk().await.unwrap() {
        raw.push_str(std::str::from_utf8(&c).unwrap());
        chunks += 1;
        if drop_after.is_some_and(|n| chunks >= n) {
            return None;
        }
    }
    assert!(raw.trim_end().ends_with("data: [DONE]"), "{raw}");
    let text = raw
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str::<Value>(d).unwrap()["choices"][0]["text"].as_str().unwrap().to_string())
        .collect();
    Some(text)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn soak() {
    // 5k idle connections here and there: both processes need the descriptors.
    let fds = rlimit::increase_nofile_limit(3 * IDLE as u64).unwrap();
    assert!(fds >= (IDLE + 512) as u64, "file-descriptor limit {fds} is too low for the soak test");
    let drain = DRAIN_SECS.to_string();
    let Served { mut child, addr, log: _log } = serve(&[
        "--max-seqs",
        "32",
        "--max-queue",
        "32",
        "--max-connections",
        "8000",
        "--header-timeout-secs",
        "30",
        "--drain-timeout-secs",
        &drain,
    ]);
    let url = format!("http://{addr}");
    let client = reqwest::Client::new();
    let started = Instant::now();

    // What each prompt gives alone: every later response must be exactly this.
    let mut alone = Vec::new();
    for p in PROMPTS {
        let v: Value = client
            .post(format!("{url}/v1/completions"))
            .json(&body(p, 24, false))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        alone.push(v["choices"][0]["text"].as_str().unwrap().to_string());
    }
    let alone = Arc::new(alone);

    // /health polled throughout, each answer within 2 s.
    let (stop, health_ok, health_failed) =
        (Arc::new(AtomicBool::new(false)), Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let poller = {
        let (stop, ok, failed, url) = (stop.clone(), health_ok.clone(), health_failed.clone(), url.clone());
        tokio::spawn(async move {
            let c = reqwest::Client::builder().timeout(Duration::from_secs(2)).build().unwrap();
            while !stop.load(Ordering::Relaxed) {
                match c.get(format!("{url}/health")).send().await {
                    Ok(r) if r.status() == 200 => ok.fetch_add(1, Ordering::Relaxed),
                    _ => failed.fetch_add(1, Ordering::Relaxed),
                };
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    };

    let mut rss = Vec::new();
    for round in 0..ROUNDS {
        let t = Instant::now();
        // 64 concurrent streams; every other client drops after two chunks.
        let tasks: Vec<_> = (0..STREAMS)
            .map(|i| {
                let (client, url, alone) = (client.clone(), url.clone(), alone.clone());
                tokio::spawn(async move {
                    let p = i % PROMPTS.len();
                    let drop_after = (i % 2 == 1).then_some(2);
                    if let Some(text) = stream(&client, &url, PROMPTS[p], 24, drop_after).await {
                        assert_eq!(text, alone[p], "stream {i} got another prompt's text");
                    }
                })
            })
            .collect();
        for task in tasks {
            task.await.unwrap();
        }
        // A burst past the queue (32 running + 32 waiting): 429 with Retry-After, or the right text.
        let tasks: Vec<_> = (0..BURST)
            .map(|i| {
                let (client, url, alone) = (client.clone(), url.clone(), alone.clone());
                tokio::spawn(async move {
                    let p = i % PROMPTS.len();
                    let r = client
                        .post(format!("{url}/v1/completions"))
                        .json(&body(PROMPTS[p], 24, false))
                        .send()
                        .await
                        .unwrap();
                    match r.status().as_u16() {
                        429 => {
                            assert_eq!(r.headers()["retry-after"], "1");
                            false
                        }
                        200 => {
                            let v: Value = r.json().await.unwrap();
                            assert_eq!(
                                v["choices"][0]["text"], alone[p],
                                "burst request {i} got another prompt's text"
                            );
                            true
                        }
                        s => panic!("burst request {i}: status {s}"),
                    }
                })
            })
            .collect();
        let mut served = 0;
        for task in tasks {
            served += task.await.unwrap() as usize;
        }
        assert!((64..BURST).contains(&served), "round {round}: {served} of {BURST} served");
        // 5k idle connections, held while /health is asked, then dropped.
        let mut idle = Vec::with_capacity(IDLE);
        for _ in 0..IDLE {
            idle.push(TcpStream::connect(&addr).await.unwrap());
        }
        let h = Instant::now();
        let health = client.get(format!("{url}/health")).send().await.unwrap();
        assert_eq!(health.status(), 200);
        let health_ms = h.elapsed().as_millis();
        drop(idle);
        // The server's settled footprint: the least of a few samples while it closes the idle
        // connections (one sample 500 ms after the drop caught a loaded machine's server still
        // holding some of their buffers: 26 MiB over the round before, then back down).
        let mut kib = u64::MAX;
        for _ in 0..12 {
            tokio::time::sleep(Duration::from_millis(250)).await;
            kib = kib.min(rss_kib(child.id()));
        }
        eprintln!("soak round {round}: {:.1} s, {served}/{BURST} of the burst served, /health with {IDLE} idle connections in {health_ms} ms, RSS {} MiB", t.elapsed().as_secs_f64(), kib / 1024);
        rss.push(kib);
    }
    stop.store(true, Ordering::Relaxed);
    poller.await.unwrap();
    let (ok, failed) = (health_ok.load(Ordering::Relaxed), health_failed.load(Ordering::Relaxed));
    eprintln!("soak: /health answered {ok} polls, failed {failed}");
    assert_eq!(failed, 0);
    assert!(ok > 0);
    // Flat: after the allocator's warm-up, within 10% + 16 MiB of it. The warm-up takes two
    // rounds: settled figures of 82 MiB after round 1 then 101-102 after each of rounds 2 to 5
    // were seen on a 2-core machine, as were 96 then 82, 102, 101, 101, 102. A leak of a few MiB
    // a request round still shows by round 5.
    let base = rss[1].max(rss[2]);
    for (i, &r) in rss.iter().enumerate().skip(3) {
        assert!(r <= base + base / 10 + 16 * 1024, "RSS grew: rounds 1-2 {base} KiB, round {i} {r} KiB");
    }

    // Shutdown with 100 half-open connections and a stream in flight.
    let mut half = Vec::new();
    for _ in 0..100 {
        let mut c = TcpStream::connect(&addr).await.unwrap();
        c.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le").await.unwrap();
        half.push(c);
    }
    let in_flight = {
        let (client, url, alone) = (client.clone(), url.clone(), alone.clone());
        // Long enough to be running when the signal comes; greedy, so it extends the 24-token text.
        tokio::spawn(async move {
            assert!(stream(&client, &url, PROMPTS[0], 400, None).await.unwrap().starts_with(&alone[0]))
        })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    signal(&child, "-TERM");
    let (status, drained) = wait_exit(&mut child, Duration::from_secs(DRAIN_SECS + 3));
    in_flight.await.unwrap();
    assert!(status.success(), "{status:?}");
    eprintln!(
        "soak: exited {:.2} s after SIGTERM (drain bound {DRAIN_SECS} s); whole soak {:.1} s",
        drained.as_secs_f64(),
        started.elapsed().as_secs_f64()
    );
    drop(half);
}
