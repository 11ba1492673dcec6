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
