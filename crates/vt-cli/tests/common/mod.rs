//! `vt serve` as a child process for the tests that need signals and a process of its own.

#![allow(dead_code)] // each test binary uses a part

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

pub struct Served {
    pub child: Child,
    /// `127.0.0.1:PORT`
    pub addr: String,
    /// Its log lines (stderr).
    pub log: Receiver<String>,
}

/// `vt serve --port 0 EXTRA...`, once it listens.
#[allow(clippy::zombie_processes)] // the child goes to the caller, which waits for it
pub fn serve(extra: &[&str]) -> Served {
    let mut child = Command::new(env!("CARGO_BIN_EXE_vt"))
        .args(["serve", "--port", "0"])
        .args(extra)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = BufReader::new(child.stderr.take().unwrap());
    let (tx, log) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in stderr.lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    loop {
        let line = log.recv_timeout(Duration::from_secs(120)).expect("vt serve started");
        if let Some(at) = line.find("http://") {
            let addr = line[at + "http://".len()..].trim().to_string();
            return Served { child, addr, log };
        }
    }
}

pub fn signal(child: &Child, sig: &str) {
    assert!(Command::new("kill").args([sig, &child.id().to_string()]).status().unwrap().success());
}

/// Waits for `child` to exit; fails the test if it is still running after `within`.
pub fn wait_exit(child: &mut Child, within: Duration) -> (ExitStatus, Duration) {
    let t = Instant::now();
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return (s, t.elapsed());
        }
        assert!(t.elapsed() < within, "still running after {within:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Resident memory of process `pid`, in KiB (Linux).
pub fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}
