// Rows `ids` of a table in its stored dtype -> f32 `[ids, hidden]`, of the ids in the bound
// piece of the table's rows, `first..end` (rows.rs).
struct P { fmt: u32, n: u32, k: u32, b0: u32, b1: u32, count: u32, first: u32, end: u32 }
@group(0) @binding(0) var<storage, read> params: P;
var<private> p: P;
@group(0) @binding(1) var<storage, read> wv: array<u32>;
@group(0) @binding(2) var<storage, read> ws: array<u32>;
@group(0) @binding(3) var<storage, read> wg: array<f32>;
@group(0) @binding(4) var<storage, read> ids: array<u32>;
@group(0) @binding(5) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>) {
    p = params;
    let i = flat(gid, groups);
    if (i < p.count) {
        let id = ids[i / p.k];
        if (id >= p.first && id < p.end) {
            out[i] = wload(Fmt(p.fmt, p.n, p.k, p.b0, p.b1), 0u, id - p.first, i % p.k);
        }
    }
}
