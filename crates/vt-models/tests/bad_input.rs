//! Malformed checkpoints, configs and prompts get an error that names what is wrong, never a panic.

use std::path::{Path, PathBuf};

use safetensors::tensor::TensorView;
use serde_json::Value;
use vt_cpu::CpuBackend;
use vt_models::{Logits, Model};
use vt_test_support::fixture;

/// A scratch copy of a fixture's checkpoint (config + one safetensors file) that a test may break.
struct Scratch {
    dir: PathBuf,
}

impl Scratch {
    fn of(name: &str, test: &str) -> Scratch {
        let dir = std::env::temp_dir().join(format!("vt-bad-input-{}-{test}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let src = fixture(name);
        std::fs::copy(src.join("config.json"), dir.join("config.json")).unwrap();
        std::fs::copy(src.join("model.safetensors"), dir.join("model.safetensors")).unwrap();
        Scratch { dir }
    }

    fn weights(&self) -> PathBuf {
        self.dir.join("model.safetensors")
    }

    fn edit_config(&self, f: impl FnOnce(&mut Value)) {
        let path = self.dir.join("config.json");
        let mut v: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        f(&mut v);
        std::fs::write(&path, serde_json::to_string_pretty(&v).unwrap()).unwrap();
    }

    /// Rewrites the weights file through `edit(name, dtype, shape, bytes)`, which may drop a
    /// tensor (return None) or replace it.
    fn edit_tensors(
        &self,
        edit: impl Fn(&str, safetensors::Dtype, Vec<usize>, Vec<u8>) -> Option<(safetensors::Dtype, Vec<usize>, Vec<u8>)>,
    ) {
        let bytes = std::fs::read(self.weights()).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let kept: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = st
            .tensors()
            .into_iter()
            .filter_map(|(name, t)| {
                edit(&name, t.dtype(), t.shape().to_vec(), t.data().to_vec()).map(|(d, s, b)| (name, d, s, b))
            })
            .collect();
        let views: Vec<(String, TensorView)> =
            kept.iter().map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap())).collect();
        safetensors::serialize_to_file(views, None, &self.weights()).unwrap();
    }

    fn load_err(&self) -> String {
        match Model::load(&CpuBackend::new(), &self.dir) {
            Ok(_) => panic!("loading {} should fail", self.dir.display()),
            Err(e) => e.to_string(),
        }
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn assert_mentions(err: &str, needles: &[&str]) {
    for n in needles {
        assert!(err.contains(n), "error `{err}` does not mention `{n}`");
    }
}

fn file_name(p: &Path) -> String {
    p.display().to_string()
}

#[test]
fn truncated_safetensors_names_the_file() {
    let s = Scratch::of("qwen3moe", "truncated");
    let len = std::fs::metadata(s.weights()).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(s.weights()).unwrap().set_len(len - 1000).unwrap();
    assert_mentions(&s.load_err(), &[&file_name(&s.weights()), "invalid safetensors"]);
}

#[test]
fn corrupt_header_names_the_file() {
    let s = Scratch::of("qwen3moe", "corrupt");
    let mut bytes = std::fs::read(s.weights()).unwrap();
    bytes[8..20].copy_from_slice(b"{not json!!!");
    std::fs::write(s.weights(), &bytes).unwrap();
    assert_mentions(&s.load_err(), &[&file_name(&s.weights())]);
    // A header length pointing past the end of the file.
    bytes[..8].copy_from_slice(&(u64::MAX / 2).to_le_bytes());
    std::fs::write(s.weights(), &bytes).unwrap();
    assert_mentions(&s.load_err(), &[&file_name(&s.weights())]);
}

#[test]
fn header_offsets_out_of_range_name_the_file() {
    let s = Scratch::of("qwen3moe", "offsets");
    let bytes = std::fs::read(s.weights()).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut header: Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    // Move the last tensor's end offset far past the data.
    let (name, end) = header
        .as_object()
        .unwrap()
        .iter()
        .filter_map(|(k, v)| v.get("data_offsets").map(|o| (k.clone(), o[1].as_u64().unwrap())))
        .max_by_key(|(_, end)| *end)
        .unwrap();
    header[&name]["data_offsets"][1] = Value::from(end + 1_000_000);
    let text = serde_json::to_vec(&header).unwrap();
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&text);
    out.extend_from_slice(&bytes[8 + n..]);
    std::fs::write(s.weights(), out).unwrap();
    assert_mentions(&s.load_err(), &[&file_name(&s.weights())]);
}

#[test]
fn missing_tensor_is_named() {
    let s = Scratch::of("qwen3moe", "missing");
    let victim = "model.layers.1.mlp.experts.3.down_proj.weight";
    s.edit_tensors(|name, d, sh, b| (name != victim).then_some((d, sh, b)));
    assert_mentions(&s.load_err(), &[victim, "not found"]);
}

#[test]
fn dtype_disagreeing_with_config_is_named() {
    let s = Scratch::of("qwen3moe", "dtype");
    let victim = "model.layers.0.self_attn.q_norm.weight";
    s.edit_tensors(|name, d, sh, b| {
        Some(if name == victim { (safetensors::Dtype::U8, vec![b.len()], b) } else { (d, sh, b) })
    });
    assert_mentions(&s.load_err(), &[victim, "U8"]);
}

#[test]
fn shape_disagreeing_with_config_is_named() {
    let s = Scratch::of("qwen3moe", "shape");
    s.edit_config(|c| c["moe_intermediate_size"] = Value::from(30));
    let err = s.load_err();
    assert_mentions(&err, &["expected shape", "mlp.experts"]);
}

#[test]
fn unknown_model_type_is_named() {
    let s = Scratch::of("qwen3moe", "model-type");
    s.edit_config(|c| c["model_type"] = Value::from("llama4"));
    assert_mentions(&s.load_err(), &["llama4", "model_type"]);
}

#[test]
fn missing_config_field_is_named() {
    let s = Scratch::of("qwen3moe", "field");
    s.edit_config(|c| {
        c.as_object_mut().unwrap().remove("num_key_value_heads");
    });
    assert_mentions(&s.load_err(), &["num_key_value_heads", "missing", "config.json"]);
}

#[test]
fn prompt_ids_outside_vocabulary_are_rejected_without_harming_the_state() {
    let b = CpuBackend::new();
    let m = Model::load(&b, &fixture("qwen3moe")).unwrap();
    let vocab = m.spec().vocab as u32;
    let mut st = m.new_state(4096).unwrap();
    let err = m.forward(&[1, vocab, 2], &mut st, Logits::Last).unwrap_err().to_string();
    assert_mentions(&err, &[&vocab.to_string(), "vocabulary"]);
    assert_eq!(st.len(), 0, "a rejected prompt must not advance the sequence");
    // The state is still usable and gives what a fresh one gives.
    let a = vt_core::Device::to_f32(&b, &m.forward(&[1, 2, 3], &mut st, Logits::Last).unwrap()).unwrap();
    let mut fresh = m.new_state(4096).unwrap();
    let f = vt_core::Device::to_f32(&b, &m.forward(&[1, 2, 3], &mut fresh, Logits::Last).unwrap()).unwrap();
    assert_eq!(a, f);
}

/// A state is emptied for reuse only by a model of its layers: another model's state is refused,
/// by name, and left as it was.
#[test]
fn resetting_another_models_state_is_refused() {
    let b = CpuBackend::new();
    let (qwen, laguna) =
        (Model::load(&b, &fixture("qwen35moe_text")).unwrap(), Model::load(&b, &fixture("laguna_a")).unwrap());
    let mut st = laguna.new_state(4096).unwrap();
    laguna.forward(&[1, 2, 3], &mut st, Logits::Last).unwrap();
    let err = qwen.reset_state(&mut st).unwrap_err().to_string();
    assert_mentions(&err, &["reset_state", "other layers"]);
    assert_eq!(st.len(), 3);
    laguna.reset_state(&mut st).unwrap();
    assert_eq!(st.len(), 0);
}

// ---- Laguna config fields (issue 3) ----

#[test]
fn head_list_of_wrong_length_is_named() {
    let s = Scratch::of("laguna_a", "heads");
    s.edit_config(|c| c["num_attention_heads_per_layer"] = serde_json::json!([6, 4, 6]));
    assert_mentions(&s.load_err(), &["num_attention_heads_per_layer", "3 entries", "4"]);
}

#[test]
fn unknown_rope_type_is_named() {
    let s = Scratch::of("laguna_a", "rope");
    s.edit_config(|c| c["rope_parameters"]["full_attention"]["rope_type"] = Value::from("longrope"));
    assert_mentions(&s.load_err(), &["rope_parameters.full_attention.rope_type", "longrope"]);
}

#[test]
fn unknown_gating_mode_is_named() {
    let s = Scratch::of("laguna_a", "gating");
    s.edit_config(|c| c["gating"] = Value::from("per-token"));
    assert_mentions(&s.load_err(), &["gating", "per-token"]);
}

#[test]
fn yarn_without_factor_is_named() {
    let s = Scratch::of("laguna_a", "yarn");
    s.edit_config(|c| {
        c["rope_parameters"]["full_attention"].as_object_mut().unwrap().remove("factor");
    });
    assert_mentions(&s.load_err(), &["rope_parameters.full_attention.factor"]);
}

#[test]
fn stacked_expert_shape_mismatch_is_named() {
    // qwen35moe_nested stores experts stacked ([E, 2I, H]); a config with another expert count
    // must name the tensor that disagrees.
    let s = Scratch::of("qwen35moe_nested", "stacked");
    s.edit_config(|c| c["text_config"]["num_experts"] = Value::from(5));
    assert_mentions(&s.load_err(), &["model.language_model.layers.0.mlp", "expected shape"]);
}
