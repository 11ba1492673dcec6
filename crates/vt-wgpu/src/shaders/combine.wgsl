// Each token's routed output: its slots' expert outputs times their weights, summed in slot
// (ascending expert) order.
struct P { count: u32, top_k: u32, hidden: u32 }
@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> y: array<f32>;
@group(0) @binding(2) var<storage, read> wts: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>) {
    let i = flat(gid, groups);
    if (i >= p.count) {
        return;
    }
    let tok = i / p.hidden;
    let c = i % p.hidden;
    var acc = 0.0;
    for (var j = 0u; j < p.top_k; j++) {
        let slot = tok * p.top_k + j;
        acc += wts[slot] * y[slot * p.hidden + c];
    }
    out[i] = acc;
}
