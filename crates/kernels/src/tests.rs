//! Cross-module tests: matmul against an f32 reference, every SIMD level against scalar, matmul_rows,
//! thread counts.

use crate::dequant::testutil::{random_weights, Rng};
use crate::kernel::Isa;
use crate::matmul::{matmul_isa, matmul_many_isa, matmul_rows_isa};
use crate::quantize::{act_kind, ActBuffers, ActKind};
use crate::*;

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

const TOKEN_COUNTS: [usize; 7] = [1, 2, 3, 5, 8, 13, 16];

fn random_x(n: usize, rng: &mut Rng) -> Vec<f32> {
    (0..n).map(|_| rng.f32() * if rng.byte() < 8 { 6.0 } else { 1.0 }).collect()
}

fn dequantized(ty: GgmlType, data: &[u8], rows: usize, cols: usize) -> Vec<f32> {
    let mut w = vec![0.0; rows * cols];
    dequantize_row(ty, data, &mut w);
    w
}

/// The activations as the kernels see them (dequantized), and for Q8_1 the per-block `s`.
fn dequantized_acts(ty: GgmlType, x: &[f32], n_tokens: usize, cols: usize) -> (Vec<f32>, Vec<f32>) {
    let kind = act_kind(ty).unwrap();
    let mut buf = ActBuffers::default();
    buf.reserve(kind, n_tokens, cols);
    buf.quantize_tokens(kind, x, cols, 0..n_tokens);
    let a = buf.view(kind, x, cols);
    let block = cols / a.nb;
    let values = (0..n_tokens * cols)
        .map(|i| match kind {
            ActKind::F32 | ActKind::F16 | ActKind::BF16 => a.f[i],
            _ => a.qs[i] as f32 * a.d[i / block],
        })
        .collect();
    (values, a.s[..if kind == ActKind::Q8_1 { n_tokens * a.nb } else { 0 }].to_vec())
}

/// For Q4_1/Q5_1 the block minimum `m` of each block (its term uses the activation's f16 `s`).
fn block_mins(ty: GgmlType, data: &[u8]) -> Vec<f32> {
    match ty {
        GgmlType::Q4_1 | GgmlType::Q5_1 => data.chunks_exact(ty.type_size()).map(|b| blocks::read_f16(b, 2)).collect(),
        _ => Vec::new(),
    }
}

#[test]
fn matmul_matches_reference_on_quantized_activations() {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let pool = ThreadPool::new(2);
    let mut scratch = MatmulScratch::default();
    for ty in TYPES {
        let (rows, cols) = (37, 512);
        let data = random_weights(ty, rows, cols, &mut rng);
        let w = QMatrix::new(ty, &data, rows, cols).unwrap();
        let wf = dequantized(ty, &data, rows, cols);
        let mins = block_mins(ty, &data);
        let n_tokens = 5;
        let x = random_x(n_tokens * cols, &mut rng);
        let (xq, s) = dequantized_acts(ty, &x, n_tokens, cols);
        for isa in [Isa::Scalar, Isa::Avx2, Isa::Avx512].into_iter().filter(|i| i.available()) {
            let mut out = vec![0.0; n_tokens * rows];
            matmul_isa(isa, &pool, &w, &x, n_tokens, &mut out, &mut scratch);
            for t in 0..n_tokens {
                for r in 0..rows {
                    let (mut exact, mut bound, mut loose) = (0.0f64, 0.0f64, 0.0f64);
                    for c in 0..cols {
                        let mut wv = wf[r * cols + c] as f64;
                        loose += wv * x[t * cols + c] as f64;
                        if !mins.is_empty() {
                            wv -= mins[(r * cols + c) / 32] as f64;
                        }
                        exact += wv * xq[t * cols + c] as f64;
                        bound += (wv * xq[t * cols + c] as f64).abs();
                    }
                    for b in 0..mins.len() / rows {
                        let term = mins[r * cols / 32 + b] as f64 * s[t * cols / 32 + b] as f64;
                        exact += term;
                        bound += term.abs();
                    }
                    let got = out[t * rows + r] as f64;
                    assert!(
                        (got - exact).abs() <= 2e-5 * bound + 1e-5,
                        "{ty} {isa:?} t={t} r={r}: {got} vs {exact} (bound {bound})"
                    );
                    // Against unquantized activations: within activation quantization error.
                    assert!(
                        (got - loose).abs() <= 0.02 * bound + 1e-3,
                        "{ty} {isa:?} t={t} r={r}: {got} vs f32 {loose}"
                    );
                }
            }
        }
    }
}

/// |W| · |x| per output, the scale for comparing two summation orders.
fn magnitude(wf: &[f32], x: &[f32], rows: usize, cols: usize, n_tokens: usize) -> Vec<f64> {
    let mut m = vec![0.0; n_tokens * rows];
    for t in 0..n_tokens {
        for r in 0..rows {
            m[t * rows + r] = (0..cols).map(|c| (wf[r * cols + c] as f64 * x[t * cols + c] as f64).abs()).sum::<f64>();
        }
    }
    m
}

#[test]
fn simd_levels_match_scalar_on_ragged_shapes() {
    let mut rng = Rng(0xdead_beef_1234_5678);
    let pool = ThreadPool::new(3);
    let mut scratch = MatmulScratch::default();
    let levels: Vec<Isa> = [Isa::Avx2, Isa::Avx512].into_iter().filter(|i| i.available()).collect();
    for ty in TYPES {
        let cols_options: &[usize] = if ty.block_size() == 256 { &[256, 768] } else { &[32, 96, 576] };
        for &cols in cols_options {
            for rows in [1, 7, 19, 70] {
                let data = random_weights(ty, rows, cols, &mut rng);
                let w = QMatrix::new(ty, &data, rows, cols).unwrap();
                let wf = dequantized(ty, &data, rows, cols);
                for n_tokens in TOKEN_COUNTS {
                    let x = random_x(n_tokens * cols, &mut rng);
                    let mag = magnitude(&wf, &x, rows, cols, n_tokens);
                    let mut want = vec![0.0; n_tokens * rows];
                    matmul_isa(Isa::Scalar, &pool, &w, &x, n_tokens, &mut want, &mut scratch);
                    for &isa in &levels {
                        let mut got = vec![f32::NAN; n_tokens * rows];
                        matmul_isa(isa, &pool, &w, &x, n_tokens, &mut got, &mut scratch);
                        for i in 0..got.len() {
                            assert!(
                                ((got[i] - want[i]) as f64).abs() <= 1e-5 * mag[i] + 1e-6,
                                "{ty} {isa:?} {rows}x{cols} n={n_tokens} i={i}: {} vs {}",
                                got[i],
                                want[i]
                            );
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn simd_matches_scalar_on_long_rows() {
    // Rows longer than one offset segment of the two-block kernels (64 blocks), with an odd tail.
    let mut rng = Rng(0x1357_9bdf_2468_ace0);
    let pool = ThreadPool::new(2);
    let mut scratch = MatmulScratch::default();
    let levels: Vec<Isa> = [Isa::Avx2, Isa::Avx512].into_iter().filter(|i| i.available()).collect();
    for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q5_0, GgmlType::Q5_1, GgmlType::Q8_0] {
        for cols in [32 * 131, 32 * 128] {
            let rows = 5;
            let data = random_weights(ty, rows, cols, &mut rng);
            let w = QMatrix::new(ty, &data, rows, cols).unwrap();
            let wf = dequantized(ty, &data, rows, cols);
            for n_tokens in [1, 3, 8, 9] {
                let x = random_x(n_tokens * cols, &mut rng);
                let mag = magnitude(&wf, &x, rows, cols, n_tokens);
                let mut want = vec![0.0; n_tokens * rows];
                matmul_isa(Isa::Scalar, &pool, &w, &x, n_tokens, &mut want, &mut scratch);
                for &isa in &levels {
                    let mut got = vec![f32::NAN; n_tokens * rows];
                    matmul_isa(isa, &pool, &w, &x, n_tokens, &mut got, &mut scratch);
                    for i in 0..got.len() {
                        assert!(
                            ((got[i] - want[i]) as f64).abs() <= 1e-5 * mag[i] + 1e-6,
                            "{ty} {isa:?} {rows}x{cols} n={n_tokens} i={i}: {} vs {}",
                            got[i],
                            want[i]
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn parallel_activation_quantization_equals_serial() {
    let mut rng = Rng(5);
    let pool = ThreadPool::new(3);
    for ty in [GgmlType::Q4_1, GgmlType::Q8_0, GgmlType::Q4_K, GgmlType::F16] {
        let kind = act_kind(ty).unwrap();
        let (n_tokens, cols) = (37, 768);
        let x = random_x(n_tokens * cols, &mut rng);
        let (mut a, mut b) = (ActBuffers::default(), ActBuffers::default());
        a.reserve(kind, n_tokens, cols);
        b.reserve(kind, n_tokens, cols);
        a.quantize_tokens(kind, &x, cols, 0..n_tokens);
        b.quantize_tokens_parallel(&pool, kind, &x, cols, n_tokens);
        assert_eq!(a.qs, b.qs, "{ty}");
        assert_eq!(a.qp, b.qp, "{ty}");
        assert_eq!(a.bsums, b.bsums, "{ty}");
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        for (va, vb) in [(&a.d, &b.d), (&a.s, &b.s), (&a.dp4, &b.dp4), (&a.f, &b.f)] {
            assert_eq!(bits(va), bits(vb), "{ty}");
        }
    }
}

#[test]
fn matmul_rows_equals_matmul_and_threads_agree() {
    let mut rng = Rng(42);
    let pools: Vec<ThreadPool> = (1..=3).map(ThreadPool::new).collect();
    let mut scratch = MatmulScratch::default();
    for ty in TYPES {
        let (rows, cols) = (300, 512);
        let data = random_weights(ty, rows, cols, &mut rng);
        let w = QMatrix::new(ty, &data, rows, cols).unwrap();
        for isa in [Isa::Scalar, Isa::Avx2, Isa::Avx512].into_iter().filter(|i| i.available()) {
            let n_tokens = 9;
            let x = random_x(n_tokens * cols, &mut rng);
            let mut first: Option<Vec<f32>> = None;
            for pool in &pools {
                let mut out = vec![0.0; n_tokens * rows];
                matmul_isa(isa, pool, &w, &x, n_tokens, &mut out, &mut scratch);
                match &first {
                    None => first = Some(out),
                    Some(f) => assert_eq!(f, &out, "{ty} {isa:?} threads={}", pool.n_threads()),
                }
            }
            let full = first.unwrap();
            let ids: Vec<u32> = (0..rows as u32).rev().step_by(3).collect();
            for pool in &pools {
                let mut out = vec![0.0; ids.len()];
                matmul_rows_isa(isa, pool, &w, &ids, &x[..cols], ids.len(), &mut out, &mut scratch);
                for (i, &id) in ids.iter().enumerate() {
                    assert_eq!(out[i], full[id as usize], "{ty} {isa:?} row {id}");
                }
                // Grouped: ids i use activation row i / 4 (the last group ragged).
                let per_row = 4;
                let grouped: Vec<u32> = ids.iter().take(n_tokens * per_row - 1).copied().collect();
                let mut out = vec![0.0; grouped.len()];
                matmul_rows_isa(isa, pool, &w, &grouped, &x, per_row, &mut out, &mut scratch);
                for (i, &id) in grouped.iter().enumerate() {
                    let t = i / per_row;
                    assert_eq!(out[i], full[t * rows + id as usize], "{ty} {isa:?} grouped row {id} token {t}");
                }
            }
        }
    }
}

#[test]
fn matmul_many_equals_separate_matmuls() {
    let mut rng = Rng(7);
    let pools: Vec<ThreadPool> = (1..=3).map(ThreadPool::new).collect();
    let mut scratch = MatmulScratch::default();
    for ty in [GgmlType::Q4_1, GgmlType::Q4_K, GgmlType::Q8_0, GgmlType::Q6_K, GgmlType::F16] {
        let cols = 512;
        let shapes = [576, 192, 37];
        let datas: Vec<Vec<u8>> = shapes.iter().map(|&r| random_weights(ty, r, cols, &mut rng)).collect();
        let ms: Vec<QMatrix> = datas.iter().zip(shapes).map(|(d, r)| QMatrix::new(ty, d, r, cols).unwrap()).collect();
        for isa in [Isa::Scalar, Isa::Avx2, Isa::Avx512].into_iter().filter(|i| i.available()) {
            for n_tokens in [1, 3, 9] {
                let x = random_x(n_tokens * cols, &mut rng);
                let want: Vec<Vec<f32>> = ms
                    .iter()
                    .map(|m| {
                        let mut out = vec![0.0; n_tokens * m.rows];
                        matmul_isa(isa, &pools[0], m, &x, n_tokens, &mut out, &mut scratch);
                        out
                    })
                    .collect();
                for pool in &pools {
                    let mut outs: Vec<Vec<f32>> = ms.iter().map(|m| vec![f32::NAN; n_tokens * m.rows]).collect();
                    let mut pairs: Vec<(&QMatrix, &mut [f32])> =
                        ms.iter().zip(outs.iter_mut()).map(|(m, o)| (m, &mut o[..])).collect();
                    matmul_many_isa(isa, pool, &mut pairs, &x, n_tokens, &mut scratch, None);
                    assert_eq!(outs, want, "{ty} {isa:?} n={n_tokens} threads={}", pool.n_threads());
                }
            }
        }
    }
}

/// The step fused into a pair's product sees exactly the matching rows of both outputs, once per token and row:
/// the result equals the two products followed by the step over whole outputs, on the serial path (few rows)
/// and the parallel one, for every thread count.
#[test]
fn matmul_pair_then_equals_the_products_then_the_step() {
    let mut rng = Rng(9);
    let pools: Vec<ThreadPool> = (1..=3).map(ThreadPool::new).collect();
    let mut scratch = MatmulScratch::default();
    let step = |a: &mut [f32], b: &[f32]| a.iter_mut().zip(b).for_each(|(a, &b)| *a = *a * 2.0 - b * b);
    for (ty, rows) in [(GgmlType::Q4_1, 1536), (GgmlType::Q8_0, 40), (GgmlType::Q8_0, 8), (GgmlType::Q4_K, 1000)] {
        let cols = 512;
        let (da, db) = (random_weights(ty, rows, cols, &mut rng), random_weights(ty, rows, cols, &mut rng));
        let (wa, wb) = (QMatrix::new(ty, &da, rows, cols).unwrap(), QMatrix::new(ty, &db, rows, cols).unwrap());
        for n_tokens in [1, 3, 9] {
            let x = random_x(n_tokens * cols, &mut rng);
            let (mut want_a, mut want_b) = (vec![0.0; n_tokens * rows], vec![0.0; n_tokens * rows]);
            matmul(&pools[0], &wa, &x, n_tokens, &mut want_a, &mut scratch);
            matmul(&pools[0], &wb, &x, n_tokens, &mut want_b, &mut scratch);
            step(&mut want_a, &want_b);
            // A second matrix of another type takes the separate products.
            let dc = random_weights(GgmlType::F16, rows, cols, &mut rng);
            let wc = QMatrix::new(GgmlType::F16, &dc, rows, cols).unwrap();
            let mut want_c = vec![0.0; n_tokens * rows];
            matmul(&pools[0], &wc, &x, n_tokens, &mut want_c, &mut scratch);
            let mut want_ac = vec![0.0; n_tokens * rows];
            matmul(&pools[0], &wa, &x, n_tokens, &mut want_ac, &mut scratch);
            step(&mut want_ac, &want_c);
            for pool in &pools {
                let (mut a, mut b) = (vec![f32::NAN; n_tokens * rows], vec![f32::NAN; n_tokens * rows]);
                crate::matmul_pair_then(pool, &wa, &wb, &x, n_tokens, &mut a, &mut b, &mut scratch, &step);
                assert_eq!(a, want_a, "{ty} rows={rows} n={n_tokens} threads={}", pool.n_threads());
                assert_eq!(b, want_b);
                let (mut a, mut c) = (vec![f32::NAN; n_tokens * rows], vec![f32::NAN; n_tokens * rows]);
                crate::matmul_pair_then(pool, &wa, &wc, &x, n_tokens, &mut a, &mut c, &mut scratch, &step);
                assert_eq!((a, c), (want_ac.clone(), want_c.clone()), "{ty} with F16, threads={}", pool.n_threads());
            }
        }
    }
}

#[test]
fn qmatrix_validates_shapes() {
    let data = vec![0u8; 2 * 18];
    assert!(QMatrix::new(GgmlType::Q4_0, &data, 1, 64).is_ok());
    assert!(matches!(QMatrix::new(GgmlType::Q4_0, &data, 2, 64), Err(KernelError::BadShape { .. })));
    assert!(matches!(QMatrix::new(GgmlType::Q4_0, &data, 1, 48), Err(KernelError::BadShape { .. })));
    assert!(matches!(QMatrix::new(GgmlType::IQ2_XXS, &data, 1, 256), Err(KernelError::UnsupportedType("IQ2_XXS"))));
    assert_eq!(QMatrix::new(GgmlType::Q4_0, &data, 1, 64).unwrap().row_bytes(), 36);
}

#[test]
fn available_levels_pass_self_check() {
    for isa in [Isa::Avx2, Isa::Avx512].into_iter().filter(|i| i.available()) {
        assert!(crate::kernel::self_check(isa), "{isa:?}");
    }
    assert!(crate::kernel::self_check(Isa::Scalar));
    eprintln!("detected: {}", detected_isa());
}

#[test]
fn every_row_is_bit_identical_whatever_the_token_count() {
    // The tree speculative decoder needs a row's result to be exactly the same alone or in a batch of any
    // size (tiles of 1..8 rows, several tiles), on every level; shapes with several offset segments and
    // an odd last block included.
    let mut rng = Rng(0x0bad_cafe_f00d_1234);
    let pool = ThreadPool::new(2);
    let mut scratch = MatmulScratch::default();
    for ty in TYPES {
        let cols_options: &[usize] = if ty.block_size() == 256 { &[256, 768] } else { &[96, 608, 4160, 4192] };
        for &cols in cols_options {
            let rows = 21;
            let data = random_weights(ty, rows, cols, &mut rng);
            let w = QMatrix::new(ty, &data, rows, cols).unwrap();
            let x = random_x(17 * cols, &mut rng);
            for isa in [Isa::Scalar, Isa::Avx2, Isa::Avx512].into_iter().filter(|i| i.available()) {
                let alone: Vec<Vec<f32>> = (0..17)
                    .map(|t| {
                        let mut out = vec![0.0; rows];
                        matmul_isa(isa, &pool, &w, &x[t * cols..(t + 1) * cols], 1, &mut out, &mut scratch);
                        out
                    })
                    .collect();
                for n_tokens in [2, 3, 7, 8, 9, 16, 17] {
                    let mut out = vec![f32::NAN; n_tokens * rows];
                    matmul_isa(isa, &pool, &w, &x[..n_tokens * cols], n_tokens, &mut out, &mut scratch);
                    for t in 0..n_tokens {
                        let got: Vec<u32> = out[t * rows..(t + 1) * rows].iter().map(|v| v.to_bits()).collect();
                        let want: Vec<u32> = alone[t].iter().map(|v| v.to_bits()).collect();
                        assert_eq!(got, want, "{ty} {isa:?} cols={cols} n={n_tokens} token {t}");
                    }
                }
            }
        }
    }
}

/// Q4_0/Q4_1/Q5_0/Q4_K/Q6_K/Q8_0 interleaved by 8 rows give the plain layout's products on every level (up to float
/// summation order), for ragged shapes and every tile size, and a row's result does not depend on how many
/// activation rows share the call.
#[test]
fn interleaved_matrices_match_the_row_layout() {
    let mut rng = Rng(0x51_7cc1_b727_220a);
    let pool = ThreadPool::new(2);
    let mut scratch = MatmulScratch::default();
    let legacy = [(8, 32), (24, 96), (40, 64), (200, 576), (48, 1536), (16, 2304)];
    let k_shapes = [(8, 256), (24, 512), (48, 1536)];
    let cases = [
        (GgmlType::Q4_0, &legacy[..]),
        (GgmlType::Q4_1, &legacy[..]),
        (GgmlType::Q5_0, &legacy[..]),
        (GgmlType::Q4_K, &k_shapes[..]),
        (GgmlType::Q6_K, &k_shapes[..]),
        (GgmlType::Q8_0, &legacy[..]),
    ];
    for (ty, shapes) in cases {
        for &(rows, cols) in shapes {
            let data = random_weights(ty, rows, cols, &mut rng);
            let plain = QMatrix::new(ty, &data, rows, cols).unwrap();
            let packed_data = repack::interleave8(ty, &data, rows, cols);
            let extra = match ty {
                GgmlType::Q4_K => 32 * rows / 8 * cols / 256,
                GgmlType::Q8_0 => 32 * rows / 8 * cols / 32,
                _ => 0,
            };
            assert_eq!(packed_data.len(), data.len() + extra);
            let packed = QMatrix::interleaved8(ty, &packed_data, rows, cols).unwrap();
            let wf = dequantized(ty, &data, rows, cols);
            let n_max = 16;
            let x = random_x(n_max * cols, &mut rng);
            let mag = magnitude(&wf, &x, rows, cols, n_max);
            let mut want = vec![0.0; n_max * rows];
            matmul_isa(Isa::Scalar, &pool, &plain, &x, n_max, &mut want, &mut scratch);
            for isa in [Isa::Scalar, Isa::Avx2, Isa::Avx512].into_iter().filter(|i| i.available()) {
                let mut single = vec![0.0; n_max * rows];
                for t in 0..n_max {
                    matmul_isa(isa, &pool, &packed, &x[t * cols..], 1, &mut single[t * rows..], &mut scratch);
                }
                for n in TOKEN_COUNTS {
                    let mut got = vec![0.0; n * rows];
                    matmul_isa(isa, &pool, &packed, &x, n, &mut got, &mut scratch);
                    for i in 0..n * rows {
                        assert!(
                            (got[i] - want[i]).abs() as f64 <= 1e-5 * mag[i] + 1e-6,
                            "{ty} {rows}x{cols} {isa:?} n={n} i={i}: {} vs {}",
                            got[i],
                            want[i]
                        );
                        assert_eq!(got[i].to_bits(), single[i].to_bits(), "{ty} {rows}x{cols} {isa:?} n={n} i={i}");
                    }
                }
            }
        }
    }
}

#[test]
fn interleaved_matrices_refuse_other_types_and_ragged_rows() {
    let q4_1 = vec![0u8; 12 * 20];
    assert!(QMatrix::interleaved8(GgmlType::Q4_1, &q4_1, 12, 32).is_err());
    assert!(QMatrix::interleaved8(GgmlType::Q4_1, &q4_1[..8 * 20], 8, 32).is_ok());
    assert!(QMatrix::interleaved8(GgmlType::Q4_0, &q4_1[..8 * 18], 8, 32).is_ok());
    // Q4_K: 1184 bytes per 8 rows and super-block, not the file's 8 × 144.
    let q4_k = vec![0u8; 1184];
    assert!(QMatrix::interleaved8(GgmlType::Q4_K, &q4_k, 8, 256).is_ok());
    assert!(QMatrix::interleaved8(GgmlType::Q4_K, &q4_k[..8 * 144], 8, 256).is_err());
    assert_eq!(QMatrix::interleaved8(GgmlType::Q4_K, &q4_k, 8, 256).unwrap().row_bytes(), 148);
    // Q8_0: 304 bytes per 8 rows and block (the offsets added), not the file's 8 × 34.
    let q8_0 = vec![0u8; 304];
    assert!(QMatrix::interleaved8(GgmlType::Q8_0, &q8_0[..8 * 34], 8, 32).is_err());
    assert_eq!(QMatrix::interleaved8(GgmlType::Q8_0, &q8_0, 8, 32).unwrap().row_bytes(), 38);
    // Q5_0: the file's 8 × 22 bytes per 8 rows and block (the fifth bits rearranged, not widened).
    let q5_0 = vec![0u8; 176];
    assert_eq!(QMatrix::interleaved8(GgmlType::Q5_0, &q5_0, 8, 32).unwrap().row_bytes(), 22);
    assert!(QMatrix::interleaved8(GgmlType::Q5_0, &q5_0[..170], 8, 32).is_err());
    // Q6_K: the file's 8 × 210 bytes per 8 rows and super-block; Q5_K is not interleaved.
    let q6_k = vec![0u8; 8 * 210];
    assert_eq!(QMatrix::interleaved8(GgmlType::Q6_K, &q6_k, 8, 256).unwrap().row_bytes(), 210);
    assert!(QMatrix::interleaved8(GgmlType::Q6_K, &q6_k[..8 * 208], 8, 256).is_err());
    assert!(QMatrix::interleaved8(GgmlType::Q5_K, &q6_k[..8 * 176], 8, 256).is_err());
}

/// The interleaved kernels write exactly the outputs they own: with an odd number of groups (the last one goes
/// through the two-group kernel alone), nothing after `(nt - 1) * stride + rows` changes, nor the gaps between
/// the token rows of a wider output.
#[test]
fn interleaved_kernels_write_only_their_outputs() {
    let mut rng = Rng(0x0dd_6a05_0075);
    for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q5_0, GgmlType::Q4_K, GgmlType::Q6_K, GgmlType::Q8_0] {
        let cols = if matches!(ty, GgmlType::Q4_K | GgmlType::Q6_K) { 256 } else { 64 };
        for rows in [8, 24] {
            let data = repack::interleave8(ty, &random_weights(ty, rows, cols, &mut rng), rows, cols);
            let kind = act_kind(ty).unwrap();
            for isa in [Isa::Scalar, Isa::Avx2, Isa::Avx512].into_iter().filter(|i| i.available()) {
                let Some(group) = kernel::group_kernel(isa, ty) else {
                    continue;
                };
                // (kernel, most activation rows a call): the AMX tile kernel too where the CPU can run it.
                let mut groups = vec![(group, kernel::TILE)];
                #[cfg(target_arch = "x86_64")]
                if isa == Isa::Avx512 && kernel::amx::hardware() {
                    groups.extend(kernel::amx::group_kernel(ty).map(|g| (g, kernel::amx::ROWS)));
                }
                let calls = groups.into_iter().flat_map(|(g, most)| [1, 3, 8, 16].map(|nt| (g, nt, most)));
                for (group, nt, _) in calls.filter(|&(_, nt, most)| nt <= most) {
                    let x = random_x(nt * cols, &mut rng);
                    let mut buf = ActBuffers::default();
                    buf.reserve(kind, nt, cols);
                    buf.quantize_tokens(kind, &x, cols, 0..nt);
                    let acts = buf.view(kind, &x, cols);
                    let stride = rows + 5;
                    let mut out = vec![f32::MAX; (nt - 1) * stride + rows + 16];
                    let len = (nt - 1) * stride + rows;
                    group(&data, cols, &acts, 0, nt, &mut out[..len], stride);
                    for (i, v) in out.iter().enumerate() {
                        let owned = i < len && i % stride < rows;
                        assert_eq!(*v == f32::MAX, !owned, "{ty} {isa:?} rows {rows} nt {nt}: element {i} = {v}");
                    }
                }
            }
        }
    }
}

/// The AMX tile kernels (the matmuls' opt-in, `SPECEE_AMX=1`; the head screen's on by default) give the VNNI
/// kernels' results bit for bit through the product's dispatch (tiles of 16 activation rows, a remainder below
/// `MIN_ROWS` on VNNI), with an odd last group, for every token count up to 40. Runs only where the CPU and OS can
/// run AMX.
#[cfg(target_arch = "x86_64")]
#[test]
fn amx_tiles_equal_the_vnni_kernels_bit_for_bit() {
    use crate::kernel::{amx, group_kernel, Kernel};
    use crate::matmul::{product, RawRows};
    if !amx::hardware() {
        eprintln!("no AMX here: skipped");
        return;
    }
    let mut rng = Rng(0x0a3c_5e11_7a9e_0001);
    let pool = ThreadPool::new(2);
    let mut scratch = MatmulScratch::default();
    // Both dispatches over `w` (`rows` × `cols`) for every token count, bit for bit.
    let mut same_bits = |(groups, tiles), kind, w: RawRows, cols: usize, what: &str, rng: &mut Rng| {
        let rows = w.rows;
        let x = random_x(40 * cols, rng);
        for n in [1, 4, 9, 10, 11, 16, 17, 25, 26, 40] {
            let (mut got, mut want) = (vec![f32::NAN; n * rows], vec![f32::NAN; n * rows]);
            let both = Kernel::Tiles { groups, tiles };
            product(&pool, both, kind, w, &x[..n * cols], cols, n, &mut got, &mut scratch);
            product(&pool, Kernel::Groups(groups), kind, w, &x[..n * cols], cols, n, &mut want, &mut scratch);
            for i in 0..n * rows {
                assert_eq!(got[i].to_bits(), want[i].to_bits(), "{what} {rows}x{cols} n={n} i={i}");
            }
        }
    };
    for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0] {
        let kind = act_kind(ty).unwrap();
        let kernels = (group_kernel(Isa::Avx512, ty).unwrap(), amx::group_kernel(ty).unwrap());
        for (rows, cols) in [(8, 32), (24, 96), (40, 64), (200, 576), (48, 1536)] {
            let data = repack::interleave8(ty, &random_weights(ty, rows, cols, &mut rng), rows, cols);
            let w = RawRows { data: &data, rows, row_bytes: data.len() / rows };
            same_bits(kernels, kind, w, cols, ty.name(), &mut rng);
        }
    }
    // The head screen's tile kernel (on by default where AMX runs: its self-check passes).
    assert!(amx::screen_available() || std::env::var("SPECEE_AMX").is_ok_and(|v| v == "0"), "screen self-check");
    let kernels = (crate::kernel::avx512::screen6_kernel(), amx::screen_kernel());
    for (rows, cols) in [(16, 32), (48, 96), (160, 640)] {
        let data = amx::random_screen_groups(rows / crate::screen::GROUP, cols, &mut || rng.next_u64());
        let w = RawRows { data: &data, rows, row_bytes: data.len() / rows };
        same_bits(kernels, ActKind::Q8_0, w, cols, "screen", &mut rng);
    }
}
