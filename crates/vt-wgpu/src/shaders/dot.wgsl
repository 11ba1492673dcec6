// `sum_c xs[x0 + c] * W[m][r][c]` in input order (needs `xs` bound).
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
