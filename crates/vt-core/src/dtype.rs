//! Element types vt stores and computes with, and the scalar decoders for the narrow ones.

use half::{bf16, f16};

/// Storage element type of a tensor. Weights keep the dtype they were stored in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    BF16,
    F16,
    /// fp8 e4m3 "fn" (no infinities; S.1111.111 is NaN), as NVFP4 block scales use it.
    F8E4M3,
    U8,
    I64,
    /// Two e2m1 (fp4) codes per byte, the even element in the low nibble. Shapes count elements.
    F4x2,
}

impl DType {
    /// Bytes for `numel` elements; `None` when a packed type gets an odd count.
    pub fn bytes_for(self, numel: usize) -> Option<usize> {
        match self {
            DType::F32 => numel.checked_mul(4),
            DType::BF16 | DType::F16 => numel.checked_mul(2),
            DType::F8E4M3 | DType::U8 => Some(numel),
            DType::I64 => numel.checked_mul(8),
            DType::F4x2 => numel.is_multiple_of(2).then_some(numel / 2),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "F32",
            DType::BF16 => "BF16",
            DType::F16 => "F16",
            DType::F8E4M3 => "F8_E4M3",
            DType::U8 => "U8",
            DType::I64 => "I64",
            DType::F4x2 => "F4x2",
        }
    }

    /// Whether the dtype holds one float per element that `to_f32` can decode.
    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::BF16 | DType::F16 | DType::F8E4M3)
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Decodes one fp8 e4m3fn byte: bias 7, subnormals at exponent 0, NaN at S.1111.111, no infinity.
pub fn f8e4m3_to_f32(bits: u8) -> f32 {
    let sign = if bits & 0x80 != 0 { -1.0f32 } else { 1.0 };
    let exp = (bits >> 3) & 0x0f;
    let mant = (bits & 0x07) as f32;
    if exp == 0x0f && bits & 0x07 == 0x07 {
        return f32::NAN;
    }
    if exp == 0 {
        sign * mant / 8.0 * 2f32.powi(-6)
    } else {
        sign * (1.0 + mant / 8.0) * 2f32.powi(exp as i32 - 7)
    }
}

/// The eight magnitudes of e2m1: exponent bias 1, one mantissa bit.
const E2M1_MAGNITUDE: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];

/// Decodes one e2m1 code (the low four bits of `code`; bit 3 is the sign).
pub fn e2m1_to_f32(code: u8) -> f32 {
    let magnitude = E2M1_MAGNITUDE[(code & 0x07) as usize];
    if code & 0x08 != 0 {
        -magnitude
    } else {
        magnitude
    }
}

/// Decodes `out.len()` floats of `dtype` from little-endian `bytes`.
///
/// The caller guarantees `bytes.len() == dtype.bytes_for(out.len())` and a float dtype.
pub fn decode_into(dtype: DType, bytes: &[u8], out: &mut [f32]) {
    match dtype {
        DType::F32 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        DType::BF16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = bf16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        DType::F16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = f16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        DType::F8E4M3 => {
            for (o, &b) in out.iter_mut().zip(bytes) {
                *o = f8e4m3_to_f32(b);
            }
        }
        DType::U8 | DType::I64 | DType::F4x2 => {
            unreachable!("decode_into called with non-float dtype {dtype}")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e2m1_all_sixteen_codes() {
        let expected = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0];
        for (code, want) in expected.iter().enumerate() {
            let got = e2m1_to_f32(code as u8);
            assert_eq!(got.to_bits(), f32::to_bits(*want), "code {code}");
        }
    }

    /// fp8 e4m3fn from first principles, independently of the decoder's branch structure.
    fn e4m3_reference(bits: u8) -> f64 {
        let s = if bits >> 7 == 1 { -1.0 } else { 1.0 };
        let e = ((bits >> 3) & 15) as i32;
        let m = (bits & 7) as f64;
        if e == 15 && m == 7.0 {
            return f64::NAN;
        }
        let (frac, exp) = if e == 0 { (m / 8.0, -6) } else { (1.0 + m / 8.0, e - 7) };
        s * frac * (2.0f64).powi(exp)
    }

    #[test]
    fn f8e4m3_all_256_codes() {
        for bits in 0..=255u8 {
            let got = f8e4m3_to_f32(bits);
            let want = e4m3_reference(bits);
            if want.is_nan() {
                assert!(got.is_nan(), "code {bits:#04x} must be NaN");
            } else {
                assert_eq!(got as f64, want, "code {bits:#04x}");
            }
        }
        // Landmarks: largest finite, smallest subnormal, one, negative zero, the two NaNs.
        assert_eq!(f8e4m3_to_f32(0x7e), 448.0);
        assert_eq!(f8e4m3_to_f32(0x01), 2f32.powi(-9));
        assert_eq!(f8e4m3_to_f32(0x38), 1.0);
        assert_eq!(f8e4m3_to_f32(0x80).to_bits(), (-0.0f32).to_bits());
        assert!(f8e4m3_to_f32(0x7f).is_nan() && f8e4m3_to_f32(0xff).is_nan());
        // 0x78 is 256 (exponent 15 with mantissa < 7 is finite in the fn variant).
        assert_eq!(f8e4m3_to_f32(0x78), 256.0);
    }

    #[test]
    fn packed_byte_counts() {
        assert_eq!(DType::F4x2.bytes_for(32), Some(16));
        assert_eq!(DType::F4x2.bytes_for(3), None);
        assert_eq!(DType::BF16.bytes_for(5), Some(10));
    }
}
