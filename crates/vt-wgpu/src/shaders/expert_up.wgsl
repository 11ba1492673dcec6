// The first half of each routed slot's expert (slot = token * k + j): `h = silu(gate x) * up x`,
// gate and up being matrices 2e and 2e + 1 of the layer's stacked gate/up weights.
struct P { fmt: u32, n: u32, k: u32, b0: u32, b1: u32, top_k: u32 }
@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> wv: array<u32>;
@group(0) @binding(2) var<storage, read> ws: array<u32>;
@group(0) @binding(3) var<storage, read> wg: array<f32>;
@group(0) @binding(4) var<storage, read> xs: array<f32>;
@group(0) @binding(5) var<storage, read> ids: array<u32>;
@group(0) @binding(6) var<storage, read_write> h: array<f32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let r = gid.x;
    let slot = gid.y;
    if (r >= p.n) {
        return;
    }
    let f = Fmt(p.fmt, p.n, p.k, p.b0, p.b1);
    let e = ids[slot];
    let x0 = (slot / p.top_k) * p.k;
    h[slot * p.n + r] = silu(wdot(f, 2u * e, r, x0)) * wdot(f, 2u * e + 1u, r, x0);
}
