//! Row kernels (one tile of weight rows × up to [`TILE`] activation rows) and the runtime choice of
//! instruction set.
//!
//! The instruction set is detected once (`is_x86_feature_detected!`) and can be forced with the
//! environment variable `SPECEE_KERNEL=scalar|avx2|avx512` (a forced path the CPU lacks falls back to the
//! best available one). Each ISA module offers kernels for the types it accelerates; the rest use
//! [`scalar`].

#[cfg(target_arch = "x86_64")]
pub(crate) mod amx;
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2;
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512;
pub(crate) mod scalar;

use crate::quantize::Acts;
use gguf::GgmlType;
use std::sync::OnceLock;

/// How far ahead of the rows or blocks being read the kernels prefetch weights. The hardware prefetchers stop at
/// 4 KiB page boundaries, and a layer's matrices are small (a thread's share of SmolLM2's 576 × 576 Q4_1 is 93 KB),
/// so without it the kernels wait on memory at every page. Measured with `specee bench -p 16 -n 128 -r 2 -t 2`,
/// alternating binaries on the 2-vCPU Sapphire Rapids VM: the AVX-512 interleaved kernels decode SmolLM2 ~8% faster
/// a whole page ahead than 1 KiB ahead (medians 106.5 vs 99.9, 95.9 vs 88.9 tok/s; 2 KiB no better than 1, 8 KiB
/// the same as 4); the AVX2 kernels, which had no prefetch, 27% faster (`SPECEE_KERNEL=avx2`: 106.5 vs 83.9).
#[cfg(target_arch = "x86_64")]
pub(crate) const PREFETCH_BYTES: usize = 4096;

/// Prefetches the `len` bytes that lie [`PREFETCH_BYTES`] after `p` into L1, and those 4 × [`PREFETCH_BYTES`] after
/// it into L2 (may point past the matrix: prefetches do not fault).
///
/// The second, farther level (session 20): an L1 prefetch holds one of the core's few fill buffers until its line
/// arrives, so a page ahead alone keeps only so many lines in flight; L2 prefetches queue in the larger L2 miss
/// queue and turn the L1 prefetches into L2 hits. `kbench 2 cold` (SmolLM2 FFN matrices streamed): 1 row 16.6 →
/// 12.2 µs per matrix, 8 rows 27.5 → 24.6. `specee bench -t 2 -p 128 -n 128 -r 3`, SmolLM2, 6 alternating rounds on
/// the 2-vCPU Sapphire Rapids VM: decode 391 / 402 / 419 / 371 / 373 / 364 → 437 / 442 / 444 / 389 / 393 / 393 tok/s
/// (+5–11%); Gemma 3 270M (`-p 16`) 113.6 → 121.0 and 83.4 → 113.6. L2 prefetches alone (`_MM_HINT_T1`, 4 or 8 KiB
/// ahead) were faster in `kbench` but 2–5% slower end to end; 8 or 32 KiB for the far level measured the same as 16.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) unsafe fn prefetch_ahead(p: *const u8, len: usize) {
    let mut off = 0;
    while off < len {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
            p.wrapping_add(PREFETCH_BYTES + off) as *const i8
        );
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T1 }>(
            p.wrapping_add(4 * PREFETCH_BYTES + off) as *const i8
        );
        off += 64;
    }
}

/// Most activation rows one kernel call handles (weights are loaded once per tile).
pub(crate) const TILE: usize = 8;

/// Computes `out[r * nt + j] = dot(weight row r of w, activation row t0 + j)` for every row in `w`
/// (`w.len() / row_bytes` rows) and `j < nt <= TILE`.
pub(crate) type RowKernel = fn(w: &[u8], row_bytes: usize, acts: &Acts, t0: usize, nt: usize, out: &mut [f32]);

/// The kernel for a matrix interleaved by 8 rows ([`crate::repack`]; the head screen's by 16): `w` holds whole
/// groups of rows (`cols` elements each); computes `out[j * out_stride + r] = dot(row r of w, activation row t0 + j)` for `j < nt <=
/// TILE`. A row's result does not depend on `nt` or `t0`.
pub(crate) type GroupKernel =
    fn(w: &[u8], cols: usize, acts: &Acts, t0: usize, nt: usize, out: &mut [f32], out_stride: usize);

/// How a matrix's rows are laid out, with the kernel for it.
#[derive(Clone, Copy)]
pub(crate) enum Kernel {
    /// ggml's row-major blocks.
    Rows(RowKernel),
    /// Groups of rows interleaved block by block: 8 rows for the matmuls ([`crate::repack`]), 16 for the head
    /// screen ([`crate::screen`]). The products hand it pieces of whole groups (`ROW_CHUNK`, 16 rows).
    Groups(GroupKernel),
    /// Groups of 8 rows with two kernels giving bit-identical results: `tiles` (AMX, up to [`amx::ROWS`]
    /// activation rows a call) for products of at least [`amx::MIN_ROWS`] activation rows, `groups` below.
    #[cfg(target_arch = "x86_64")]
    Tiles { groups: GroupKernel, tiles: GroupKernel },
}

/// The kernel for weights of type `ty` in `layout` on level `isa` (falls back to scalar).
pub(crate) fn kernel_for(isa: Isa, ty: GgmlType, layout: crate::Layout) -> Option<Kernel> {
    match layout {
        crate::Layout::Rows => row_kernel(isa, ty).map(Kernel::Rows),
        crate::Layout::Interleaved8 => {
            let groups = group_kernel(isa, ty)?;
            #[cfg(target_arch = "x86_64")]
            if isa == Isa::Avx512 && amx::available() {
                if let Some(tiles) = amx::group_kernel(ty) {
                    return Some(Kernel::Tiles { groups, tiles });
                }
            }
            Some(Kernel::Groups(groups))
        }
    }
}

/// The kernel for weights of type `ty` interleaved by 8 rows (Q4_0, Q4_1, Q5_0, Q4_K, Q6_K, Q8_0; AVX2 has no
/// Q8_0 one: such matrices are interleaved only where [`crate::repack::interleave_pays`]).
pub(crate) fn group_kernel(isa: Isa, ty: GgmlType) -> Option<GroupKernel> {
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512 && Isa::Avx512.available() {
        return match ty {
            GgmlType::Q4_0 => Some(avx512::q4_x8_kernel::<false, false>()),
            GgmlType::Q4_1 => Some(avx512::q4_x8_kernel::<true, false>()),
            GgmlType::Q4_K => Some(avx512::k_x8_kernel::<false>()),
            GgmlType::Q8_0 => Some(avx512::q8_x8_kernel()),
            GgmlType::Q5_0 => Some(avx512::q4_x8_kernel::<false, true>()),
            GgmlType::Q6_K => Some(avx512::k_x8_kernel::<true>()),
            _ => None,
        };
    }
    #[cfg(target_arch = "x86_64")]
    if matches!(isa, Isa::Avx2 | Isa::Avx512) && Isa::Avx2.available() {
        return match ty {
            GgmlType::Q4_0 => Some(avx2::q4_x8_kernel::<false, false>()),
            GgmlType::Q4_1 => Some(avx2::q4_x8_kernel::<true, false>()),
            GgmlType::Q4_K => Some(avx2::k_x8_kernel::<false>()),
            GgmlType::Q8_0 => Some(scalar::q8_x8),
            GgmlType::Q5_0 => Some(avx2::q4_x8_kernel::<false, true>()),
            GgmlType::Q6_K => Some(avx2::k_x8_kernel::<true>()),
            _ => None,
        };
    }
    let _ = isa;
    match ty {
        GgmlType::Q4_0 => Some(scalar::q4_x8::<false, false>),
        GgmlType::Q4_1 => Some(scalar::q4_x8::<true, false>),
        GgmlType::Q5_0 => Some(scalar::q4_x8::<false, true>),
        GgmlType::Q4_K => Some(scalar::q4_k_x8),
        GgmlType::Q8_0 => Some(scalar::q8_x8),
        GgmlType::Q6_K => Some(scalar::q6_k_x8),
        _ => None,
    }
}

/// Calls `f::<N>` with the tile size as a constant.
macro_rules! tile {
    ($f:ident $(::<$($k:tt),+>)?, $nt:expr, $($arg:expr),*) => {
        match $nt {
            1 => $f::<$($($k,)+)? 1>($($arg),*),
            2 => $f::<$($($k,)+)? 2>($($arg),*),
            3 => $f::<$($($k,)+)? 3>($($arg),*),
            4 => $f::<$($($k,)+)? 4>($($arg),*),
            5 => $f::<$($($k,)+)? 5>($($arg),*),
            6 => $f::<$($($k,)+)? 6>($($arg),*),
            7 => $f::<$($($k,)+)? 7>($($arg),*),
            8 => $f::<$($($k,)+)? 8>($($arg),*),
            n => panic!("tile of {n} activation rows"),
        }
    };
}
pub(crate) use tile;

/// An instruction-set level with its own kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Isa {
    Scalar,
    Avx2,
    Avx512,
}

impl Isa {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512-vnni",
        }
    }

    /// Whether this CPU can run the level.
    pub(crate) fn available(self) -> bool {
        match self {
            Isa::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => {
                is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => {
                Isa::Avx2.available()
                    && is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vl")
                    && is_x86_feature_detected!("avx512vnni")
            }
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    /// The best level available (and passing [`self_check`]), or the one named by `SPECEE_KERNEL` if
    /// the CPU has it.
    fn detect() -> Isa {
        let best =
            [Isa::Avx512, Isa::Avx2].into_iter().find(|isa| isa.available() && self_check(*isa)).unwrap_or(Isa::Scalar);
        match std::env::var("SPECEE_KERNEL").ok().as_deref() {
            Some("scalar") => Isa::Scalar,
            Some("avx2") if Isa::Avx2.available() => Isa::Avx2,
            Some("avx512") if Isa::Avx512.available() => Isa::Avx512,
            _ => best,
        }
    }

    /// The level chosen for this process (detected once).
    pub(crate) fn current() -> Isa {
        static ISA: OnceLock<Isa> = OnceLock::new();
        *ISA.get_or_init(Isa::detect)
    }
}

/// A xorshift64 generator from `seed` (non-zero): the self-checks' pseudo-random weights and activations.
pub(crate) fn xorshift(mut state: u64) -> impl FnMut() -> u64 {
    move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    }
}

/// `n` rows of `cols` pseudo-random activations in [-1, 1) and their quantization to `kind` (the self-checks').
pub(crate) fn random_acts(
    kind: crate::quantize::ActKind,
    n: usize,
    cols: usize,
    next: &mut impl FnMut() -> u64,
) -> (Vec<f32>, crate::quantize::ActBuffers) {
    let x: Vec<f32> = (0..n * cols).map(|_| (next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0).collect();
    let mut buf = crate::quantize::ActBuffers::default();
    buf.reserve(kind, n, cols);
    buf.quantize_tokens(kind, &x, cols, 0..n);
    (x, buf)
}

/// Compares every kernel of `isa` with the scalar kernels on a few pseudo-random rows and tiles.
///
/// A guard for levels that cannot be tested on every development machine (the AVX-512 kernels run only
/// where the CPU has them): a level that disagrees is not chosen, and a warning is printed once.
pub(crate) fn self_check(isa: Isa) -> bool {
    use crate::quantize::act_kind;
    let types = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::BF16,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
    ];
    let mut next = xorshift(0x9e37_79b9_7f4a_7c15);
    // 8 rows, so that the interleaved kernels (groups of 8 rows) run on the same matrices.
    let (rows, cols, n_tokens) = (8, 768, 5);
    for ty in types {
        let (Some(kind), Some(fast), Some(slow)) = (act_kind(ty), row_kernel(isa, ty), scalar::kernel(ty)) else {
            continue;
        };
        let rb = cols / ty.block_size() * ty.type_size();
        let mut w: Vec<u8> = (0..rows * rb).map(|_| next() as u8).collect();
        // Small finite f16 scale fields (0x2000 ≈ 0.0078); plain float types get small values.
        let fields: &[usize] = match ty {
            GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => &[0],
            GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4_K | GgmlType::Q5_K => &[0, 2],
            GgmlType::Q6_K => &[208],
            _ => &[],
        };
        if fields.is_empty() {
            w.chunks_exact_mut(ty.type_size()).for_each(|e| *e.last_mut().unwrap_or(&mut 0) &= 0x3f);
        }
        for block in w.chunks_exact_mut(ty.type_size()) {
            for &f in fields {
                block[f..f + 2].copy_from_slice(&0x2000u16.to_le_bytes());
            }
        }
        let (x, buf) = random_acts(kind, n_tokens, cols, &mut next);
        let acts = buf.view(kind, &x, cols);
        // Both outputs row-major (`[r * n_tokens + j]`), the scalar row kernel's as the reference.
        let (mut got, mut want) = (vec![0.0f32; rows * n_tokens], vec![0.0f32; rows * n_tokens]);
        slow(&w, rb, &acts, 0, n_tokens, &mut want);
        let scale = want.iter().fold(1e-3f32, |m, v| m.max(v.abs()));
        let agrees = |got: &[f32]| got.iter().zip(&want).all(|(g, w)| (g - w).abs() <= 1e-3 * scale);
        fast(&w, rb, &acts, 0, n_tokens, &mut got);
        if !agrees(&got) {
            eprintln!("specee kernels: {} {} kernel disagrees with scalar; not using it", isa.name(), ty.name());
            return false;
        }
        if let Some(group) = group_kernel(isa, ty) {
            // Token-major output: transposed before comparing.
            let mut tokens_major = vec![0.0f32; rows * n_tokens];
            group(&crate::repack::interleave8(ty, &w, rows, cols), cols, &acts, 0, n_tokens, &mut tokens_major, rows);
            let got: Vec<f32> =
                (0..rows * n_tokens).map(|i| tokens_major[(i % n_tokens) * rows + i / n_tokens]).collect();
            if !agrees(&got) {
                let (isa, ty) = (isa.name(), ty.name());
                eprintln!("specee kernels: {isa} interleaved {ty} kernel disagrees with scalar; not using it");
                return false;
            }
        }
    }
    true
}

/// The row kernel for weights of type `ty` on level `isa` (falls back to scalar per type).
pub(crate) fn row_kernel(isa: Isa, ty: GgmlType) -> Option<RowKernel> {
    #[cfg(target_arch = "x86_64")]
    {
        let simd = match isa {
            Isa::Avx512 if isa.available() => avx512::kernel(ty),
            Isa::Avx2 if isa.available() => avx2::kernel(ty),
            _ => None,
        };
        if simd.is_some() {
            return simd;
        }
    }
    let _ = isa;
    scalar::kernel(ty)
}
