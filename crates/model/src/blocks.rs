//! Small f32 building blocks shared by every architecture: RMS norm, rotary embeddings, softmax and the gate
//! activations. Written as plain loops the compiler vectorises; the heavy work (matrix products) lives in the
//! `kernels` crate.

use crate::config::{Activation, RopeStyle};

/// `out = x / rms(x) * weight`, with `rms(x) = sqrt(mean(x²) + eps)`.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let mut sum = 0f32;
    for &v in x {
        sum += v * v;
    }
    let scale = 1.0 / (sum / x.len() as f32 + eps).sqrt();
    for ((o, &v), &w) in out.iter_mut().zip(x).zip(weight) {
        *o = v * scale * w;
    }
}

/// [`rms_norm`] in place.
pub fn rms_norm_in_place(x: &mut [f32], weight: &[f32], eps: f32) {
    let mut sum = 0f32;
    for &v in x.iter() {
        sum += v * v;
    }
    let scale = 1.0 / (sum / x.len() as f32 + eps).sqrt();
    for (v, &w) in x.iter_mut().zip(weight) {
        *v = *v * scale * w;
    }
}

/// Inverse frequencies `base^(-2i/dims)` for `i < dims/2`.
pub fn rope_inv_freq(base: f32, dims: usize) -> Vec<f32> {
    (0..dims / 2).map(|i| base.powf(-2.0 * i as f32 / dims as f32)).collect()
}

/// Fills `cos`/`sin` (each `inv_freq.len()` long) for one position.
pub fn rope_angles(pos: u32, inv_freq: &[f32], cos: &mut [f32], sin: &mut [f32]) {
    for ((c, s), &f) in cos.iter_mut().zip(sin.iter_mut()).zip(inv_freq) {
        let theta = pos as f32 * f;
        *c = theta.cos();
        *s = theta.sin();
    }
}

/// Rotates the first `2 * cos.len()` dimensions of one head in place.
pub fn rope_apply(head: &mut [f32], cos: &[f32], sin: &[f32], style: RopeStyle) {
    let half = cos.len();
    match style {
        RopeStyle::Normal => {
            for i in 0..half {
                let (a, b) = (head[2 * i], head[2 * i + 1]);
                head[2 * i] = a * cos[i] - b * sin[i];
                head[2 * i + 1] = a * sin[i] + b * cos[i];
            }
        }
        RopeStyle::Neox => {
            for i in 0..half {
                let (a, b) = (head[i], head[i + half]);
                head[i] = a * cos[i] - b * sin[i];
                head[i + half] = a * sin[i] + b * cos[i];
            }
        }
    }
}

/// Softmax in place; returns nothing. An empty slice is left alone.
pub fn softmax_in_place(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if !max.is_finite() {
        return;
    }
    let mut sum = 0f32;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    let inv = 1.0 / sum;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

/// SiLU: `x * sigmoid(x)`.
#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// GELU, tanh approximation (as ggml's `gelu`).
#[inline]
pub fn gelu_tanh(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * x * (1.0 + 0.044_715 * x * x)).tanh())
}

/// `e^x` without libm: range reduction to `x = n·ln2 + r`, `|r| ≤ ln2/2`, a degree-6 Taylor polynomial for
/// `e^r` (relative error ~2e-7) and `2^n` put into the exponent bits. Branch-free, so loops over it vectorise.
/// Inputs are clamped to about ±88 (results stay finite and normal); NaN stays NaN.
#[inline(always)]
fn exp_approx(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    const ROUND: f32 = 12_582_912.0; // 1.5 · 2^23: adding and subtracting it rounds to an integer
    let x = x.clamp(-87.0, 88.0);
    let n = (x * LOG2E + ROUND) - ROUND;
    let r = (x - n * LN2_HI) - n * LN2_LO;
    let p = 1.0 + r * (1.0 + r * (0.5 + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0))))));
    p * pow2_int(n)
}

/// `2^n` for an integer-valued `n` in [−126, 127], from the float bits of `n + 127 + 2^23` (whose low bits hold
/// the integer n + 127): shifted into the exponent field, the rest falls off the top. The same value as
/// `f32::from_bits(((n as i32 + 127) as u32) << 23)`, but without Rust's saturating float-to-int cast, which does
/// not vectorise (a scalar convert, compare and move per element: [`glu_in_place`] was 4.6% of an 8-row SmolLM2
/// forward with it, 2.3% without).
#[inline(always)]
fn pow2_int(n: f32) -> f32 {
    f32::from_bits((n + (127.0 + 8_388_608.0)).to_bits() << 23)
}

/// `gate[i] = act(gate[i]) · up[i]` over whole slices (the gated feed-forward block), with SiLU as
/// `x / (1 + e^-x)` and tanh-GELU as `x / (1 + e^-2y)`, `y = √(2/π)·(x + 0.044715·x³)` (the same function as
/// `0.5·x·(1 + tanh y)`), both through [`exp_approx`]: ~10× cheaper than libm's `expf`/`tanhf` per element
/// and within a few 1e-7 of them (test below). Runs with AVX2 + FMA when the CPU has them.
pub fn glu_in_place(activation: Activation, gate: &mut [f32], up: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: the CPU has the features the function is compiled for.
        unsafe { glu_avx2(activation, gate, up) };
        return;
    }
    glu_portable(activation, gate, up);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn glu_avx2(activation: Activation, gate: &mut [f32], up: &[f32]) {
    glu_portable(activation, gate, up)
}

#[inline(always)]
fn glu_portable(activation: Activation, gate: &mut [f32], up: &[f32]) {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    match activation {
        Activation::Silu => gate.iter_mut().zip(up).for_each(|(g, &u)| *g = *g / (1.0 + exp_approx(-*g)) * u),
        Activation::GeluTanh => gate.iter_mut().zip(up).for_each(|(g, &u)| {
            let x = *g;
            let y = SQRT_2_OVER_PI * x * (1.0 + 0.044_715 * x * x);
            *g = x / (1.0 + exp_approx(-2.0 * y)) * u;
        }),
    }
}

/// Dot product of two equal-length slices.
#[inline(always)]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    // Eight accumulators let the compiler vectorise without reassociation flags.
    let mut acc = [0f32; 8];
    let chunks = a.len() / 8;
    for c in 0..chunks {
        for l in 0..8 {
            acc[l] += a[c * 8 + l] * b[c * 8 + l];
        }
    }
    let mut sum: f32 = acc.iter().sum();
    for i in chunks * 8..a.len() {
        sum += a[i] * b[i];
    }
    sum
}

/// `y += a * x`.
#[inline(always)]
pub fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
    for (yv, &xv) in y.iter_mut().zip(x) {
        *yv += a * xv;
    }
}

/// The f32 value of f16 bits (exact).
#[inline(always)]
pub fn f16_to_f32(h: u16) -> f32 {
    half::f16::from_bits(h).to_f32()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rms_norm_unit_weight_has_unit_rms() {
        let x = [1.0, -2.0, 3.0, -4.0];
        let mut out = [0.0; 4];
        rms_norm(&x, &[1.0; 4], 0.0, &mut out);
        let rms = (out.iter().map(|v| v * v).sum::<f32>() / 4.0).sqrt();
        assert!((rms - 1.0).abs() < 1e-6);
    }

    #[test]
    fn rope_at_position_zero_is_identity_and_preserves_norm() {
        let inv = rope_inv_freq(10000.0, 8);
        let (mut c, mut s) = (vec![0.0; 4], vec![0.0; 4]);
        rope_angles(0, &inv, &mut c, &mut s);
        let mut h = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0];
        let orig = h;
        rope_apply(&mut h, &c, &s, RopeStyle::Neox);
        assert_eq!(h, orig);
        rope_angles(17, &inv, &mut c, &mut s);
        for style in [RopeStyle::Normal, RopeStyle::Neox] {
            let mut h2 = orig;
            rope_apply(&mut h2, &c, &s, style);
            let n1: f32 = orig.iter().map(|v| v * v).sum();
            let n2: f32 = h2.iter().map(|v| v * v).sum();
            assert!((n1 - n2).abs() < 1e-3);
            assert_ne!(h2, orig);
        }
    }

    #[test]
    fn fast_activations_match_libm() {
        let xs: Vec<f32> = (-4000..=4000).map(|i| i as f32 * 0.005).chain([-300.0, -90.0, 90.0, 300.0]).collect();
        for (act, reference) in [(Activation::Silu, silu as fn(f32) -> f32), (Activation::GeluTanh, gelu_tanh)] {
            let mut gate = xs.clone();
            let up: Vec<f32> = xs.iter().map(|_| 1.5).collect();
            glu_in_place(act, &mut gate, &up);
            let mut portable = xs.clone();
            glu_portable(act, &mut portable, &up);
            for ((&x, &got), &p) in xs.iter().zip(&gate).zip(&portable) {
                let want = reference(x) * 1.5;
                assert!((got - want).abs() <= 1e-6 + 1e-6 * want.abs(), "{act:?}({x}): {got} vs libm {want}");
                assert!((got - p).abs() <= 1e-6 * (1.0 + p.abs()), "{act:?}({x}): SIMD {got} vs portable {p}");
            }
        }
        let mut nan = [f32::NAN];
        glu_in_place(Activation::Silu, &mut nan, &[1.0]);
        assert!(nan[0].is_nan());
        for x in [-80.0f32, -10.0, -1.0, 0.0, 0.5, 3.0, 80.0] {
            assert!((exp_approx(x) / x.exp() - 1.0).abs() < 5e-7, "exp({x})");
        }
        // 2^n from float bits equals the integer construction for every n the clamp lets through.
        for n in -126..=127 {
            assert_eq!(pow2_int(n as f32), f32::from_bits(((n + 127) as u32) << 23), "2^{n}");
        }
    }

    #[test]
    fn softmax_sums_to_one_and_handles_masked() {
        let mut x = [1.0, 2.0, f32::NEG_INFINITY, 0.5];
        softmax_in_place(&mut x);
        assert!((x.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert_eq!(x[2], 0.0);
    }

    #[test]
    fn activations_match_known_values() {
        assert!((silu(1.0) - 0.731_058_6).abs() < 1e-6);
        assert!((gelu_tanh(1.0) - 0.841_192).abs() < 1e-5);
        assert_eq!(gelu_tanh(0.0), 0.0);
    }
}
