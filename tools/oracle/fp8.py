"""FP8 block-scaled checkpoints for the oracle, as Qwen publishes them (`quant_method: fp8`, transformers'
FineGrainedFP8 format):

    M.weight            F8_E4M3 [n, k]
    M.weight_scale_inv  F32     [ceil(n / bn), ceil(k / bk)]     W[i, j] = e4m3(weight[i, j]) * scale_inv[i // bn, j // bk]

with `weight_block_size: [bn, bk]`. A dimension that is not a multiple of its block size ends in a partial
block, as the inference kernels (transformers' Triton / DeepGEMM, vLLM) index scales by `i // bn`.

Quantization is transformers' `Fp8Quantize` arithmetic (per-block amax, scale = 448 / amax, clamp, cast to
e4m3, store 1 / scale), extended to partial blocks: `Fp8Quantize` itself leaves a weight whose shape is not a
multiple of the block unquantized, so a partial block is quantized here over its valid elements only; every
whole-block module is asserted equal, bit for bit, to `Fp8Quantize`'s output. Dequantization is transformers'
own `_dequantize_fp8_weight` (the FP8 layers' backward path), which expands scales by the block size and so
handles partial blocks.
"""

import torch
from transformers.integrations.finegrained_fp8 import Fp8Quantize, _dequantize_fp8_weight
from transformers.quantizers.quantizers_utils import should_convert_module
from transformers.utils.quantization_config import FineGrainedFP8Config

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max


def quantize(weight, block):
    """One `[n, k]` float32 weight -> (e4m3 `[n, k]`, f32 scale_inv `[ceil(n/bn), ceil(k/bk)]`)."""
    n, k = weight.shape
    bn, bk = block
    rb, cb = -(-n // bn), -(-k // bk)
    padded = torch.zeros(rb * bn, cb * bk, dtype=torch.float32)
    padded[:n, :k] = weight
    tiles = padded.reshape(rb, bn, cb, bk)
    amax = tiles.abs().amax(dim=(1, 3))  # zero padding never raises a block's max
    scales = torch.where(amax > 0, FP8_MAX / torch.where(amax > 0, amax, torch.ones_like(amax)), torch.ones_like(amax))
    inv = (1.0 / scales).to(torch.float32)
    q = torch.clamp(tiles * scales[:, None, :, None], min=-FP8_MAX, max=FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(rb * bn, cb * bk)[:n, :k].contiguous(), inv


def dequantize(q, inv, block):
    return _dequantize_fp8_weight(q.clone(), inv, list(block), torch.float32)


def check_against_transformers(weight, q, inv, block):
    """Whole-block weights: transformers' own Fp8Quantize must give the same bytes and scales."""
    op = Fp8Quantize(type("Q", (), {"quantization_config": FineGrainedFP8Config(weight_block_size=list(block))})())
    out = op.convert({"m.weight": weight})
    assert torch.equal(out["m.weight"].view(torch.uint8), q.view(torch.uint8)), "e4m3 values differ from Fp8Quantize"
    assert torch.equal(out["m.weight_scale_inv"], inv), "scales differ from Fp8Quantize"


def selected(module, skip, linear_modules):
    """transformers' rule (`should_convert_module`): every linear not matched by `modules_to_not_convert`."""
    return module in linear_modules and should_convert_module(module, skip)


def quantize_tensors(tensors, skip, block):
    """Quantizes, in a checkpoint's tensor dict (bf16), every linear module the config selects.
    Returns (fp8 tensors, {module: f32 dequantized weight}, modules with a partial block)."""
    linear = {k[: -len(".weight")] for k, v in tensors.items()
              if k.endswith(".weight") and v.dim() == 2 and "embed_tokens" not in k}
    out, dense, partial = {}, {}, []
    for name, t in tensors.items():
        module = name[: -len(".weight")] if name.endswith(".weight") else None
        if module is None or not selected(module, skip, linear):
            out[name] = t
            continue
        w = t.to(torch.float32)
        q, inv = quantize(w, block)
        if w.shape[0] % block[0] or w.shape[1] % block[1]:
            partial.append(module)
        else:
            check_against_transformers(w, q, inv, block)
        out[name], out[f"{module}.weight_scale_inv"] = q, inv
        dense[module] = dequantize(q, inv, block)
    assert dense, "the config selects no module"
    return out, dense, partial


def config(skip, block):
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": list(block), "modules_to_not_convert": skip}
