//! Dev-only helpers shared by vt's test suites: committed fixtures, their HF references, the
//! comparison rules (max |Δlogit|, greedy ids with the near-tie exception), and the engine helpers
//! of the lifetime tests (`lifetime`, `variant`).

pub mod lifetime;
pub mod mtp;
pub mod ops;
pub mod parallel;
pub mod parity;
pub mod variant;

use std::path::{Path, PathBuf};

use vt_core::checkpoint::TensorStore;

/// Tolerance on logits, CPU f32 against transformers f32 (issue bar; f32 arithmetic in different
/// orders over a few layers of tiny models lands around 1e-5).
pub const LOGIT_TOL: f32 = 1e-3;

pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

pub fn fixtures_dir() -> PathBuf {
    repo_root().join("fixtures")
}

/// Every committed fixture directory (those holding a `reference.safetensors`), sorted.
pub fn all_fixtures() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(fixtures_dir())
        .expect("fixtures/ exists")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.join("reference.safetensors").exists())
        .collect();
    dirs.sort();
    dirs
}

pub fn fixture(name: &str) -> PathBuf {
    fixtures_dir().join(name)
}

/// What transformers computed for a fixture.
pub struct Reference {
    pub prompt_ids: Vec<u32>,
    pub greedy_ids: Vec<u32>,
    /// `[prompt + greedy - 1, vocab]`, one full forward over prompt ++ greedy[..-1].
    pub logits: Vec<f32>,
    pub vocab: usize,
}

impl Reference {
    pub fn load(dir: &Path) -> Reference {
        let path = dir.join("reference.safetensors");
        let store = TensorStore::open_files(dir, &[path]).expect("reference.safetensors");
        let ids =
            |n: &str| store.get(n).unwrap().to_i64_vec().unwrap().into_iter().map(|x| x as u32).collect::<Vec<_>>();
        let logits = store.get("logits").unwrap();
        let vocab = logits.shape[1];
        Reference {
            prompt_ids: ids("prompt_ids"),
            greedy_ids: ids("greedy_ids"),
            logits: logits.to_f32_vec().unwrap(),
            vocab,
        }
    }

    pub fn row(&self, i: usize) -> &[f32] {
        &self.logits[i * self.vocab..(i + 1) * self.vocab]
    }

    /// The full token sequence the reference logits were computed over.
    pub fn sequence(&self) -> Vec<u32> {
        let mut s = self.prompt_ids.clone();
        s.extend_from_slice(&self.greedy_ids[..self.greedy_ids.len() - 1]);
        s
    }
}

/// Largest `|a[i] - b[i]|`, or NaN when some pair has exactly one NaN: `f32::max` skips a NaN, so
/// folding with it let a NaN output compare as a perfect match. Equal values (equal infinities,
/// two NaNs) differ by 0.
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "compared slices differ in length");
    a.iter()
        .zip(b)
        .map(|(x, y)| if x == y || (x.is_nan() && y.is_nan()) { 0.0 } else { (x - y).abs() })
        .fold(0.0, |m, d| if m.is_nan() || d.is_nan() { f32::NAN } else { m.max(d) })
}

/// vt's greedy pick (`vt_core::argmax`: the first largest value) as a token id.
pub fn argmax(row: &[f32]) -> u32 {
    vt_core::argmax(row) as u32
}

/// Gap between the largest and second-largest value of a row.
pub fn top2_gap(row: &[f32]) -> f32 {
    let (mut a, mut b) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
    for &v in row {
        if v > a {
            b = a;
            a = v;
        } else if v > b {
            b = v;
        }
    }
    a - b
}

/// Compares generated ids with the reference's greedy ids. A mismatch is tolerated only where the
/// reference's own top-2 gap at that step is below `LOGIT_TOL` (a near tie); after a tolerated
/// divergence the rest cannot be compared. Returns the number of steps compared.
pub fn check_greedy(reference: &Reference, ours: &[u32]) -> Result<usize, String> {
    let t = reference.prompt_ids.len();
    if ours.len() != reference.greedy_ids.len() {
        return Err(format!("generated {} tokens, reference has {}", ours.len(), reference.greedy_ids.len()));
    }
    for (step, (&o, &r)) in ours.iter().zip(&reference.greedy_ids).enumerate() {
        if o != r {
            let gap = top2_gap(reference.row(t - 1 + step));
            if gap < LOGIT_TOL {
                return Ok(step);
            }
            return Err(format!("step {step}: generated {o}, reference {r} (reference top-2 gap {gap:.3e})"));
        }
    }
    Ok(ours.len())
}

#[cfg(test)]
mod tests {
    use super::max_abs_diff;

    #[test]
    fn max_abs_diff_reports_a_one_sided_nan() {
        assert_eq!(max_abs_diff(&[1.0, 3.0, -2.0], &[1.5, 3.0, -2.25]), 0.5);
        // The NaN pair first and last: neither a later number nor an earlier one hides it.
        assert!(max_abs_diff(&[f32::NAN, 1.0], &[0.0, 1.25]).is_nan());
        assert!(max_abs_diff(&[1.0, 2.0], &[1.25, f32::NAN]).is_nan());
        // Agreeing NaNs and infinities are no difference; opposite infinities are.
        let (inf, nan) = (f32::INFINITY, f32::NAN);
        assert_eq!(max_abs_diff(&[inf, nan, -inf], &[inf, nan, -inf]), 0.0);
        assert_eq!(max_abs_diff(&[inf], &[-inf]), f32::INFINITY);
    }
}
