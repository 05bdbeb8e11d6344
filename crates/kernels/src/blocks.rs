//! ggml block layouts (byte offsets inside one block) and the scalar number conversions they need.
//!
//! Layouts follow ggml's `ggml-common.h`: legacy quants have 32 elements per block, k-quants 256
//! ("super-blocks"). All multi-byte fields are little-endian. Conversions: f16 with round-to-nearest-even
//! (as F16C's `vcvtps2ph` with mode 0, which ggml's x86 build uses), bf16 rounding as `GGML_FP32_TO_BF16`.

/// Elements per legacy block (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_1).
pub const QK: usize = 32;
/// Elements per k-quant super-block.
pub const QK_K: usize = 256;

/// Bytes per block of each supported weight type.
pub const Q4_0_BYTES: usize = 18;
pub const Q4_1_BYTES: usize = 20;
pub const Q5_0_BYTES: usize = 22;
pub const Q5_1_BYTES: usize = 24;
pub const Q8_0_BYTES: usize = 34;
pub const Q2_K_BYTES: usize = 84;
pub const Q3_K_BYTES: usize = 110;
pub const Q4_K_BYTES: usize = 144;
pub const Q5_K_BYTES: usize = 176;
pub const Q6_K_BYTES: usize = 210;

/// f16 bits to f32.
#[inline(always)]
pub fn f16_to_f32(bits: u16) -> f32 {
    half::f16::from_bits(bits).to_f32()
}

/// f32 to f16 bits, round to nearest even.
#[inline(always)]
pub fn f32_to_f16(x: f32) -> u16 {
    half::f16::from_f32(x).to_bits()
}

/// Reads the little-endian f16 at `b[at..at + 2]` as f32.
#[inline(always)]
pub fn read_f16(b: &[u8], at: usize) -> f32 {
    f16_to_f32(u16::from_le_bytes([b[at], b[at + 1]]))
}

/// f32 to bf16 bits exactly as ggml's `GGML_FP32_TO_BF16` (round to nearest even, quiet NaN).
#[inline(always)]
pub fn f32_to_bf16(x: f32) -> u16 {
    let u = x.to_bits();
    if (u & 0x7fff_ffff) > 0x7f80_0000 {
        return ((u >> 16) | 64) as u16;
    }
    ((u + (0x7fff + ((u >> 16) & 1))) >> 16) as u16
}

/// bf16 bits to f32.
#[inline(always)]
pub fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits(u32::from(bits) << 16)
}

/// ggml's `nearest_int`: round half to even (valid for |x| < 2^22, which all callers guarantee).
#[inline(always)]
pub fn nearest_int(x: f32) -> i32 {
    x.round_ties_even() as i32
}

/// The 6-bit scale and min of sub-block `j` (0..8) of a Q4_K/Q5_K super-block (`get_scale_min_k4`).
#[inline(always)]
pub fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        ((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
    }
}

/// Decodes the 8 six-bit scales and 8 mins of a Q4_K/Q5_K super-block (ggml's `utmp` shuffle) as
/// little-endian bytes: `(scales[0..8], mins[0..8])` packed in two u64.
#[inline(always)]
pub fn k4_scales_mins(q: &[u8]) -> (u64, u64) {
    const KMASK1: u32 = 0x3f3f_3f3f;
    const KMASK2: u32 = 0x0f0f_0f0f;
    const KMASK3: u32 = 0x0303_0303;
    let word = |i: usize| u32::from_le_bytes([q[4 * i], q[4 * i + 1], q[4 * i + 2], q[4 * i + 3]]);
    let (u0, u1, u2) = (word(0), word(1), word(2));
    let sc_lo = u0 & KMASK1;
    let sc_hi = (u2 & KMASK2) | (((u0 >> 6) & KMASK3) << 4);
    let m_lo = u1 & KMASK1;
    let m_hi = ((u2 >> 4) & KMASK2) | (((u1 >> 6) & KMASK3) << 4);
    (sc_lo as u64 | ((sc_hi as u64) << 32), m_lo as u64 | ((m_hi as u64) << 32))
}

/// The 16 signed 6-bit scales of a Q3_K super-block (packed into 12 bytes), each still offset by 32.
#[inline(always)]
pub fn q3_k_scales(packed: &[u8]) -> [i8; 16] {
    const KMASK1: u32 = 0x0303_0303;
    const KMASK2: u32 = 0x0f0f_0f0f;
    let word = |i: usize| u32::from_le_bytes([packed[4 * i], packed[4 * i + 1], packed[4 * i + 2], packed[4 * i + 3]]);
    let (a0, a1, tmp) = (word(0), word(1), word(2));
    let aux = [
        (a0 & KMASK2) | ((tmp & KMASK1) << 4),
        (a1 & KMASK2) | (((tmp >> 2) & KMASK1) << 4),
        ((a0 >> 4) & KMASK2) | (((tmp >> 4) & KMASK1) << 4),
        ((a1 >> 4) & KMASK2) | (((tmp >> 6) & KMASK1) << 4),
    ];
    let mut out = [0i8; 16];
    for (i, w) in aux.iter().enumerate() {
        for (k, byte) in w.to_le_bytes().iter().enumerate() {
            out[4 * i + k] = (*byte as i8).wrapping_sub(32);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_rounding_matches_ggml() {
        assert_eq!(f32_to_bf16(1.0), 0x3f80);
        // 1 + 2^-8 is exactly halfway between two bf16 values: ties to even (down).
        assert_eq!(f32_to_bf16(f32::from_bits(0x3f80_8000)), 0x3f80);
        assert_eq!(f32_to_bf16(f32::from_bits(0x3f81_8000)), 0x3f82);
        assert_eq!(f32_to_bf16(f32::NAN) & 0x7fc0, 0x7fc0);
    }

    #[test]
    fn k4_scales_mins_matches_scale_min_k4() {
        let q: Vec<u8> = (0..12).map(|i| (i * 37 + 11) as u8).collect();
        let (sc, mn) = k4_scales_mins(&q);
        for j in 0..8 {
            assert_eq!(scale_min_k4(j, &q), (sc.to_le_bytes()[j], mn.to_le_bytes()[j]), "sub-block {j}");
        }
    }

    #[test]
    fn nearest_int_ties_to_even() {
        assert_eq!(nearest_int(2.5), 2);
        assert_eq!(nearest_int(3.5), 4);
        assert_eq!(nearest_int(-2.5), -2);
        assert_eq!(nearest_int(-127.4), -127);
    }

    #[test]
    fn q3_k_scale_unpacking_roundtrips() {
        // Pack 16 six-bit values the way ggml's quantizer does, then unpack.
        let values: Vec<u8> = (0..16).map(|i| (i * 7 + 3) as u8 & 63).collect();
        let mut packed = [0u8; 12];
        for (j, &l) in values.iter().enumerate() {
            if j < 8 {
                packed[j] = l & 0xF;
            } else {
                packed[j - 8] |= (l & 0xF) << 4;
            }
            packed[8 + j % 4] |= (l >> 4) << (2 * (j / 4));
        }
        let got = q3_k_scales(&packed);
        for j in 0..16 {
            assert_eq!(got[j], values[j] as i8 - 32, "scale {j}");
        }
    }
}
