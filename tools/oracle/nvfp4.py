"""NVFP4 checkpoints for the oracle: compressed-tensors' own quantize/pack, the ModelOpt encoding of
the same codes and scales, and the float32 decompression the reference is computed from.

Both encodings store, per quantized linear `[n, k]`, e2m1 codes packed two per byte (`[n, k/2]`,
even element in the low nibble) and one fp8 e4m3 scale per 16 inputs (`[n, k/16]`). They differ in
the per-tensor scale and in names:

    compressed-tensors   M.weight_packed  M.weight_scale  M.weight_global_scale [1]  (W = e2m1 * s / g)
    ModelOpt             M.weight         M.weight_scale  M.weight_scale_2 []        (W = e2m1 * s * g2)
                                                          M.input_scale []           (W4A4 only; vt ignores it)

Every global scale comes from its own tensor (gate and up of one expert get different ones): llm-compressor
would fuse them for vLLM, but vt must keep each exact, so the fixtures make sure they differ.
"""

import fnmatch
import json

import torch
from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
from compressed_tensors.entrypoints.convert.converters.modelopt_nvfp4 import ModelOptNvfp4Converter
from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus, preset_name_to_scheme
from compressed_tensors.quantization.lifecycle.forward import dequantize
from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam
from compressed_tensors.utils.match import match_name

GROUP = 16
CT_FORMAT = "nvfp4-pack-quantized"


def ct_scheme(targets):
    # NVFP4A16: NVFP4 weights, activations left in high precision (what vt computes).
    return preset_name_to_scheme("NVFP4A16", targets=targets)


def quantize_ct(weight, scheme):
    """One `[n, k]` float32 weight -> compressed-tensors' tensors (weight_packed u8, weight_scale fp8,
    weight_global_scale f32 [1]): the min/max observer's global and group scales, then the NVFP4
    compressor's own quantize-and-pack."""
    n, k = weight.shape
    assert k % GROUP == 0, f"input size {k} is not a multiple of {GROUP}"
    global_scale = generate_gparam(weight.min(), weight.max())
    groups = weight.reshape(n, k // GROUP, GROUP)
    scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights, global_scale=global_scale)
    out = NVFP4PackedCompressor.compress(
        {"weight": weight, "weight_scale": scale, "weight_global_scale": global_scale}, scheme)
    assert set(out) == {"weight_packed", "weight_scale", "weight_global_scale"}, sorted(out)
    return out


def decompress_f32(ct, scheme):
    """compressed-tensors' unpack + dequantize, kept in float32. (Its `decompress` rounds the result to
    bf16, which would put ~2^-9 relative error between the reference and the checkpoint's values.)"""
    packed = ct["weight_packed"]
    n, half = packed.shape
    codes = unpack_fp4_from_uint8(packed, n, 2 * half, dtype=torch.float32)
    w = dequantize(codes, ct["weight_scale"].to(torch.float32), args=scheme.weights,
                   global_scale=ct["weight_global_scale"], dtype=torch.float32)
    # Same values as the library's own bf16 decompression, before that rounding.
    lib = NVFP4PackedCompressor.decompress(dict(ct), scheme)["weight"]
    assert torch.equal(lib, w.to(lib.dtype)), "f32 decompression disagrees with compressed-tensors'"
    return w


def ct_selected(module, targets, ignore, linear_modules):
    """compressed-tensors' rule: a module is quantized if a target matches it (a class name such as
    `Linear` matches every linear module) and no ignore entry does."""
    def hit(t):
        return module in linear_modules if t == "Linear" else match_name(module, t)
    return any(hit(t) for t in targets) and not any(match_name(module, i) for i in ignore)


def quantize_tensors(tensors, targets, ignore, scheme):
    """Quantizes, in a checkpoint's tensor dict (bf16), every linear module the config selects.
    Returns (ct_tensors, {module: f32 decompressed weight})."""
    linear = {k[: -len(".weight")] for k, v in tensors.items()
              if k.endswith(".weight") and v.dim() == 2 and "embed_tokens" not in k}
    out, dense = {}, {}
    for name, t in tensors.items():
        module = name[: -len(".weight")] if name.endswith(".weight") else None
        if module is None or not ct_selected(module, targets, ignore, linear):
            out[name] = t
            continue
        ct = quantize_ct(t.to(torch.float32), scheme)
        for suffix, v in ct.items():
            out[f"{module}.{suffix}"] = v
        dense[module] = decompress_f32(ct, scheme)
    assert dense, "the config selects no module"
    return out, dense


def ct_config(targets, ignore, scheme):
    cfg = QuantizationConfig(config_groups={"group_0": scheme}, ignore=ignore, format=CT_FORMAT,
                             quantization_status=QuantizationStatus.COMPRESSED)
    return json.loads(json.dumps(cfg.to_dict(), default=str))


def to_modelopt(ct_tensors, modules):
    """The ModelOpt encoding of the same codes and scales: `weight_packed` -> u8 `weight`,
    `weight_global_scale` g -> `weight_scale_2` = 1/g (float32 division), plus an `input_scale`."""
    out = dict(ct_tensors)
    for m in modules:
        out[f"{m}.weight"] = out.pop(f"{m}.weight_packed")
        g = out.pop(f"{m}.weight_global_scale")
        out[f"{m}.weight_scale_2"] = (1.0 / g).reshape(())
        out[f"{m}.input_scale"] = torch.tensor(1.0 / 448.0, dtype=torch.float32)
    # compressed-tensors' own ModelOpt converter must map this back to the same codes and scales.
    back = ModelOptNvfp4Converter(targets=["re:.*"]).process({k: v.clone() for k, v in out.items()
                                                             if any(k.startswith(m + ".") for m in modules)})
    for m in modules:
        assert torch.equal(back[f"{m}.weight_packed"], ct_tensors[f"{m}.weight_packed"]), m
        assert torch.equal(back[f"{m}.weight_scale"].view(torch.uint8), ct_tensors[f"{m}.weight_scale"].view(torch.uint8)), m
        g, g2 = ct_tensors[f"{m}.weight_global_scale"], back[f"{m}.weight_global_scale"].reshape(1)
        assert torch.allclose(g, g2, rtol=2e-7, atol=0), (m, g, g2)
    return out


def modelopt_excluded(module, exclude):
    return any(fnmatch.fnmatchcase(module, p) for p in exclude)


def modelopt_quant_config(exclude):
    """What ModelOpt writes for NVFP4: `hf_quant_config.json`'s `quantization` section."""
    return {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": GROUP, "exclude_modules": exclude}


def check_modelopt_exclude(modules, all_linear, exclude):
    """The exclude list must leave exactly the quantized modules quantized."""
    for m in all_linear:
        assert (m in modules) != modelopt_excluded(m, exclude), (m, exclude)
