//! Engine helpers for the lifetime tests (docs/lifetime.md): the fixtures with MoE layers, each
//! paired with a variant of different weights, one deterministic run of an engine, bit-exact
//! comparison, and where an engine's expert storage lives; the test bodies themselves are in
//! `checks`. Generic over the backend, so every backend runs the same bodies.

pub mod checks;

use std::panic::AssertUnwindSafe;
use std::path::{Path, PathBuf};

use tempfile::TempDir;
use vt_core::checkpoint::Config;
use vt_core::{Backend, Weight};
use vt_models::spec::FfnSpec;
use vt_models::{Logits, Model, ModelSpec};

use crate::{all_fixtures, argmax, Reference};

/// A fixture with MoE layers (engine "A") and a perturbed variant of it (engine "B": different
/// weights, same shapes, hence the same allocation sequence).
pub struct Pair {
    pub name: String,
    pub a: PathBuf,
    b: TempDir,
    /// The fixture's reference prompt.
    pub prompt: Vec<u32>,
}

impl Pair {
    pub fn new(dir: &Path) -> Pair {
        Pair {
            name: dir.file_name().expect("fixture dir name").to_string_lossy().into_owned(),
            a: dir.to_path_buf(),
            b: crate::variant::perturbed(dir, 0x5eed),
            prompt: Reference::load(dir).prompt_ids,
        }
    }

    /// `[A, B]`.
    pub fn dirs(&self) -> [&Path; 2] {
        [&self.a, self.b.path()]
    }
}

/// Every committed fixture whose config has at least one MoE layer, paired with its variant; new
/// families and weight formats are covered as soon as their fixtures land.
pub fn moe_pairs() -> Vec<Pair> {
    let pairs: Vec<Pair> = all_fixtures().iter().filter(|d| has_moe(d)).map(|d| Pair::new(d)).collect();
    assert!(!pairs.is_empty(), "no fixture with MoE layers");
    pairs
}

/// Runs `check` on every pair, then fails naming every fixture whose check panicked, so one log
/// shows each family and format a regression (or the mutation arm) breaks.
pub fn check_each(pairs: &[Pair], check: impl Fn(&Pair)) {
    let failed: Vec<&str> = pairs
        .iter()
        .filter(|p| std::panic::catch_unwind(AssertUnwindSafe(|| check(p))).is_err())
        .map(|p| p.name.as_str())
        .collect();
    assert!(failed.is_empty(), "failed on {failed:?} (their messages are above)");
}

fn has_moe(dir: &Path) -> bool {
    let cfg = Config::from_file(&dir.join("config.json")).expect("fixture config");
    let spec = ModelSpec::from_config(&cfg).expect("fixture spec");
    spec.layers.iter().any(|l| matches!(l.ffn, FfnSpec::Moe(_)))
}

/// What one engine computed: the logits of every prompt position and of each greedy step, and the
/// greedy ids.
pub struct Run {
    pub logits: Vec<f32>,
    pub ids: Vec<u32>,
}

/// Prefill of `prompt` (logits at every position), then `steps` greedy decode steps.
pub fn run<B: Backend>(model: &Model<B>, prompt: &[u32], steps: usize) -> Run {
    let b = model.backend();
    let mut state = model.new_state(4096).expect("sequence state");
    let mut logits = b.to_f32(&model.forward(prompt, &mut state, Logits::All).expect("prefill")).expect("logits");
    let vocab = model.spec().vocab;
    let mut ids = vec![argmax(&logits[logits.len() - vocab..])];
    while ids.len() < steps {
        let row =
            b.to_f32(&model.forward(&ids[ids.len() - 1..], &mut state, Logits::Last).expect("decode")).expect("logits");
        ids.push(argmax(&row));
        logits.extend_from_slice(&row);
    }
    Run { logits, ids }
}

/// Loads `dir` on `backend`, runs it once and drops it.
pub fn solo<B: Backend>(backend: &B, dir: &Path, prompt: &[u32], steps: usize) -> Run {
    run(&Model::load(backend, dir).expect("load fixture"), prompt, steps)
}

/// Bit-for-bit equality of logits and ids; the panic names the first differing logit.
pub fn assert_bit_identical(what: &str, got: &Run, want: &Run) {
    assert_eq!(got.logits.len(), want.logits.len(), "{what}: logit count");
    if let Some(i) = (0..got.logits.len()).find(|&i| got.logits[i].to_bits() != want.logits[i].to_bits()) {
        panic!(
            "{what}: logits differ from the engine built alone, first at index {i} ({} vs {}), max |d| {:.3e}",
            got.logits[i],
            want.logits[i],
            crate::max_abs_diff(&got.logits, &want.logits)
        );
    }
    assert_eq!(got.ids, want.ids, "{what}: greedy ids differ from the engine built alone");
}

/// Whether two runs differ anywhere (a test with "different weights" must see a difference).
pub fn differs(a: &Run, b: &Run) -> bool {
    a.ids != b.ids || a.logits.iter().zip(&b.logits).any(|(x, y)| x.to_bits() != y.to_bits())
}

/// Addresses of every routed expert's gate, up and down storage, layer by layer.
pub fn expert_storage<B: Backend>(model: &Model<B>) -> Vec<usize> {
    let b = model.backend();
    let addr = |w: &Weight<B>| w.storage_addr(b);
    model
        .moe_experts()
        .flat_map(|m| m.experts.iter().flat_map(|e| [addr(&e.gate), addr(&e.up), addr(&e.down)]))
        .collect()
}

/// Whether no MoE layer of `model` has built its resident state yet.
pub fn slots_empty<B: Backend>(model: &Model<B>) -> bool {
    model.moe_experts().all(|m| m.resident.is_empty())
}
