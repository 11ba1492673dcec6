//! FP8 block-scaled checkpoints (transformers' FineGrainedFP8 format, as Qwen publishes it) on the
//! CPU: against transformers f32, with partial blocks (the fixture's experts are 48 wide in 32-wide
//! blocks); quantized weights resident as e4m3 values and f32 block scales; bf16 scales read as
//! their f32 values; bad input as errors that name the tensor or config field. (parity.rs runs the
//! fixture, with every other, through prefill, decode and greedy generation.)

mod support;

use std::path::Path;

use serde_json::{json, Value};
use vt_core::checkpoint::{Checkpoint, TensorStore};
use vt_core::{DType, Device, Weight};
use vt_cpu::CpuBackend;
use vt_models::{Loader, Logits, Model};
use vt_test_support::{fixture, max_abs_diff, Reference, LOGIT_TOL};

use support::{edit, Corrupted, Entry};

const FIXTURE: &str = "qwen35moe_fp8";
const EXPERT: &str = "model.layers.0.mlp.experts.3.gate_proj";

fn full_forward(b: &CpuBackend, dir: &Path, seq: &[u32]) -> Vec<f32> {
    let m = Model::load(b, dir).unwrap();
    let mut st = m.new_state(4096).unwrap();
    b.to_f32(&m.forward(seq, &mut st, Logits::All).unwrap()).unwrap()
}

#[test]
fn fp8_matches_reference() {
    let b = CpuBackend::new();
    let r = Reference::load(&fixture(FIXTURE));
    let seq = r.sequence();
    let ours = full_forward(&b, &fixture(FIXTURE), &seq);
    let d = max_abs_diff(&ours, &r.logits);
    println!("{FIXTURE}: full forward over {} tokens, max |dlogit| = {d:.3e}", seq.len());
    assert!(d <= LOGIT_TOL, "max |dlogit| {d} > {LOGIT_TOL}");
}

/// Modules the fixture stores as FP8, with their `[n, k]`.
fn fp8_modules(tensors: &TensorStore) -> Vec<(String, usize, usize)> {
    let mut out: Vec<_> = tensors
        .names()
        .filter_map(|n| n.strip_suffix(".weight_scale_inv"))
        .map(|m| {
            let s = tensors.get(&format!("{m}.weight")).unwrap().shape;
            (m.to_string(), s[0], s[1])
        })
        .collect();
    out.sort();
    out
}

#[test]
fn fp8_weights_stay_quantized() {
    let b = CpuBackend::new();
    let ckpt = Checkpoint::open(&fixture(FIXTURE)).unwrap();
    let ld = Loader::new(&ckpt, &b, &|_, _| {}).unwrap();
    let modules = fp8_modules(&ckpt.tensors);
    assert!(modules.iter().any(|(m, n, _)| m.contains(".experts.") && n % 32 != 0), "no partial-block expert");
    for (m, n, k) in &modules {
        let w = ld.weight(m, *n, *k).unwrap();
        assert!(matches!(w, Weight::Fp8(_)), "{m} not loaded as FP8");
        // One byte a weight, one f32 per 32 x 32 block (partial blocks included).
        assert_eq!(w.resident_bytes(), n * k + 4 * n.div_ceil(32) * k.div_ceil(32), "{m}");
    }
    drop(ld);
    let m = Model::load(&b, &fixture(FIXTURE)).unwrap();
    let live = b.memory().bytes_live;
    println!(
        "{FIXTURE}: {} FP8 tensors; model resident {live} bytes, checkpoint {} bytes",
        modules.len(),
        ckpt.tensors.total_bytes()
    );
    assert!(live <= ckpt.tensors.total_bytes(), "{live} bytes resident: something was expanded");
    drop(m);
}

/// f32 -> bf16, round to nearest even.
fn bf16_bits(x: f32) -> u16 {
    let u = x.to_bits();
    ((u + 0x7fff + ((u >> 16) & 1)) >> 16) as u16
}

#[test]
fn bf16_scales_are_read_as_their_values() {
    let scales = |t: &mut Vec<Entry>, as_bf16: bool| {
        for e in t.iter_mut().filter(|e| e.name.ends_with(".weight_scale_inv")) {
            let rounded: Vec<u16> =
                e.bytes.chunks_exact(4).map(|c| bf16_bits(f32::from_le_bytes(c.try_into().unwrap()))).collect();
            (e.dtype, e.bytes) = if as_bf16 {
                (DType::BF16, rounded.iter().flat_map(|h| h.to_le_bytes()).collect())
            } else {
                (DType::F32, rounded.iter().flat_map(|&h| (f32::from_bits((h as u32) << 16)).to_le_bytes()).collect())
            };
        }
    };
    let none = |_: &mut Value| {};
    let bf16 = Corrupted::new(FIXTURE, "bf16-scales", |t| scales(t, true), none);
    let f32 = Corrupted::new(FIXTURE, "f32-rounded-scales", |t| scales(t, false), none);
    let b = CpuBackend::new();
    let seq = Reference::load(&fixture(FIXTURE)).sequence();
    let (x, y) = (full_forward(&b, &bf16.0, &seq), full_forward(&b, &f32.0, &seq));
    assert!(
        x.iter().zip(&y).all(|(a, b)| a.to_bits() == b.to_bits()),
        "bf16 scales read differently from their f32 values"
    );
}

#[test]
fn bad_fp8_tensors_are_errors_naming_the_tensor() {
    let none = |_: &mut Value| {};
    let scale = format!("{EXPERT}.weight_scale_inv");
    let nan_first = |t: &mut Vec<Entry>| {
        edit(t, &format!("{EXPERT}.weight_scale_inv")).bytes[..4].copy_from_slice(&f32::NAN.to_le_bytes())
    };
    let cases: Vec<(&str, Corrupted, String)> = vec![
        (
            "scales of whole blocks only (partial block dropped)",
            Corrupted::new(
                FIXTURE,
                "scale-shape",
                |t| {
                    let e = edit(t, &format!("{EXPERT}.weight_scale_inv"));
                    (e.shape, e.bytes) = (vec![1, 2], e.bytes[..8].to_vec());
                },
                none,
            ),
            scale.clone(),
        ),
        (
            "scales not float",
            Corrupted::new(
                FIXTURE,
                "scale-dtype",
                |t| {
                    let e = edit(t, &format!("{EXPERT}.weight_scale_inv"));
                    (e.dtype, e.shape) = (DType::U8, vec![2, 8]);
                },
                none,
            ),
            scale.clone(),
        ),
        ("a NaN scale", Corrupted::new(FIXTURE, "scale-nan", nan_first, none), scale.clone()),
        (
            "missing scales",
            Corrupted::new(
                FIXTURE,
                "scale-missing",
                |t| t.retain(|e| e.name != format!("{EXPERT}.weight_scale_inv")),
                none,
            ),
            scale.clone(),
        ),
        (
            "values of the wrong shape",
            Corrupted::new(
                FIXTURE,
                "values-shape",
                |t| edit(t, &format!("{EXPERT}.weight")).shape = vec![64, 48],
                none,
            ),
            format!("{EXPERT}.weight"),
        ),
        (
            "a block size the scales do not have",
            Corrupted::new(
                FIXTURE,
                "block",
                |_| {},
                |c| c["quantization_config"]["weight_block_size"] = json!([64, 64]),
            ),
            // The first FP8 module read: layer 0's GDN in_proj_qkv [128, 64] has [4, 2] scales, [2, 1] at 64.
            "model.layers.0.linear_attn.in_proj_qkv.weight_scale_inv".to_string(),
        ),
        (
            "an FP8 module the config leaves unquantized",
            Corrupted::new(
                FIXTURE,
                "skipped",
                |_| {},
                |c| c["quantization_config"]["modules_to_not_convert"].as_array_mut().unwrap().push(json!("gate_proj")),
            ),
            "model.layers.0.mlp.experts.0.gate_proj.weight".to_string(),
        ),
    ];
    for (what, dir, name) in cases {
        let e = dir.load_error();
        println!("{what}: {e}");
        assert!(e.contains(&name), "{what}: error does not name `{name}`: {e}");
    }
}

#[test]
fn bad_fp8_configs_are_errors_naming_the_field() {
    let same = |_: &mut Vec<Entry>| {};
    let qc = |f: &'static str, v: Value| move |c: &mut Value| c["quantization_config"][f] = v;
    let cases: Vec<(&str, Corrupted, &str)> = vec![
        (
            "no block size",
            Corrupted::new(FIXTURE, "c-block", same, qc("weight_block_size", Value::Null)),
            "weight_block_size",
        ),
        (
            "a zero block side",
            Corrupted::new(FIXTURE, "c-zero", same, qc("weight_block_size", json!([0, 32]))),
            "weight_block_size",
        ),
        (
            "one block side",
            Corrupted::new(FIXTURE, "c-one", same, qc("weight_block_size", json!([32]))),
            "weight_block_size",
        ),
        ("e5m2 values", Corrupted::new(FIXTURE, "c-fmt", same, qc("fmt", json!("e5m2"))), "fmt"),
        ("ue8m0 scales", Corrupted::new(FIXTURE, "c-ue8m0", same, qc("scale_fmt", json!("ue8m0"))), "scale_fmt"),
        ("fp4 experts", Corrupted::new(FIXTURE, "c-fp4", same, qc("expert_dtype", json!("fp4"))), "expert_dtype"),
        (
            "unknown activation scheme",
            Corrupted::new(FIXTURE, "c-act", same, qc("activation_scheme", json!("mx"))),
            "activation_scheme",
        ),
        (
            "a skip pattern the regex crate cannot read",
            Corrupted::new(FIXTURE, "c-pattern", same, qc("modules_to_not_convert", json!(["lm_head", "(?=x)"]))),
            "modules_to_not_convert[1]",
        ),
    ];
    for (what, dir, field) in cases {
        let e = dir.load_error();
        println!("{what}: {e}");
        let field = format!("quantization_config.{field}");
        assert!(e.contains(&field) && e.contains("config.json"), "{what}: error does not name `{field}`: {e}");
    }
}
