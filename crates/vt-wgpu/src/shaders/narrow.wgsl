// Columns `start..start + len` of `x` `[rows, width]`.
struct P { count: u32, width: u32, start: u32, len: u32 }
@group(0) @binding(0) var<storage, read> params: P;
var<private> p: P;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>) {
    p = params;
    let i = flat(gid, groups);
    if (i < p.count) {
        out[i] = x[(i / p.len) * p.width + p.start + i % p.len];
    }
}
