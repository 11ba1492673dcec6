//! Quantized checkpoints: which format a checkpoint's quantization config names, and reading a
//! module's tensors into that format's `vt_core` weight. One module per format; a new format adds
//! its module and an arm in `QuantConfig::parse` and `QuantConfig::weight`.

mod config;
mod fp8;
mod nvfp4;
mod pattern;

use serde_json::Value;
use vt_core::checkpoint::Checkpoint;
use vt_core::{Backend, Result, Weight, NVFP4_GROUP};

use crate::loader::Loader;
use config::Ctx;

/// A checkpoint's quantization config.
#[derive(Debug)]
pub enum QuantConfig {
    Nvfp4(nvfp4::Nvfp4Config),
    Fp8(fp8::Fp8Config),
}

impl QuantConfig {
    /// config.json's `quantization_config`, else ModelOpt's `hf_quant_config.json`; `None` when
    /// neither exists.
    pub fn from_checkpoint(ckpt: &Checkpoint) -> Result<Option<Self>> {
        match ckpt.config.get("quantization_config") {
            Some(qc) => Self::parse(&Ctx::new(ckpt.config.path(), "quantization_config"), qc).map(Some),
            None => Ok(nvfp4::Nvfp4Config::from_hf_quant_config(ckpt)?.map(QuantConfig::Nvfp4)),
        }
    }

    fn parse(c: &Ctx, v: &Value) -> Result<Self> {
        match v.get("quant_method").and_then(Value::as_str) {
            Some(m) if nvfp4::Nvfp4Config::reads(m) => nvfp4::Nvfp4Config::parse(c, v).map(QuantConfig::Nvfp4),
            Some("fp8") => fp8::Fp8Config::parse(c, v).map(QuantConfig::Fp8),
            Some(m) => Err(c.err(
                "quant_method",
                format!("`{m}` is not supported (vt reads NVFP4 compressed-tensors and modelopt, and fp8 checkpoints)"),
            )),
            None => Err(c.err("quant_method", "missing or not a string")),
        }
    }

    /// Module `module` (`[n, k]` from config.json) in its quantized form, every tensor checked;
    /// `None` where the checkpoint keeps it dense.
    pub fn weight<B: Backend>(&self, ld: &Loader<B>, module: &str, n: usize, k: usize) -> Result<Option<Weight<B>>> {
        match self {
            QuantConfig::Nvfp4(c) => c.weight(ld, module, n, k),
            QuantConfig::Fp8(c) => c.weight(ld, module, n, k),
        }
    }
}

impl QuantConfig {
    /// The smallest step a tensor-parallel cut of a weight's rows or columns can take: an NVFP4
    /// scale group, or a multiple of both sides of an FP8 block.
    pub fn split_unit(&self) -> usize {
        match self {
            QuantConfig::Nvfp4(_) => NVFP4_GROUP,
            QuantConfig::Fp8(c) => {
                let [a, b] = c.block;
                let gcd = |mut x: usize, mut y: usize| {
                    while y != 0 {
                        (x, y) = (y, x % y);
                    }
                    x
                };
                a / gcd(a, b).max(1) * b
            }
        }
    }
}

/// Activation scales of W4A4 / W8A8 checkpoints, which vt's weight-only compute never reads.
pub fn is_activation_scale(name: &str) -> bool {
    [".input_global_scale", ".input_scale", ".activation_scale"].iter().any(|s| name.ends_with(s))
}
