//! Rotary inverse frequencies as transformers computes them (`default` and `yarn`), in f32.

use serde_json::Value;
use vt_core::checkpoint::Config;
use vt_core::{Result, Rope};

/// One rotary parameter set (`rope_parameters`, or one of its per-layer-type entries).
pub struct RopeParams<'a> {
    pub params: &'a Value,
    /// Dotted config path of `params`, for error messages.
    pub field: String,
    /// `truncate` as transformers reads it: from the top-level `rope_parameters` object.
    pub truncate: bool,
}

fn num(cfg: &Config, p: &RopeParams, key: &str) -> Result<Option<f64>> {
    match p.params.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_f64()
            .map(Some)
            .ok_or_else(|| cfg.error(&format!("{}.{key}", p.field), format!("expected a number, found {v}"))),
    }
}

/// Inverse frequencies for `head_dim`, given `rope_theta` and `partial_rotary_factor` defaults
/// for parameters the set leaves out.
pub fn rope_from_params(
    cfg: &Config,
    p: &RopeParams,
    head_dim: usize,
    default_theta: f64,
    default_partial: f64,
) -> Result<Rope> {
    let theta = num(cfg, p, "rope_theta")?.unwrap_or(default_theta);
    // theta 0 makes every rotary frequency infinite (NaN attention); below 1 it inverts them.
    if !(theta.is_finite() && theta > 1.0) {
        return Err(cfg.error(&format!("{}.rope_theta", p.field), format!("{theta} must be a finite number above 1")));
    }
    let partial = num(cfg, p, "partial_rotary_factor")?.unwrap_or(default_partial);
    let dim = (head_dim as f64 * partial) as usize;
    if dim == 0 || !dim.is_multiple_of(2) || dim > head_dim {
        return Err(cfg.error(&p.field, format!("rotary dimension {dim} (head_dim {head_dim} x partial_rotary_factor {partial}) must be even, positive and at most head_dim")));
    }
    // base ** (arange(0, dim, 2) / dim), all in f32 as torch does.
    let pos_freqs: Vec<f32> = (0..dim).step_by(2).map(|i| (theta as f32).powf(i as f32 / dim as f32)).collect();
    let rope_type = match p.params.get("rope_type").or_else(|| p.params.get("type")) {
        None => "default",
        Some(v) => v
            .as_str()
            .ok_or_else(|| cfg.error(&format!("{}.rope_type", p.field), format!("expected a string, found {v}")))?,
    };
    match rope_type {
        "default" => Ok(Rope { inv_freq: pos_freqs.iter().map(|f| 1.0 / f).collect(), attention_scaling: 1.0 }),
        "yarn" => yarn(cfg, p, theta, dim, &pos_freqs),
        other => Err(cfg.error(
            &format!("{}.rope_type", p.field),
            format!("unsupported rope type `{other}` (vt supports `default` and `yarn`)"),
        )),
    }
}

fn yarn(cfg: &Config, p: &RopeParams, base: f64, dim: usize, pos_freqs: &[f32]) -> Result<Rope> {
    let need =
        |key: &str| num(cfg, p, key)?.ok_or_else(|| cfg.error(&format!("{}.{key}", p.field), "required for yarn rope"));
    let factor = need("factor")?;
    let original_max = need("original_max_position_embeddings")?;
    let mscale = |scale: f64, m: f64| if scale <= 1.0 { 1.0 } else { 0.1 * m * scale.ln() + 1.0 };
    let attention_factor = match num(cfg, p, "attention_factor")? {
        Some(a) => a,
        None => match (num(cfg, p, "mscale")?, num(cfg, p, "mscale_all_dim")?) {
            (Some(m), Some(all)) if m != 0.0 && all != 0.0 => mscale(factor, m) / mscale(factor, all),
            _ => mscale(factor, 1.0),
        },
    };
    let beta_fast = num(cfg, p, "beta_fast")?.filter(|&b| b != 0.0).unwrap_or(32.0);
    let beta_slow = num(cfg, p, "beta_slow")?.filter(|&b| b != 0.0).unwrap_or(1.0);
    let correction_dim = |rotations: f64| {
        (dim as f64 * (original_max / (rotations * 2.0 * std::f64::consts::PI)).ln()) / (2.0 * base.ln())
    };
    let (mut low, mut high) = (correction_dim(beta_fast), correction_dim(beta_slow));
    if p.truncate {
        low = low.floor();
        high = high.ceil();
    }
    let (low, mut high) = (low.max(0.0), high.min(dim as f64 - 1.0));
    if low == high {
        high += 0.001;
    }
    let inv_freq = pos_freqs
        .iter()
        .enumerate()
        .map(|(i, &pf)| {
            let ramp = ((i as f32 - low as f32) / (high as f32 - low as f32)).clamp(0.0, 1.0);
            let extrapolation_factor = 1.0 - ramp;
            let extrapolation = 1.0 / pf;
            let interpolation = 1.0 / (factor as f32 * pf);
            interpolation * (1.0 - extrapolation_factor) + extrapolation * extrapolation_factor
        })
        .collect();
    Ok(Rope { inv_freq, attention_scaling: attention_factor as f32 })
}
