//! FP8 block-scaled checkpoints: transformers' FineGrainedFP8 format, `quant_method: fp8`, as Qwen
//! (Qwen3.5/3.6 `-FP8`) and DeepSeek publish it, read into `vt_core::Fp8Block`.
//!
//! | | |
//! |---|---|
//! | config | `quantization_config`: `quant_method` `fp8`, `fmt` `e4m3`, `weight_block_size` `[bn, bk]`, `activation_scheme` |
//! | values, F8_E4M3 `[n, k]` | `M.weight` |
//! | scales, F32 or BF16 `[ceil(n/bn), ceil(k/bk)]` | `M.weight_scale_inv`: a multiplier, despite the name |
//! | left unquantized | `modules_to_not_convert` (MiniMax: `ignored_layers`) |
//!
//! `W[i, j] = e4m3(weight[i, j]) * weight_scale_inv[i / bn, j / bk]`; a dimension that is not a
//! multiple of its block ends in a partial block. vt computes W8A16: the activations stay bf16, and
//! a static scheme's `activation_scale` is not read.

use serde_json::{json, Value};
use vt_core::dtype::decode_into;
use vt_core::{Backend, DType, Error, Fp8Block, Result, Weight};

use super::config::{expect_tensor, Ctx, Rule};
use super::pattern::Pattern;
use crate::loader::Loader;

#[derive(Debug)]
pub struct Fp8Config {
    /// `[bn, bk]`.
    pub(super) block: [usize; 2],
    /// Modules kept in high precision.
    skip: Vec<Rule>,
}

impl Fp8Config {
    pub(super) fn parse(c: &Ctx, v: &Value) -> Result<Self> {
        c.expect(v, "fmt", json!("e4m3"), false)?;
        c.expect(v, "scale_fmt", json!("float"), false)?;
        c.expect(v, "expert_dtype", json!("fp8"), false)?;
        match c.opt_str(v, "activation_scheme")? {
            None | Some("dynamic" | "static") => {}
            Some(s) => return Err(c.err("activation_scheme", format!("`{s}` is not `dynamic` or `static`"))),
        }
        let block = match v.get("weight_block_size") {
            Some(x @ Value::Array(a)) if a.len() == 2 => {
                let side = |x: &Value| x.as_u64().filter(|&s| s > 0).and_then(|s| usize::try_from(s).ok());
                match (side(&a[0]), side(&a[1])) {
                    (Some(bn), Some(bk)) => [bn, bk],
                    _ => return Err(c.err("weight_block_size", format!("{x} is not two positive integers"))),
                }
            }
            other => {
                let found = other.map_or("nothing".to_string(), Value::to_string);
                return Err(c.err(
                    "weight_block_size",
                    format!("expected [rows, inputs] per scale, found {found} (vt reads block-scaled FP8)"),
                ));
            }
        };
        let key = if v.get("modules_to_not_convert").is_some_and(|x| !x.is_null()) {
            "modules_to_not_convert"
        } else {
            "ignored_layers"
        };
        let skip =
            c.str_list(v, key)?.into_iter().map(|e| c.rule(e, Pattern::transformers_skip)).collect::<Result<_>>()?;
        Ok(Fp8Config { block, skip })
    }

    /// Module `module` `[n, k]` as an FP8 weight, or `None` where the checkpoint stores it dense.
    ///
    /// The checkpoint's `M.weight` dtype decides, as in transformers, whose load quantizes every
    /// linear the list does not skip but passes a weight stored without scales through; a module
    /// the list skips must not be stored FP8.
    pub(super) fn weight<B: Backend>(
        &self,
        ld: &Loader<B>,
        module: &str,
        n: usize,
        k: usize,
    ) -> Result<Option<Weight<B>>> {
        let tensors = &ld.ckpt.tensors;
        let name = format!("{module}.weight");
        let stored = tensors.get(&name).is_ok_and(|t| t.dtype == DType::F8E4M3);
        if let Some(r) = self.skip.iter().find(|r| r.pattern.matches(module)) {
            if stored {
                return Err(Error::tensor(
                    name,
                    format!("is F8_E4M3, but `{}` = `{}` leaves module `{module}` unquantized", r.field, r.text),
                ));
            }
            return Ok(None);
        }
        if !stored {
            return Ok(None);
        }
        let [bn, bk] = self.block;
        let values = tensors.get(&name)?;
        expect_tensor(&values, DType::F8E4M3, &[n, k], "e4m3 values")?;
        let scales = tensors.get(&format!("{module}.weight_scale_inv"))?;
        let shape = Fp8Block::<B>::scales_shape(n, k, self.block);
        if !matches!(scales.dtype, DType::F32 | DType::BF16) || scales.shape != shape {
            return Err(Error::tensor(
                scales.name,
                format!(
                    "expected F32 or BF16 {shape:?} (one scale per [{bn}, {bk}] block), found {} {:?}",
                    scales.dtype, scales.shape
                ),
            ));
        }
        let mut f32s = vec![0.0f32; shape[0] * shape[1]];
        decode_into(scales.dtype, scales.bytes, &mut f32s);
        if let Some((i, s)) = f32s.iter().enumerate().find(|(_, s)| !s.is_finite()) {
            let (r, c) = (i / shape[1], i % shape[1]);
            return Err(Error::tensor(scales.name, format!("the scale of block [{r}, {c}] is {s}, not finite")));
        }
        let bytes: Vec<u8> = f32s.iter().flat_map(|s| s.to_le_bytes()).collect();
        let scales_t = ld.place(DType::F32, &shape, &bytes)?;
        ld.count_read(scales.bytes.len());
        Ok(Some(Weight::Fp8(Fp8Block {
            values: ld.upload(DType::F8E4M3, &[n, k], values.bytes)?,
            scales: scales_t,
            block: self.block,
        })))
    }
}
