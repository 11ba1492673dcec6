// Greedy picks, a workgroup per row of logits `[rows, width]` (any dense format weights.wgsl
// reads): vt-core's `argmax` (the first largest; a NaN never wins, but a NaN at index 0 is never
// displaced), of the values a grammar's mask leaves (`masked`: a bit per token, `words` per row;
// a 0 bit reads as -inf), and whether every value of the row, masked or not, is finite. Writes
// (id, finite) per row to `picks`.
struct P { fmt: u32, rows: u32, width: u32, b0: u32, b1: u32, masked: u32, words: u32 }
@group(0) @binding(0) var<storage, read> params: P;
var<private> p: P;
@group(0) @binding(1) var<storage, read> wv: array<u32>;
@group(0) @binding(2) var<storage, read> ws: array<u32>;
@group(0) @binding(3) var<storage, read> wg: array<f32>;
@group(0) @binding(4) var<storage, read> allowed: array<u32>;
@group(0) @binding(5) var<storage, read_write> picks: array<u32>;

const WG: u32 = 256u;
var<workgroup> best_id: array<u32, WG>;
var<workgroup> best_v: array<f32, WG>;
// Bit 0: the invocation has a candidate; bit 1: every value it read is finite.
var<workgroup> flags: array<u32, WG>;

fn value(row: u32, i: u32) -> f32 {
    let x = wload(Fmt(p.fmt, p.rows, p.width, p.b0, p.b1), 0u, row, i);
    if (p.masked != 0u && ((allowed[row * p.words + i / 32u] >> (i % 32u)) & 1u) == 0u) {
        return bitcast<f32>(0xff800000u);
    }
    return x;
}

@compute @workgroup_size(256)
fn main(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>,
        @builtin(num_workgroups) groups: vec3<u32>) {
    p = params;
    let row = wid.x + wid.y * groups.x;
    if (row >= p.rows) {
        return;
    }
    let f = Fmt(p.fmt, p.rows, p.width, p.b0, p.b1);
    var id = 0u;
    var v = 0.0;
    var have = false;
    var finite = true;
    for (var i = lid.x; i < p.width; i += WG) {
        let raw = wload(f, 0u, row, i);
        finite = finite && (bitcast<u32>(raw) & 0x7f800000u) != 0x7f800000u;
        let x = value(row, i);
        if (!is_nan(x) && (!have || x > v)) {
            id = i;
            v = x;
            have = true;
        }
    }
    best_id[lid.x] = id;
    best_v[lid.x] = v;
    flags[lid.x] = u32(have) | (u32(finite) << 1u);
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if (lid.x < s) {
            let o = lid.x + s;
            let fa = flags[lid.x];
            let fb = flags[o];
            let b_wins = (fb & 1u) != 0u && ((fa & 1u) == 0u || best_v[o] > best_v[lid.x]
                || (best_v[o] == best_v[lid.x] && best_id[o] < best_id[lid.x]));
            if (b_wins) {
                best_id[lid.x] = best_id[o];
                best_v[lid.x] = best_v[o];
            }
            flags[lid.x] = ((fa | fb) & 1u) | (fa & fb & 2u);
        }
        workgroupBarrier();
    }
    if (lid.x == 0u) {
        var pick = best_id[0];
        if (is_nan(value(row, 0u))) {
            pick = 0u;
        }
        picks[2u * row] = pick;
        picks[2u * row + 1u] = flags[0] >> 1u;
    }
}
