//! Deterministic random tensor contents for dummy weights (`vt bench --load-format dummy`).
//!
//! Element `i` of a tensor with seed `s` is drawn from `mix(mix(s) ^ i)` (splitmix64's finaliser),
//! a counter-based hash, so any backend can generate the same values in parallel: vt-cuda's
//! `kernels/random.cu` computes exactly these bytes on the device.

use crate::{DType, Error, Result};

/// splitmix64's output function.
pub fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Uniform in [0, 1) from the top 24 bits of a hash.
fn unit(h: u64) -> f32 {
    (h >> 40) as f32 / (1u64 << 24) as f32
}

/// The e4m3 code of a positive normal `v`, mantissa truncated, clamped to [2^-6, 448].
pub fn f32_to_e4m3_positive(v: f32) -> u8 {
    let bits = v.to_bits();
    let exp = ((bits >> 23) & 0xff) as i32 - 127 + 7;
    match exp {
        ..=0 => 0x08,
        16.. => 0x7e,
        e => ((e as u8) << 3 | ((bits >> 20) & 7) as u8).min(0x7e),
    }
}

/// Stored bytes of `numel` random elements of `dtype`: floats uniform in [-scale, scale); fp8
/// e4m3 (NVFP4 block scales) positive, uniform in [scale/2, scale) before truncation; packed
/// codes and bytes uniform over all values.
pub fn random_bytes(dtype: DType, numel: usize, seed: u64, scale: f32) -> Result<Vec<u8>> {
    let key = mix(seed);
    let h = |i: usize| mix(key ^ i as u64);
    Ok(match dtype {
        DType::F32 => (0..numel).flat_map(|i| ((unit(h(i)) * 2.0 - 1.0) * scale).to_le_bytes()).collect(),
        DType::BF16 => {
            (0..numel).flat_map(|i| half::bf16::from_f32((unit(h(i)) * 2.0 - 1.0) * scale).to_le_bytes()).collect()
        }
        DType::F8E4M3 => (0..numel).map(|i| f32_to_e4m3_positive(scale * (0.5 + 0.5 * unit(h(i))))).collect(),
        DType::U8 | DType::F4x2 => {
            let n = dtype.bytes_for(numel).ok_or_else(|| Error::input(format!("{numel} elements of {dtype}")))?;
            (0..n).map(|i| (h(i) >> 32) as u8).collect()
        }
        DType::F16 | DType::I64 => return Err(Error::input(format!("random values of {dtype} are not supported"))),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e4m3_encoding_round_trips_normals() {
        for code in 0x08u8..0x7f {
            let v = crate::dtype::f8e4m3_to_f32(code);
            assert_eq!(f32_to_e4m3_positive(v), code, "code {code:#x}");
        }
        assert_eq!(f32_to_e4m3_positive(1e-9), 0x08);
        assert_eq!(f32_to_e4m3_positive(1e9), 0x7e);
    }

    #[test]
    fn values_are_in_range_and_seeded() {
        let a = random_bytes(DType::F32, 1000, 7, 0.5).unwrap();
        let v: Vec<f32> = a.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
        assert!(v.iter().all(|x| (-0.5..0.5).contains(x)));
        assert!(v.iter().any(|&x| x > 0.4) && v.iter().any(|&x| x < -0.4));
        assert_ne!(a, random_bytes(DType::F32, 1000, 8, 0.5).unwrap());
        assert_eq!(random_bytes(DType::F4x2, 6, 1, 1.0).unwrap().len(), 3);
    }
}
