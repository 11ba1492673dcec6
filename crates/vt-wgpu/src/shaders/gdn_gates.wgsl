// The gated delta rule's gates for `[t, value_heads]`: `g = -exp(a_log) * softplus(a + dt_bias)`
// into `gb[0..count]` and `beta = sigmoid(b)` into `gb[count..2 count]`.
struct P { count: u32, heads: u32 }
@group(0) @binding(0) var<storage, read> params: P;
var<private> p: P;
@group(0) @binding(1) var<storage, read> a: array<f32>;
@group(0) @binding(2) var<storage, read> b: array<f32>;
@group(0) @binding(3) var<storage, read> a_log: array<f32>;
@group(0) @binding(4) var<storage, read> dt_bias: array<f32>;
@group(0) @binding(5) var<storage, read_write> gb: array<f32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>) {
    p = params;
    let i = flat(gid, groups);
    if (i < p.count) {
        let h = i % p.heads;
        let neg_a = -exp(a_log[h]);
        gb[i] = neg_a * softplus(a[i] + dt_bias[h]);
        gb[p.count + i] = sigmoid(b[i]);
    }
}
