// A weight in its stored form (needs `wv`, `ws`, `wg` bound by the kernel): a stack of matrices
// `[n, k]` (one for a linear; an expert's gate and up, or its down, for the MoE), element
// (m, r, c) decoded to f32 as vt-cpu decodes it.
//
// Formats: 0 f32, 1 bf16, 2 f16, 3 fp8 e4m3 (unscaled), 4 NVFP4 (e2m1 codes in `wv`, an fp8
// scale per 16 inputs in `ws`, a global f32 per matrix in `wg`), 5 FP8 blocks (e4m3 in `wv`, an
// f32 scale per `b0 x b1` block in `ws`).

struct Fmt {
    fmt: u32,
    n: u32,
    k: u32,
    b0: u32,
    b1: u32,
}

fn wbyte(i: u32) -> u32 {
    return (wv[i >> 2u] >> ((i & 3u) * 8u)) & 0xffu;
}

fn whalf(i: u32) -> u32 {
    return (wv[i >> 1u] >> ((i & 1u) * 16u)) & 0xffffu;
}

fn sbyte(i: u32) -> u32 {
    return (ws[i >> 2u] >> ((i & 3u) * 8u)) & 0xffu;
}

fn wload(f: Fmt, m: u32, r: u32, c: u32) -> f32 {
    let i = (m * f.n + r) * f.k + c;
    switch f.fmt {
        case 0u: {
            return bitcast<f32>(wv[i]);
        }
        case 1u: {
            return bitcast<f32>(whalf(i) << 16u);
        }
        case 2u: {
            return unpack2x16float(whalf(i)).x;
        }
        case 3u: {
            return f8e4m3(wbyte(i));
        }
        case 4u: {
            let code = (wbyte(i >> 1u) >> ((c & 1u) * 4u)) & 15u;
            let scale = f8e4m3(sbyte((m * f.n + r) * (f.k / 16u) + c / 16u)) * wg[m];
            return e2m1(code) * scale;
        }
        default: {
            let kb = (f.k + f.b1 - 1u) / f.b1;
            let nb = (f.n + f.b0 - 1u) / f.b0;
            let scale = bitcast<f32>(ws[(m * nb + r / f.b0) * kb + c / f.b1]);
            return f8e4m3(wbyte(i)) * scale;
        }
    }
}
