//! What the kernel benchmarks share (decode_bench, prefill_bench).

/// Whether the case kind `kind` is among `VT_BENCH_CASES` (all when unset).
pub fn wanted(kind: &str) -> bool {
    std::env::var("VT_BENCH_CASES").map_or(true, |v| v.split(',').any(|c| c.trim() == kind))
}
