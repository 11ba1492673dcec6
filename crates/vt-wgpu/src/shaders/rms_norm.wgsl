// RMSNorm of each row (a workgroup a row): `x * r * (w + offset)`, or gated
// `w * (x * r) * silu(z)`, with `r = 1 / sqrt(mean(x^2) + eps)`.
struct P { d: u32, eps: f32, offset: f32, gated: u32, rows: u32 }
@group(0) @binding(0) var<storage, read> params: P;
var<private> p: P;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> w: array<f32>;
@group(0) @binding(3) var<storage, read> z: array<f32>;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;

var<workgroup> part: array<f32, 64>;

@compute @workgroup_size(64)
fn main(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>,
        @builtin(num_workgroups) groups: vec3<u32>) {
    p = params;
    let row = wid.x + wid.y * groups.x;
    if (row >= p.rows) {
        return;
    }
    let base = row * p.d;
    var ss = 0.0;
    for (var i = lid.x; i < p.d; i += 64u) {
        let v = x[base + i];
        ss += v * v;
    }
    part[lid.x] = ss;
    workgroupBarrier();
    for (var s = 32u; s > 0u; s >>= 1u) {
        if (lid.x < s) {
            part[lid.x] += part[lid.x + s];
        }
        workgroupBarrier();
    }
    let r = 1.0 / sqrt(part[0] / f32(p.d) + p.eps);
    for (var i = lid.x; i < p.d; i += 64u) {
        let v = x[base + i];
        if (p.gated != 0u) {
            out[base + i] = w[i] * (v * r) * silu(z[base + i]);
        } else {
            out[base + i] = v * r * (w[i] + p.offset);
        }
    }
}
