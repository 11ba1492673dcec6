//! What a checkpoint's `config.json` says the graph is: one `ModelSpec` for all three families.
//!
//! The families differ only at a few variation points (norm flavour, attention gate, rotary per
//! layer, sliding windows, router, shared expert, dense layers); everything else is shared.

use vt_core::checkpoint::Config;
use vt_core::{Error, NormKind, Result, Rope, RouterKind};

use crate::rope::{rope_from_params, RopeParams};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    Qwen35Moe,
    Laguna,
    Qwen3Moe,
}

#[derive(Clone, Debug, PartialEq)]
pub struct ModelSpec {
    pub family: Family,
    pub hidden: usize,
    pub vocab: usize,
    pub eps: f32,
    /// Input, post-attention and final norms.
    pub norm: NormKind,
    pub tie_embeddings: bool,
    pub layers: Vec<LayerSpec>,
    /// The multi-token-prediction layer config.json describes (`mtp_num_hidden_layers`), run as a
    /// draft model: a full-attention layer with the model's FFN. Qwen3.5-MoE only; the weights
    /// may still be absent from the checkpoint (`Model::has_mtp`).
    pub mtp: Option<LayerSpec>,
    pub eos_token_ids: Vec<u32>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct LayerSpec {
    pub mixer: MixerSpec,
    pub ffn: FfnSpec,
}

#[derive(Clone, Debug, PartialEq)]
pub enum MixerSpec {
    Attention(AttnSpec),
    DeltaNet(GdnSpec),
}

#[derive(Clone, Debug, PartialEq)]
pub struct AttnSpec {
    pub q_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub rope: Rope,
    pub window: Option<usize>,
    pub qk_norm: NormKind,
    pub gate: AttnGate,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttnGate {
    None,
    /// Qwen3.5: `q_proj` yields `[q | gate]` per head; output times `sigmoid(gate)` per element.
    SigmoidFromQProj,
    /// Laguna: output times `softplus(g_proj(x))`, one gate per head or per element.
    Softplus {
        per_head: bool,
    },
}

#[derive(Clone, Debug, PartialEq)]
pub struct GdnSpec {
    pub key_heads: usize,
    pub value_heads: usize,
    pub key_dim: usize,
    pub value_dim: usize,
    pub conv_kernel: usize,
}

impl GdnSpec {
    pub fn conv_channels(&self) -> usize {
        2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim
    }
}

#[derive(Clone, Debug, PartialEq)]
pub enum FfnSpec {
    Dense { intermediate: usize },
    Moe(MoeSpec),
}

#[derive(Clone, Debug, PartialEq)]
pub struct MoeSpec {
    pub num_experts: usize,
    pub intermediate: usize,
    pub router: RouterKind,
    /// Whether the router has an `e_score_correction_bias`.
    pub correction_bias: bool,
    pub shared: SharedExpert,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SharedExpert {
    None,
    Plain {
        intermediate: usize,
    },
    /// Scaled by `sigmoid(shared_expert_gate(x))`.
    SigmoidGated {
        intermediate: usize,
    },
}

impl ModelSpec {
    pub fn from_config(cfg: &Config) -> Result<Self> {
        let model_type = cfg.model_type()?;
        match model_type {
            "qwen3_5_moe" | "qwen3_5_moe_text" => qwen35(cfg),
            "laguna" => laguna(cfg),
            "qwen3_moe" => qwen3_moe(cfg),
            other => Err(Error::UnsupportedModel(format!(
                "{}: model_type `{other}` (vt supports qwen3_5_moe, qwen3_5_moe_text, laguna, qwen3_moe)",
                cfg.path().display()
            ))),
        }
    }
}

/// Larger than any size field of a real model (vocabularies included): a bound that keeps every
/// product of sizes, and every per-layer list, in range.
const MAX_SIZE: usize = 1 << 24;
/// More layers than any real model has (per-layer lists are built at this length).
const MAX_LAYERS: usize = 4096;

fn positive(cfg: &Config, field: &str) -> Result<usize> {
    let v = cfg.usize(field)?;
    if v == 0 || v > MAX_SIZE {
        return Err(cfg.error(field, format!("{v} must be positive and at most {MAX_SIZE}")));
    }
    Ok(v)
}

fn layer_count(cfg: &Config) -> Result<usize> {
    let n = positive(cfg, "num_hidden_layers")?;
    if n > MAX_LAYERS {
        return Err(cfg.error("num_hidden_layers", format!("{n} is more than {MAX_LAYERS}")));
    }
    Ok(n)
}

/// `rms_norm_eps`: a finite, non-negative number (a NaN or negative one makes every norm NaN).
fn norm_eps(cfg: &Config) -> Result<f32> {
    let eps = cfg.opt_f64("rms_norm_eps")?.unwrap_or(1e-6);
    if !(eps.is_finite() && eps >= 0.0) {
        return Err(cfg.error("rms_norm_eps", format!("{eps} must be a finite number, zero or above")));
    }
    Ok(eps as f32)
}

fn eos_ids(cfg: &Config) -> Result<Vec<u32>> {
    let field = "eos_token_id";
    match cfg.get(field) {
        None => Ok(Vec::new()),
        Some(v) if v.is_u64() => Ok(vec![v.as_u64().expect("checked") as u32]),
        Some(_) => Ok(cfg.opt_usize_list(field)?.unwrap_or_default().into_iter().map(|x| x as u32).collect()),
    }
}

/// A per-layer list of length `layers`, or an error naming the field.
fn per_layer<T>(cfg: &Config, field: &str, list: Option<Vec<T>>, layers: usize) -> Result<Option<Vec<T>>> {
    match list {
        Some(l) if l.len() != layers => {
            Err(cfg.error(field, format!("has {} entries but num_hidden_layers is {layers}", l.len())))
        }
        other => Ok(other),
    }
}

fn base(cfg: &Config, family: Family, norm: NormKind) -> Result<ModelSpec> {
    let act = cfg.opt_str("hidden_act")?.unwrap_or("silu");
    if act != "silu" {
        return Err(cfg.error("hidden_act", format!("`{act}` is not supported (vt implements silu)")));
    }
    if cfg.bool_or("attention_bias", false)? {
        return Err(cfg.error("attention_bias", "attention biases are not supported"));
    }
    Ok(ModelSpec {
        family,
        hidden: positive(cfg, "hidden_size")?,
        vocab: positive(cfg, "vocab_size")?,
        eps: norm_eps(cfg)?,
        norm,
        tie_embeddings: cfg.bool_or("tie_word_embeddings", false)?,
        layers: Vec::new(),
        mtp: None,
        eos_token_ids: eos_ids(cfg)?,
    })
}

fn head_dim(cfg: &Config) -> Result<usize> {
    match cfg.opt_usize("head_dim")? {
        Some(d) if d > 0 && d <= MAX_SIZE => Ok(d),
        Some(d) => Err(cfg.error("head_dim", format!("{d} must be positive and at most {MAX_SIZE}"))),
        None => Ok(positive(cfg, "hidden_size")? / positive(cfg, "num_attention_heads")?),
    }
}

/// `rope_parameters` (or legacy top-level `rope_theta`) of a model with one rotary for all layers.
fn global_rope(cfg: &Config, head_dim: usize, default_partial: f64) -> Result<Rope> {
    let empty = serde_json::json!({});
    let params = cfg.get("rope_parameters").unwrap_or(&empty);
    if !params.is_object() {
        return Err(cfg.error("rope_parameters", "expected an object"));
    }
    let truncate = params.get("truncate").and_then(|v| v.as_bool()).unwrap_or(true);
    let default_theta = cfg.opt_f64("rope_theta")?.unwrap_or(10000.0);
    let default_partial = cfg.opt_f64("partial_rotary_factor")?.unwrap_or(default_partial);
    rope_from_params(
        cfg,
        &RopeParams { params, field: "rope_parameters".into(), truncate },
        head_dim,
        default_theta,
        default_partial,
    )
}

fn qwen35(cfg: &Config) -> Result<ModelSpec> {
    let mut spec = base(cfg, Family::Qwen35Moe, NormKind::UnitOffset)?;
    let n = layer_count(cfg)?;
    let types = match per_layer(cfg, "layer_types", cfg.opt_str_list("layer_types")?, n)? {
        Some(t) => t,
        None => {
            let interval = cfg.opt_usize("full_attention_interval")?.unwrap_or(4);
            if interval == 0 {
                return Err(cfg.error("full_attention_interval", "must be positive"));
            }
            (0..n)
                .map(|i| if (i + 1) % interval == 0 { "full_attention" } else { "linear_attention" }.to_string())
                .collect()
        }
    };
    let hd = head_dim(cfg)?;
    let rope = global_rope(cfg, hd, 0.25)?;
    let attn = AttnSpec {
        q_heads: positive(cfg, "num_attention_heads")?,
        kv_heads: positive(cfg, "num_key_value_heads")?,
        head_dim: hd,
        rope,
        window: None,
        qk_norm: NormKind::UnitOffset,
        gate: AttnGate::SigmoidFromQProj,
    };
    check_gqa(cfg, attn.q_heads, attn.kv_heads)?;
    let gdn = GdnSpec {
        key_heads: positive(cfg, "linear_num_key_heads")?,
        value_heads: positive(cfg, "linear_num_value_heads")?,
        key_dim: positive(cfg, "linear_key_head_dim")?,
        value_dim: positive(cfg, "linear_value_head_dim")?,
        conv_kernel: positive(cfg, "linear_conv_kernel_dim")?,
    };
    if !gdn.value_heads.is_multiple_of(gdn.key_heads) {
        return Err(cfg.error(
            "linear_num_value_heads",
            format!("{} is not a multiple of linear_num_key_heads {}", gdn.value_heads, gdn.key_heads),
        ));
    }
    let moe = MoeSpec {
        num_experts: positive(cfg, "num_experts")?,
        intermediate: positive(cfg, "moe_intermediate_size")?,
        router: RouterKind::Softmax { top_k: positive(cfg, "num_experts_per_tok")?, renormalize: true },
        correction_bias: false,
        shared: SharedExpert::SigmoidGated { intermediate: positive(cfg, "shared_expert_intermediate_size")? },
    };
    check_top_k(cfg, &moe)?;
    spec.mtp = match cfg.opt_usize("mtp_num_hidden_layers")?.unwrap_or(0) {
        0 => None,
        1 if cfg.bool_or("mtp_use_dedicated_embeddings", false)? => {
            return Err(cfg.error("mtp_use_dedicated_embeddings", "vt runs the MTP layer on the model's embeddings"))
        }
        1 => Some(LayerSpec { mixer: MixerSpec::Attention(attn.clone()), ffn: FfnSpec::Moe(moe.clone()) }),
        n => return Err(cfg.error("mtp_num_hidden_layers", format!("{n}: vt runs one MTP layer"))),
    };
    for t in &types {
        let mixer = match t.as_str() {
            "linear_attention" => MixerSpec::DeltaNet(gdn.clone()),
            "full_attention" => MixerSpec::Attention(attn.clone()),
            other => return Err(cfg.error("layer_types", format!("unknown layer type `{other}`"))),
        };
        spec.layers.push(LayerSpec { mixer, ffn: FfnSpec::Moe(moe.clone()) });
    }
    Ok(spec)
}

fn check_gqa(cfg: &Config, q_heads: usize, kv_heads: usize) -> Result<()> {
    if !q_heads.is_multiple_of(kv_heads) {
        return Err(cfg.error(
            "num_key_value_heads",
            format!("{q_heads} query heads are not a multiple of {kv_heads} key/value heads"),
        ));
    }
    Ok(())
}

fn check_top_k(cfg: &Config, moe: &MoeSpec) -> Result<()> {
    let k = moe.router.top_k();
    if k == 0 || k > moe.num_experts {
        return Err(
            cfg.error("num_experts_per_tok", format!("{k} must be between 1 and the {} experts", moe.num_experts))
        );
    }
    Ok(())
}

fn laguna(cfg: &Config) -> Result<ModelSpec> {
    let mut spec = base(cfg, Family::Laguna, NormKind::Plain)?;
    let n = layer_count(cfg)?;
    let types = per_layer(cfg, "layer_types", cfg.opt_str_list("layer_types")?, n)?
        .unwrap_or_else(|| vec!["full_attention".into(); n]);
    let mlp_types = per_layer(cfg, "mlp_layer_types", cfg.opt_str_list("mlp_layer_types")?, n)?.unwrap_or_else(|| {
        std::iter::once("dense".to_string()).chain(std::iter::repeat_n("sparse".to_string(), n - 1)).collect()
    });
    let heads =
        match per_layer(cfg, "num_attention_heads_per_layer", cfg.opt_usize_list("num_attention_heads_per_layer")?, n)?
        {
            Some(h) => h,
            None => vec![positive(cfg, "num_attention_heads")?; n],
        };
    let kv_heads = positive(cfg, "num_key_value_heads")?;
    let hd = head_dim(cfg)?;
    let gate = match cfg.get("gating") {
        None => AttnGate::Softplus { per_head: false },
        Some(v) if v.as_bool() == Some(true) || v.as_str() == Some("per-head") => AttnGate::Softplus { per_head: true },
        Some(v) if v.as_str() == Some("per-element") => AttnGate::Softplus { per_head: false },
        Some(v) => {
            return Err(cfg
                .error("gating", format!("unknown gating mode {v} (expected true, \"per-head\" or \"per-element\")")))
        }
    };
    if cfg.bool_or("moe_apply_router_weight_on_input", false)? {
        return Err(cfg.error("moe_apply_router_weight_on_input", "true is not supported"));
    }
    let softcap = cfg.opt_f64("moe_router_logit_softcapping")?.unwrap_or(0.0);
    let moe = MoeSpec {
        num_experts: positive(cfg, "num_experts")?,
        intermediate: positive(cfg, "moe_intermediate_size")?,
        router: RouterKind::Sigmoid {
            top_k: positive(cfg, "num_experts_per_tok")?,
            softcap: (softcap > 0.0).then_some(softcap as f32),
            renormalize: true,
            routed_scaling: cfg.opt_f64("moe_routed_scaling_factor")?.unwrap_or(1.0) as f32,
        },
        correction_bias: true,
        shared: SharedExpert::Plain { intermediate: positive(cfg, "shared_expert_intermediate_size")? },
    };
    check_top_k(cfg, &moe)?;
    let dense = FfnSpec::Dense { intermediate: positive(cfg, "intermediate_size")? };
    let rope_all = cfg.get("rope_parameters").ok_or_else(|| cfg.error("rope_parameters", "missing"))?;
    let truncate = rope_all.get("truncate").and_then(|v| v.as_bool()).unwrap_or(true);
    let window = cfg.opt_usize("sliding_window")?;
    for (i, ((t, mlp), &q_heads)) in types.iter().zip(&mlp_types).zip(&heads).enumerate() {
        if q_heads == 0 {
            return Err(cfg.error("num_attention_heads_per_layer", format!("layer {i} has no heads")));
        }
        check_gqa(cfg, q_heads, kv_heads)?;
        let window = match t.as_str() {
            "full_attention" => None,
            "sliding_attention" => Some(
                window
                    .filter(|&w| w > 0)
                    .ok_or_else(|| cfg.error("sliding_window", "sliding layers need a positive window"))?,
            ),
            other => return Err(cfg.error("layer_types", format!("unknown layer type `{other}`"))),
        };
        let params = rope_all.get(t.as_str()).ok_or_else(|| cfg.error(&format!("rope_parameters.{t}"), "missing"))?;
        let rope = rope_from_params(
            cfg,
            &RopeParams { params, field: format!("rope_parameters.{t}"), truncate },
            hd,
            10000.0,
            1.0,
        )?;
        let mixer = MixerSpec::Attention(AttnSpec {
            q_heads,
            kv_heads,
            head_dim: hd,
            rope,
            window,
            qk_norm: NormKind::Plain,
            gate,
        });
        let ffn = match mlp.as_str() {
            "dense" => dense.clone(),
            "sparse" => FfnSpec::Moe(moe.clone()),
            other => {
                return Err(
                    cfg.error("mlp_layer_types", format!("unknown MLP type `{other}` (expected dense or sparse)"))
                )
            }
        };
        spec.layers.push(LayerSpec { mixer, ffn });
    }
    Ok(spec)
}

fn qwen3_moe(cfg: &Config) -> Result<ModelSpec> {
    let mut spec = base(cfg, Family::Qwen3Moe, NormKind::Plain)?;
    // As transformers: `sliding_window` applies to every layer, and only with `use_sliding_window`.
    let window = if cfg.bool_or("use_sliding_window", false)? {
        Some(
            cfg.opt_usize("sliding_window")?
                .filter(|&w| w > 0)
                .ok_or_else(|| cfg.error("sliding_window", "use_sliding_window needs a positive window"))?,
        )
    } else {
        None
    };
    let n = layer_count(cfg)?;
    let hd = head_dim(cfg)?;
    let attn = AttnSpec {
        q_heads: positive(cfg, "num_attention_heads")?,
        kv_heads: positive(cfg, "num_key_value_heads")?,
        head_dim: hd,
        rope: global_rope(cfg, hd, 1.0)?,
        window,
        qk_norm: NormKind::Plain,
        gate: AttnGate::None,
    };
    check_gqa(cfg, attn.q_heads, attn.kv_heads)?;
    let num_experts = match cfg.opt_usize("num_experts")? {
        Some(e) => e,
        None => cfg.usize("num_local_experts")?,
    };
    let step = cfg.opt_usize("decoder_sparse_step")?.unwrap_or(1);
    let mlp_only = cfg.opt_usize_list("mlp_only_layers")?.unwrap_or_default();
    let moe = MoeSpec {
        num_experts,
        intermediate: positive(cfg, "moe_intermediate_size")?,
        router: RouterKind::Softmax {
            top_k: positive(cfg, "num_experts_per_tok")?,
            renormalize: cfg.bool_or("norm_topk_prob", false)?,
        },
        correction_bias: false,
        shared: SharedExpert::None,
    };
    for i in 0..n {
        let sparse = !mlp_only.contains(&i) && num_experts > 0 && step > 0 && (i + 1) % step == 0;
        let ffn = if sparse {
            check_top_k(cfg, &moe)?;
            FfnSpec::Moe(moe.clone())
        } else {
            FfnSpec::Dense { intermediate: positive(cfg, "intermediate_size")? }
        };
        spec.layers.push(LayerSpec { mixer: MixerSpec::Attention(attn.clone()), ffn });
    }
    Ok(spec)
}
