//! Criterion benches: matvec throughput (GB/s of weights) per type at SmolLM2/Gemma shapes, the multi-row
//! curve (time for n = 1, 2, 4, 8, 16 activation rows), and the machine's plain read bandwidth on the same
//! pool (summing 256 MB of bytes), the ceiling the memory-bound matvecs are measured against. Threads: env `SPECEE_BENCH_THREADS`
//! (default 2). Weights are random bytes with sane scales (speed does not depend on the values).

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use gguf::GgmlType;
use kernels::{matmul, MatmulScratch, QMatrix, ThreadPool};
use std::time::Duration;

fn random_matrix(ty: GgmlType, rows: usize, cols: usize) -> Vec<u8> {
    let bytes = ty.row_bytes(cols).unwrap() * rows;
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut data: Vec<u8> = (0..bytes)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect();
    // Make every f16 scale field a small finite number (0x2000 ≈ 0.0078) so no NaN/inf slows anything.
    let ts = ty.type_size();
    let fields: &[usize] = match ty {
        GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => &[0],
        GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4_K | GgmlType::Q5_K => &[0, 2],
        GgmlType::Q6_K => &[208],
        GgmlType::Q2_K => &[80, 82],
        GgmlType::Q3_K => &[108],
        _ => &[],
    };
    if ty == GgmlType::F16 || ty == GgmlType::BF16 || ty == GgmlType::F32 {
        data.iter_mut().for_each(|b| *b &= 0x3f);
    }
    for block in data.chunks_exact_mut(ts) {
        for &f in fields {
            block[f..f + 2].copy_from_slice(&0x2000u16.to_le_bytes());
        }
    }
    data
}

fn threads() -> usize {
    std::env::var("SPECEE_BENCH_THREADS").ok().and_then(|v| v.parse().ok()).unwrap_or(2)
}

fn matvec(c: &mut Criterion) {
    let pool = ThreadPool::new(threads());
    let shapes = [
        (GgmlType::Q4_1, 1536, 576),
        (GgmlType::Q4_1, 576, 1536),
        (GgmlType::Q8_0, 49152, 576),
        (GgmlType::Q8_0, 262144, 640),
        (GgmlType::Q5_0, 2048, 640),
        // The same matrix as Q8_0 (Q5_0 and Q4_0 convert to it exactly): is the wider type faster?
        (GgmlType::Q8_0, 2048, 640),
        (GgmlType::Q4_K, 640, 2048),
        (GgmlType::Q6_K, 640, 2048),
        (GgmlType::Q4_0, 1536, 576),
        (GgmlType::F16, 1536, 576),
    ];
    let mut group = c.benchmark_group(format!("matvec_t{}_{}", pool.n_threads(), kernels::detected_isa()));
    group.warm_up_time(Duration::from_millis(300)).measurement_time(Duration::from_secs(1)).sample_size(20);
    for (ty, rows, cols) in shapes {
        let data = random_matrix(ty, rows, cols);
        let w = QMatrix::new(ty, &data, rows, cols).unwrap();
        let x: Vec<f32> = (0..cols).map(|i| ((i * 7919) % 113) as f32 / 113.0 - 0.5).collect();
        let mut out = vec![0.0; rows];
        let mut scratch = MatmulScratch::default();
        group.throughput(Throughput::Bytes(data.len() as u64));
        group.bench_function(BenchmarkId::new(ty.name(), format!("{rows}x{cols}")), |b| {
            b.iter(|| matmul(&pool, &w, &x, 1, &mut out, &mut scratch))
        });
    }
    group.finish();
}

fn multi_row(c: &mut Criterion) {
    let pool = ThreadPool::new(threads());
    let shapes = [
        (GgmlType::Q4_1, 1536, 576),
        (GgmlType::Q4_1, 576, 1536),
        (GgmlType::Q8_0, 49152, 576),
        (GgmlType::Q5_0, 2048, 640),
        (GgmlType::Q8_0, 2048, 640),
        (GgmlType::Q4_K, 640, 2048),
        (GgmlType::Q6_K, 640, 2048),
    ];
    let mut group = c.benchmark_group(format!("multirow_t{}_{}", pool.n_threads(), kernels::detected_isa()));
    group.warm_up_time(Duration::from_millis(300)).measurement_time(Duration::from_secs(1)).sample_size(20);
    // Q4_0/Q4_1 shapes interleaved by 8 rows, as the model loads them.
    let interleaved = [
        (GgmlType::Q4_1, 1536, 576),
        (GgmlType::Q4_1, 576, 1536),
        (GgmlType::Q4_0, 1536, 576),
        (GgmlType::Q4_K, 640, 2048),
    ];
    let all = shapes.iter().map(|s| (*s, false)).chain(interleaved.iter().map(|s| (*s, true)));
    for ((ty, rows, cols), x8) in all {
        let data = random_matrix(ty, rows, cols);
        let data = if x8 { kernels::repack::interleave8(ty, &data, rows, cols) } else { data };
        let w = if x8 { QMatrix::interleaved8(ty, &data, rows, cols) } else { QMatrix::new(ty, &data, rows, cols) };
        let w = w.unwrap();
        let ty = if x8 { format!("{}x8", ty.name()) } else { ty.name().to_string() };
        for n in [1usize, 2, 4, 8, 16] {
            let x: Vec<f32> = (0..n * cols).map(|i| ((i * 7919) % 113) as f32 / 113.0 - 0.5).collect();
            let mut out = vec![0.0; n * rows];
            let mut scratch = MatmulScratch::default();
            group.bench_function(BenchmarkId::new(format!("{ty}_{rows}x{cols}"), n), |b| {
                b.iter(|| matmul(&pool, &w, &x, n, &mut out, &mut scratch))
            });
        }
    }
    group.finish();
}

fn read_bandwidth(c: &mut Criterion) {
    let pool = ThreadPool::new(threads());
    let data: Vec<u64> = (0..32usize << 20).map(|i| i as u64 * 0x9e37_79b9).collect();
    let mut group = c.benchmark_group(format!("read_t{}", pool.n_threads()));
    group.warm_up_time(Duration::from_millis(300)).measurement_time(Duration::from_secs(2)).sample_size(10);
    group.throughput(Throughput::Bytes((data.len() * 8) as u64));
    let chunk = data.len() / 64;
    group.bench_function("sum_256MB", |b| {
        b.iter(|| {
            let total = std::sync::atomic::AtomicU64::new(0);
            kernels::parallel_for(&pool, 64, |items| {
                let mut acc = [0u64; 4];
                for item in items {
                    for c4 in data[item * chunk..(item + 1) * chunk].chunks_exact(4) {
                        for (a, v) in acc.iter_mut().zip(c4) {
                            *a = a.wrapping_add(*v);
                        }
                    }
                }
                let sum = acc.iter().fold(0u64, |s, a| s.wrapping_add(*a));
                total.fetch_add(sum, std::sync::atomic::Ordering::Relaxed);
            });
            std::hint::black_box(total.into_inner())
        })
    });
    group.finish();
}

criterion_group!(benches, matvec, multi_row, read_bandwidth);
criterion_main!(benches);
