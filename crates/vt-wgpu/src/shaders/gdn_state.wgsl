// The chunked gated delta rule's second pass: through the group's chunks in order, an
// invocation per (value head, state column x), which no other invocation reads or writes:
//   v'_i = U_i - W_i^T S;  o_i = (q_i exp(c_i))^T S + sum_{j<=i} QK_ij v'_j;
//   S = S exp(c_last) + sum_j (k_j exp(c_last - c_j)) (x) v'_j
// with S the state `[value_heads, dk, dv]` entering each chunk, products formed as vt-cpu forms
// them.
@group(0) @binding(0) var<storage, read> params: GdnP;
var<private> p: GdnP;
@group(0) @binding(1) var<storage, read> scratch: array<f32>;
@group(0) @binding(2) var<storage, read_write> state: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    p = params;
    let x = gid.x;
    let h = gid.y;
    if (x >= p.dv) {
        return;
    }
    let o = parts();
    let sb = h * p.dk * p.dv + x;
    var vn: array<f32, 64>;
    var e: array<f32, 64>;
    for (var cg = 0u; cg < p.chunks; cg++) {
        let l = chunk_len(cg);
        let s0 = (p.first + cg) * CHUNK;
        let b = (cg * p.vh + h) * o.size;
        let c_last = scratch[b + o.cum + l - 1u];
        for (var i = 0u; i < l; i++) {
            var ws = 0.0;
            for (var r = 0u; r < p.dk; r++) {
                ws += scratch[b + o.w + i * p.dk + r] * state[sb + r * p.dv];
            }
            vn[i] = scratch[b + o.u + i * p.dv + x] - ws;
        }
        for (var i = 0u; i < l; i++) {
            let ei = exp(scratch[b + o.cum + i]);
            var inter = 0.0;
            for (var r = 0u; r < p.dk; r++) {
                inter += (scratch[b + o.qn + i * p.dk + r] * ei) * state[sb + r * p.dv];
            }
            var intra = 0.0;
            for (var j = 0u; j <= i; j++) {
                intra += scratch[b + o.qk + i * CHUNK + j] * vn[j];
            }
            out[((s0 + i) * p.vh + h) * p.dv + x] = inter + intra;
            e[i] = exp(c_last - scratch[b + o.cum + i]);
        }
        let decay = exp(c_last);
        for (var r = 0u; r < p.dk; r++) {
            var acc = 0.0;
            for (var j = 0u; j < l; j++) {
                acc += (scratch[b + o.kn + j * p.dk + r] * e[j]) * vn[j];
            }
            state[sb + r * p.dv] = state[sb + r * p.dv] * decay + acc;
        }
    }
}
