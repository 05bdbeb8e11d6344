//! AMX tile kernels (Intel Advanced Matrix Extensions, Sapphire Rapids and later) for products with several
//! activation rows: the interleaved Q4_0, Q4_1 and Q8_0 matrices ([`crate::repack::interleave8`]) and the head
//! screen's 6-bit groups ([`crate::screen`]).
//!
//! One `tdpbsud`/`tdpbssd` multiplies a tile of up to 16 activation rows × 32 values (signed bytes) by 32 values
//! of 16 weight rows, giving the 16 × 16 block sums a VNNI kernel builds from 8 `vpdpbusd` per activation row.
//! The block's scale is applied per block, so every block goes through its own tile product and the sums are
//! stored (`tilestored`) and scaled in AVX-512 registers with exactly the float operations of the VNNI kernels
//! ([`super::avx512`]): the integers are the same (exact sums), so every output is **bit-identical** to the VNNI
//! kernel's, whatever the number of activation rows. That keeps batch invariance (a row's result does not depend
//! on the rows beside it) across the switch between the two at [`MIN_ROWS`].
//!
//! Operand layout: the tile's A operand is the activations as they are quantized (row `m` = the block's 32 signed
//! values of activation row `m`, loaded with the row stride, no copy); the B operand ("VNNI order", 4 consecutive
//! values of 16 weight rows per 64-byte tile row) is exactly what two interleaved groups' registers hold side by
//! side: tile row `i` is register `i` of both groups ([`super::avx512::pair_reg`]), for Q4 split into its low
//! nibbles (values `4i..4i+4`, tile rows 0..4) and high nibbles (values `16+4i..`, tile rows 4..8), so the
//! values come in their natural order and the activations need no reordering. Unsigned nibbles use `tdpbsud`
//! (signed A × unsigned B), Q8_0 `tdpbssd`; neither needs the `+128` offset of the VNNI kernels. The screen's
//! value register `j` is tile row `j` too; its stored `q + 32` are unpacked as signed `q` (`tdpbssd`), whose sum
//! is the VNNI screen kernel's `-32·Σy + Σ(q + 32)·y`.
//!
//! Two blocks are in flight at a time (tiles 0–2 and 3–5): the product of block b + 1 runs while block b is
//! scaled. Used where the CPU has AMX-INT8, Linux grants the tile state (`arch_prctl(ARCH_REQ_XCOMP_PERM)`) and
//! the kernels agree bit for bit with the VNNI ones on a self-check: the head screen's by default (`SPECEE_AMX=0`
//! turns it off), the matmuls' only with `SPECEE_AMX=1`.
//!
//! **The head screen's tiles pay from ~10 rows** (session 60, same VM): the screen is the largest product of a
//! batched greedy step (Gemma 3 270M: 262,144 × 640), a tile block's fixed cost (~30 ns a block of 16 weight rows,
//! whatever the activation rows) is below 16 rows' 128 `vpdpbusd`, and its signed values need no offset term
//! (the Q4 matmuls' second FMA per block). Measured with `batchbench` (numbers in `screen.rs`); with
//! `HEADBENCH_ROWS=N SPECEE_AMX=0|1 headbench MODEL 2` (the screened argmax alone, Gemma) at 4 and 8 rows the
//! tiles took 5.4 / 6.2 ms against VNNI's 3.5 / 5.7 (`MIN_ROWS` lowered to 4 for that run).
//!
//! **The matmuls' tiles are opt-in, because they do not pay end to end here** (session 55, 2-vCPU Emerald Rapids VM):
//! - `bench/amx_tile_probe.c`: the tile instructions of one block cost ~25 ns (sum store 8.5–9, product 7.5–7.8,
//!   activation load 5.1) whatever the number of activation rows, and the per-block float scaling, which the
//!   VNNI kernels do too (`acc += f32(sum)·(d_w·d_x) + m_w·s_x`: 4 vector operations per activation row and 16
//!   outputs), stays; together 29.5–32 ns a block of 16 rows (48.5–49.5 with the sums stored right after the
//!   product: later loads wait for a tile store). VNNI's 8 `vpdpbusd` per activation row cost less below ~8 rows.
//! - `SPECEE_AMX=1|0 cargo run --release -p kernels --example kbench -- 1 Q4_1_1536` (one thread, weights in
//!   cache, 3 alternating runs; n16 time over n1): Q4_1 1536 × 576 6.4–7.6× with tiles vs 8.3–8.5× VNNI; `Q8_0_2048`:
//!   4.2–4.4× vs 6.3–6.6×; n8 unchanged (below [`MIN_ROWS`]).
//! - End to end the difference is under this VM's noise: SmolLM2 `specee bench -p 128 -n 0 -r 5` alternating
//!   (prefill, tiles of 16 rows) 894 / 902 / 1154 / 930 vs 956 / 947 / 1300 / 1325 tok/s without, then within
//!   ±10% either way; `kprof` 128 rows 164 / 166 / 174 vs 169 / 165 / 157 ms. The matmul is about half of a
//!   multi-row forward and the tiles take a quarter off it at 16 rows.

use super::avx512::{pair_f16, pair_reg, screen_values, store_pair_rows};
use super::{prefetch_ahead, GroupKernel};
use crate::quantize::Acts;
use std::arch::asm;
use std::arch::x86_64::*;
use std::sync::OnceLock;

/// Most activation rows one kernel call handles: the rows of one tile.
pub(crate) const ROWS: usize = 16;

/// From this many activation rows a call uses the tiles; below, the VNNI kernels (at 8 rows the two measured the
/// same; at 4 the tiles took 1.7× as long).
pub(crate) const MIN_ROWS: usize = 10;

/// Whether the matmuls' AMX kernels are used in this process (checked once): only where asked for with `SPECEE_AMX=1`
/// (measured no faster end to end on the 2-vCPU Emerald Rapids VM, see the module header), the CPU can run them
/// ([`hardware`]) and they agree with the VNNI kernels.
pub(crate) fn available() -> bool {
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(|| {
        if !std::env::var("SPECEE_AMX").is_ok_and(|v| v == "1") || !hardware() {
            return false;
        }
        let ok = self_check();
        if !ok {
            eprintln!("specee kernels: the AMX kernels disagree with the VNNI ones; not using them");
        }
        ok
    })
}

/// Whether the head screen ([`crate::screen`]) uses its tile kernel for products of at least [`MIN_ROWS`]
/// activation rows (checked once): by default where the CPU can run it ([`hardware`]) and it agrees bit for bit
/// with the VNNI screen kernel; `SPECEE_AMX=0` turns it off.
pub(crate) fn screen_available() -> bool {
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(|| {
        if std::env::var("SPECEE_AMX").is_ok_and(|v| v == "0") || !hardware() {
            return false;
        }
        let ok = screen_self_check();
        if !ok {
            eprintln!("specee kernels: the AMX head screen disagrees with the VNNI one; not using it");
        }
        ok
    })
}

/// Whether this CPU and OS can run the tile kernels (checked once): AVX-512 VNNI, AMX-TILE and AMX-INT8, and Linux
/// grants the tile state.
pub(crate) fn hardware() -> bool {
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(|| {
        if !super::Isa::Avx512.available() {
            return false;
        }
        let leaf = __cpuid_count(7, 0);
        let (tile, int8) = ((leaf.edx >> 24) & 1 == 1, (leaf.edx >> 25) & 1 == 1);
        tile && int8 && request_tile_state()
    })
}

/// Asks Linux for the AMX tile data state (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`): without it the
/// first tile instruction kills the process. The permission covers every thread of the process.
#[cfg(target_os = "linux")]
fn request_tile_state() -> bool {
    const SYS_ARCH_PRCTL: i64 = 158;
    const ARCH_REQ_XCOMP_PERM: i64 = 0x1023;
    const XFEATURE_XTILEDATA: i64 = 18;
    let ret: i64;
    // SAFETY: a plain system call; it only changes which register states the process may use.
    unsafe {
        asm!("syscall", inlateout("rax") SYS_ARCH_PRCTL => ret, in("rdi") ARCH_REQ_XCOMP_PERM,
             in("rsi") XFEATURE_XTILEDATA, lateout("rcx") _, lateout("r11") _, options(nostack));
    }
    ret == 0
}

#[cfg(not(target_os = "linux"))]
fn request_tile_state() -> bool {
    false
}

/// The tile configuration (`ldtilecfg`'s 64-byte operand) for `m` activation rows: tiles 0 and 3 hold block sums
/// (`m` × 16 i32), 1 and 4 activations (`m` × 32 bytes), 2 and 5 weights (8 × 64 bytes).
#[repr(C, align(64))]
struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    colsb: [u16; 16],
    rows: [u8; 16],
    reserved2: [u8; 16],
}

impl TileConfig {
    fn new(m: usize) -> TileConfig {
        assert!((1..=ROWS).contains(&m));
        let mut c = TileConfig {
            palette: 1,
            start_row: 0,
            reserved: [0; 14],
            colsb: [0; 16],
            rows: [0; 16],
            reserved2: [0; 16],
        };
        for base in [0, 3] {
            (c.colsb[base], c.rows[base]) = (64, m as u8);
            (c.colsb[base + 1], c.rows[base + 1]) = (32, m as u8);
            (c.colsb[base + 2], c.rows[base + 2]) = (64, 8);
        }
        c
    }
}

/// Scratch of one call: the two blocks' weight tiles and block sums (64-byte aligned).
#[repr(C, align(64))]
struct Scratch {
    weights: [[u8; 512]; 2],
    sums: [[i32; ROWS * 16]; 2],
}

/// Weight types with a tile kernel.
const Q4_0: u8 = 0;
const Q4_1: u8 = 1;
const Q8_0: u8 = 2;
/// The head screen's 6-bit groups of 16 rows ([`crate::screen`]).
const SCREEN: u8 = 3;

/// The tile kernel for interleaved `ty`, if there is one (call only after [`hardware`]). Handles up to [`ROWS`]
/// activation rows per call, with the [`GroupKernel`] contract.
pub(crate) fn group_kernel(ty: gguf::GgmlType) -> Option<GroupKernel> {
    // SAFETY (all closures): handed out only after `hardware()`, so the CPU has AVX-512 (F, BW, VL, VNNI), FMA,
    // F16C and AMX-INT8 with the tile state granted; `legacy` checks the shapes it reads.
    Some(match ty {
        gguf::GgmlType::Q4_0 => {
            |w, cols, a, t0, nt, o, stride| unsafe { legacy::<Q4_0>(w, cols, a, t0, nt, o, stride) }
        }
        gguf::GgmlType::Q4_1 => {
            |w, cols, a, t0, nt, o, stride| unsafe { legacy::<Q4_1>(w, cols, a, t0, nt, o, stride) }
        }
        gguf::GgmlType::Q8_0 => {
            |w, cols, a, t0, nt, o, stride| unsafe { legacy::<Q8_0>(w, cols, a, t0, nt, o, stride) }
        }
        _ => return None,
    })
}

/// Calls `f::<K, G>` with the number of activation rows (1..=16) as a constant, so the accumulators stay in
/// registers.
macro_rules! rows16 {
    ($f:ident::<$k:tt>, $nt:expr, $($arg:expr),*) => {
        match $nt {
            1 => $f::<$k, 1>($($arg),*),
            2 => $f::<$k, 2>($($arg),*),
            3 => $f::<$k, 3>($($arg),*),
            4 => $f::<$k, 4>($($arg),*),
            5 => $f::<$k, 5>($($arg),*),
            6 => $f::<$k, 6>($($arg),*),
            7 => $f::<$k, 7>($($arg),*),
            8 => $f::<$k, 8>($($arg),*),
            9 => $f::<$k, 9>($($arg),*),
            10 => $f::<$k, 10>($($arg),*),
            11 => $f::<$k, 11>($($arg),*),
            12 => $f::<$k, 12>($($arg),*),
            13 => $f::<$k, 13>($($arg),*),
            14 => $f::<$k, 14>($($arg),*),
            15 => $f::<$k, 15>($($arg),*),
            16 => $f::<$k, 16>($($arg),*),
            n => panic!("tile of {n} activation rows"),
        }
    };
}

/// Interleaved Q4_0/Q4_1/Q8_0 weights (`K`) × activation rows `t0..t0+nt` (`nt <= 16`), written to
/// `out[j * stride + r]`, as the VNNI group kernels.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
unsafe fn legacy<const K: u8>(w: &[u8], cols: usize, a: &Acts, t0: usize, nt: usize, out: &mut [f32], stride: usize) {
    let nb = cols / 32;
    assert!(a.nb == nb && a.cols == cols && (1..=ROWS).contains(&nt));
    assert!(a.qs.len() >= (t0 + nt) * cols && a.d.len() >= (t0 + nt) * nb);
    assert!(K == Q8_0 || a.s.len() >= (t0 + nt) * nb);
    let group_bytes = nb * block_bytes(K);
    let groups = w.len() / group_bytes;
    assert!(w.len() % group_bytes == 0 && out.len() >= (nt - 1) * stride + 8 * groups);
    configure(nt);
    // Not zeroed (a 3 KiB memset per call measured 10% of a SmolLM2 prefill): every byte is written (the weights
    // by `unpack`, the sums by `store`) before it is read.
    let mut scratch = std::mem::MaybeUninit::<Scratch>::uninit();
    // SAFETY: see above; `Scratch` is plain integers.
    let scratch = unsafe { scratch.assume_init_mut() };
    for g in (0..groups).step_by(2) {
        let grp = w.as_ptr().add(g * group_bytes);
        let second = if g + 1 < groups { group_bytes } else { 0 };
        rows16!(pair::<K>, nt, grp, second, a, t0, out.as_mut_ptr().add(8 * g), stride, scratch);
    }
}

/// The head screen's groups of 16 interleaved 6-bit rows ([`crate::screen`]) × activation rows `t0..t0+nt`
/// (`nt <= 16`), written to `out[j * stride + r]`, bit for bit as the VNNI screen kernel
/// ([`super::avx512::screen6_kernel`]): the same integer block sums (from the tiles), the same float operations.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
unsafe fn screen(w: &[u8], cols: usize, a: &Acts, t0: usize, nt: usize, out: &mut [f32], stride: usize) {
    use crate::screen::{BLOCK_BYTES, GROUP};
    let nb = cols / 32;
    let gb = nb * BLOCK_BYTES;
    assert!(a.nb == nb && a.cols == cols && nb * 32 == cols && (1..=ROWS).contains(&nt) && w.len() % gb == 0);
    assert!(a.qs.len() >= (t0 + nt) * cols && a.d.len() >= (t0 + nt) * nb && a.zb.len() >= (t0 + nt) * nb);
    let groups = w.len() / gb;
    assert!(out.len() >= (nt - 1) * stride + GROUP * groups);
    configure(nt);
    let mut scratch = std::mem::MaybeUninit::<Scratch>::uninit();
    // SAFETY: as in `legacy`: every byte is written before it is read.
    let scratch = unsafe { scratch.assume_init_mut() };
    for g in 0..groups {
        let grp = w.as_ptr().add(g * gb);
        rows16!(pair::<SCREEN>, nt, grp, 0, a, t0, out.as_mut_ptr().add(GROUP * g), stride, scratch);
    }
}

/// The tile kernel of the head screen (call only after [`hardware`]), with the [`GroupKernel`] contract.
pub(crate) fn screen_kernel() -> GroupKernel {
    // SAFETY: handed out only after `hardware()` (see `group_kernel`); `screen` checks the shapes.
    |w, cols, a, t0, nt, o, stride| unsafe { screen(w, cols, a, t0, nt, o, stride) }
}

thread_local! {
    /// The activation rows the tiles of this thread are configured for (0: not configured).
    static CONFIGURED: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Configures this thread's tiles for `m` activation rows unless they already are (`ldtilecfg` with
/// `tilerelease` costs ~80 ns: once per product and thread, not per call).
fn configure(m: usize) {
    CONFIGURED.with(|c| {
        if c.get() != m {
            let config = TileConfig::new(m);
            // SAFETY: only reached from the kernels, after `hardware()` (the tile state is granted).
            unsafe { asm!("ldtilecfg [{}]", in(reg) &config, options(nostack, readonly)) };
            c.set(m);
        }
    });
}

/// Gives back this thread's tile state if a kernel configured it (after a product: an idle thread holding tiles
/// makes every context switch save 8 KiB).
pub(crate) fn release() {
    CONFIGURED.with(|c| {
        if c.get() != 0 {
            // SAFETY: the tiles are configured, so the CPU has AMX.
            unsafe { asm!("tilerelease", options(nostack, nomem)) };
            c.set(0);
        }
    });
}

const fn block_bytes(k: u8) -> usize {
    match k {
        Q4_0 => crate::repack::x8_legacy_bytes(false),
        Q4_1 => crate::repack::x8_legacy_bytes(true),
        SCREEN => crate::screen::BLOCK_BYTES,
        _ => crate::repack::Q8_0_X8_BYTES,
    }
}

/// Two groups of 8 interleaved rows (`grp`, `grp + second`; `second == 0` for a lone last group, read twice and
/// written once) × activation rows `t..t+G`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
#[inline]
unsafe fn pair<const K: u8, const G: usize>(
    grp: *const u8,
    second: usize,
    a: &Acts,
    t: usize,
    out: *mut f32,
    stride: usize,
    scratch: &mut Scratch,
) {
    let nb = a.nb;
    let xb = block_bytes(K);
    // A screen group is 16 rows in one block column: its two "groups" are the same pointer.
    let blocks = |b: usize| {
        if K == SCREEN {
            (grp.add(b * xb), grp.add(b * xb))
        } else {
            (grp.add(b * xb), grp.add(second + b * xb))
        }
    };
    let mut acc = [_mm512_setzero_ps(); G];
    // Software-pipelined: the tile product of block b + 1 runs while block b is scaled, and its sums are stored
    // only after block b's were loaded (loads do not pass an older tile store: stored first, the scaling waited
    // for the product every block, 41 vs 25 ns a block at 4 rows in a C probe); the weight tile of block b + 2 is
    // written a whole step before it is loaded (a tile load right after stores to it waits for them to drain).
    unpack::<K>(blocks(0), &mut scratch.weights[0]);
    compute::<K, 0>(a, t, 0, scratch);
    store::<0>(scratch);
    if nb > 1 {
        unpack::<K>(blocks(1), &mut scratch.weights[1]);
    }
    for b in 0..nb {
        let next = b + 1 < nb;
        if next {
            if b % 2 == 0 {
                compute::<K, 1>(a, t, b + 1, scratch);
            } else {
                compute::<K, 0>(a, t, b + 1, scratch);
            }
        }
        if b + 2 < nb {
            unpack::<K>(blocks(b + 2), &mut scratch.weights[b % 2]);
        }
        scale::<K, G>(blocks(b), a, t, b, &scratch.sums[b % 2], &mut acc);
        if next {
            if b % 2 == 0 {
                store::<1>(scratch);
            } else {
                store::<0>(scratch);
            }
        }
    }
    if K == SCREEN {
        for (j, acc) in acc.iter().enumerate() {
            _mm512_storeu_ps(out.add(j * stride), *acc);
        }
    } else {
        store_pair_rows(&acc, second, out, stride);
    }
}

/// Block column `(b0, b1)` of two groups' weights into a tile in VNNI order (see the module header).
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
#[inline]
unsafe fn unpack<const K: u8>((b0, b1): (*const u8, *const u8), dst: &mut [u8; 512]) {
    let xb = block_bytes(K);
    prefetch_ahead(b0, xb);
    if K != SCREEN {
        // (A screen group's two pointers are the same block.)
        prefetch_ahead(b1, xb);
    }
    let dst = dst.as_mut_ptr() as *mut __m512i;
    if K == SCREEN {
        // Value register j (values 4j..4j+4 of the 16 rows) is tile row j, as the VNNI screen kernel builds it, less
        // the +32 of the stored values: signed, so the product needs no offset term.
        use crate::screen::{HIGH, NIBBLES};
        let h0 = _mm512_loadu_si512(b0.add(HIGH) as *const _);
        let h1 = _mm512_loadu_si512(b0.add(HIGH + 64) as *const _);
        let off = _mm512_set1_epi8(32);
        macro_rules! step {
            ($i:literal) => {{
                let nib = _mm512_loadu_si512(b0.add(NIBBLES + 64 * $i) as *const _);
                _mm512_store_si512(dst.add($i), _mm512_sub_epi8(screen_values::<$i>(nib, h0), off));
                _mm512_store_si512(dst.add(4 + $i), _mm512_sub_epi8(screen_values::<{ 4 + $i }>(nib, h1), off));
            }};
        }
        step!(0);
        step!(1);
        step!(2);
        step!(3);
    } else if K == Q8_0 {
        for i in 0..8 {
            _mm512_store_si512(dst.add(i), pair_reg(b0, b1, crate::repack::Q8_0_X8_QS + 32 * i));
        }
    } else {
        let low4 = _mm512_set1_epi8(0x0F);
        let regs = crate::repack::x8_regs_offset(K == Q4_1);
        for i in 0..4 {
            let p = pair_reg(b0, b1, regs + 32 * i);
            _mm512_store_si512(dst.add(i), _mm512_and_si512(p, low4));
            _mm512_store_si512(dst.add(4 + i), _mm512_and_si512(_mm512_srli_epi16::<4>(p), low4));
        }
    }
}

/// Block `b`: the activation rows from `t` × the weight tile in `scratch.weights[S]`, one tile product into
/// tile 0 (`S = 0`) or 3 (`S = 1`), whose sums [`store`] writes.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn compute<const K: u8, const S: usize>(a: &Acts, t: usize, b: usize, scratch: &Scratch) {
    let (acts, acts_stride) = (a.qs.as_ptr().add(t * a.cols + 32 * b), a.cols);
    let weights = scratch.weights[S].as_ptr();
    // The tile instructions name their registers, so each (set, signedness) has its own text.
    macro_rules! compute {
        ($dp:literal, $c:literal, $a:literal, $b:literal) => {
            asm!(
                concat!("tilezero tmm", $c),
                concat!("tileloadd tmm", $a, ", [{acts} + {acts_stride}*1]"),
                concat!("tileloadd tmm", $b, ", [{weights} + {row}*1]"),
                concat!($dp, " tmm", $c, ", tmm", $a, ", tmm", $b),
                acts = in(reg) acts, acts_stride = in(reg) acts_stride, weights = in(reg) weights,
                row = in(reg) 64usize, options(nostack, readonly)
            )
        };
    }
    match (K == Q8_0 || K == SCREEN, S) {
        (false, 0) => compute!("tdpbsud", "0", "1", "2"),
        (false, _) => compute!("tdpbsud", "3", "4", "5"),
        (true, 0) => compute!("tdpbssd", "0", "1", "2"),
        (true, _) => compute!("tdpbssd", "3", "4", "5"),
    }
}

/// Stores the block sums of tile 0 (`S = 0`) or 3 into `scratch.sums[S]` (row `j`: the 16 weight rows' sums
/// with activation row `t + j`).
#[inline(always)]
unsafe fn store<const S: usize>(scratch: &mut Scratch) {
    let sums = scratch.sums[S].as_mut_ptr();
    if S == 0 {
        asm!("tilestored [{sums} + {row}*1], tmm0", sums = in(reg) sums, row = in(reg) 64usize, options(nostack));
    } else {
        asm!("tilestored [{sums} + {row}*1], tmm3", sums = in(reg) sums, row = in(reg) 64usize, options(nostack));
    }
}

/// Adds block `b`'s scaled sums to the `G` activation rows' accumulators with the VNNI kernels' float
/// operations: `acc += f32(sum) · (d_w · d_x)`, then for Q4 `acc += c_w · s_x` (`c_w = m_w` for Q4_1, `-8·d_w`
/// for Q4_0).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
#[inline]
unsafe fn scale<const K: u8, const G: usize>(
    (b0, b1): (*const u8, *const u8),
    a: &Acts,
    t: usize,
    b: usize,
    sums: &[i32; ROWS * 16],
    acc: &mut [__m512; G],
) {
    let nb = a.nb;
    if K == SCREEN {
        // The VNNI screen kernel's operations: `acc += f32(sum) · (d_w · d_x)`, where its sum `-32·Σy + Σ(q + 32)·y`
        // is the tiles' signed `Σq·y` (the same integer).
        let d0 = a.d.as_ptr().add(t * nb + b);
        let dw = _mm512_cvtph_ps(_mm256_loadu_si256(b0 as *const __m256i));
        for (j, acc) in acc.iter_mut().enumerate() {
            let sum = _mm512_load_si512(sums.as_ptr().add(16 * j) as *const __m512i);
            let scale = _mm512_mul_ps(dw, _mm512_set1_ps(*d0.add(j * nb)));
            *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), scale, *acc);
        }
        return;
    }
    let (d0, s0) = (a.d.as_ptr().add(t * nb + b), a.s.as_ptr().add(t * nb + b));
    let dw = pair_f16(b0, b1, 0);
    let cw = match K {
        Q4_1 => pair_f16(b0, b1, 16),
        _ => _mm512_mul_ps(dw, _mm512_set1_ps(-8.0)),
    };
    for (j, acc) in acc.iter_mut().enumerate() {
        let sum = _mm512_load_si512(sums.as_ptr().add(16 * j) as *const __m512i);
        let scale = _mm512_mul_ps(dw, _mm512_set1_ps(*d0.add(j * nb)));
        *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), scale, *acc);
        if K != Q8_0 {
            *acc = _mm512_fmadd_ps(cw, _mm512_set1_ps(*s0.add(j * nb)), *acc);
        }
    }
}

/// Compares the screen's tile kernel with its VNNI kernel, bit for bit, on pseudo-random screen groups (3 groups
/// of 16 rows × 96 columns) for 1, 10 and 16 activation rows.
fn screen_self_check() -> bool {
    use crate::quantize::ActKind;
    use crate::screen::GROUP;
    let mut next = super::xorshift(0x5c4e_e11a_3b9d_0c21);
    let (groups, cols) = (3, 96);
    let w = random_screen_groups(groups, cols, &mut next);
    let (tiles, vnni) = (screen_kernel(), super::avx512::screen6_kernel());
    agree(tiles, vnni, &w, groups * GROUP, cols, ActKind::Q8_0, &[1, 10, 16], &mut next)
}

/// `groups` head-screen groups of `cols` columns ([`crate::screen`]) of pseudo-random values, with finite scales
/// (f16 values in [2⁻⁶, 2⁻⁵)).
pub(crate) fn random_screen_groups(groups: usize, cols: usize, next: &mut impl FnMut() -> u64) -> Vec<u8> {
    use crate::screen::{BLOCK_BYTES, GROUP};
    let mut w: Vec<u8> = (0..groups * cols / 32 * BLOCK_BYTES).map(|_| next() as u8).collect();
    for block in w.chunks_exact_mut(BLOCK_BYTES) {
        for r in 0..GROUP {
            block[2 * r..2 * r + 2].copy_from_slice(&(0x2400u16 + (next() % 512) as u16).to_le_bytes());
        }
    }
    w
}

/// Whether `tiles` gives `vnni`'s products of `w` (`rows` × `cols`, laid out for both) bit for bit, for each count
/// of pseudo-random activation rows in `counts` (the VNNI kernel called on at most `TILE` rows at a time).
#[allow(clippy::too_many_arguments)]
fn agree(
    tiles: GroupKernel,
    vnni: GroupKernel,
    w: &[u8],
    rows: usize,
    cols: usize,
    kind: crate::quantize::ActKind,
    counts: &[usize],
    next: &mut impl FnMut() -> u64,
) -> bool {
    counts.iter().all(|&nt| {
        let (x, buf) = super::random_acts(kind, nt, cols, next);
        let acts = buf.view(kind, &x, cols);
        let (mut got, mut want) = (vec![0.0f32; nt * rows], vec![0.0f32; nt * rows]);
        tiles(w, cols, &acts, 0, nt, &mut got, rows);
        release();
        for t0 in (0..nt).step_by(super::TILE) {
            let n = (nt - t0).min(super::TILE);
            vnni(w, cols, &acts, t0, n, &mut want[t0 * rows..], rows);
        }
        got.iter().zip(&want).all(|(g, w)| g.to_bits() == w.to_bits())
    })
}

/// Compares the tile kernels with the VNNI group kernels, bit for bit, on pseudo-random matrices (an odd number
/// of groups, so the lone-group path runs too) for 1, 5 and 16 activation rows.
fn self_check() -> bool {
    use crate::quantize::act_kind;
    use gguf::GgmlType;
    let mut next = super::xorshift(0x51_7cc1_b727_220a);
    let (rows, cols) = (24, 96);
    for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0] {
        let (Some(kind), Some(tiles), Some(vnni)) =
            (act_kind(ty), group_kernel(ty), super::group_kernel(super::Isa::Avx512, ty))
        else {
            return false;
        };
        let mut w: Vec<u8> = (0..rows * cols / 32 * ty.type_size()).map(|_| next() as u8).collect();
        for block in w.chunks_exact_mut(ty.type_size()) {
            block[..2].copy_from_slice(&0x2000u16.to_le_bytes());
            if ty == GgmlType::Q4_1 {
                block[2..4].copy_from_slice(&0x2400u16.to_le_bytes());
            }
        }
        let w = crate::repack::interleave8(ty, &w, rows, cols);
        if !agree(tiles, vnni, &w, rows, cols, kind, &[1, 5, 16], &mut next) {
            return false;
        }
    }
    true
}
