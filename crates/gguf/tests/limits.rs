//! Resource limits: a GGUF whose declared counts and sizes exceed the file is refused with little memory —
//! the reader never allocates for what a header merely declares (peak bytes measured per thread by a
//! counting allocator).

mod support {
    pub mod peak_alloc;
}
use support::peak_alloc;

use gguf::{GgmlType, GgufFile, GgufWriter, Value};

#[global_allocator]
static ALLOC: peak_alloc::PeakAlloc = peak_alloc::PeakAlloc;

/// Magic, version 3, tensor count, kv count.
fn header(n_tensors: u64, n_kv: u64) -> Vec<u8> {
    let mut out = b"GGUF".to_vec();
    out.extend_from_slice(&3u32.to_le_bytes());
    out.extend_from_slice(&n_tensors.to_le_bytes());
    out.extend_from_slice(&n_kv.to_le_bytes());
    out
}

fn key(out: &mut Vec<u8>, k: &str) {
    out.extend_from_slice(&(k.len() as u64).to_le_bytes());
    out.extend_from_slice(k.as_bytes());
}

/// Parses `bytes` and returns the error text and the peak allocation above the input's own copy.
fn refuse(what: &str, bytes: Vec<u8>) -> String {
    let len = bytes.len();
    let (out, peak) = peak_alloc::measure(|| GgufFile::from_bytes(bytes));
    let err = match out {
        Ok(_) => panic!("{what}: accepted"),
        Err(e) => e.to_string(),
    };
    // the input is copied once into aligned storage; anything beyond that is the reader's own
    assert!(peak < 2 * len + (256 << 10), "{what}: peak {peak} bytes for a {len}-byte file ({err})");
    err
}

#[test]
fn declared_counts_and_sizes_beyond_the_file_allocate_nothing_for_them() {
    let e = refuse("65,536 tensors declared in 24 bytes", header(65_536, 0));
    assert!(e.contains("tensor"), "{e}");
    let e = refuse("u64::MAX keys declared", header(0, u64::MAX));
    assert!(e.contains("key"), "{e}");
    let mut b = header(0, 1);
    key(&mut b, "k");
    b.extend_from_slice(&8u32.to_le_bytes()); // string
    b.extend_from_slice(&(60u64 << 20).to_le_bytes());
    let e = refuse("a 60 MiB string in a 40-byte file", b);
    assert!(e.contains("'k'") || e.contains("k"), "{e}");
    for (elem_ty, len) in [(8u32, 60u64 << 20), (0, 60 << 20), (9, 1 << 26), (6, u64::MAX)] {
        let mut b = header(0, 1);
        key(&mut b, "tokenizer.ggml.tokens");
        b.extend_from_slice(&9u32.to_le_bytes()); // array
        b.extend_from_slice(&elem_ty.to_le_bytes());
        b.extend_from_slice(&len.to_le_bytes());
        let e = refuse(&format!("an array of {len} elements of type {elem_ty}"), b);
        assert!(e.contains("tokenizer.ggml.tokens"), "{e}");
    }
}

#[test]
fn tensors_past_the_end_of_the_file_are_refused() {
    // a valid file, then its one tensor's dimensions made huge (data past the end, or an overflowing size)
    let mut w = GgufWriter::new();
    w.add("general.architecture", Value::String("llama".into()));
    w.add_tensor("t", &[32, 2], GgmlType::Q8_0, vec![0; 68]);
    let good = w.to_bytes().unwrap();
    assert!(GgufFile::from_bytes(good.clone()).is_ok());
    // the tensor info: name length (u64 1), "t", n_dims (u32 2), then the two dims (u64 each)
    let info: Vec<u8> = [&1u64.to_le_bytes()[..], b"t", &2u32.to_le_bytes()].concat();
    let dims_at = good.windows(info.len()).position(|w| w == info).unwrap() + info.len();
    for dims in [[32u64, 1 << 30], [u64::MAX / 2, 3], [1 << 40, 1 << 40]] {
        let mut b = good.clone();
        b[dims_at..dims_at + 8].copy_from_slice(&dims[0].to_le_bytes());
        b[dims_at + 8..dims_at + 16].copy_from_slice(&dims[1].to_le_bytes());
        let e = refuse(&format!("tensor dims {dims:?}"), b);
        assert!(e.contains('t'), "{e}");
    }
}
