//! The `vt` command's contract that later tooling relies on, checked against the HF references.

use std::process::Command;

use vt_core::checkpoint::TensorStore;
use vt_test_support::{check_greedy, fixture, max_abs_diff, Reference, LOGIT_TOL};

fn vt() -> Command {
    Command::new(env!("CARGO_BIN_EXE_vt"))
}

fn ids_arg(ids: &[u32]) -> String {
    ids.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
}

#[test]
fn logits_writes_prompt_logits_matching_reference() {
    let dir = fixture("qwen35moe_text");
    let r = Reference::load(&dir);
    let out = std::env::temp_dir().join(format!("vt-cli-logits-{}.safetensors", std::process::id()));
    let status = vt()
        .args([
            "logits",
            "--model",
            dir.to_str().unwrap(),
            "--prompt-ids",
            &ids_arg(&r.prompt_ids),
            "--out",
            out.to_str().unwrap(),
            "--backend",
            "cpu",
        ])
        .status()
        .unwrap();
    assert!(status.success());
    let store = TensorStore::open_files(out.parent().unwrap(), std::slice::from_ref(&out)).unwrap();
    let logits = store.get("logits").unwrap();
    assert_eq!(logits.dtype, vt_core::DType::F32);
    assert_eq!(logits.shape, [r.prompt_ids.len(), r.vocab]);
    let d = max_abs_diff(&logits.to_f32_vec().unwrap(), &r.logits[..r.prompt_ids.len() * r.vocab]);
    assert!(d <= LOGIT_TOL, "max |dlogit| {d}");
    std::fs::remove_file(out).unwrap();
}

#[test]
fn generate_json_last_line_holds_generated_ids() {
    for name in ["qwen35moe_nested", "laguna_a", "qwen3moe"] {
        let dir = fixture(name);
        let r = Reference::load(&dir);
        let out = vt()
            .args(["generate", "--model", dir.to_str().unwrap(), "--prompt-ids", &ids_arg(&r.prompt_ids)])
            .args([
                "--max-new-tokens",
                &r.greedy_ids.len().to_string(),
                "--temperature",
                "0",
                "--json",
                "--backend",
                "cpu",
            ])
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let stdout = String::from_utf8(out.stdout).unwrap();
        let last: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
        let ids: Vec<u32> = last["token_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
        check_greedy(&r, &ids).unwrap_or_else(|e| panic!("{name}: {e}"));
    }
}

#[test]
fn bad_model_dir_fails_with_a_named_error() {
    let out = vt().args(["generate", "--model", "/nonexistent/vt-model", "--prompt-ids", "1,2"]).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("/nonexistent/vt-model"), "{err}");
}

/// `vt bench --hold-context` (workload 5(b) of #30) holds every sequence the pool's arithmetic
/// allows at once: each keeps generating until the last one is admitted.
#[test]
fn bench_hold_runs_every_sequence_the_pool_allows_at_once() {
    let dir = fixture("qwen35moe_nested");
    let out = vt()
        .args(["bench", "--backend", "cpu", "--model", dir.to_str().unwrap()])
        .args(["--hold-context", "512", "--batch", "8", "--gen-len", "4"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8(out.stdout).unwrap();
    let held = stdout.lines().find(|l| l.starts_with("held ")).unwrap_or_else(|| panic!("no 'held' line: {stdout}"));
    assert!(held.starts_with("held 8 of 8 ") && held.ends_with("allows 8"), "{held}");
}

/// `vt generate --speculative-tokens K` on the built-in model drafts with its MTP layer: the same
/// ids as without speculation, and the drafts accepted and proposed in the JSON.
#[test]
fn generate_speculates_with_the_builtin_mtp_layer() {
    let run = generate_builtin;
    let plain = run(&[]);
    assert_eq!(plain["drafts_proposed"], 0);
    for drafter in ["auto", "mtp"] {
        let spec = run(&["--speculative-tokens", "2", "--drafter", drafter]);
        assert_eq!(spec["token_ids"], plain["token_ids"], "--drafter {drafter}");
        let (proposed, accepted) =
            (spec["drafts_proposed"].as_u64().unwrap(), spec["drafts_accepted"].as_u64().unwrap());
        assert!(proposed > 0 && accepted > 0 && accepted <= proposed, "--drafter {drafter}: {accepted} of {proposed}");
    }
}

/// `vt generate` on the built-in model with `extra` arguments: its JSON line.
fn generate_builtin(extra: &[&str]) -> serde_json::Value {
    let out = vt()
        .args(["generate", "--backend", "cpu", "--prompt", "def fibonacci(n):\n    if n < 2:\n"])
        .args(["--max-new-tokens", "40", "--temperature", "0", "--json"])
        .args(extra)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8(out.stdout).unwrap();
    serde_json::from_str(stdout.lines().last().unwrap()).unwrap()
}

/// `vt generate --tensor-parallel 2 --speculative-tokens 2` runs on 2 CPU ranks (and with
/// `--expert-parallel`): the MTP layer, split as the model's layers are, drafts what it drafts on
/// one rank, so the ids and the drafts proposed and accepted are those of one rank, and the ids
/// those without speculation.
#[test]
fn generate_speculates_split_over_ranks() {
    let plain = generate_builtin(&[]);
    let one = generate_builtin(&["--speculative-tokens", "2"]);
    assert!(one["drafts_accepted"].as_u64().unwrap() > 0, "{one}");
    for extra in [&["--tensor-parallel", "2"][..], &["--tensor-parallel", "2", "--expert-parallel"]] {
        let split = generate_builtin(&[extra, &["--speculative-tokens", "2"]].concat());
        assert_eq!(split["token_ids"], plain["token_ids"], "{extra:?}");
        for key in ["drafts_proposed", "drafts_accepted"] {
            assert_eq!(split[key], one[key], "{extra:?}: {key}");
        }
    }
}

/// `vt bench --speculative-tokens K` splits each decode step into drafting and verification (and
/// the verification's settling) and states the throughput at acceptance rates 0.6/0.7/0.8 with its formula.
#[test]
fn bench_reports_speculation_timings() {
    let out = vt()
        .args(["bench", "--backend", "cpu", "--model", fixture("qwen35moe_text").to_str().unwrap()])
        .args(["--speculative-tokens", "2", "--batch", "1,2", "--prompt-len", "8", "--gen-len", "8"])
        .output()
        .unwrap();
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert!(out.status.success(), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("by the MTP layer") && stdout.contains("sum_{i=0..k} a^i"), "{stdout}");
    for batch in [1, 2] {
        let line = stdout.lines().find(|l| l.contains(&format!("k 2, batch {batch}: drafting"))).expect(&stdout);
        // sum_{i=0..2} a^i at a = 0.7: 1 + 0.7 + 0.49.
        assert!(line.contains("verification") && line.contains("a=0.7: 2.19 tok/step"), "{line}");
        let settling = line.split("settling ").nth(1).and_then(|r| r.split(" ms").next());
        assert!(settling.is_some_and(|ms| ms.parse::<f64>().is_ok()), "{line}");
    }
}
