// Top-k routing of each token (an invocation per token), as vt-cpu's `route`: a softmax router
// (kind 0) takes the top k probabilities, renormalised if asked; a sigmoid router (kind 1) scores
// `sigmoid(softcap(l))`, chooses by score + correction bias, weighs by the score (renormalised if
// asked) times the routed scaling. Ties go to the lower expert; a NaN ranks below every number.
// Writes each token's chosen experts in ascending order (the order vt-cpu sums them in) to `ids`
// and their weights to `wts`; `logits` is overwritten by the probabilities or scores.
struct P { t: u32, e: u32, k: u32, kind: u32, renorm: u32, has_cap: u32, cap: f32, scaling: f32, has_bias: u32 }
@group(0) @binding(0) var<storage, read> params: P;
var<private> p: P;
@group(0) @binding(1) var<storage, read_write> logits: array<f32>;
@group(0) @binding(2) var<storage, read> bias: array<f32>;
@group(0) @binding(3) var<storage, read_write> ids: array<u32>;
@group(0) @binding(4) var<storage, read_write> wts: array<f32>;

const MAX_E: u32 = 1024u;
const MAX_K: u32 = 64u;

// `x` as an integer in the order of f32::total_cmp, with NaN mapped to -inf first (tested on
// the bits: a compiler may assume `x != x` never holds).
fn rank(x: f32) -> i32 {
    var i = bitcast<i32>(x);
    if (is_nan(x)) {
        i = bitcast<i32>(0xff800000u);
    }
    return i ^ ((i >> 31u) & 0x7fffffff);
}

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>) {
    p = params;
    let tok = flat(gid, groups);
    if (tok >= p.t) {
        return;
    }
    let base = tok * p.e;
    if (p.kind == 0u) {
        var m = bitcast<f32>(0xff800000u);
        for (var e = 0u; e < p.e; e++) {
            let l = logits[base + e];
            if (!is_nan(l) && l > m) {
                m = l;
            }
        }
        var sum = 0.0;
        for (var e = 0u; e < p.e; e++) {
            let x = exp(logits[base + e] - m);
            logits[base + e] = x;
            sum += x;
        }
        for (var e = 0u; e < p.e; e++) {
            logits[base + e] = logits[base + e] / sum;
        }
    } else {
        for (var e = 0u; e < p.e; e++) {
            var l = logits[base + e];
            if (p.has_cap != 0u) {
                l = p.cap * tanh(l / p.cap);
            }
            logits[base + e] = sigmoid(l);
        }
    }
    var taken: array<u32, 32>;
    var chosen: array<u32, MAX_K>;
    var norm = 0.0;
    for (var kk = 0u; kk < p.k; kk++) {
        var best = 0u;
        var best_rank = 0;
        var found = false;
        for (var e = 0u; e < p.e; e++) {
            if ((taken[e / 32u] & (1u << (e % 32u))) != 0u) {
                continue;
            }
            var c = logits[base + e];
            if (p.has_bias != 0u) {
                c += bias[e];
            }
            let r = rank(c);
            if (!found || r > best_rank) {
                best = e;
                best_rank = r;
                found = true;
            }
        }
        taken[best / 32u] |= 1u << (best % 32u);
        chosen[kk] = best;
        norm += logits[base + best];
    }
    if (p.renorm == 0u) {
        norm = 1.0;
    }
    var scale = 1.0;
    if (p.kind == 1u) {
        scale = p.scaling;
    }
    // Ascending expert order (insertion sort of k entries).
    for (var a = 1u; a < p.k; a++) {
        let x = chosen[a];
        var b = a;
        while (b > 0u && chosen[b - 1u] > x) {
            chosen[b] = chosen[b - 1u];
            b--;
        }
        chosen[b] = x;
    }
    for (var kk = 0u; kk < p.k; kk++) {
        let e = chosen[kk];
        ids[tok * p.k + kk] = e;
        if (p.kind == 1u) {
            wts[tok * p.k + kk] = logits[base + e] / norm * scale;
        } else {
            wts[tok * p.k + kk] = logits[base + e] / norm;
        }
    }
}
