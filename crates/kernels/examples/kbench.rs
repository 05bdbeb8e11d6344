//! Quick kernel timing without criterion: `cargo run --release -p kernels --example kbench -- [threads] [filter]`.
//! Prints min and median time per matmul (GB/s of weights on the min) for decode/multi-row shapes, and the
//! pool's per-`run` latency. Min-of-many is used because the development machine is shared.
//!
//! `kbench THREADS cold [MATRICES]` instead multiplies MATRICES (200) distinct SmolLM2-sized Q4_1 FFN matrices
//! (1536 × 576, interleaved; ~108 MB, more than the caches hold) in turn by 1–8 activation rows, so the weights
//! stream from memory as in decoding (the other shapes reuse one matrix, which stays cached). Session 18 on the
//! 2-vCPU VM: 46.6, 42.9, 45.6, 54.0, 62.2, 82.4 µs per matrix for 1, 2, 3, 4, 6, 8 rows: up to 3 rows cost no
//! more than one.

use gguf::GgmlType;
use kernels::{matmul, MatmulScratch, QMatrix, ThreadPool};
use std::time::Instant;

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
    let fields: &[usize] = match ty {
        GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => &[0],
        GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4_K | GgmlType::Q5_K => &[0, 2],
        GgmlType::Q6_K => &[208],
        _ => &[],
    };
    if matches!(ty, GgmlType::F16 | GgmlType::BF16 | GgmlType::F32) {
        data.iter_mut().for_each(|b| *b &= 0x3f);
    }
    for block in data.chunks_exact_mut(ty.type_size()) {
        for &f in fields {
            block[f..f + 2].copy_from_slice(&0x2000u16.to_le_bytes());
        }
    }
    data
}

fn time(reps: usize, mut f: impl FnMut()) -> (f64, f64) {
    f();
    let mut ts: Vec<f64> = (0..reps)
        .map(|_| {
            let s = Instant::now();
            f();
            s.elapsed().as_secs_f64()
        })
        .collect();
    ts.sort_by(|a, b| a.partial_cmp(b).unwrap());
    (ts[0], ts[reps / 2])
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let threads: usize = args.get(1).and_then(|v| v.parse().ok()).unwrap_or(2);
    let filter = args.get(2).cloned().unwrap_or_default();
    let pool = ThreadPool::new(threads);
    println!("isa {} threads {threads}", kernels::detected_isa());
    if filter == "cold" {
        return cold(&pool, args.get(3).and_then(|v| v.parse().ok()).unwrap_or(200));
    }
    if filter.is_empty() || filter == "pool" {
        let (min, med) = time(20, || {
            for _ in 0..10_000 {
                pool.run(&|_, _| {});
            }
        });
        println!("pool run: min {:.2} us  median {:.2} us", min * 1e2, med * 1e2);
        if filter == "pool" {
            return;
        }
    }
    let shapes = [
        (GgmlType::Q4_1, 1536, 576),
        (GgmlType::Q4_1, 576, 1536),
        (GgmlType::Q4_1, 576, 576),
        (GgmlType::Q8_0, 49152, 576),
        (GgmlType::Q8_0, 262144, 640),
        (GgmlType::Q5_0, 2048, 640),
        (GgmlType::Q8_0, 2048, 640),
        (GgmlType::Q4_K, 640, 2048),
        (GgmlType::Q6_K, 640, 2048),
        (GgmlType::Q6_K, 896, 4864),
    ];
    for (ty, rows, cols) in shapes {
        let name = format!("{}_{rows}x{cols}", ty.name());
        if !filter.is_empty() && !name.contains(&filter) {
            continue;
        }
        let plain = random_matrix(ty, rows, cols);
        // Measured as the engine loads them: interleaved by 8 rows where that pays on this CPU (so
        // `SPECEE_Q5_X8=0` / `SPECEE_Q6_X8=0` time Q5_0 / Q6_K's rows).
        let x8 = kernels::repack::interleave_pays(ty);
        let data = if x8 { kernels::repack::interleave8(ty, &plain, rows, cols) } else { plain };
        let w = if x8 {
            QMatrix::interleaved8(ty, &data, rows, cols).unwrap()
        } else {
            QMatrix::new(ty, &data, rows, cols).unwrap()
        };
        let mut line = format!("{:<18}", if x8 { format!("{name} x8") } else { name });
        let mut base = 0.0;
        for n in [1usize, 2, 4, 8, 16] {
            let x: Vec<f32> = (0..n * cols).map(|i| ((i * 7919) % 113) as f32 / 113.0 - 0.5).collect();
            let mut out = vec![0.0; n * rows];
            let mut scratch = MatmulScratch::default();
            let reps = (2_000_000_000 / (data.len() * n.max(2))).clamp(5, 400);
            let (min, _med) = time(reps, || matmul(&pool, &w, &x, n, &mut out, &mut scratch));
            if n == 1 {
                base = min;
                line += &format!(" n1 {:8.1}us {:5.1}GB/s |", min * 1e6, data.len() as f64 / min / 1e9);
            } else {
                line += &format!(" n{n} {:4.2}x", min / base);
            }
        }
        println!("{line}");
    }
}

/// Products with `count` distinct matrices in turn, so that their weights come from memory (see the header).
fn cold(pool: &ThreadPool, count: usize) {
    let (ty, rows, cols) = (GgmlType::Q4_1, 1536usize, 576usize);
    let mats: Vec<Vec<u8>> = (0..count)
        .map(|i| {
            let mut plain = random_matrix(ty, rows, cols);
            // Distinct contents per matrix (the generator is seeded the same each time).
            plain.iter_mut().skip(4).step_by(20).for_each(|b| *b = b.wrapping_add(i as u8));
            kernels::repack::interleave8(ty, &plain, rows, cols)
        })
        .collect();
    let qm: Vec<QMatrix> = mats.iter().map(|d| QMatrix::interleaved8(ty, d, rows, cols).unwrap()).collect();
    let bytes = mats[0].len();
    println!("{count} matrices of {} KB", bytes / 1024);
    for n in [1usize, 2, 3, 4, 6, 8] {
        let x: Vec<f32> = (0..n * cols).map(|i| ((i * 7919) % 113) as f32 / 113.0 - 0.5).collect();
        let mut out = vec![0.0; n * rows];
        let mut scratch = MatmulScratch::default();
        let (min, _) = time(7, || {
            for m in &qm {
                matmul(pool, m, &x, n, &mut out, &mut scratch);
            }
        });
        let per = min / count as f64;
        println!("n {n}: {:.1} us per matrix, {:.1} GB/s", per * 1e6, bytes as f64 / per / 1e9);
    }
}
