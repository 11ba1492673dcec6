// Causal (optionally windowed) GQA attention of `t` new queries at positions `start..start + t`,
// a workgroup per (query, head), over the pool layer's keys and values `kc`, `vc` (`[blocks, bs,
// kv_heads, d]`): position j lives in block `table[j / bs]`, row `j % bs` (the call's own rows
// were written there before). Softmax as vt-cpu: scores, their max, exps, their sum, then
// `o += (e / sum) * v` in key order.
//
// A dispatch reads the keys `k0..k1` (all of them where they fit lavapipe's loop budget: gpu.rs
// LOOP_BUDGET). Over several, each query's running max, sum and unnormalized `o` are carried in
// `run` (`[t, hq, 2 + d]`) from dispatch to dispatch (`first`, `last`), merged as flash attention
// does, and the last writes `o / sum`.
struct P { t: u32, hq: u32, hkv: u32, d: u32, start: u32, window: u32, bs: u32, scale: f32, k0: u32, k1: u32,
           first: u32, last: u32 }
@group(0) @binding(0) var<storage, read> params: P;
var<private> p: P;
@group(0) @binding(1) var<storage, read> q: array<f32>;
@group(0) @binding(2) var<storage, read> table: array<u32>;
@group(0) @binding(3) var<storage, read> kc: array<f32>;
@group(0) @binding(4) var<storage, read> vc: array<f32>;
@group(0) @binding(5) var<storage, read_write> out: array<f32>;
@group(0) @binding(6) var<storage, read_write> run: array<f32>;

var<workgroup> part: array<f32, 64>;
var<workgroup> scores: array<f32, 64>;

// Offset of position `j`'s head `g` in the pool layer.
fn key_at(j: u32, g: u32) -> u32 {
    return ((table[j / p.bs] * p.bs + j % p.bs) * p.hkv + g) * p.d;
}

fn score(qo: u32, j: u32, g: u32) -> f32 {
    let at = key_at(j, g);
    var acc = 0.0;
    for (var c = 0u; c < p.d; c++) {
        acc += q[qo + c] * kc[at + c];
    }
    return acc * p.scale;
}

fn value(j: u32, g: u32, c: u32) -> f32 {
    return vc[key_at(j, g) + c];
}

@compute @workgroup_size(64)
fn main(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>) {
    p = params;
    let h = wid.x;
    let i = wid.y;
    let g = h / (p.hq / p.hkv);
    let pos = p.start + i;
    var lo = p.k0;
    if (p.window != 0u && pos + 1u > p.window) {
        lo = max(lo, pos + 1u - p.window);
    }
    // This dispatch's keys: lo..=hi (none where lo > hi).
    let hi = min(pos, p.k1 - 1u);
    let qo = (i * p.hq + h) * p.d;
    let ro = (i * p.hq + h) * (2u + p.d);
    let alone = p.first == 1u && p.last == 1u;
    // The largest score.
    var m = bitcast<f32>(0xff800000u);
    for (var j = lo + lid.x; j <= hi; j += 64u) {
        m = max(m, score(qo, j, g));
    }
    part[lid.x] = m;
    workgroupBarrier();
    for (var s = 32u; s > 0u; s >>= 1u) {
        if (lid.x < s) {
            part[lid.x] = max(part[lid.x], part[lid.x + s]);
        }
        workgroupBarrier();
    }
    let mx = part[0];
    workgroupBarrier();
    // The sum of exps.
    var sum = 0.0;
    for (var j = lo + lid.x; j <= hi; j += 64u) {
        sum += exp(score(qo, j, g) - mx);
    }
    part[lid.x] = sum;
    workgroupBarrier();
    for (var s = 32u; s > 0u; s >>= 1u) {
        if (lid.x < s) {
            part[lid.x] += part[lid.x + s];
        }
        workgroupBarrier();
    }
    let total = part[0];
    // The weighted values, 64 keys at a time; each invocation owns features lid, lid + 64, ...
    // Alone, the weights are normalized as they go (vt-cpu's order); over several dispatches, at
    // the end.
    let norm = select(1.0, total, alone);
    var acc: array<f32, 8>;
    for (var tile = lo; tile <= hi; tile += 64u) {
        workgroupBarrier();
        let j = tile + lid.x;
        if (j <= hi) {
            scores[lid.x] = exp(score(qo, j, g) - mx) / norm;
        }
        workgroupBarrier();
        let n = min(64u, hi + 1u - tile);
        for (var e = 0u; e < n; e++) {
            let wgt = scores[e];
            for (var c = lid.x; c < p.d; c += 64u) {
                acc[c / 64u] += wgt * value(tile + e, g, c);
            }
        }
    }
    if (alone) {
        for (var c = lid.x; c < p.d; c += 64u) {
            out[qo + c] = acc[c / 64u];
        }
        return;
    }
    // Merged with what the earlier dispatches carried (nothing before the first, and nothing of
    // this one where it read no key): both scaled to the larger max.
    var m0 = bitcast<f32>(0xff800000u);
    var l0 = 0.0;
    if (p.first == 0u) {
        m0 = run[ro];
        l0 = run[ro + 1u];
    }
    let m1 = max(m0, mx);
    var a = 0.0;
    if (l0 > 0.0) {
        a = exp(m0 - m1);
    }
    var b = 0.0;
    if (total > 0.0) {
        b = exp(mx - m1);
    }
    let l1 = l0 * a + total * b;
    for (var c = lid.x; c < p.d; c += 64u) {
        var o = acc[c / 64u] * b;
        if (p.first == 0u) {
            o += run[ro + 2u + c] * a;
        }
        if (p.last == 1u) {
            out[qo + c] = o / l1;
        } else {
            run[ro + 2u + c] = o;
        }
    }
    // Every invocation has read the carried max and sum before one writes them.
    workgroupBarrier();
    if (lid.x == 0u && p.last == 0u) {
        run[ro] = m1;
        run[ro + 1u] = l1;
    }
}
