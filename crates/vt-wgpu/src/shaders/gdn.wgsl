// The gated delta rule, token by token (vt-cpu's recurrent form, for decode), a workgroup per
// value head and an invocation per value column; the state `[value_heads, key_dim, value_dim]` is f32:
//   S = S * exp(g);  delta = (v - S^T k) * beta;  S += k (x) delta;  o = S^T q
// with q, k l2-normalised (`x * rsqrt(sum(x^2) + 1e-6)`) and q divided by sqrt(key_dim), for the
// call's tokens `first..first + n` (a dispatch's share of the call's `t`).
struct P { t: u32, kh: u32, vh: u32, dk: u32, dv: u32, scale: f32, first: u32, n: u32 }
@group(0) @binding(0) var<storage, read> params: P;
var<private> p: P;
@group(0) @binding(1) var<storage, read> q: array<f32>;
@group(0) @binding(2) var<storage, read> k: array<f32>;
@group(0) @binding(3) var<storage, read> v: array<f32>;
@group(0) @binding(4) var<storage, read> gb: array<f32>;
@group(0) @binding(5) var<storage, read_write> state: array<f32>;
@group(0) @binding(6) var<storage, read_write> out: array<f32>;

const MAX_DK: u32 = 256u;
var<workgroup> qs: array<f32, MAX_DK>;
var<workgroup> ks: array<f32, MAX_DK>;
var<workgroup> norms: array<f32, 2>;

@compute @workgroup_size(64)
fn main(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>) {
    p = params;
    let h = wid.x;
    let kh = h / (p.vh / p.kh);
    let sbase = h * p.dk * p.dv;
    let count = p.t * p.vh;
    for (var s = p.first; s < p.first + p.n; s++) {
        let src = (s * p.kh + kh) * p.dk;
        for (var i = lid.x; i < p.dk; i += 64u) {
            qs[i] = q[src + i];
            ks[i] = k[src + i];
        }
        workgroupBarrier();
        if (lid.x == 0u) {
            var sq = 0.0;
            var sk = 0.0;
            for (var i = 0u; i < p.dk; i++) {
                sq += qs[i] * qs[i];
                sk += ks[i] * ks[i];
            }
            norms[0] = 1.0 / sqrt(sq + 1e-6);
            norms[1] = 1.0 / sqrt(sk + 1e-6);
        }
        workgroupBarrier();
        let decay = exp(gb[s * p.vh + h]);
        let beta = gb[count + s * p.vh + h];
        for (var j = lid.x; j < p.dv; j += 64u) {
            var mem = 0.0;
            for (var r = 0u; r < p.dk; r++) {
                let at = sbase + r * p.dv + j;
                let sv = state[at] * decay;
                state[at] = sv;
                mem += (ks[r] * norms[1]) * sv;
            }
            let delta = (v[(s * p.vh + h) * p.dv + j] - mem) * beta;
            var o = 0.0;
            for (var r = 0u; r < p.dk; r++) {
                let at = sbase + r * p.dv + j;
                let sv = state[at] + (ks[r] * norms[1]) * delta;
                state[at] = sv;
                o += ((qs[r] * norms[0]) / p.scale) * sv;
            }
            out[(s * p.vh + h) * p.dv + j] = o;
        }
        workgroupBarrier();
    }
}
