//! Malformed input: every byte string must give `Ok` or a typed `Err`, never a panic, hang or huge
//! allocation.

use gguf::{GgmlType, GgufError, GgufFile, GgufWriter, Value};

/// A small xorshift generator (deterministic, no dependency).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// A small valid file with metadata of several types (nested array included) and three tensors.
fn small_valid_file() -> Vec<u8> {
    let mut w = GgufWriter::new();
    w.add("general.architecture", "llama")
        .add("llama.block_count", Value::U32(2))
        .add("llama.rope.freq_base", Value::F32(10000.0))
        .add("tokenizer.ggml.tokens", Value::Array(vec!["a".into(), "bc".into(), "<s>".into()]))
        .add("tokenizer.ggml.scores", Value::Array(vec![Value::F32(0.0), Value::F32(-1.0), Value::F32(-2.0)]))
        .add("nested", Value::Array(vec![Value::Array(vec![Value::I64(1)]), Value::Array(vec![])]))
        .add("flag", Value::Bool(false));
    w.add_tensor("a", &[32, 2], GgmlType::Q8_0, vec![7; 68]);
    w.add_tensor("b", &[3], GgmlType::F32, vec![1; 12]);
    w.add_tensor("c", &[256], GgmlType::Q4_K, vec![2; 144]);
    w.to_bytes().unwrap()
}

/// The fixed part of a header: magic, version, tensor count, kv count.
fn header(version: u32, n_tensors: u64, n_kv: u64) -> Vec<u8> {
    let mut out = b"GGUF".to_vec();
    out.extend_from_slice(&version.to_le_bytes());
    out.extend_from_slice(&n_tensors.to_le_bytes());
    out.extend_from_slice(&n_kv.to_le_bytes());
    out
}

fn push_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

/// Parses and, when it succeeds, touches every accessor so that any latent panic shows up.
fn exercise(bytes: Vec<u8>) {
    if let Ok(file) = GgufFile::from_bytes(bytes) {
        for (key, _) in &file.metadata {
            let _ = (file.get_u32(key), file.get_f32(key), file.get_str(key), file.get_str_array(key));
            let _ = (file.get_i32_array(key), file.get_f32_array(key), file.opt_bool(key));
        }
        for info in &file.tensors {
            assert_eq!(file.tensor_bytes(info).len(), info.n_bytes);
            let _ = info.n_elements();
        }
        let _ = file.architecture();
    }
}

#[test]
fn empty_input() {
    assert!(matches!(GgufFile::from_bytes(vec![]), Err(GgufError::Empty)));
}

#[test]
fn header_only_file_is_an_empty_gguf() {
    for version in [2, 3] {
        let file = GgufFile::from_bytes(header(version, 0, 0)).unwrap();
        assert_eq!(file.version, version);
        assert!(file.metadata.is_empty() && file.tensors.is_empty());
        assert_eq!(file.alignment(), 32);
    }
    let written = GgufWriter::new().to_bytes().unwrap();
    assert_eq!(written, header(3, 0, 0));
}

#[test]
fn bad_magic_and_versions() {
    let e = GgufFile::from_bytes(b"PK\x03\x04rest of a zip".to_vec()).unwrap_err();
    assert!(matches!(e, GgufError::NotGguf { found } if &found == b"PK\x03\x04"));
    assert!(e.to_string().contains("not a GGUF file"), "{e}");
    assert!(matches!(GgufFile::from_bytes(b"ab".to_vec()), Err(GgufError::NotGguf { .. })));
    assert!(matches!(GgufFile::from_bytes(b"GG".to_vec()), Err(GgufError::Truncated { .. })));
    assert!(matches!(GgufFile::from_bytes(header(1, 0, 0)), Err(GgufError::UnsupportedVersion(1))));
    assert!(matches!(GgufFile::from_bytes(header(4, 0, 0)), Err(GgufError::UnsupportedVersion(4))));
    // A big-endian file reads as a huge version.
    assert!(matches!(GgufFile::from_bytes(header(3u32.swap_bytes(), 0, 0)), Err(GgufError::UnsupportedVersion(_))));
}

#[test]
fn counts_are_limited_and_checked_against_file_size() {
    let e = GgufFile::from_bytes(header(3, 1 << 40, 0)).unwrap_err();
    assert!(matches!(e, GgufError::LimitExceeded { value, .. } if value == 1 << 40), "{e}");
    let e = GgufFile::from_bytes(header(3, 0, 70_000)).unwrap_err();
    assert!(matches!(e, GgufError::LimitExceeded { .. }), "{e}");
    // Plausible counts that the file cannot hold fail fast.
    let e = GgufFile::from_bytes(header(3, 60_000, 0)).unwrap_err();
    assert!(matches!(e, GgufError::Truncated { .. }), "{e}");
    let e = GgufFile::from_bytes(header(3, 0, 60_000)).unwrap_err();
    assert!(matches!(e, GgufError::Truncated { .. }), "{e}");
}

#[test]
fn huge_array_in_small_file_fails_without_allocating() {
    let mut bytes = header(3, 0, 1);
    push_str(&mut bytes, "big");
    bytes.extend_from_slice(&9u32.to_le_bytes()); // array
    bytes.extend_from_slice(&4u32.to_le_bytes()); // of u32
    bytes.extend_from_slice(&1_000_000_000u64.to_le_bytes());
    bytes.resize(1024, 0);
    let e = GgufFile::from_bytes(bytes.clone()).unwrap_err();
    assert!(matches!(e, GgufError::LimitExceeded { .. }), "{e}");
    // Under the hard limit but far more than the file holds.
    let pos = 24 + 8 + 3 + 4 + 4;
    bytes[pos..pos + 8].copy_from_slice(&(60u64 << 20).to_le_bytes());
    let e = GgufFile::from_bytes(bytes.clone()).unwrap_err();
    assert!(matches!(e, GgufError::Truncated { .. }), "{e}");
    assert!(e.to_string().contains("'big'"), "{e}");
    // Strings: a length of 2^63.
    let mut bytes = header(3, 0, 1);
    push_str(&mut bytes, "s");
    bytes.extend_from_slice(&8u32.to_le_bytes());
    bytes.extend_from_slice(&(1u64 << 63).to_le_bytes());
    let e = GgufFile::from_bytes(bytes).unwrap_err();
    assert!(matches!(e, GgufError::LimitExceeded { .. }), "{e}");
}

#[test]
fn nesting_deeper_than_two_is_rejected() {
    let mut bytes = header(3, 0, 1);
    push_str(&mut bytes, "deep");
    bytes.extend_from_slice(&9u32.to_le_bytes());
    for _ in 0..3 {
        bytes.extend_from_slice(&9u32.to_le_bytes());
        bytes.extend_from_slice(&1u64.to_le_bytes());
    }
    bytes.resize(bytes.len() + 64, 0);
    let e = GgufFile::from_bytes(bytes).unwrap_err();
    assert!(matches!(e, GgufError::LimitExceeded { ref what, .. } if what.contains("deep")), "{e}");
}

#[test]
fn unknown_value_and_tensor_types() {
    let mut bytes = header(3, 0, 1);
    push_str(&mut bytes, "weird");
    bytes.extend_from_slice(&13u32.to_le_bytes());
    bytes.extend_from_slice(&[0; 8]);
    let e = GgufFile::from_bytes(bytes).unwrap_err();
    assert!(matches!(e, GgufError::UnknownValueType { ref key, ty: 13 } if key == "weird"), "{e}");

    let mut bytes = header(3, 0, 1);
    push_str(&mut bytes, "weird_array");
    bytes.extend_from_slice(&9u32.to_le_bytes());
    bytes.extend_from_slice(&99u32.to_le_bytes());
    bytes.extend_from_slice(&1u64.to_le_bytes());
    bytes.extend_from_slice(&[0; 8]);
    let e = GgufFile::from_bytes(bytes).unwrap_err();
    assert!(matches!(e, GgufError::UnknownValueType { ty: 99, .. }), "{e}");

    let mut bytes = header(3, 1, 0);
    push_str(&mut bytes, "t");
    bytes.extend_from_slice(&1u32.to_le_bytes());
    bytes.extend_from_slice(&4u64.to_le_bytes());
    bytes.extend_from_slice(&5u32.to_le_bytes()); // removed Q4_2
    bytes.extend_from_slice(&0u64.to_le_bytes());
    bytes.resize(64, 0);
    let e = GgufFile::from_bytes(bytes).unwrap_err();
    assert!(matches!(e, GgufError::UnknownTensorType { ref tensor, ty: 5 } if tensor == "t"), "{e}");
    assert_eq!(e.to_string(), "GGUF tensor 't' has unknown ggml type 5");
}

/// Builds a one-tensor file with the given dims, type id and offset (data section padded with `extra`).
fn one_tensor(dims: &[u64], ty: u32, offset: u64, extra: usize) -> Vec<u8> {
    let mut bytes = header(3, 1, 0);
    push_str(&mut bytes, "w");
    bytes.extend_from_slice(&(dims.len() as u32).to_le_bytes());
    for d in dims {
        bytes.extend_from_slice(&d.to_le_bytes());
    }
    bytes.extend_from_slice(&ty.to_le_bytes());
    bytes.extend_from_slice(&offset.to_le_bytes());
    bytes.resize(bytes.len().next_multiple_of(32) + extra, 0);
    bytes
}

#[test]
fn bad_tensors_are_rejected_with_the_name() {
    assert!(GgufFile::from_bytes(one_tensor(&[4], 0, 0, 16)).is_ok());
    let cases: &[(&[u64], u32, u64, usize, &str)] = &[
        (&[4], 0, 0, 15, "outside the file"),
        (&[4], 0, 32, 16, "outside the file"),
        (&[4], 0, 8, 64, "not a multiple of the alignment"),
        (&[0], 0, 0, 64, "zero dimension"),
        (&[], 0, 0, 64, "0 dimensions"),
        (&[1, 1, 1, 1, 1], 0, 0, 64, "5 dimensions"),
        (&[33], 8, 0, 64, "not a multiple of the Q8_0 block size 32"),
        (&[1 << 40, 1 << 40], 0, 0, 64, "overflows"),
        (&[1 << 62], 0, 0, 64, "overflows"),
        (&[4], 0, u64::MAX - 31, 64, "outside the file"),
    ];
    for (dims, ty, offset, extra, expected) in cases {
        let e = GgufFile::from_bytes(one_tensor(dims, *ty, *offset, *extra)).unwrap_err();
        let text = e.to_string();
        assert!(matches!(e, GgufError::BadTensor { ref tensor, .. } if tensor == "w"), "{text}");
        assert!(text.contains(expected), "{dims:?}: {text}");
        assert!(!text.contains('\n'));
    }
}

#[test]
fn duplicates_and_bad_alignment() {
    let mut bytes = header(3, 0, 2);
    for _ in 0..2 {
        push_str(&mut bytes, "k");
        bytes.extend_from_slice(&0u32.to_le_bytes());
        bytes.push(1);
    }
    assert!(matches!(GgufFile::from_bytes(bytes), Err(GgufError::DuplicateKey(k)) if k == "k"));

    let mut bytes = header(3, 2, 0);
    for _ in 0..2 {
        push_str(&mut bytes, "t");
        bytes.extend_from_slice(&1u32.to_le_bytes());
        bytes.extend_from_slice(&1u64.to_le_bytes());
        bytes.extend_from_slice(&0u32.to_le_bytes());
        bytes.extend_from_slice(&0u64.to_le_bytes());
    }
    bytes.resize(256, 0);
    assert!(matches!(GgufFile::from_bytes(bytes), Err(GgufError::DuplicateTensor(t)) if t == "t"));

    for (value, ok) in [(0u32, false), (3, false), (1, true), (64, true), (1 << 31, false)] {
        let mut bytes = header(3, 0, 1);
        push_str(&mut bytes, "general.alignment");
        bytes.extend_from_slice(&4u32.to_le_bytes());
        bytes.extend_from_slice(&value.to_le_bytes());
        let result = GgufFile::from_bytes(bytes);
        assert_eq!(result.is_ok(), ok, "alignment {value}: {result:?}");
    }
    let mut bytes = header(3, 0, 1);
    push_str(&mut bytes, "general.alignment");
    bytes.extend_from_slice(&8u32.to_le_bytes());
    push_str(&mut bytes, "32");
    assert!(matches!(GgufFile::from_bytes(bytes), Err(GgufError::WrongType { .. })));
}

#[test]
fn invalid_utf8_names_the_offset() {
    let mut bytes = header(3, 0, 1);
    bytes.extend_from_slice(&2u64.to_le_bytes());
    bytes.extend_from_slice(&[0xff, 0xfe]);
    bytes.extend_from_slice(&[0; 8]);
    let e = GgufFile::from_bytes(bytes).unwrap_err();
    assert!(matches!(e, GgufError::InvalidUtf8 { offset: 32 }), "{e}");
}

#[test]
fn truncation_at_every_length() {
    let valid = small_valid_file();
    assert!(GgufFile::from_bytes(valid.clone()).is_ok());
    for len in 0..valid.len() {
        let result = GgufFile::from_bytes(valid[..len].to_vec());
        // Only the trailing padding after the last tensor may be cut without error.
        if let Ok(file) = result {
            let end = file.tensors.iter().map(|t| file.data_offset() + t.offset as usize + t.n_bytes).max();
            assert!(end.unwrap_or(0) <= len, "length {len} parsed but tensors do not fit");
        }
    }
}

#[test]
fn random_and_mutated_inputs_never_panic() {
    let valid = small_valid_file();
    let mut rng = Rng(0x1234_5678_9abc_def1);
    for round in 0..10_000 {
        let bytes = match round % 5 {
            // Pure random bytes, with and without the magic.
            0 => {
                let n = rng.below(300);
                let mut b: Vec<u8> = (0..n).map(|_| rng.next() as u8).collect();
                if round % 2 == 0 && b.len() >= 8 {
                    b[..8].copy_from_slice(b"GGUF\x03\0\0\0");
                }
                b
            }
            // A few random byte flips.
            1 | 2 => {
                let mut b = valid.clone();
                for _ in 0..1 + rng.below(4) {
                    let i = rng.below(b.len());
                    b[i] = rng.next() as u8;
                }
                b
            }
            // Overwrite an aligned u64 with an extreme value (counts, lengths, dims, offsets).
            3 => {
                let mut b = valid.clone();
                let i = rng.below(b.len() - 8);
                let v = [u64::MAX, 1 << 63, 1 << 32, 0, 1, 65_537, rng.next()][rng.below(7)];
                b[i..i + 8].copy_from_slice(&v.to_le_bytes());
                b
            }
            // Flip then truncate.
            _ => {
                let mut b = valid.clone();
                let i = rng.below(b.len());
                b[i] ^= 1 << rng.below(8);
                b.truncate(rng.below(b.len() + 1));
                b
            }
        };
        exercise(bytes);
    }
}
