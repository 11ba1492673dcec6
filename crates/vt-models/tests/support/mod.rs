//! Checkpoint fixtures rewritten for bad-input tests: a copy of a fixture with tensors and
//! config.json edited.

use std::path::{Path, PathBuf};

use serde_json::{json, Value};
use vt_core::checkpoint::TensorStore;
use vt_core::DType;
use vt_cpu::CpuBackend;
use vt_models::Model;
use vt_test_support::fixture;

/// One tensor of a checkpoint being rewritten.
pub struct Entry {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub bytes: Vec<u8>,
}

/// A copy of fixture `src` in a fresh temporary directory, its tensors and config.json edited.
pub struct Corrupted(pub PathBuf);

impl Corrupted {
    pub fn new(src: &str, tag: &str, tensors: impl FnOnce(&mut Vec<Entry>), config: impl FnOnce(&mut Value)) -> Self {
        let from = fixture(src);
        let dir = std::env::temp_dir().join(format!("vt-corrupt-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        for f in ["generation_config.json", "hf_quant_config.json"] {
            if from.join(f).exists() {
                std::fs::copy(from.join(f), dir.join(f)).unwrap();
            }
        }
        let mut cfg: Value = serde_json::from_str(&std::fs::read_to_string(from.join("config.json")).unwrap()).unwrap();
        config(&mut cfg);
        std::fs::write(dir.join("config.json"), serde_json::to_string_pretty(&cfg).unwrap()).unwrap();
        let store = TensorStore::open_dir(&from).unwrap();
        let mut names: Vec<&str> = store.names().collect();
        names.sort();
        let mut entries: Vec<Entry> = names
            .into_iter()
            .map(|n| {
                let t = store.get(n).unwrap();
                Entry { name: n.to_string(), dtype: t.dtype, shape: t.shape.to_vec(), bytes: t.bytes.to_vec() }
            })
            .collect();
        tensors(&mut entries);
        write_safetensors(&dir.join("model.safetensors"), &entries);
        Corrupted(dir)
    }

    pub fn load_error(&self) -> String {
        match Model::load(&CpuBackend::new(), &self.0) {
            Ok(_) => panic!("{} loaded", self.0.display()),
            Err(e) => e.to_string(),
        }
    }
}

impl Drop for Corrupted {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The safetensors layout: u64 header length, JSON header, then the tensors back to back.
fn write_safetensors(path: &Path, entries: &[Entry]) {
    let mut header = serde_json::Map::new();
    let mut offset = 0;
    for e in entries {
        header.insert(
            e.name.clone(),
            json!({"dtype": e.dtype.name(), "shape": e.shape, "data_offsets": [offset, offset + e.bytes.len()]}),
        );
        offset += e.bytes.len();
    }
    let mut text = serde_json::to_string(&header).unwrap();
    text.push_str(&" ".repeat((8 - text.len() % 8) % 8));
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(text.as_bytes());
    for e in entries {
        out.extend_from_slice(&e.bytes);
    }
    std::fs::write(path, out).unwrap();
}

pub fn edit<'a>(entries: &'a mut [Entry], name: &str) -> &'a mut Entry {
    entries.iter_mut().find(|e| e.name == name).unwrap_or_else(|| panic!("{name} not in the fixture"))
}
