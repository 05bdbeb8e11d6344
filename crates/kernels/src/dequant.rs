//! Dequantization of one row of any supported weight type to f32, with ggml's exact formulas
//! (`dequantize_row_*` in ggml-quants.c). Used for embedding lookups, norms and reference checks; the
//! matmul kernels never dequantize whole matrices.

use crate::blocks::*;
use gguf::GgmlType;

/// Dequantizes `dst.len()` elements from `src` (which must hold at least that many elements of `ty`).
///
/// # Panics
/// If `ty` is not supported ([`crate::is_supported`]), `dst.len()` is not a multiple of the block size, or
/// `src` is too short.
pub fn dequantize_row(ty: GgmlType, src: &[u8], dst: &mut [f32]) {
    let bs = ty.block_size();
    assert!(dst.len() % bs == 0, "dequantize_row: {} elements is not a multiple of {bs} ({ty})", dst.len());
    let ts = ty.type_size();
    let nb = dst.len() / bs;
    assert!(src.len() >= nb * ts, "dequantize_row: {} bytes is too short for {} {ty} elements", src.len(), dst.len());
    let blocks = src[..nb * ts].chunks_exact(ts).zip(dst.chunks_exact_mut(bs));
    match ty {
        GgmlType::F32 => blocks.for_each(|(b, y)| y[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        GgmlType::F16 => blocks.for_each(|(b, y)| y[0] = read_f16(b, 0)),
        GgmlType::BF16 => blocks.for_each(|(b, y)| y[0] = bf16_to_f32(u16::from_le_bytes([b[0], b[1]]))),
        GgmlType::Q4_0 => blocks.for_each(|(b, y)| q4_0(b, y)),
        GgmlType::Q4_1 => blocks.for_each(|(b, y)| q4_1(b, y)),
        GgmlType::Q5_0 => blocks.for_each(|(b, y)| q5_0(b, y)),
        GgmlType::Q5_1 => blocks.for_each(|(b, y)| q5_1(b, y)),
        GgmlType::Q8_0 => blocks.for_each(|(b, y)| q8_0(b, y)),
        GgmlType::Q2_K => blocks.for_each(|(b, y)| q2_k(b, y)),
        GgmlType::Q3_K => blocks.for_each(|(b, y)| q3_k(b, y)),
        GgmlType::Q4_K => blocks.for_each(|(b, y)| q4_k(b, y)),
        GgmlType::Q5_K => blocks.for_each(|(b, y)| q5_k(b, y)),
        GgmlType::Q6_K => blocks.for_each(|(b, y)| q6_k(b, y)),
        other => panic!("dequantize_row: unsupported type {}", other.name()),
    }
}

fn q4_0(b: &[u8], y: &mut [f32]) {
    let d = read_f16(b, 0);
    let qs = &b[2..18];
    for j in 0..16 {
        y[j] = ((qs[j] & 0xF) as i32 - 8) as f32 * d;
        y[j + 16] = ((qs[j] >> 4) as i32 - 8) as f32 * d;
    }
}

fn q4_1(b: &[u8], y: &mut [f32]) {
    let (d, m) = (read_f16(b, 0), read_f16(b, 2));
    let qs = &b[4..20];
    for j in 0..16 {
        y[j] = (qs[j] & 0xF) as f32 * d + m;
        y[j + 16] = (qs[j] >> 4) as f32 * d + m;
    }
}

fn q5_0(b: &[u8], y: &mut [f32]) {
    let d = read_f16(b, 0);
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    let qs = &b[6..22];
    for j in 0..16 {
        let xh0 = (((qh >> j) << 4) & 0x10) as i32;
        let xh1 = ((qh >> (j + 12)) & 0x10) as i32;
        y[j] = (((qs[j] & 0xF) as i32 | xh0) - 16) as f32 * d;
        y[j + 16] = (((qs[j] >> 4) as i32 | xh1) - 16) as f32 * d;
    }
}

fn q5_1(b: &[u8], y: &mut [f32]) {
    let (d, m) = (read_f16(b, 0), read_f16(b, 2));
    let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    let qs = &b[8..24];
    for j in 0..16 {
        let xh0 = (((qh >> j) << 4) & 0x10) as i32;
        let xh1 = ((qh >> (j + 12)) & 0x10) as i32;
        y[j] = ((qs[j] & 0xF) as i32 | xh0) as f32 * d + m;
        y[j + 16] = ((qs[j] >> 4) as i32 | xh1) as f32 * d + m;
    }
}

fn q8_0(b: &[u8], y: &mut [f32]) {
    let d = read_f16(b, 0);
    for j in 0..32 {
        y[j] = (b[2 + j] as i8) as f32 * d;
    }
}

fn q2_k(b: &[u8], y: &mut [f32]) {
    let scales = &b[0..16];
    let qs = &b[16..80];
    let (d, min) = (read_f16(b, 80), read_f16(b, 82));
    let mut out = 0;
    let mut is = 0;
    for n in 0..2 {
        let q = &qs[32 * n..32 * n + 32];
        for shift in [0, 2, 4, 6] {
            for half in 0..2 {
                let sc = scales[is];
                is += 1;
                let (dl, ml) = (d * (sc & 0xF) as f32, min * (sc >> 4) as f32);
                for l in 0..16 {
                    y[out] = dl * ((q[l + 16 * half] >> shift) & 3) as f32 - ml;
                    out += 1;
                }
            }
        }
    }
}

fn q3_k(b: &[u8], y: &mut [f32]) {
    let hm = &b[0..32];
    let qs = &b[32..96];
    let scales = q3_k_scales(&b[96..108]);
    let d_all = read_f16(b, 108);
    let mut out = 0;
    let mut is = 0;
    let mut m = 1u8;
    for n in 0..2 {
        let q = &qs[32 * n..32 * n + 32];
        for shift in [0, 2, 4, 6] {
            for half in 0..2 {
                let dl = d_all * scales[is] as f32;
                is += 1;
                for l in 16 * half..16 * half + 16 {
                    let v = ((q[l] >> shift) & 3) as i32 - if hm[l] & m != 0 { 0 } else { 4 };
                    y[out] = dl * v as f32;
                    out += 1;
                }
            }
            m <<= 1;
        }
    }
}

fn q4_k(b: &[u8], y: &mut [f32]) {
    let (d, min) = (read_f16(b, 0), read_f16(b, 2));
    let scales = &b[4..16];
    let qs = &b[16..144];
    for j in 0..4 {
        let (sc1, m1) = scale_min_k4(2 * j, scales);
        let (sc2, m2) = scale_min_k4(2 * j + 1, scales);
        let (d1, m1) = (d * sc1 as f32, min * m1 as f32);
        let (d2, m2) = (d * sc2 as f32, min * m2 as f32);
        let q = &qs[32 * j..32 * j + 32];
        for l in 0..32 {
            y[64 * j + l] = d1 * (q[l] & 0xF) as f32 - m1;
            y[64 * j + 32 + l] = d2 * (q[l] >> 4) as f32 - m2;
        }
    }
}

fn q5_k(b: &[u8], y: &mut [f32]) {
    let (d, min) = (read_f16(b, 0), read_f16(b, 2));
    let scales = &b[4..16];
    let qh = &b[16..48];
    let qs = &b[48..176];
    for j in 0..4 {
        let (sc1, m1) = scale_min_k4(2 * j, scales);
        let (sc2, m2) = scale_min_k4(2 * j + 1, scales);
        let (d1, m1) = (d * sc1 as f32, min * m1 as f32);
        let (d2, m2) = (d * sc2 as f32, min * m2 as f32);
        let (u1, u2) = (1u8 << (2 * j), 2u8 << (2 * j));
        let q = &qs[32 * j..32 * j + 32];
        for l in 0..32 {
            let h1 = if qh[l] & u1 != 0 { 16 } else { 0 };
            let h2 = if qh[l] & u2 != 0 { 16 } else { 0 };
            y[64 * j + l] = d1 * ((q[l] & 0xF) + h1) as f32 - m1;
            y[64 * j + 32 + l] = d2 * ((q[l] >> 4) + h2) as f32 - m2;
        }
    }
}

fn q6_k(b: &[u8], y: &mut [f32]) {
    let d = read_f16(b, 208);
    for n in 0..2 {
        let ql = &b[64 * n..64 * n + 64];
        let qh = &b[128 + 32 * n..128 + 32 * n + 32];
        let sc = &b[192 + 8 * n..192 + 8 * n + 8];
        let y = &mut y[128 * n..128 * n + 128];
        for l in 0..32 {
            let is = l / 16;
            let q1 = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) as i32 - 32;
            let q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
            let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
            let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
            y[l] = d * (sc[is] as i8) as f32 * q1 as f32;
            y[l + 32] = d * (sc[is + 2] as i8) as f32 * q2 as f32;
            y[l + 64] = d * (sc[is + 4] as i8) as f32 * q3 as f32;
            y[l + 96] = d * (sc[is + 6] as i8) as f32 * q4 as f32;
        }
    }
}

/// Test helpers shared by the crate's tests: random weight blocks of any type and an independent,
/// element-by-element reference decoder written straight from the block layouts.
#[cfg(test)]
pub(crate) mod testutil {
    use super::*;

    /// A tiny deterministic xorshift generator (no external crates needed).
    pub struct Rng(pub u64);
    impl Rng {
        pub fn next_u64(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        /// Uniform in [-1, 1).
        pub fn f32(&mut self) -> f32 {
            (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        }
        pub fn byte(&mut self) -> u8 {
            self.next_u64() as u8
        }
    }

    /// `rows * cols` elements of `ty` with random quant bits and sane (small, finite) scales.
    pub fn random_weights(ty: GgmlType, rows: usize, cols: usize, rng: &mut Rng) -> Vec<u8> {
        let ts = ty.type_size();
        let nb = rows * cols / ty.block_size();
        let mut data: Vec<u8> = (0..nb * ts).map(|_| rng.byte()).collect();
        let put_f16 = |block: &mut [u8], at: usize, v: f32| {
            block[at..at + 2].copy_from_slice(&f32_to_f16(v).to_le_bytes());
        };
        for block in data.chunks_exact_mut(ts) {
            let scale = 0.01 + 0.02 * rng.f32().abs();
            match ty {
                GgmlType::F32 => block.copy_from_slice(&rng.f32().to_le_bytes()),
                GgmlType::F16 => put_f16(block, 0, rng.f32()),
                GgmlType::BF16 => block.copy_from_slice(&f32_to_bf16(rng.f32()).to_le_bytes()),
                GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 | GgmlType::Q4_K | GgmlType::Q5_K => {
                    put_f16(block, 0, scale);
                    if matches!(ty, GgmlType::Q4_K | GgmlType::Q5_K) {
                        put_f16(block, 2, 0.5 * scale * rng.f32().abs());
                    }
                }
                GgmlType::Q4_1 | GgmlType::Q5_1 => {
                    put_f16(block, 0, scale);
                    put_f16(block, 2, -8.0 * scale * rng.f32().abs());
                }
                GgmlType::Q2_K => {
                    put_f16(block, 80, scale);
                    put_f16(block, 82, 0.5 * scale * rng.f32().abs());
                }
                GgmlType::Q3_K => put_f16(block, 108, scale),
                GgmlType::Q6_K => put_f16(block, 208, scale * 0.05),
                other => panic!("random_weights: {other}"),
            }
        }
        data
    }

    /// Element `i` (0..block_size) of one block, decoded independently of the production code.
    pub fn reference_element(ty: GgmlType, b: &[u8], i: usize) -> f32 {
        let f16 = |at: usize| half::f16::from_le_bytes([b[at], b[at + 1]]).to_f32();
        let nib = |qs: &[u8], i: usize| if i < 16 { qs[i] & 0xF } else { qs[i - 16] >> 4 };
        let bit = |bytes: &[u8], k: usize| (bytes[k / 8] >> (k % 8)) & 1;
        match ty {
            GgmlType::F32 => f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
            GgmlType::F16 => f16(0),
            GgmlType::BF16 => f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16),
            GgmlType::Q4_0 => f16(0) * (nib(&b[2..], i) as f32 - 8.0),
            GgmlType::Q4_1 => f16(0) * nib(&b[4..], i) as f32 + f16(2),
            GgmlType::Q5_0 => f16(0) * ((nib(&b[6..], i) | (bit(&b[2..6], i) << 4)) as f32 - 16.0),
            GgmlType::Q5_1 => f16(0) * (nib(&b[8..], i) | (bit(&b[4..8], i) << 4)) as f32 + f16(2),
            GgmlType::Q8_0 => f16(0) * (b[2 + i] as i8) as f32,
            GgmlType::Q4_K | GgmlType::Q5_K => {
                // Sub-block j of 32 elements; 64-element chunk c = j / 2 uses low (even j) or high nibbles.
                let (j, l) = (i / 32, i % 32);
                let (sc, m) = if j < 4 {
                    (b[4 + j] & 63, b[8 + j] & 63)
                } else {
                    ((b[12 + j - 4] & 0xF) | ((b[4 + j - 4] >> 6) << 4), (b[12 + j - 4] >> 4) | ((b[4 + j] >> 6) << 4))
                };
                let qs_at = if ty == GgmlType::Q4_K { 16 } else { 48 };
                let byte = b[qs_at + 32 * (j / 2) + l];
                let mut q = if j % 2 == 0 { byte & 0xF } else { byte >> 4 };
                if ty == GgmlType::Q5_K {
                    q |= bit(&b[16 + l..], j) << 4;
                }
                f16(0) * sc as f32 * q as f32 - f16(2) * m as f32
            }
            GgmlType::Q6_K => {
                // 128-element half n; within it, quarter k (32 elements) takes ql low/high nibbles and
                // qh bit pair k.
                let (n, r) = (i / 128, i % 128);
                let (k, l) = (r / 32, r % 32);
                let ql = b[64 * n + l + 32 * (k % 2)];
                let low = if k < 2 { ql & 0xF } else { ql >> 4 };
                let high = (b[128 + 32 * n + l] >> (2 * k)) & 3;
                let q = (low | (high << 4)) as i32 - 32;
                let sc = b[192 + i / 16] as i8;
                f16(208) * sc as f32 * q as f32
            }
            GgmlType::Q2_K => {
                let (n, r) = (i / 128, i % 128);
                let (shift_index, l) = (r / 32, r % 32);
                let q = (b[16 + 32 * n + l] >> (2 * shift_index)) & 3;
                let sc = b[i / 16];
                f16(80) * (sc & 0xF) as f32 * q as f32 - f16(82) * (sc >> 4) as f32
            }
            GgmlType::Q3_K => {
                let (n, r) = (i / 128, i % 128);
                let (shift_index, l) = (r / 32, r % 32);
                let q = ((b[32 + 32 * n + l] >> (2 * shift_index)) & 3) as i32;
                let high = (b[l] >> (4 * n + shift_index)) & 1;
                let q = q - if high == 1 { 0 } else { 4 };
                // Scale s (0..16): low 4 bits in byte s%8 (nibble s/8), high 2 bits in byte 8 + s%4.
                let s = i / 16;
                let low = (b[96 + s % 8] >> (4 * (s / 8))) & 0xF;
                let hi = (b[96 + 8 + s % 4] >> (2 * (s / 4))) & 3;
                f16(108) * ((low | (hi << 4)) as i32 - 32) as f32 * q as f32
            }
            other => panic!("reference_element: {other}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::testutil::*;
    use super::*;

    const TYPES: [GgmlType; 13] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::BF16,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
        GgmlType::Q2_K,
        GgmlType::Q3_K,
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
    ];

    #[test]
    fn dequantize_matches_reference_layout() {
        let mut rng = Rng(0x1234_5678_9abc_def1);
        for ty in TYPES {
            let n = 512;
            let data = random_weights(ty, 1, n, &mut rng);
            let mut got = vec![0.0; n];
            dequantize_row(ty, &data, &mut got);
            let (bs, ts) = (ty.block_size(), ty.type_size());
            for (i, &g) in got.iter().enumerate() {
                let block = &data[(i / bs) * ts..(i / bs + 1) * ts];
                let want = reference_element(ty, block, i % bs);
                assert!((g - want).abs() <= 1e-6 * want.abs().max(1e-3), "{ty} element {i}: {g} vs {want}");
            }
        }
    }
}
