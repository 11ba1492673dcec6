// Depthwise causal conv1d with silu over `x` `[t, c]`, weight `[c, k]` (f32), continuing from and
// updating `state` `[c, k - 1]`; an invocation per channel, tokens in order.
struct P { t: u32, c: u32, k: u32 }
@group(0) @binding(0) var<storage, read> params: P;
var<private> p: P;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> w: array<f32>;
@group(0) @binding(3) var<storage, read_write> state: array<f32>;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>) {
    p = params;
    let ch = flat(gid, groups);
    if (ch >= p.c) {
        return;
    }
    let km1 = p.k - 1u;
    for (var s = 0u; s < p.t; s++) {
        var acc = 0.0;
        for (var j = 0u; j < p.k; j++) {
            let pos = s + j;
            var v: f32;
            if (pos >= km1) {
                v = x[(pos - km1) * p.c + ch];
            } else {
                v = state[ch * km1 + pos];
            }
            acc += w[ch * p.k + j] * v;
        }
        out[s * p.c + ch] = silu(acc);
    }
    for (var i = 0u; i < km1; i++) {
        let pos = p.t + i;
        if (pos < km1) {
            state[ch * km1 + i] = state[ch * km1 + pos];
        } else {
            state[ch * km1 + i] = x[(pos - km1) * p.c + ch];
        }
    }
}
