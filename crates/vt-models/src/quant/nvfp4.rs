//! NVFP4 checkpoints: which modules a quantization config makes NVFP4, and reading their tensors
//! into the one in-memory form, `vt_core::Nvfp4` (packed e2m1 codes, fp8 e4m3 block scales, one
//! f32 multiplier per tensor).
//!
//! Two encodings of the same numbers reach vt:
//!
//! | | compressed-tensors | ModelOpt |
//! |---|---|---|
//! | config | `quantization_config`: `quant_method` `compressed-tensors`, format `nvfp4-pack-quantized` | `quant_method` `modelopt`, `quant_algo` `NVFP4`, in config.json or `hf_quant_config.json` |
//! | codes, u8 `[n, k/2]` | `M.weight_packed` | `M.weight` |
//! | block scales, fp8 `[n, k/16]` | `M.weight_scale` | `M.weight_scale` |
//! | per-tensor f32 | `M.weight_global_scale`, a divisor | `M.weight_scale_2`, a multiplier |
//! | left unquantized | `ignore` (names, `re:` patterns) and what no `config_groups[*].targets` entry matches | `exclude_modules` (or `ignore`), wildcards |
//!
//! Activation scales (`input_global_scale`, `input_scale`) serve W4A4; vt computes W4A16 and does
//! not read them. Experts are read per expert: both exporters write `experts.{e}.gate_proj` etc.
//! for these models (transformers' own compressed-tensors loader only reads that layout).

use serde_json::{json, Value};
use vt_core::checkpoint::{Checkpoint, TensorRef, TensorStore};
use vt_core::{Backend, DType, Error, Nvfp4, Result, Weight, NVFP4_GROUP};

use super::config::{expect_tensor, Ctx, Rule};
use super::pattern::Pattern;
use crate::loader::Loader;

/// The only compressed-tensors format vt reads.
const CT_FORMAT: &str = "nvfp4-pack-quantized";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Encoding {
    CompressedTensors,
    ModelOpt,
}

impl Encoding {
    /// The u8 tensor holding the codes of module `m`.
    fn codes(self, m: &str) -> String {
        match self {
            Encoding::CompressedTensors => format!("{m}.weight_packed"),
            Encoding::ModelOpt => format!("{m}.weight"),
        }
    }

    /// The f32 per-tensor scale of module `m`.
    fn global(self, m: &str) -> String {
        match self {
            Encoding::CompressedTensors => format!("{m}.weight_global_scale"),
            Encoding::ModelOpt => format!("{m}.weight_scale_2"),
        }
    }
}

/// A checkpoint's NVFP4 quantization config.
///
/// The config decides where it can: a module it leaves unquantized must be stored dense, a module a
/// compressed-tensors target names (a module name or `re:` pattern) must be stored NVFP4. Class
/// targets (`Linear`) and ModelOpt's "everything not excluded" refer to Python module classes vt
/// does not have; there the checkpoint's tensors decide. A disagreement is an error naming the tensor.
#[derive(Debug)]
pub struct Nvfp4Config {
    encoding: Encoding,
    /// Modules kept in high precision.
    skip: Vec<Rule>,
    /// compressed-tensors targets naming modules.
    targets: Vec<Rule>,
    /// Whether some target may be a class name, which only the checkpoint can resolve.
    class_targets: bool,
}

impl Nvfp4Config {
    /// ModelOpt's `hf_quant_config.json`, read when config.json has no `quantization_config`;
    /// `None` when the file does not exist.
    pub(super) fn from_hf_quant_config(ckpt: &Checkpoint) -> Result<Option<Self>> {
        let path = ckpt.dir.join("hf_quant_config.json");
        if !path.exists() {
            return Ok(None);
        }
        let text = std::fs::read_to_string(&path).map_err(|source| Error::Io { path: path.clone(), source })?;
        let v: Value = serde_json::from_str(&text).map_err(|source| Error::Json { path: path.clone(), source })?;
        modelopt(&Ctx::new(&path, ""), &v).map(Some)
    }

    /// Whether `quant_method` names an NVFP4 encoding vt reads.
    pub(super) fn reads(method: &str) -> bool {
        method == "compressed-tensors" || method.to_ascii_lowercase().starts_with("modelopt")
    }

    /// config.json's `quantization_config` (`quant_method` accepted by `reads`).
    pub(super) fn parse(c: &Ctx, v: &Value) -> Result<Self> {
        match v.get("quant_method").and_then(Value::as_str) {
            Some("compressed-tensors") => compressed_tensors(c, v),
            _ => modelopt(c, v),
        }
    }

    /// Module `module` `[n, k]` as an NVFP4 weight, or `None` where it is left unquantized.
    pub(super) fn weight<B: Backend>(
        &self,
        ld: &Loader<B>,
        module: &str,
        n: usize,
        k: usize,
    ) -> Result<Option<Weight<B>>> {
        let tensors = &ld.ckpt.tensors;
        if !self.is_nvfp4(module, self.stored_nvfp4(tensors, module))? {
            return Ok(None);
        }
        let parts = self.read(tensors, module, n, k)?;
        ld.count_read(parts.global_bytes);
        Ok(Some(Weight::Nvfp4(Nvfp4::new(
            ld.backend,
            module,
            ld.upload(DType::F4x2, &[n, k], parts.codes.bytes)?,
            ld.upload(DType::F8E4M3, &[n, k / NVFP4_GROUP], parts.scales.bytes)?,
            parts.global_scale,
        )?)))
    }

    /// Whether the checkpoint stores module `module` in this encoding's NVFP4 form.
    fn stored_nvfp4(&self, tensors: &TensorStore, module: &str) -> bool {
        let codes = self.encoding.codes(module);
        match self.encoding {
            Encoding::CompressedTensors => tensors.contains(&codes),
            Encoding::ModelOpt => tensors.get(&codes).is_ok_and(|t| t.dtype == DType::U8),
        }
    }

    /// Whether module `module` is NVFP4, given whether the checkpoint stores it so.
    fn is_nvfp4(&self, module: &str, stored: bool) -> Result<bool> {
        let codes = || self.encoding.codes(module);
        if let Some(r) = self.skip.iter().find(|r| r.pattern.matches(module)) {
            if stored {
                return Err(Error::tensor(
                    codes(),
                    format!("is NVFP4, but `{}` = `{}` leaves module `{module}` unquantized", r.field, r.text),
                ));
            }
            return Ok(false);
        }
        if let Some(r) = self.targets.iter().find(|r| r.pattern.matches(module)) {
            if !stored {
                return Err(Error::tensor(
                    codes(),
                    format!("missing: `{}` = `{}` quantizes module `{module}`", r.field, r.text),
                ));
            }
            return Ok(true);
        }
        if stored && !self.class_targets {
            return Err(Error::tensor(
                codes(),
                format!("is NVFP4, but no `config_groups` target matches module `{module}`"),
            ));
        }
        Ok(stored)
    }

    /// Module `module` as an NVFP4 `[n, k]` matrix (`n`, `k` from config.json), every tensor's dtype
    /// and shape checked, the per-tensor scale normalised to a multiplier.
    fn read<'t>(&self, tensors: &'t TensorStore, module: &str, n: usize, k: usize) -> Result<Nvfp4Parts<'t>> {
        if !k.is_multiple_of(NVFP4_GROUP) {
            return Err(Error::tensor(
                module,
                format!("NVFP4 needs an input size that is a multiple of {NVFP4_GROUP}, config.json gives {k}"),
            ));
        }
        let codes = tensors.get(&self.encoding.codes(module))?;
        expect_tensor(&codes, DType::U8, &[n, k / 2], &format!("e2m1 codes of a [{n}, {k}] matrix, two per byte"))?;
        let scales = tensors.get(&format!("{module}.weight_scale"))?;
        expect_tensor(&scales, DType::F8E4M3, &[n, k / NVFP4_GROUP], &format!("one scale per {NVFP4_GROUP} inputs"))?;
        let global = tensors.get(&self.encoding.global(module))?;
        let stored = match (global.dtype, global.bytes) {
            (DType::F32, &[a, b, c, d]) => f32::from_le_bytes([a, b, c, d]),
            _ => {
                return Err(Error::tensor(
                    global.name,
                    format!("expected one F32 value, found {} {:?}", global.dtype, global.shape),
                ))
            }
        };
        let global_scale = match self.encoding {
            Encoding::CompressedTensors => 1.0 / stored,
            Encoding::ModelOpt => stored,
        };
        if !(global_scale.is_finite() && global_scale > 0.0) {
            return Err(Error::tensor(global.name, format!("{stored} does not give a finite positive multiplier")));
        }
        Ok(Nvfp4Parts { codes, scales, global_scale, global_bytes: global.bytes.len() })
    }
}

/// A checked NVFP4 module still in the checkpoint: codes `[n, k/2]`, scales `[n, k/16]`, and the
/// per-tensor scale as a multiplier.
struct Nvfp4Parts<'t> {
    codes: TensorRef<'t>,
    scales: TensorRef<'t>,
    global_scale: f32,
    /// Size of the stored per-tensor scale (read into `global_scale`, not uploaded).
    global_bytes: usize,
}

fn compressed_tensors(c: &Ctx, v: &Value) -> Result<Nvfp4Config> {
    let top_format = c.opt_str(v, "format")?;
    let groups = match v.get("config_groups") {
        Some(Value::Object(g)) if !g.is_empty() => g,
        _ => return Err(c.err("config_groups", "missing, empty or not an object")),
    };
    let (mut targets, mut class_targets) = (Vec::new(), false);
    for (name, group) in groups {
        let g = c.sub(&format!("config_groups.{name}"));
        // A group's own format wins over the top-level one.
        let (format, at) = match g.opt_str(group, "format")? {
            Some(f) => (Some(f), &g),
            None => (top_format, c),
        };
        match format {
            Some(CT_FORMAT) => {}
            Some(f) => return Err(at.err("format", format!("`{f}` is not supported (vt reads {CT_FORMAT})"))),
            None => return Err(c.err("format", format!("missing (vt reads {CT_FORMAT})"))),
        }
        let weights = group
            .get("weights")
            .filter(|w| w.is_object())
            .ok_or_else(|| g.err("weights", "missing: vt reads NVFP4 weights"))?;
        let w = g.sub("weights");
        w.expect(weights, "num_bits", json!(4), true)?;
        w.expect(weights, "type", json!("float"), true)?;
        w.expect(weights, "group_size", json!(NVFP4_GROUP), true)?;
        w.expect(weights, "strategy", json!("tensor_group"), false)?;
        w.expect(weights, "symmetric", json!(true), false)?;
        for entry in g.str_list(group, "targets")? {
            // compressed-tensors matches a plain target against module names and class names; a
            // dotless one (`Linear`) may be a class.
            class_targets |= !entry.1.starts_with("re:") && !entry.1.contains('.');
            targets.push(ct_rule(c, entry)?);
        }
    }
    let skip = c.str_list(v, "ignore")?.into_iter().map(|e| ct_rule(c, e)).collect::<Result<_>>()?;
    Ok(Nvfp4Config { encoding: Encoding::CompressedTensors, skip, targets, class_targets })
}

/// ModelOpt: `hf_quant_config.json` nests its fields under `quantization` and lists
/// `exclude_modules`; config.json's `quantization_config` has them at the top and says `ignore`.
fn modelopt(c: &Ctx, v: &Value) -> Result<Nvfp4Config> {
    let (sec, c) = match v.get("quantization") {
        Some(q) if q.is_object() => (q, c.sub("quantization")),
        _ => (v, c.clone()),
    };
    let algo = c.opt_str(sec, "quant_algo")?.ok_or_else(|| c.err("quant_algo", "missing"))?;
    if !matches!(algo.to_ascii_uppercase().as_str(), "NVFP4" | "W4A16_NVFP4") {
        return Err(c.err("quant_algo", format!("`{algo}` is not supported (vt reads NVFP4)")));
    }
    c.expect(sec, "group_size", json!(NVFP4_GROUP), false)?;
    let key = if sec.get("exclude_modules").is_some() { "exclude_modules" } else { "ignore" };
    let skip = c
        .str_list(sec, key)?
        .into_iter()
        .map(|(field, text)| Rule { pattern: Pattern::glob(&text), field, text })
        .collect();
    Ok(Nvfp4Config { encoding: Encoding::ModelOpt, skip, targets: Vec::new(), class_targets: true })
}

/// A compressed-tensors list entry: `re:` patterns as Python `re.match`, others exact names.
fn ct_rule(c: &Ctx, entry: (String, String)) -> Result<Rule> {
    c.rule(entry, |text| match text.strip_prefix("re:") {
        Some(re) => Pattern::regex(re),
        None => Ok(Pattern::exact(text)),
    })
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::super::QuantConfig;
    use super::*;

    fn parse(json: &str) -> Result<Nvfp4Config> {
        let c = Ctx::new(Path::new("/m/config.json"), "quantization_config");
        match QuantConfig::parse(&c, &serde_json::from_str(json).unwrap())? {
            QuantConfig::Nvfp4(q) => Ok(q),
            other => panic!("{json}: read as {other:?}"),
        }
    }

    fn ct(weights: &str, targets: &str, ignore: &str) -> String {
        format!(
            r#"{{"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
                "config_groups": {{"group_0": {{"format": null, "targets": {targets}, "weights": {weights}}}}},
                "ignore": {ignore}}}"#
        )
    }

    const NVFP4_WEIGHTS: &str =
        r#"{"num_bits": 4, "type": "float", "group_size": 16, "strategy": "tensor_group", "symmetric": true}"#;

    #[test]
    fn compressed_tensors_class_target_lets_the_checkpoint_decide() {
        let q = parse(&ct(NVFP4_WEIGHTS, r#"["Linear"]"#, r#"["lm_head", "re:.*mlp\\.gate$"]"#)).unwrap();
        assert_eq!(q.encoding, Encoding::CompressedTensors);
        let expert = "model.layers.0.mlp.experts.3.up_proj";
        assert!(q.is_nvfp4(expert, true).unwrap());
        assert!(!q.is_nvfp4(expert, false).unwrap());
        assert!(!q.is_nvfp4("model.layers.0.mlp.gate", false).unwrap());
        let e = q.is_nvfp4("lm_head", true).unwrap_err().to_string();
        assert!(e.contains("lm_head.weight_packed") && e.contains("quantization_config.ignore[0]"), "{e}");
    }

    #[test]
    fn compressed_tensors_named_targets_decide() {
        let q = parse(&ct(NVFP4_WEIGHTS, r#"["re:.*self_attn\\.[qkvo]_proj$"]"#, "[]")).unwrap();
        let q_proj = "model.layers.1.self_attn.q_proj";
        assert!(q.is_nvfp4(q_proj, true).unwrap());
        let e = q.is_nvfp4(q_proj, false).unwrap_err().to_string();
        assert!(e.contains("self_attn.q_proj.weight_packed") && e.contains("config_groups.group_0.targets[0]"), "{e}");
        assert!(!q.is_nvfp4("model.layers.1.mlp.down_proj", false).unwrap());
        let e = q.is_nvfp4("model.layers.1.mlp.down_proj", true).unwrap_err().to_string();
        assert!(e.contains("mlp.down_proj.weight_packed") && e.contains("no `config_groups` target"), "{e}");
    }

    #[test]
    fn compressed_tensors_errors_name_the_field() {
        let cases = [
            (
                ct(&NVFP4_WEIGHTS.replace("16", "32"), r#"["Linear"]"#, "[]"),
                "quantization_config.config_groups.group_0.weights.group_size",
            ),
            (
                ct(&NVFP4_WEIGHTS.replace("4,", "8,"), r#"["Linear"]"#, "[]"),
                "quantization_config.config_groups.group_0.weights.num_bits",
            ),
            (
                ct(NVFP4_WEIGHTS, r#"["Linear"]"#, "[]").replace("nvfp4-pack-quantized", "int-quantized"),
                "quantization_config.format",
            ),
            (
                ct(NVFP4_WEIGHTS, r#"["Linear"]"#, "[]")
                    .replace(r#""format": null"#, r#""format": "mxfp4-pack-quantized""#),
                "quantization_config.config_groups.group_0.format",
            ),
            (ct(NVFP4_WEIGHTS, r#"["re:(?=x)"]"#, "[]"), "quantization_config.config_groups.group_0.targets[0]"),
            (ct(NVFP4_WEIGHTS, r#"["Linear"]"#, "[3]"), "quantization_config.ignore[0]"),
            (r#"{"quant_method": "gptq"}"#.to_string(), "quantization_config.quant_method"),
        ];
        for (json, field) in cases {
            let e = parse(&json).unwrap_err().to_string();
            assert!(e.contains(field) && e.contains("/m/config.json"), "{field}: {e}");
        }
    }

    #[test]
    fn modelopt_in_config_json_and_in_hf_quant_config() {
        let q = parse(r#"{"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "ignore": ["lm_head", "*mlp.gate"]}"#).unwrap();
        assert_eq!(q.encoding, Encoding::ModelOpt);
        assert!(q.is_nvfp4("model.layers.0.mlp.experts.0.down_proj", true).unwrap());
        assert!(!q.is_nvfp4("model.layers.0.mlp.gate", false).unwrap());
        assert!(q
            .is_nvfp4("model.layers.0.mlp.gate", true)
            .unwrap_err()
            .to_string()
            .contains("quantization_config.ignore[1]"));

        let file = Path::new("/m/hf_quant_config.json");
        let hf = serde_json::json!({"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "NVFP4", "exclude_modules": ["*self_attn*"]}});
        let q = modelopt(&Ctx::new(file, ""), &hf).unwrap();
        let e = q.is_nvfp4("model.layers.2.self_attn.o_proj", true).unwrap_err().to_string();
        assert!(e.contains("self_attn.o_proj.weight") && e.contains("quantization.exclude_modules[0]"), "{e}");

        let bad = serde_json::json!({"quantization": {"quant_algo": "FP8"}});
        assert!(modelopt(&Ctx::new(file, ""), &bad).unwrap_err().to_string().contains("quantization.quant_algo"));
        let e =
            parse(r#"{"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 32}"#).unwrap_err().to_string();
        assert!(e.contains("quantization_config.group_size"), "{e}");
    }
}
