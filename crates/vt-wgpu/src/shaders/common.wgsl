// Scalar math shared by every kernel, each as vt-cpu computes it (f32).

fn sigmoid(x: f32) -> f32 {
    return 1.0 / (1.0 + exp(-x));
}

fn silu(x: f32) -> f32 {
    return x / (1.0 + exp(-x));
}

// ln(1 + y) without losing a small y (WGSL has no log1p).
fn log1p(y: f32) -> f32 {
    let u = 1.0 + y;
    if (u == 1.0) {
        return y;
    }
    return log(u) * (y / (u - 1.0));
}

// torch's softplus (beta 1, threshold 20).
fn softplus(x: f32) -> f32 {
    if (x > 20.0) {
        return x;
    }
    return log1p(exp(x));
}

// On the bits: a compiler may assume `x != x` never holds.
fn is_nan(x: f32) -> bool {
    return (bitcast<u32>(x) & 0x7fffffffu) > 0x7f800000u;
}

fn nan() -> f32 {
    return bitcast<f32>(0x7fc00000u);
}

// fp8 e4m3fn: bias 7, subnormals at exponent 0, NaN at S.1111.111, no infinity.
fn f8e4m3(b: u32) -> f32 {
    let e = (b >> 3u) & 15u;
    let m = f32(b & 7u);
    if (e == 15u && (b & 7u) == 7u) {
        return nan();
    }
    var v: f32;
    if (e == 0u) {
        v = ldexp(m / 8.0, -6);
    } else {
        v = ldexp(1.0 + m / 8.0, i32(e) - 7);
    }
    if ((b & 0x80u) != 0u) {
        v = -v;
    }
    return v;
}

// e2m1: sign in bit 3, exponent bias 1, one mantissa bit.
fn e2m1(code: u32) -> f32 {
    let e = (code >> 1u) & 3u;
    let m = f32(code & 1u);
    var v: f32;
    if (e == 0u) {
        v = m * 0.5;
    } else {
        v = ldexp(1.0 + m * 0.5, i32(e) - 1);
    }
    if ((code & 8u) != 0u) {
        v = -v;
    }
    return v;
}

// The flat index of invocation `gid` in a grid of 64-wide workgroups spread over x and y.
fn flat(gid: vec3<u32>, groups: vec3<u32>) -> u32 {
    return gid.x + gid.y * groups.x * 64u;
}
