// A stand-alone copy of the AVX2 interleaved Q4_1 loop (`q4_x8_tokens` in crates/kernels/src/kernel/avx2.rs: per
// block, 4 nibble registers unpacked once for 4 activation rows, 8 `vpmaddubsw` per row, then the f32 scale step)
// on L2-resident data, one thread, to see what the loop costs apart from the rest of a matmul. Three variants:
// `full` (as the kernel was before session 65), `pipelined` (block b's scale step issued after block b+1's integer
// work, as the kernel does since), `noscale` (the scale step replaced by a conversion and an add: the integer part's
// own rate). Prints `vpmaddubsw` per ns, best of 5.
//   rustc -O -C target-feature=+avx2,+fma,+f16c bench/avx2_q4_loop.rs -o /tmp/avx2_q4_loop && /tmp/avx2_q4_loop
// Session 65, the 2-vCPU Zen 3 VM (a training job on the other core), four runs: full 2.45 / 2.52 / 2.69 / 2.68,
// pipelined 2.50 / 2.56 / 2.64 / 2.71, noscale 3.13 / 3.30 / 2.53 / 3.33 per ns: the scale step is ~20-25% of the
// loop; pipelining it gains ~1% here (the kernel itself, `kbench 2 Q4_1_1536`: 3-6%).
use std::arch::x86_64::*;
use std::time::Instant;

const NB: usize = 18; // blocks per row (576 columns, SmolLM2)
const XB: usize = 160; // bytes per block of 8 interleaved rows: 16 f16 d/m, 128 of nibbles
const G: usize = 4; // activation rows per pass

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn rows(w: *const u8, y: *const i8, d: *const f32, out: *mut f32, variant: u8) {
    let (low4, ones) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi16(1));
    let mut acc = [_mm256_setzero_ps(); G];
    let mut prev = [_mm256_setzero_si256(); G];
    for b in 0..=NB {
        let mut isum = [_mm256_setzero_si256(); G];
        if b < NB {
            let blk = w.add(b * XB);
            let mut s16 = [_mm256_setzero_si256(); G];
            for i in 0..4 {
                let p = _mm256_loadu_si256(blk.add(32 + 32 * i) as *const __m256i);
                let (lo, hi) = (_mm256_and_si256(p, low4), _mm256_and_si256(_mm256_srli_epi16::<4>(p), low4));
                for j in 0..G {
                    let yj = y.add(j * NB * 32 + 32 * b + 4 * i);
                    let ylo = _mm256_set1_epi32((yj as *const i32).read_unaligned());
                    let yhi = _mm256_set1_epi32((yj.add(16) as *const i32).read_unaligned());
                    let p16 = _mm256_add_epi16(_mm256_maddubs_epi16(lo, ylo), _mm256_maddubs_epi16(hi, yhi));
                    s16[j] = _mm256_add_epi16(s16[j], p16);
                }
            }
            isum = core::array::from_fn(|j| _mm256_madd_epi16(s16[j], ones));
        }
        // The block whose scale step runs now: this one (`full`, `noscale`) or the previous one (`pipelined`).
        let (sb, sums) = if variant == 1 { (b.wrapping_sub(1), prev) } else { (b, isum) };
        if sb < NB {
            if variant == 2 {
                for j in 0..G {
                    acc[j] = _mm256_add_ps(_mm256_cvtepi32_ps(sums[j]), acc[j]);
                }
            } else {
                let blk = w.add(sb * XB);
                let dw = _mm256_cvtph_ps(_mm_loadu_si128(blk as *const __m128i));
                let mw = _mm256_cvtph_ps(_mm_loadu_si128(blk.add(16) as *const __m128i));
                for j in 0..G {
                    let scale = _mm256_mul_ps(dw, _mm256_set1_ps(*d.add(j * NB + sb)));
                    acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[j]), scale, acc[j]);
                    acc[j] = _mm256_fmadd_ps(mw, _mm256_set1_ps(*d.add(j * NB + sb)), acc[j]);
                }
            }
        }
        prev = isum;
    }
    for (j, a) in acc.iter().enumerate() {
        _mm256_storeu_ps(out.add(8 * j), *a);
    }
}

fn main() {
    assert!(is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c"));
    let groups = 24; // 24 × 2.9 KB: in L2
                     // f16 fields get small normal values (0x2000-ish), the nibbles anything.
    let w: Vec<u8> =
        (0..groups * NB * XB).map(|i| if i % XB < 32 { (i % 2 * 0x20) as u8 } else { (i * 13) as u8 }).collect();
    let y: Vec<i8> = (0..G * NB * 32).map(|i| ((i * 7) % 50) as i8 - 25).collect();
    let d: Vec<f32> = (0..G * NB).map(|i| 0.01 + i as f32 * 1e-4).collect();
    let mut out = vec![0f32; 8 * G * groups];
    for (variant, name) in [(0u8, "full"), (1, "pipelined"), (2, "noscale")] {
        let iters = 20_000;
        let mut best = f64::MAX;
        for _ in 0..5 {
            let t = Instant::now();
            for _ in 0..iters {
                for g in 0..groups {
                    // SAFETY: the CPU has the features (asserted); the pointers cover what `rows` reads and writes.
                    unsafe {
                        rows(
                            w.as_ptr().add(g * NB * XB),
                            y.as_ptr(),
                            d.as_ptr(),
                            out.as_mut_ptr().add(8 * G * g),
                            variant,
                        )
                    };
                }
            }
            best = best.min(t.elapsed().as_secs_f64());
        }
        let maddubs = (iters * groups * NB * G * 8) as f64;
        println!(
            "{name:10} {:.2} vpmaddubsw/ns ({:.0} multiply-adds/ns) [{:e}]",
            maddubs / best / 1e9,
            maddubs * 32.0 / best / 1e9,
            out[3]
        );
    }
}
