//! NVFP4 checkpoints on the CPU: both encodings (compressed-tensors, ModelOpt) against transformers
//! f32, with identical logits; quantized weights resident in packed form; bad input as errors that
//! name the tensor or config field. (parity.rs runs every fixture, these included, through prefill,
//! decode and greedy generation.)

mod support;

use std::path::Path;

use serde_json::{json, Value};
use vt_core::backend::prelude::*;
use vt_core::checkpoint::{Checkpoint, TensorStore};
use vt_core::{DType, Weight};
use vt_cpu::CpuBackend;
use vt_models::{Loader, Logits, Model};
use vt_test_support::{fixture, max_abs_diff, Reference, LOGIT_TOL};

use support::{edit, Corrupted, Entry};

/// (compressed-tensors fixture, its ModelOpt twin with the same codes and scales).
const PAIRS: [(&str, &str); 3] = [
    ("qwen35moe_nvfp4", "qwen35moe_nvfp4_modelopt"),
    ("qwen35moe_dims_nvfp4", "qwen35moe_dims_nvfp4_modelopt"),
    ("laguna_nvfp4", "laguna_nvfp4_modelopt"),
];

fn full_forward(b: &CpuBackend, dir: &Path, seq: &[u32]) -> Vec<f32> {
    let m = Model::load(b, dir).unwrap();
    let mut st = m.new_state(4096).unwrap();
    b.to_f32(&m.forward(seq, &mut st, Logits::All).unwrap()).unwrap()
}

#[test]
fn both_encodings_match_reference_with_identical_logits() {
    let b = CpuBackend::new();
    for (ct, modelopt) in PAIRS {
        let r = Reference::load(&fixture(ct));
        let seq = r.sequence();
        let ours = full_forward(&b, &fixture(ct), &seq);
        let d = max_abs_diff(&ours, &r.logits);
        println!("{ct}: full forward over {} tokens, max |dlogit| = {d:.3e}", seq.len());
        assert!(d <= LOGIT_TOL, "{ct}: max |dlogit| {d} > {LOGIT_TOL}");
        let twin = full_forward(&b, &fixture(modelopt), &seq);
        assert!(ours.iter().zip(&twin).all(|(a, b)| a.to_bits() == b.to_bits()), "{modelopt}: logits differ from {ct}");
    }
}

/// Modules a fixture stores as NVFP4, with their `[n, k]`.
fn nvfp4_modules(tensors: &TensorStore) -> Vec<(String, usize, usize)> {
    let mut out: Vec<_> = tensors
        .names()
        .filter_map(|n| n.strip_suffix(".weight_scale"))
        .map(|m| {
            let s = tensors.get(&format!("{m}.weight_scale")).unwrap().shape;
            (m.to_string(), s[0], s[1] * 16)
        })
        .collect();
    out.sort();
    out
}

#[test]
fn quantized_weights_stay_packed() {
    for (ct, modelopt) in PAIRS {
        for name in [ct, modelopt] {
            let b = CpuBackend::new();
            let ckpt = Checkpoint::open(&fixture(name)).unwrap();
            let ld = Loader::new(&ckpt, &b, &|_, _| {}).unwrap();
            let modules = nvfp4_modules(&ckpt.tensors);
            assert!(!modules.is_empty(), "{name}: no NVFP4 modules");
            let (mut bytes, mut weights) = (0, 0);
            for (m, n, k) in &modules {
                let w = ld.weight(m, *n, *k).unwrap();
                assert!(matches!(w, Weight::Nvfp4(_)), "{name}: {m} not loaded as NVFP4");
                // Codes (half a byte each), one fp8 scale per 16 weights, one f32 per tensor.
                assert_eq!(w.resident_bytes(), n * k / 2 + n * k / 16 + 4, "{name}: {m}");
                bytes += w.resident_bytes();
                weights += n * k;
            }
            drop(ld);
            println!(
                "{name}: {} NVFP4 tensors, {weights} weights, {bytes} bytes resident = {:.4} byte/weight (0.5625 + 4 bytes per tensor)",
                modules.len(),
                bytes as f64 / weights as f64
            );
            // The whole model in memory is no larger than its checkpoint: nothing expanded to f32.
            let m = Model::load(&b, &fixture(name)).unwrap();
            let live = b.memory().bytes_live;
            println!("{name}: model resident {live} bytes, checkpoint tensors {} bytes", ckpt.tensors.total_bytes());
            assert!(live <= ckpt.tensors.total_bytes(), "{name}: {live} bytes resident");
            drop(m);
        }
    }
}

const Q_PROJ: &str = "model.layers.0.self_attn.q_proj";

#[test]
fn bad_nvfp4_tensors_are_errors_naming_the_tensor() {
    let none = |_: &mut Value| {};
    let cases: Vec<(&str, Corrupted, String)> = vec![
        (
            "wrong packed shape",
            Corrupted::new(
                "laguna_nvfp4",
                "packed",
                |t| edit(t, &format!("{Q_PROJ}.weight_packed")).shape = vec![128, 16],
                none,
            ),
            format!("{Q_PROJ}.weight_packed"),
        ),
        (
            "wrong scale shape",
            Corrupted::new(
                "laguna_nvfp4",
                "scale",
                |t| edit(t, &format!("{Q_PROJ}.weight_scale")).shape = vec![32, 8],
                none,
            ),
            format!("{Q_PROJ}.weight_scale"),
        ),
        (
            "scales not fp8",
            Corrupted::new(
                "laguna_nvfp4",
                "scale-dtype",
                |t| edit(t, &format!("{Q_PROJ}.weight_scale")).dtype = DType::U8,
                none,
            ),
            format!("{Q_PROJ}.weight_scale"),
        ),
        (
            "missing global scale",
            Corrupted::new(
                "laguna_nvfp4",
                "global",
                |t| t.retain(|e| e.name != format!("{Q_PROJ}.weight_global_scale")),
                none,
            ),
            format!("{Q_PROJ}.weight_global_scale"),
        ),
        (
            "zero global scale (a divisor)",
            Corrupted::new(
                "laguna_nvfp4",
                "global-zero",
                |t| edit(t, &format!("{Q_PROJ}.weight_global_scale")).bytes = vec![0; 4],
                none,
            ),
            format!("{Q_PROJ}.weight_global_scale"),
        ),
        (
            "missing ModelOpt weight_scale_2",
            Corrupted::new(
                "laguna_nvfp4_modelopt",
                "scale2",
                |t| t.retain(|e| e.name != format!("{Q_PROJ}.weight_scale_2")),
                none,
            ),
            format!("{Q_PROJ}.weight_scale_2"),
        ),
        (
            "packed module the config ignores",
            Corrupted::new(
                "laguna_nvfp4",
                "ignored",
                |_| {},
                |c| c["quantization_config"]["ignore"].as_array_mut().unwrap().push(json!("re:.*q_proj$")),
            ),
            format!("{Q_PROJ}.weight_packed"),
        ),
        (
            "targeted module stored dense",
            Corrupted::new(
                "laguna_nvfp4",
                "dense",
                |t| {
                    let p = format!("{Q_PROJ}.");
                    t.retain(|e| !e.name.starts_with(&p));
                    t.push(Entry {
                        name: format!("{Q_PROJ}.weight"),
                        dtype: DType::BF16,
                        shape: vec![64, 64],
                        bytes: vec![0; 64 * 64 * 2],
                    });
                },
                none,
            ),
            format!("{Q_PROJ}.weight_packed"),
        ),
    ];
    for (what, dir, name) in cases {
        let e = dir.load_error();
        println!("{what}: {e}");
        assert!(e.contains(&name), "{what}: error does not name `{name}`: {e}");
    }
}

#[test]
fn bad_nvfp4_configs_are_errors_naming_the_field() {
    let same = |_: &mut Vec<Entry>| {};
    let cases: Vec<(&str, Corrupted, &str)> = vec![
        (
            "group size other than 16",
            Corrupted::new("laguna_nvfp4", "group", same, |c| {
                c["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = json!(32)
            }),
            "quantization_config.config_groups.group_0.weights.group_size",
        ),
        (
            "unknown format string",
            Corrupted::new("laguna_nvfp4", "format", same, |c| {
                c["quantization_config"]["format"] = json!("nvfp4-pack-quantized-v2")
            }),
            "quantization_config.format",
        ),
        (
            "unknown ModelOpt algorithm",
            Corrupted::new("laguna_nvfp4_modelopt", "algo", same, |c| {
                c["quantization_config"]["quant_algo"] = json!("FP8")
            }),
            "quantization_config.quant_algo",
        ),
        (
            "unknown quantization method",
            Corrupted::new("laguna_nvfp4", "method", same, |c| c["quantization_config"]["quant_method"] = json!("awq")),
            "quantization_config.quant_method",
        ),
    ];
    for (what, dir, field) in cases {
        let e = dir.load_error();
        println!("{what}: {e}");
        assert!(e.contains(field) && e.contains("config.json"), "{what}: error does not name `{field}`: {e}");
    }
}
