//! Checkpoint variants written at test time: a fixture's config and tensor layout with
//! deterministically perturbed values. An engine built from a variant has *different* weights of
//! exactly the same shapes, so it makes the same allocations as the original and, in a placement
//! arena, lands at the original's freed addresses. No extra fixture files are committed.

use std::collections::HashMap;
use std::path::Path;

use half::{bf16, f16};
use safetensors::tensor::{Dtype, SafeTensors, TensorView};
use tempfile::TempDir;

/// A copy of the checkpoint in `src` (every file but the references) with every weight
/// value perturbed by a function of `seed`, the tensor's name and the element's index. Floats are
/// scaled by a factor in [0.75, 1.25]; `U8` tensors (packed NVFP4 e2m1 pairs, where every byte is
/// valid) get a quarter of their bytes' low code bits flipped. fp8 scales and integers are kept:
/// perturbing fp8 bits could produce NaN codes.
pub fn perturbed(src: &Path, seed: u64) -> TempDir {
    let dst = tempfile::Builder::new().prefix("vt-variant-").tempdir().expect("temp dir");
    for entry in std::fs::read_dir(src).expect("fixture dir") {
        let path = entry.expect("dir entry").path();
        let name = path.file_name().expect("file name");
        if name == "reference.safetensors" || name == crate::mtp::FILE {
            continue;
        }
        if path.extension().is_some_and(|e| e == "safetensors") {
            rewrite(&path, &dst.path().join(name), seed);
        } else {
            std::fs::copy(&path, dst.path().join(name)).expect("copy fixture file");
        }
    }
    dst
}

fn rewrite(src: &Path, dst: &Path, seed: u64) {
    let bytes = std::fs::read(src).expect("read safetensors");
    let st = SafeTensors::deserialize(&bytes).expect("parse safetensors");
    let (_, meta) = SafeTensors::read_metadata(&bytes).expect("parse safetensors header");
    let data: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .map(|(name, t)| {
            let new = perturb(t.dtype(), t.data(), seed ^ fnv1a(&name));
            (name, t.dtype(), t.shape().to_vec(), new)
        })
        .collect();
    let views = data.iter().map(|(n, d, s, b)| (n.as_str(), TensorView::new(*d, s.clone(), b).expect("same layout")));
    let info: Option<HashMap<String, String>> = meta.metadata().clone();
    safetensors::serialize_to_file(views, info, dst).expect("write safetensors");
}

fn perturb(dtype: Dtype, data: &[u8], key: u64) -> Vec<u8> {
    let scale = |i: usize| 1.0 + 0.25 * unit(key, i);
    match dtype {
        Dtype::BF16 => map_chunks::<2>(data, |i, c| {
            bf16::from_f32(bf16::from_bits(u16::from_le_bytes(c)).to_f32() * scale(i)).to_bits().to_le_bytes()
        }),
        Dtype::F16 => map_chunks::<2>(data, |i, c| {
            f16::from_f32(f16::from_bits(u16::from_le_bytes(c)).to_f32() * scale(i)).to_bits().to_le_bytes()
        }),
        Dtype::F32 => map_chunks::<4>(data, |i, c| (f32::from_le_bytes(c) * scale(i)).to_le_bytes()),
        Dtype::U8 => data.iter().enumerate().map(|(i, &b)| if mix(key, i) & 3 == 0 { b ^ 0x11 } else { b }).collect(),
        _ => data.to_vec(),
    }
}

/// Applies `f(element index, element bytes)` to every `N`-byte element.
fn map_chunks<const N: usize>(data: &[u8], f: impl Fn(usize, [u8; N]) -> [u8; N]) -> Vec<u8> {
    data.chunks_exact(N).enumerate().flat_map(|(i, c)| f(i, c.try_into().expect("N-byte chunk"))).collect()
}

/// A value in [-1, 1) from `key` and `i`.
fn unit(key: u64, i: usize) -> f32 {
    (mix(key, i) >> 40) as f32 / (1u64 << 23) as f32 - 1.0
}

/// splitmix64 of `key + i`: cheap, well-mixed, deterministic.
fn mix(key: u64, i: usize) -> u64 {
    let mut z = key.wrapping_add((i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15));
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn fnv1a(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3))
}
