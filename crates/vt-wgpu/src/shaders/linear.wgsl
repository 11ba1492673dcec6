// `y [rows, n]`: each row's input times W^T, W in its stored form (weights.wgsl), one invocation
// per output (x: outputs, y: rows), into columns `col0..col0 + n` of rows of `cols` (a linear's
// rows bound a piece at a time: rows.rs). `mode` 0, a linear: matrix 0, input row = row. The routed
// experts (a row a slot, slot = token * top_k + j, e = ids[slot]; the bound matrices are
// experts `first..end`, and slots of other experts are left alone): 1, their down: matrix
// e - first, input row = slot; 2, their gate and up: `silu(W[2m] x) * W[2m + 1] x`, m = e - first,
// x the slot's token.
struct P { fmt: u32, n: u32, k: u32, b0: u32, b1: u32, mode: u32, top_k: u32, first: u32, end: u32, cols: u32, col0: u32 }
@group(0) @binding(0) var<storage, read> params: P;
var<private> p: P;
@group(0) @binding(1) var<storage, read> wv: array<u32>;
@group(0) @binding(2) var<storage, read> ws: array<u32>;
@group(0) @binding(3) var<storage, read> wg: array<f32>;
@group(0) @binding(4) var<storage, read> xs: array<f32>;
@group(0) @binding(5) var<storage, read> ids: array<u32>;
@group(0) @binding(6) var<storage, read_write> y: array<f32>;

// `sum_c xs[x0 + c] * W[m][r][c]` in input order.
fn wdot(f: Fmt, m: u32, r: u32, x0: u32) -> f32 {
    var acc = 0.0;
    let base = (m * f.n + r) * f.k;
    if (f.fmt == 1u) {
        for (var c = 0u; c < f.k; c++) {
            acc += xs[x0 + c] * bitcast<f32>(whalf(base + c) << 16u);
        }
    } else if (f.fmt == 0u) {
        for (var c = 0u; c < f.k; c++) {
            acc += xs[x0 + c] * bitcast<f32>(wv[base + c]);
        }
    } else {
        for (var c = 0u; c < f.k; c++) {
            acc += xs[x0 + c] * wload(f, m, r, c);
        }
    }
    return acc;
}

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    p = params;
    let r = gid.x;
    let row = gid.y;
    if (r >= p.n) {
        return;
    }
    let f = Fmt(p.fmt, p.n, p.k, p.b0, p.b1);
    if (p.mode == 0u) {
        y[row * p.cols + p.col0 + r] = wdot(f, 0u, r, row * p.k);
        return;
    }
    let e = ids[row];
    if (e < p.first || e >= p.end) {
        return;
    }
    let m = e - p.first;
    var v: f32;
    if (p.mode == 1u) {
        v = wdot(f, m, r, row * p.k);
    } else {
        let x0 = (row / p.top_k) * p.k;
        v = silu(wdot(f, 2u * m, r, x0)) * wdot(f, 2u * m + 1u, r, x0);
    }
    y[row * p.cols + p.col0 + r] = v;
}
