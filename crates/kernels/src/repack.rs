//! Exact conversions of weights into a type whose kernels are faster on this machine, done once at load.
//!
//! Q5_0 → Q8_0: a Q5_0 value is `d · (q − 16)` with `q` in 0..32, so the same `d` and the int8 `q − 16` are a
//! Q8_0 block holding exactly the same numbers; both types dot against Q8_0 activations, so only the order of
//! float additions differs. Measured on the 2-core AVX2 machine (`cargo bench -p kernels --bench matmul`,
//! 2048 × 640, 2 threads, weights in cache): one row 42–47 µs as Q8_0 vs 75–77 µs as Q5_0, eight rows 152 vs
//! 167 µs. The Q5_0 kernel spends its time spreading the fifth bits; streaming 55% more bytes costs less.
//!
//! Q4_0/Q4_1/Q4_K → the same type interleaved by 8 rows ([`interleave8`]): the same bytes in another order, so
//! that one 32-byte register holds four consecutive values of eight weight rows; the kernels then compute eight
//! rows' block sums in the eight lanes of one register (no horizontal sums, one scale multiply per block and
//! activation row instead of one per row). Same numbers. Measured (`cargo bench -p kernels --bench
//! matmul -- multirow`, Q4_1 1536 × 576, weights in cache): one thread 50 → 20 µs for one activation row, 171 →
//! 109 µs for eight; SmolLM2 prefill 1.6×, decode 1.2× (medians of 3 paired `specee bench -p 128 -n 128` runs with
//! and without `SPECEE_REPACK=0`).
//!
//! Q5_0 → interleaved by 8 rows as it is, where the CPU has AVX2 or AVX-512 VNNI ([`interleave_pays`]; on the
//! scalar kernels the Q8_0 conversion above): the nibbles as Q4_0's, the fifth bits rearranged into one 32-bit mask
//! per nibble register and half ([`Q5_0_X8_BYTES`]), which the AVX-512 kernel adds in with one masked byte add (16
//! where the bit is set) and the AVX2 one spreads into bytes (`vpshufb`, and, compare) and or's in. It reads the
//! file's 5.5 bits per weight instead of the conversion's 8.5, and decoding is bandwidth-bound. Session 57, the
//! 2-vCPU Emerald Rapids VM, `specee bench -p 128 -n 128 -r 3 -t 2` alternating with `SPECEE_Q5_X8=0`: Qwen2.5-Coder
//! 0.5B (24 layers of Q5_0 gate/up/q/k/o) decode 74.2 / 75.5 vs 52.7 / 44.9 tok/s, prefill 411 / 421 vs 319 / 284;
//! Gemma 3 270M decode 107.7 / 98.7 vs 96.2 / 91.3, prefill 704 / 684 vs 737 / 728 (its multi-row products pay
//! for the masks). Session 62, a 2-vCPU AMD EPYC Zen 3 (AVX2, no AVX-512), alternating with `SPECEE_Q5_X8=0` (the
//! conversion): `kbench 2 Q5_0` (2048 × 640, weights in cache) one activation row 31.8 vs 48.9 µs for the
//! converted Q8_0 rows, 16 rows 265 vs 332 µs; Qwen2.5-Coder `specee bench -p 128 -n 128 -r 3 -t 2` decode
//! 47.4 / 46.7 vs 40.7 / 36.9 tok/s, prefill 178 / 207 vs 142 / 126; one thread decode 29.0 vs 21.8.
//!
//! Q6_K → interleaved by 8 rows where the CPU has AVX2 or AVX-512 VNNI ([`interleave_pays`]; on the scalar
//! kernels the rows as they are): per sub-block of 16 values two nibble registers and one of high bit pairs
//! ([`Q6_K_X8_QS`]), the file's size; the kernel decodes a sub-block of 16 rows into four registers and
//! `vpdpbusd`s each activation row into them, where the row kernel unpacks one row at a time. Q4_K_M files keep half their `ffn_down` in Q6_K (Qwen2.5-
//! Coder 12 of 24 layers, Gemma 3 9 of 18). Session 58, `kbench 2 Q6_K` (weights in cache), alternating with
//! `SPECEE_Q6_X8=0`: Qwen's 896 × 4864 one activation row 55 vs 89 µs, eight 171 vs 326 µs; `kprof` 5-row Qwen
//! forward 12.4–13.5 vs 13.6–15.9 ms (median of each of 3 alternating runs), Qwen prefill (`specee bench -p 128`)
//! median 465 vs 436 tok/s over 3 alternating rounds, decode unchanged (the VM's ±25% swings hide smaller changes).
//! The AVX2 kernel (session 62, 2-vCPU Zen 3, alternating with `SPECEE_Q6_X8=0`): `kbench 2 Q6_K` Qwen's 896 × 4864
//! one row 83–85 vs 165–196 µs, 16 rows 0.71–0.80 vs 0.98–1.14 ms; Qwen `specee bench -p 128 -n 128 -r 5 -t 1`
//! decode 32.6 vs 29.5 tok/s.
//!
//! Q8_0 → interleaved by 8 rows too, where the CPU has AVX-512 VNNI ([`interleave_pays`]; 32 bytes per 8 rows and
//! block larger: each row's `-128 · Σq`, the offset of the VNNI kernel's unsigned activations). Measured on a
//! 2-core Zen 4 (`kbench`, 2 threads): Gemma's 2048 × 640 Q8_0 one row 25 → 12 µs; its 262,144 × 640 head 8 rows
//! 12.5 → 8.3 ms.

use crate::blocks::{Q4_0_BYTES, Q4_1_BYTES, Q5_0_BYTES, QK};
use gguf::GgmlType;

/// Bytes of one Q8_0 block.
const Q8_0_BYTES: usize = 34;

/// Converts whole Q5_0 blocks (`src.len()` a multiple of 22 bytes) into Q8_0 blocks holding the same values.
pub fn q5_0_to_q8_0(src: &[u8]) -> Vec<u8> {
    assert!(src.len() % Q5_0_BYTES == 0, "q5_0_to_q8_0: {} bytes is not whole Q5_0 blocks", src.len());
    let mut out = Vec::with_capacity(src.len() / Q5_0_BYTES * Q8_0_BYTES);
    for b in src.chunks_exact(Q5_0_BYTES) {
        out.extend_from_slice(&b[..2]);
        let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
        let qs = &b[6..];
        let value = |j: usize| -> u8 {
            let nibble = if j < QK / 2 { qs[j] & 0x0F } else { qs[j - QK / 2] >> 4 };
            let q = nibble | ((((qh >> j) & 1) as u8) << 4);
            (q as i8 - 16) as u8
        };
        out.extend((0..QK).map(value));
    }
    out
}

/// The types [`interleave8`] handles.
pub fn interleavable(ty: GgmlType) -> bool {
    x8_block_bytes(ty).is_some()
}

/// Bytes of one block column of 8 interleaved rows of type `ty` (None: the type is not interleaved).
pub fn x8_block_bytes(ty: GgmlType) -> Option<usize> {
    match ty {
        GgmlType::Q4_0 => Some(x8_legacy_bytes(false)),
        GgmlType::Q4_1 => Some(x8_legacy_bytes(true)),
        GgmlType::Q4_K => Some(Q4_K_X8_BYTES),
        GgmlType::Q8_0 => Some(Q8_0_X8_BYTES),
        GgmlType::Q5_0 => Some(Q5_0_X8_BYTES),
        GgmlType::Q6_K => Some(Q6_K_X8_BYTES),
        _ => None,
    }
}

/// Whether interleaving a matrix of type `ty` pays on this machine: Q4_0, Q4_1 and Q4_K always; Q5_0 and Q6_K
/// where the CPU has the AVX2 or AVX-512 VNNI kernels for them, Q8_0 only with AVX-512 VNNI (elsewhere their
/// interleaved products would take the scalar path; Q5_0 is then converted to Q8_0 by [`q5_0_to_q8_0`] instead,
/// Q6_K keeps its rows).
/// `SPECEE_Q5_X8=0` converts Q5_0 to Q8_0 there too, `SPECEE_Q6_X8=0` keeps Q6_K's rows (to measure the
/// difference).
pub fn interleave_pays(ty: GgmlType) -> bool {
    static Q5_X8: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    static Q6_X8: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    // On unless the variable says 0, read once.
    let on = |cell: &std::sync::OnceLock<bool>, var: &str| {
        *cell.get_or_init(|| std::env::var(var).map_or(true, |v| v != "0"))
    };
    use crate::kernel::Isa;
    let isa = Isa::current();
    let simd = matches!(isa, Isa::Avx2 | Isa::Avx512);
    match ty {
        GgmlType::Q8_0 => isa == Isa::Avx512,
        GgmlType::Q5_0 => simd && on(&Q5_X8, "SPECEE_Q5_X8"),
        GgmlType::Q6_K => simd && on(&Q6_X8, "SPECEE_Q6_X8"),
        _ => interleavable(ty),
    }
}

/// Bytes of one block column of 8 interleaved Q8_0 rows: the eight rows' `d` (f16), their `-128 · Σ q` (i32:
/// the VNNI kernel's offset for activations stored as `y + 128`), then 256 bytes of values.
pub const Q8_0_X8_BYTES: usize = 16 + 32 + 256;
/// Where the interleaved Q8_0 offsets start.
pub const Q8_0_X8_OFFSETS: usize = 16;
/// Where the interleaved Q8_0 values start.
pub const Q8_0_X8_QS: usize = 48;

/// Bytes of one block column of 8 interleaved Q5_0 rows: the eight rows' `d` (f16), the fifth bits as eight
/// 32-bit masks (register `i`'s low-nibble mask at `16 + 8i`, its high-nibble mask at `20 + 8i`: bit `4r + e` is
/// the fifth bit of the value that byte `4r + e` of the register holds in that nibble), then the four nibble
/// registers as Q4_0's. The file's size: native Q5_0 reads 5.5 bits a weight where the Q8_0 conversion reads 8.5.
pub const Q5_0_X8_BYTES: usize = 8 * Q5_0_BYTES;
/// Where the interleaved Q5_0 fifth-bit masks start.
pub const Q5_0_X8_QH: usize = 16;
/// Where the interleaved Q5_0 nibble registers start.
pub const Q5_0_X8_QS: usize = 48;

/// Bytes of one block column of 8 interleaved Q4_0/Q4_1 rows: the eight rows' `d` (f16), for Q4_1 their `m`
/// (f16), then 128 bytes of nibbles.
pub const fn x8_legacy_bytes(has_min: bool) -> usize {
    if has_min {
        8 * Q4_1_BYTES
    } else {
        8 * Q4_0_BYTES
    }
}

/// Bytes of one interleaved Q4_0 / Q4_1 (`has_min`) / Q5_0 (`fifth`) block column and where its four nibble
/// registers start: the layout the kernels of all three walk.
pub const fn x8_nibble_layout(has_min: bool, fifth: bool) -> (usize, usize) {
    if fifth {
        (Q5_0_X8_BYTES, Q5_0_X8_QS)
    } else {
        (x8_legacy_bytes(has_min), x8_regs_offset(has_min))
    }
}

/// Where the four nibble registers start in an interleaved Q4_0/Q4_1 block column (after the `d`s and, for
/// Q4_1, the `m`s).
pub const fn x8_regs_offset(has_min: bool) -> usize {
    if has_min {
        32
    } else {
        16
    }
}

/// Bytes of one super-block column of 8 interleaved Q4_K rows: `d` ×8 (f16), `dmin` ×8 (f16), the 8 sub-block
/// scales of the 8 rows (u8, `[sub-block][row]`), their mins (same order), then 1024 bytes of nibbles.
pub const Q4_K_X8_BYTES: usize = 16 + 16 + 64 + 64 + 1024;
/// Where the interleaved Q4_K scales, mins and nibbles start.
pub const Q4_K_X8_SCALES: usize = 32;
pub const Q4_K_X8_MINS: usize = 96;
pub const Q4_K_X8_QS: usize = 160;

/// Bytes of one super-block column of 8 interleaved Q6_K rows: `d` ×8 (f16), the 16 sub-block scales of the 8 rows
/// (i8, `[sub-block][row]`), then per sub-block `s` a unit of three registers of 4 bytes per row ([`Q6_K_X8_QS`]):
/// the file's size.
pub const Q6_K_X8_BYTES: usize = 8 * 210;
/// Where the interleaved Q6_K scales start.
pub const Q6_K_X8_SCALES: usize = 16;
/// Where the interleaved Q6_K units start: unit `s` (96 bytes, at `Q6_K_X8_QS + 96 s`) holds sub-block `s`'s 16
/// values of the 8 rows as two nibble registers and one register of high bit pairs. In nibble register `h` (0, 1),
/// row `r`'s byte `4r + e` holds value `16s + 8h + e` in its low nibble and `16s + 8h + 4 + e` in its high one; in
/// the high register, byte `4r + e` holds the top two bits of value `16s + 4k + e` at bits `2k, 2k + 1` (k 0..4).
/// So one unit decodes into four registers of 4 values × 8 rows (per value `q` in 0..64, the weight `d·sc·(q − 32)`),
/// one sub-block whole.
pub const Q6_K_X8_QS: usize = 144;

/// Reorders a Q4_0, Q4_1, Q5_0, Q4_K, Q6_K or Q8_0 matrix of `rows` rows (a multiple of 8) and `cols` columns into
/// groups of 8 rows, block column by block column: group `g` (rows `8g..8g+8`) holds block column `b` at
/// `(g * nb + b) *` [`x8_block_bytes`], where the nibbles form 32-byte registers holding 4 bytes of each of the 8
/// rows (row `r` at bytes `4r..4r+4`):
/// - Q4_0/Q4_1: the 8 rows' `d`, for Q4_1 their `m`, then four registers; register `i` holds row `r`'s packed
///   bytes `qs[4i..4i+4]` (low nibbles: values `4i..4i+4`, high nibbles: values `16+4i..`). Same size as the file.
/// - Q5_0: `d`, the fifth bits as masks over the four registers ([`Q5_0_X8_BYTES`]), then the registers as Q4_0.
///   Same size as the file.
/// - Q4_K: `d`, `dmin`, the decoded 6-bit scales and mins as bytes, then 32 registers; register `8k + i` holds
///   row `r`'s `qs[32k+4i..32k+4i+4]` (low nibbles: sub-block `2k`'s values `4i..4i+4`, high: sub-block `2k+1`'s).
///   32 bytes per 8 rows larger than the file (the scales unpacked).
/// - Q8_0: `d`, `-128 · Σ q` per row (i32), then eight registers; register `i` holds row `r`'s `qs[4i..4i+4]`.
///   32 bytes per 8 rows and block larger than the file.
/// - Q6_K: `d`, the scales, then one unit per sub-block of 16 values ([`Q6_K_X8_QS`]). Same size as the file.
pub fn interleave8(ty: GgmlType, src: &[u8], rows: usize, cols: usize) -> Vec<u8> {
    let xb = x8_block_bytes(ty).unwrap_or_else(|| panic!("interleave8: {} cannot be interleaved", ty.name()));
    let (bytes, block) = (ty.type_size(), ty.block_size());
    let nb = cols / block;
    let rb = nb * bytes;
    assert!(
        rows % 8 == 0 && cols % block == 0 && src.len() == rows * rb,
        "interleave8: {} bytes do not hold a {} {rows}x{cols} matrix with rows a multiple of 8",
        src.len(),
        ty.name()
    );
    let mut out = vec![0u8; rows / 8 * nb * xb];
    for (g, dst_group) in out.chunks_exact_mut(nb * xb).enumerate() {
        for (b, dst) in dst_group.chunks_exact_mut(xb).enumerate() {
            for r in 0..8 {
                let blk = &src[(8 * g + r) * rb + b * bytes..][..bytes];
                if ty == GgmlType::Q6_K {
                    interleave_q6_k_row(blk, r, dst);
                    continue;
                }
                // d, then dmin (Q4_K) or m (Q4_1): f16 fields at the front of every type's block.
                dst[2 * r..2 * r + 2].copy_from_slice(&blk[0..2]);
                if !matches!(ty, GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0) {
                    dst[16 + 2 * r..16 + 2 * r + 2].copy_from_slice(&blk[2..4]);
                }
                let (qs, regs) = match ty {
                    GgmlType::Q8_0 => {
                        let sum: i32 = blk[2..].iter().map(|&q| q as i8 as i32).sum();
                        let at = Q8_0_X8_OFFSETS + 4 * r;
                        dst[at..at + 4].copy_from_slice(&(-128 * sum).to_le_bytes());
                        (&blk[2..], &mut dst[Q8_0_X8_QS..])
                    }
                    GgmlType::Q5_0 => {
                        let qh = u32::from_le_bytes([blk[2], blk[3], blk[4], blk[5]]);
                        for i in 0..4 {
                            for e in 0..4 {
                                let bit = 4 * r + e;
                                for (half, value) in [(0, 4 * i + e), (4, 16 + 4 * i + e)] {
                                    let byte = Q5_0_X8_QH + 8 * i + half + bit / 8;
                                    dst[byte] |= (((qh >> value) & 1) as u8) << (bit % 8);
                                }
                            }
                        }
                        (&blk[6..], &mut dst[Q5_0_X8_QS..])
                    }
                    GgmlType::Q4_K => {
                        let (sc, mn) = crate::blocks::k4_scales_mins(&blk[4..16]);
                        for (j, (s, m)) in sc.to_le_bytes().into_iter().zip(mn.to_le_bytes()).enumerate() {
                            dst[Q4_K_X8_SCALES + 8 * j + r] = s;
                            dst[Q4_K_X8_MINS + 8 * j + r] = m;
                        }
                        (&blk[16..], &mut dst[Q4_K_X8_QS..])
                    }
                    _ => {
                        let has_min = ty == GgmlType::Q4_1;
                        (&blk[if has_min { 4 } else { 2 }..], &mut dst[x8_regs_offset(has_min)..])
                    }
                };
                for i in 0..qs.len() / 4 {
                    regs[32 * i + 4 * r..32 * i + 4 * r + 4].copy_from_slice(&qs[4 * i..4 * i + 4]);
                }
            }
        }
    }
    out
}

/// Writes row `r`'s Q6_K super-block `blk` (ggml's 210 bytes: 128 of low nibbles, 64 of high bit pairs, 16 scales,
/// `d`) into its place in the interleaved block column `dst` ([`Q6_K_X8_BYTES`]).
fn interleave_q6_k_row(blk: &[u8], r: usize, dst: &mut [u8]) {
    dst[2 * r..2 * r + 2].copy_from_slice(&blk[208..210]);
    for s in 0..16 {
        dst[Q6_K_X8_SCALES + 8 * s + r] = blk[192 + s];
    }
    // ggml's order: value 128n + 32m + l (n 0..2, m 0..4, l 0..32) has its low nibble in ql[64n + l + 32(m % 2)]
    // (the high nibble for m ≥ 2) and its top bits at bits 2m of qh[32n + l].
    let q = |v: usize| -> u8 {
        let (n, m, l) = (v / 128, v % 128 / 32, v % 32);
        let ql = blk[64 * n + l + 32 * (m % 2)];
        let nibble = if m < 2 { ql & 0x0F } else { ql >> 4 };
        nibble | ((blk[128 + 32 * n + l] >> (2 * m)) & 3) << 4
    };
    for s in 0..16 {
        let unit = &mut dst[Q6_K_X8_QS + 96 * s..][..96];
        for e in 0..4 {
            for h in 0..2 {
                unit[32 * h + 4 * r + e] = (q(16 * s + 8 * h + e) & 0x0F) | (q(16 * s + 8 * h + 4 + e) & 0x0F) << 4;
            }
            unit[64 + 4 * r + e] = (0..4).fold(0, |bits, k| bits | (q(16 * s + 4 * k + e) >> 4) << (2 * k));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{dequantize_row, matmul, GgmlType, MatmulScratch, QMatrix, ThreadPool};

    fn random_q5_0(blocks: usize, seed: u64) -> Vec<u8> {
        let mut s = seed;
        let mut out = Vec::new();
        for _ in 0..blocks {
            // A finite scale, then random high bits and nibbles (every q from 0 to 31 occurs).
            out.extend_from_slice(&half::f16::from_f32(0.01 + (s % 97) as f32 * 1e-3).to_le_bytes());
            for _ in 0..20 {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                out.push((s >> 33) as u8);
            }
        }
        out
    }

    #[test]
    fn q5_0_converts_to_identical_q8_0_values() {
        let src = random_q5_0(64, 3);
        let dst = q5_0_to_q8_0(&src);
        assert_eq!(dst.len(), 64 * Q8_0_BYTES);
        let (mut a, mut b) = (vec![0.0f32; 64 * QK], vec![0.0f32; 64 * QK]);
        dequantize_row(GgmlType::Q5_0, &src, &mut a);
        dequantize_row(GgmlType::Q8_0, &dst, &mut b);
        assert_eq!(a, b);
        assert!(a.iter().any(|&v| v < 0.0) && a.iter().any(|&v| v > 0.0));
    }

    #[test]
    fn converted_matrices_give_the_same_products() {
        let (rows, cols) = (48, 320);
        let src = random_q5_0(rows * cols / QK, 9);
        let dst = q5_0_to_q8_0(&src);
        let x: Vec<f32> = (0..3 * cols).map(|i| ((i * 7919) % 113) as f32 / 113.0 - 0.5).collect();
        let pool = ThreadPool::new(2);
        let mut scratch = MatmulScratch::default();
        let (mut a, mut b) = (vec![0.0; 3 * rows], vec![0.0; 3 * rows]);
        matmul(&pool, &QMatrix::new(GgmlType::Q5_0, &src, rows, cols).unwrap(), &x, 3, &mut a, &mut scratch);
        matmul(&pool, &QMatrix::new(GgmlType::Q8_0, &dst, rows, cols).unwrap(), &x, 3, &mut b, &mut scratch);
        for (p, q) in a.iter().zip(&b) {
            assert!((p - q).abs() <= 1e-4 * (1.0 + p.abs()), "{p} vs {q}");
        }
    }
}
