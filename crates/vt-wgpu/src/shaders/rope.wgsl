// NeoX rotary embedding of `x` `[t, heads, dim]` over the first `2 * half` features, with
// `cs` `[t, half, 2]` the host's (cos, sin) per position and frequency (as vt-cpu computes them).
struct P { count: u32, heads: u32, dim: u32, half: u32 }
@group(0) @binding(0) var<storage, read> params: P;
var<private> p: P;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> cs: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>) {
    p = params;
    let i = flat(gid, groups);
    if (i >= p.count) {
        return;
    }
    let j = i % p.dim;
    let head = i - j;
    let tok = i / (p.heads * p.dim);
    if (j < p.half) {
        let c = (tok * p.half + j) * 2u;
        out[i] = x[i] * cs[c] - x[head + j + p.half] * cs[c + 1u];
    } else if (j < 2u * p.half) {
        let c = (tok * p.half + j - p.half) * 2u;
        out[i] = x[i] * cs[c] + x[head + j - p.half] * cs[c + 1u];
    } else {
        out[i] = x[i];
    }
}
