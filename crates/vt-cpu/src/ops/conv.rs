//! Depthwise causal 1-D convolution followed by SiLU: the "short convolution" in front of a
//! Gated DeltaNet layer.
//!
//! Mirrors the torch fallbacks of Hugging Face transformers
//! (`models/qwen3_5_moe/modeling_qwen3_5_moe.py`):
//!
//! * `causal_conv1d_fn` (prefill, no cache): `F.conv1d(x, w, padding=k-1, groups=c)[..., :t]`, i.e.
//!   the sequence is left-padded with k-1 zeros;
//! * `causal_conv1d_update` (cached decode): `cat([conv_state, x])`, conv without padding, keep the
//!   last `t` outputs, and `conv_state <- last k-1 columns of the concatenation`.
//!
//! Both are the same computation once the zero padding is seen as an all-zero state, which is what
//! [`causal_conv1d_silu`] does: `state` holds the previous k-1 inputs of every channel.
//! `F.conv1d` is a cross-correlation, so tap `k-1` multiplies the *current* input:
//!
//! ```text
//! ext = [state (k-1 columns), x (t columns)]            per channel
//! y[s][ch] = silu( sum_{j<k} w[ch][j] * ext[s + j][ch] ) for s in 0..t
//! ```
//!
//! The Qwen3.5 conv has no bias (`bias=False`), so none is taken here.

use rayon::prelude::*;

/// Output rows per rayon task. A row costs ~`k*c` multiply-adds (c is ~8k channels for a real
/// model), so a few rows per task already amortise the scheduling; decode (t = 1) stays serial.
const ROWS_PER_TASK: usize = 16;

/// Channels summed together per pass (keeps k taps' worth of slices in L1).
const CH_BLOCK: usize = 512;

/// SiLU as torch computes it in f32: `x * sigmoid(x) = x / (1 + exp(-x))`.
#[inline]
fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// Depthwise causal conv1d + silu. x: [t, c] (time-major!), w: [c, k] (the HF weight [c,1,k] squeezed),
/// state: [c, k-1] = the previous k-1 inputs of each channel (oldest first), zeros for a new sequence;
/// updated in place to the last k-1 inputs (including earlier state when t < k-1). Returns [t, c].
pub fn causal_conv1d_silu(x: &[f32], t: usize, c: usize, w: &[f32], k: usize, state: &mut [f32]) -> Vec<f32> {
    debug_assert_eq!(x.len(), t * c, "x must be [t, c]");
    debug_assert_eq!(w.len(), c * k, "w must be [c, k]");
    debug_assert!(k >= 1, "kernel size must be at least 1");
    let km1 = k.saturating_sub(1);
    debug_assert_eq!(state.len(), c * km1, "state must be [c, k-1]");

    let mut out = vec![0.0f32; t * c];
    if t == 0 || c == 0 || k == 0 {
        return out;
    }

    // Transpose the weight to tap-major [k, c] so the inner loop runs over contiguous channels.
    let mut wt = vec![0.0f32; k * c];
    for ch in 0..c {
        for j in 0..k {
            wt[j * c + ch] = w[ch * k + j];
        }
    }

    // Compute output rows `s0..s0+rows` into `dst` ([rows, c]). Input position `p = s + j` of the
    // virtual `ext` sequence is state column `p` when `p < k-1`, else x row `p - (k-1)`.
    // Channels go in blocks of CH_BLOCK so the accumulator, weight and input slices of all k taps
    // stay in L1 while they are summed.
    let state_ro: &[f32] = state;
    let fill_rows = |s0: usize, dst: &mut [f32]| {
        for (r, out_row) in dst.chunks_mut(c).enumerate() {
            let s = s0 + r;
            for c0 in (0..c).step_by(CH_BLOCK) {
                let c1 = (c0 + CH_BLOCK).min(c);
                let acc = &mut out_row[c0..c1];
                for j in 0..k {
                    let w_tap = &wt[j * c + c0..j * c + c1];
                    let p = s + j;
                    if p >= km1 {
                        let x_in = &x[(p - km1) * c + c0..(p - km1) * c + c1];
                        for ((o, &wv), &xv) in acc.iter_mut().zip(w_tap).zip(x_in) {
                            *o += wv * xv;
                        }
                    } else {
                        // Still inside the carried state: channel-major, column p.
                        for (i, (o, &wv)) in acc.iter_mut().zip(w_tap).enumerate() {
                            *o += wv * state_ro[(c0 + i) * km1 + p];
                        }
                    }
                }
                for o in acc.iter_mut() {
                    *o = silu(*o);
                }
            }
        }
    };

    if t <= ROWS_PER_TASK {
        fill_rows(0, &mut out);
    } else {
        out.par_chunks_mut(ROWS_PER_TASK * c).enumerate().for_each(|(i, dst)| fill_rows(i * ROWS_PER_TASK, dst));
    }

    // New state: the last k-1 columns of ext = [state, x]. Column i of the new state is ext column
    // t + i, which comes from the old state when t + i < k-1 (short inputs), else from x.
    if km1 > 0 {
        for ch in 0..c {
            let st = &mut state[ch * km1..(ch + 1) * km1];
            // Ascending i reads old column t + i > i before it is overwritten: safe in place.
            for i in 0..km1 {
                let p = t + i;
                st[i] = if p < km1 { st[p] } else { x[(p - km1) * c + ch] };
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    use vt_test_support::ops::Rng;

    fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
        assert_eq!(a.len(), b.len());
        a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
    }

    #[test]
    fn hand_computed_tiny_case() {
        // c = 2, k = 3, t = 3, zero state. Channel 0 weights [1, 2, 3], channel 1 [0, 0, -1].
        let w = [1.0, 2.0, 3.0, 0.0, 0.0, -1.0];
        // x rows (time-major): t0 = [1, 4], t1 = [2, 5], t2 = [3, 6]
        let x = [1.0, 4.0, 2.0, 5.0, 3.0, 6.0];
        let mut state = vec![0.0; 2 * 2];
        let y = causal_conv1d_silu(&x, 3, 2, &w, 3, &mut state);
        // ch0: s0 = 3*1 = 3; s1 = 2*1 + 3*2 = 8; s2 = 1*1 + 2*2 + 3*3 = 14
        // ch1: -x: -4, -5, -6
        let pre = [3.0f32, -4.0, 8.0, -5.0, 14.0, -6.0];
        for (got, p) in y.iter().zip(pre) {
            let want = p / (1.0 + (-p).exp());
            assert!((got - want).abs() <= 1e-6, "{got} vs {want}");
        }
        // State = last two inputs per channel, oldest first.
        assert_eq!(state, vec![2.0, 3.0, 5.0, 6.0]);

        // One more token [10, 1] with that state: ch0 = 1*2 + 2*3 + 3*10 = 38, ch1 = -1.
        let y = causal_conv1d_silu(&[10.0, 1.0], 1, 2, &w, 3, &mut state);
        assert!((y[0] - 38.0 / (1.0 + (-38.0f32).exp())).abs() <= 1e-5);
        assert!((y[1] - (-1.0 / (1.0 + 1.0f32.exp()))).abs() <= 1e-6);
        assert_eq!(state, vec![3.0, 10.0, 6.0, 1.0]);
    }

    #[test]
    fn split_processing_matches_one_pass() {
        let (t, c, k) = (41usize, 7usize, 4usize);
        let mut rng = Rng(0x1234_5678_9abc_def1);
        let x = rng.vec(t * c, 1.0);
        let w = rng.vec(c * k, 1.0);

        let mut st_full = vec![0.0; c * (k - 1)];
        let full = causal_conv1d_silu(&x, t, c, &w, k, &mut st_full);

        // Prefill 5 tokens, then one at a time.
        let mut st = vec![0.0; c * (k - 1)];
        let mut split = causal_conv1d_silu(&x[..5 * c], 5, c, &w, k, &mut st);
        for s in 5..t {
            split.extend(causal_conv1d_silu(&x[s * c..(s + 1) * c], 1, c, &w, k, &mut st));
        }
        let d = max_abs_diff(&full, &split);
        eprintln!("conv split vs one pass: max abs diff {d:e}");
        // Identical arithmetic in identical order: bit-exact.
        assert_eq!(d, 0.0);
        assert_eq!(st, st_full);

        // Chunks shorter than k-1 (t = 2 < 3) exercise the "state keeps old columns" path.
        let mut st2 = vec![0.0; c * (k - 1)];
        let mut split2 = Vec::new();
        let mut s = 0;
        while s < t {
            let n = 2.min(t - s);
            split2.extend(causal_conv1d_silu(&x[s * c..(s + n) * c], n, c, &w, k, &mut st2));
            s += n;
        }
        assert_eq!(max_abs_diff(&full, &split2), 0.0);
        assert_eq!(st2, st_full);
    }

    /// Golden values from transformers' `causal_conv1d_fn` / `causal_conv1d_update` (torch, f32),
    /// written by tools/oracle/gdn_golden.py.
    #[test]
    fn matches_torch_golden() {
        let doc: serde_json::Value =
            serde_json::from_str(include_str!("../../tests/data/gdn_golden.json")).expect("golden json");
        let floats = |v: &serde_json::Value, key: &str| -> Vec<f32> {
            v[key]
                .as_array()
                .unwrap_or_else(|| panic!("golden: missing array {key}"))
                .iter()
                .map(|x| x.as_f64().expect("golden: number") as f32)
                .collect()
        };
        let cases = doc["conv"].as_array().expect("golden: conv cases");
        assert!(!cases.is_empty());
        for case in cases {
            let dim = |n: &str| case[n].as_u64().expect("golden: dim") as usize;
            let (t, c, k) = (dim("t"), dim("c"), dim("k"));
            let mut state = floats(case, "initial_state");
            let y = causal_conv1d_silu(&floats(case, "x"), t, c, &floats(case, "w"), k, &mut state);
            let (eo, es) = (max_abs_diff(&y, &floats(case, "out")), max_abs_diff(&state, &floats(case, "state")));
            eprintln!("conv golden {}: out max|diff| {eo:e}, state max|diff| {es:e}", case["name"]);
            // A 4-term f32 dot product of O(1) values then silu: torch may sum the taps in another
            // order, so allow a few ulps of O(1). The state is a copy: exact.
            assert!(eo <= 1e-5, "conv golden: output diff {eo}");
            assert_eq!(es, 0.0);
        }
    }
}
