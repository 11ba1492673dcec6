// The chunked gated delta rule's parameters and scratch layout (needs `p` bound): a block per
// (chunk of the call's current group, value head), holding for the chunk's (up to) 64 tokens
// normalised q and k `[64, dk]`, W `[64, dk]`, U `[64, dv]`, A and QK `[64, 64]` and the
// cumulative log-decay c `[64]`. `first` is the group's first chunk of the call.
struct GdnP { t: u32, kh: u32, vh: u32, dk: u32, dv: u32, scale: f32, first: u32, chunks: u32 }

const CHUNK: u32 = 64u;

// Offsets of the parts within a block.
struct Parts { qn: u32, kn: u32, w: u32, u: u32, a: u32, qk: u32, cum: u32, size: u32 }

fn parts() -> Parts {
    let kn = CHUNK * p.dk;
    let w = 2u * kn;
    let u = 3u * kn;
    let a = u + CHUNK * p.dv;
    let qk = a + CHUNK * CHUNK;
    let cum = qk + CHUNK * CHUNK;
    return Parts(0u, kn, w, u, a, qk, cum, cum + CHUNK);
}

// Tokens in chunk `cg` of the group.
fn chunk_len(cg: u32) -> u32 {
    return min(CHUNK, p.t - (p.first + cg) * CHUNK);
}
