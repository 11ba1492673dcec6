// The gated delta rule's chunked form, first pass (vt-cpu's `chunked_head`, HF's and FLA's
// algebra): a workgroup per (value head, chunk of 64 tokens), all chunks at once, since nothing
// here reads the state. For chunk tokens i, j (c the cumulative log-decay, Γ_ij = exp(c_i - c_j)):
//   q, k l2-normalised (q times `scale`);  A_ij = (β_i k_i · k_j) Γ_ij (j < i);
//   QK_ij = (q_i · k_j) Γ_ij (j <= i);  (I + A) U = β v;  (I + A) W = β k exp(c)
// into the chunk's block of `scratch` (layout in gdn_layout.wgsl), which gdn_state.wgsl reads.
@group(0) @binding(0) var<storage, read> params: GdnP;
var<private> p: GdnP;
@group(0) @binding(1) var<storage, read> q: array<f32>;
@group(0) @binding(2) var<storage, read> k: array<f32>;
@group(0) @binding(3) var<storage, read> v: array<f32>;
@group(0) @binding(4) var<storage, read> gb: array<f32>;
@group(0) @binding(5) var<storage, read_write> scratch: array<f32>;

var<workgroup> beta: array<f32, 64>;

// `a + b` exactly as a rounded sum and its error (Knuth's two-sum).
fn two_sum(a: f32, b: f32) -> vec2<f32> {
    let s = a + b;
    let bb = s - a;
    return vec2<f32>(s, (a - (s - bb)) + (b - bb));
}

@compute @workgroup_size(64)
fn main(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>) {
    p = params;
    let h = wid.x;
    let l = chunk_len(wid.y);
    let s0 = (p.first + wid.y) * CHUNK;
    let o = parts();
    let b = (wid.y * p.vh + h) * o.size;
    let kh = h / (p.vh / p.kh);
    let count = p.t * p.vh;
    if (lid.x == 0u) {
        // Prefix sums of g as vt-cpu takes them: accumulated in double precision (here a
        // compensated pair) and each prefix rounded to f32.
        var hi = 0.0;
        var lo = 0.0;
        for (var i = 0u; i < l; i++) {
            let s = two_sum(hi, gb[(s0 + i) * p.vh + h]);
            lo += s.y;
            let r = two_sum(s.x, lo);
            hi = r.x;
            lo = r.y;
            scratch[b + o.cum + i] = hi;
        }
    }
    if (lid.x < l) {
        let i = lid.x;
        beta[i] = gb[count + (s0 + i) * p.vh + h];
        let src = ((s0 + i) * p.kh + kh) * p.dk;
        var sq = 0.0;
        var sk = 0.0;
        for (var r = 0u; r < p.dk; r++) {
            sq += q[src + r] * q[src + r];
            sk += k[src + r] * k[src + r];
        }
        let nq = 1.0 / sqrt(sq + 1e-6);
        let nk = 1.0 / sqrt(sk + 1e-6);
        for (var r = 0u; r < p.dk; r++) {
            scratch[b + o.qn + i * p.dk + r] = (q[src + r] * nq) * p.scale;
            scratch[b + o.kn + i * p.dk + r] = k[src + r] * nk;
        }
    }
    storageBarrier();
    workgroupBarrier();
    let qn = b + o.qn;
    let kn = b + o.kn;
    let cum = b + o.cum;
    for (var e = lid.x; e < l * l; e += 64u) {
        let i = e / l;
        let j = e % l;
        if (j > i) {
            continue;
        }
        var dq = 0.0;
        var da = 0.0;
        for (var r = 0u; r < p.dk; r++) {
            let kj = scratch[kn + j * p.dk + r];
            dq += scratch[qn + i * p.dk + r] * kj;
            da += (scratch[kn + i * p.dk + r] * beta[i]) * kj;
        }
        let gam = exp(scratch[cum + i] - scratch[cum + j]);
        scratch[b + o.qk + i * CHUNK + j] = dq * gam;
        if (j < i) {
            scratch[b + o.a + i * CHUNK + j] = da * gam;
        }
    }
    storageBarrier();
    workgroupBarrier();
    // Forward substitution, a column of U (value columns) or of W (key columns) per invocation:
    // X_i = RHS_i - sum_{j<i} A_ij X_j, rows in order.
    for (var c = lid.x; c < p.dv + p.dk; c += 64u) {
        var x0: u32;
        var stride: u32;
        if (c < p.dv) {
            x0 = b + o.u + c;
            stride = p.dv;
            for (var i = 0u; i < l; i++) {
                scratch[x0 + i * stride] = v[((s0 + i) * p.vh + h) * p.dv + c] * beta[i];
            }
        } else {
            let r = c - p.dv;
            x0 = b + o.w + r;
            stride = p.dk;
            for (var i = 0u; i < l; i++) {
                scratch[x0 + i * stride] = (scratch[kn + i * p.dk + r] * beta[i]) * exp(scratch[cum + i]);
            }
        }
        for (var i = 1u; i < l; i++) {
            var x = scratch[x0 + i * stride];
            for (var j = 0u; j < i; j++) {
                x += -scratch[b + o.a + i * CHUNK + j] * scratch[x0 + j * stride];
            }
            scratch[x0 + i * stride] = x;
        }
    }
}
