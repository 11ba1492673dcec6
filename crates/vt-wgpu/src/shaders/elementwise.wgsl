// Elementwise ops over `count` values: 0 add, 1 swiglu `silu(a) * b`, 2 `a * sigmoid(b[i / per])`,
// 3 `a * softplus(b[i / per])`; 4, the MoE's weighted sum: for token `i / per`, the rows `a` of
// its `k` slots at column `i % per`, times their weights `b`, summed in slot (ascending expert)
// order.
struct P { op: u32, count: u32, per: u32, k: u32 }
@group(0) @binding(0) var<storage, read> params: P;
var<private> p: P;
@group(0) @binding(1) var<storage, read> a: array<f32>;
@group(0) @binding(2) var<storage, read> b: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>) {
    p = params;
    let i = flat(gid, groups);
    if (i >= p.count) {
        return;
    }
    switch p.op {
        case 0u: {
            out[i] = a[i] + b[i];
        }
        case 1u: {
            out[i] = silu(a[i]) * b[i];
        }
        case 2u: {
            out[i] = a[i] * sigmoid(b[i / p.per]);
        }
        case 3u: {
            out[i] = a[i] * softplus(b[i / p.per]);
        }
        default: {
            let tok = i / p.per;
            var acc = 0.0;
            for (var j = 0u; j < p.k; j++) {
                let slot = tok * p.k + j;
                acc += b[slot] * a[slot * p.per + i % p.per];
            }
            out[i] = acc;
        }
    }
}
