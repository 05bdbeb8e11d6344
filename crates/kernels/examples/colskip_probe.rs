//! Times one column-skipping product against the dense one (profiling aid; `perf record` it).
//! Usage: colskip_probe [rows] [cols] [zero%] [threads] [iters] [dense|col] [MB of copies cycled through]
use gguf::GgmlType;
use kernels::{matmul, ColMatrix, ColScratch, MatmulScratch, QMatrix, ThreadPool};
fn main() {
    let a: Vec<String> = std::env::args().collect();
    let arg = |i: usize, d: usize| a.get(i).and_then(|v| v.parse().ok()).unwrap_or(d);
    let (rows, cols, zero, threads, iters) = (arg(1, 576), arg(2, 1536), arg(3, 0), arg(4, 1), arg(5, 20000));
    let mode = a.get(6).cloned().unwrap_or_else(|| "col".into());
    let megabytes = arg(7, 0);
    let ty = GgmlType::Q4_1;
    let mut st = 0x2545_f491_4f6c_dd1du64;
    let mut data: Vec<u8> = (0..ty.row_bytes(cols).unwrap() * rows)
        .map(|_| {
            st ^= st << 13;
            st ^= st >> 7;
            st ^= st << 17;
            st as u8
        })
        .collect();
    for b in data.chunks_exact_mut(20) {
        b[0..2].copy_from_slice(&0x2000u16.to_le_bytes());
        b[2..4].copy_from_slice(&0x2000u16.to_le_bytes());
    }
    let x: Vec<f32> = (0..cols)
        .map(|i| {
            let h = (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 40;
            if (h % 100) < zero as u64 {
                0.0
            } else {
                ((i * 7919) % 113) as f32 / 113.0 - 0.5
            }
        })
        .collect();
    let copies = (megabytes << 20).div_ceil(data.len()).max(1);
    let datas: Vec<Vec<u8>> = (0..copies)
        .map(|c| {
            let mut d = data.clone();
            d.iter_mut().step_by(4096).for_each(|b| *b ^= c as u8);
            d
        })
        .collect();
    let pool = ThreadPool::new(threads);
    let mut out = vec![0.0; rows];
    if mode == "dense" {
        let x8: Vec<Vec<u8>> = datas.iter().map(|d| kernels::repack::interleave8(ty, d, rows, cols)).collect();
        let w: Vec<QMatrix> = x8.iter().map(|d| QMatrix::interleaved8(ty, d, rows, cols).unwrap()).collect();
        let mut s = MatmulScratch::default();
        let t = std::time::Instant::now();
        for i in 0..iters {
            matmul(&pool, &w[i % copies], &x, 1, &mut out, &mut s);
        }
        report(&mode, rows, cols, zero, threads, copies, t.elapsed().as_secs_f64() / iters as f64)
    } else {
        let w: Vec<ColMatrix> =
            datas.iter().map(|d| ColMatrix::from_rows(&QMatrix::new(ty, d, rows, cols).unwrap()).unwrap()).collect();
        let mut s = ColScratch::default();
        let t = std::time::Instant::now();
        for i in 0..iters {
            kernels::colskip_matvec(&pool, &w[i % copies], &x, &mut out, &mut s);
        }
        report(&mode, rows, cols, zero, threads, copies, t.elapsed().as_secs_f64() / iters as f64)
    }
}

fn report(mode: &str, rows: usize, cols: usize, zero: usize, threads: usize, copies: usize, secs: f64) {
    let mb = (rows * cols / 32 * 20) as f64 / 1e6;
    println!(
        "{mode:5} {rows}x{cols} zero {zero:2}% t{threads} copies {copies:4}: {:8.2} us  ({:.1} GB/s of dense bytes)",
        secs * 1e6,
        mb / 1e3 / secs
    );
}
