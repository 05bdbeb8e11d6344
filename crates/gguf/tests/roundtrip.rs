//! Writer → reader roundtrips: every value type, several tensor types, the typed accessors.

use gguf::{GgmlType, GgufError, GgufFile, GgufWriter, Value};

fn all_values() -> Vec<(&'static str, Value)> {
    vec![
        ("v.u8", Value::U8(200)),
        ("v.i8", Value::I8(-100)),
        ("v.u16", Value::U16(60_000)),
        ("v.i16", Value::I16(-30_000)),
        ("v.u32", Value::U32(4_000_000_000)),
        ("v.i32", Value::I32(-2_000_000_000)),
        ("v.f32", Value::F32(1.5e-5)),
        ("v.bool", Value::Bool(true)),
        ("v.string", Value::String("héllo ▁world".into())),
        ("v.u64", Value::U64(u64::MAX)),
        ("v.i64", Value::I64(i64::MIN)),
        ("v.f64", Value::F64(-2.5e300)),
        ("v.empty_string", Value::String(String::new())),
        ("v.array_u8", Value::Array(vec![Value::U8(1), Value::U8(0)])),
        ("v.array_bool", Value::Array(vec![Value::Bool(true), Value::Bool(false), Value::Bool(true)])),
        ("v.array_i32", Value::Array(vec![Value::I32(-1), Value::I32(7)])),
        ("v.array_f32", Value::Array(vec![Value::F32(0.25), Value::F32(-8.0)])),
        ("v.array_str", Value::Array(vec!["a".into(), "".into(), "<|im_end|>".into()])),
        ("v.array_u64", Value::Array(vec![Value::U64(1 << 40)])),
        ("v.array_f64", Value::Array(vec![Value::F64(0.1)])),
        ("v.array_i16", Value::Array(vec![Value::I16(-3)])),
        ("v.array_u16", Value::Array(vec![Value::U16(3)])),
        ("v.array_i8", Value::Array(vec![Value::I8(-3)])),
        ("v.array_u32", Value::Array(vec![Value::U32(3)])),
        ("v.array_i64", Value::Array(vec![Value::I64(-3)])),
        ("v.array_empty", Value::Array(vec![])),
        (
            "v.array_nested",
            Value::Array(vec![
                Value::Array(vec![Value::U32(1), Value::U32(2)]),
                Value::Array(vec!["x".into()]),
                Value::Array(vec![]),
            ]),
        ),
    ]
}

/// Deterministic pseudo-random bytes.
fn bytes(n: usize, seed: u64) -> Vec<u8> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect()
}

#[test]
fn every_value_type_roundtrips_in_order() {
    let mut w = GgufWriter::new();
    for (k, v) in all_values() {
        w.add(k, v);
    }
    let file = GgufFile::from_bytes(w.to_bytes().unwrap()).unwrap();
    assert_eq!(file.version, 3);
    let expected: Vec<(String, Value)> = all_values().into_iter().map(|(k, v)| (k.to_owned(), v)).collect();
    assert_eq!(file.metadata, expected);
    for (k, v) in all_values() {
        assert_eq!(file.get(k), Some(&v), "{k}");
    }
    assert!(file.tensors.is_empty());
}

#[test]
fn tensors_roundtrip_with_alignment() {
    let types = [
        (GgmlType::F32, vec![5, 3]),
        (GgmlType::F16, vec![7]),
        (GgmlType::BF16, vec![2, 2, 2]),
        (GgmlType::Q4_0, vec![64, 3]),
        (GgmlType::Q4_1, vec![32, 1, 2]),
        (GgmlType::Q5_0, vec![32]),
        (GgmlType::Q8_0, vec![96, 5]),
        (GgmlType::Q4_K, vec![256, 2]),
        (GgmlType::Q6_K, vec![512, 1, 1, 3]),
        (GgmlType::I32, vec![3]),
    ];
    let mut w = GgufWriter::new();
    w.add("general.architecture", "test");
    let mut expected = Vec::new();
    for (i, (ty, dims)) in types.iter().enumerate() {
        let n = ty.row_bytes(dims[0]).unwrap() * dims[1..].iter().product::<usize>();
        let data = bytes(n, i as u64);
        w.add_tensor(format!("t{i}.weight"), dims, *ty, data.clone());
        expected.push((format!("t{i}.weight"), dims.clone(), *ty, data));
    }
    let file = GgufFile::from_bytes(w.to_bytes().unwrap()).unwrap();
    assert_eq!(file.alignment(), 32);
    assert_eq!(file.data_offset() % 32, 0);
    assert_eq!(file.tensors.len(), expected.len());
    for (info, (name, dims, ty, data)) in file.tensors.iter().zip(&expected) {
        assert_eq!((&info.name, &info.dims, info.ty), (name, dims, *ty));
        assert_eq!(info.offset % 32, 0);
        assert_eq!(info.n_elements(), dims.iter().product::<usize>());
        assert_eq!(file.tensor_bytes(info), &data[..]);
        assert_eq!(file.tensor_bytes(info).as_ptr() as usize % 32, 0, "{name} misaligned in memory");
        assert_eq!(file.tensor(name), Some(info));
    }
    assert!(file.tensor("missing").is_none());
}

#[test]
fn custom_alignment_is_honoured() {
    let mut w = GgufWriter::new();
    w.add("general.alignment", Value::U32(64));
    w.add_tensor("a", &[3], GgmlType::F32, vec![1; 12]);
    w.add_tensor("b", &[1], GgmlType::F32, vec![2; 4]);
    let file = GgufFile::from_bytes(w.to_bytes().unwrap()).unwrap();
    assert_eq!(file.alignment(), 64);
    assert_eq!(file.data_offset() % 64, 0);
    assert_eq!(file.tensor("b").unwrap().offset, 64);
    assert_eq!(file.tensor_bytes(file.tensor("b").unwrap()), &[2; 4]);

    let mut w = GgufWriter::new();
    w.add("general.alignment", Value::U32(48));
    assert!(matches!(w.to_bytes(), Err(GgufError::BadAlignment(48))));
}

#[test]
fn typed_accessors_convert_and_name_the_key() {
    let mut w = GgufWriter::new();
    for (k, v) in all_values() {
        w.add(k, v);
    }
    let file = GgufFile::from_bytes(w.to_bytes().unwrap()).unwrap();
    assert_eq!(file.get_u32("v.u16").unwrap(), 60_000);
    assert_eq!(file.get_u32("v.u8").unwrap(), 200);
    assert_eq!(file.get_u64("v.u64").unwrap(), u64::MAX);
    assert_eq!(file.get_i64("v.i8").unwrap(), -100);
    assert_eq!(file.get_f32("v.f32").unwrap(), 1.5e-5);
    assert_eq!(file.get_f32("v.u32").unwrap(), 4e9);
    assert!(file.get_bool("v.bool").unwrap());
    assert_eq!(file.get_str("v.string").unwrap(), "héllo ▁world");
    assert_eq!(file.get_array("v.array_i32").unwrap().len(), 2);
    assert_eq!(file.get_str_array("v.array_str").unwrap(), vec!["a", "", "<|im_end|>"]);
    assert_eq!(file.get_f32_array("v.array_f32").unwrap(), vec![0.25, -8.0]);
    assert_eq!(file.get_f32_array("v.array_i32").unwrap(), vec![-1.0, 7.0]);
    assert_eq!(file.get_i32_array("v.array_bool").unwrap(), vec![1, 0, 1]);
    assert_eq!(file.get_i32_array("v.array_u8").unwrap(), vec![1, 0]);
    assert_eq!(file.opt_u32("absent").unwrap(), None);
    assert_eq!(file.opt_u32("v.u8").unwrap(), Some(200));
    assert_eq!(file.opt_f32("absent").unwrap(), None);
    assert_eq!(file.opt_bool("v.bool").unwrap(), Some(true));
    assert_eq!(file.opt_str("v.string").unwrap(), Some("héllo ▁world"));

    let err = |r: Result<_, GgufError>| r.map(|_: ()| ()).unwrap_err().to_string();
    assert_eq!(err(file.get_u32("nope").map(drop)), "GGUF metadata key 'nope' is missing");
    assert_eq!(err(file.get_u32("v.i32").map(drop)), "GGUF key 'v.i32' has type i32, expected u32");
    assert_eq!(err(file.get_u32("v.u64").map(drop)), "GGUF key 'v.u64' has type u64, expected u32");
    assert_eq!(err(file.get_str("v.u8").map(drop)), "GGUF key 'v.u8' has type u8, expected string");
    assert_eq!(err(file.opt_bool("v.u8").map(drop)), "GGUF key 'v.u8' has type u8, expected bool");
    assert_eq!(
        err(file.get_str_array("v.array_u8").map(drop)),
        "GGUF key 'v.array_u8[0]' has type u8, expected string"
    );
    assert_eq!(
        err(file.get_i32_array("v.array_u64").map(drop)),
        "GGUF key 'v.array_u64[0]' has type u64, expected i32"
    );
    assert_eq!(err(file.architecture().map(drop)), "GGUF metadata key 'general.architecture' is missing");
}

#[test]
fn writer_rejects_bad_input_without_panicking() {
    let mut w = GgufWriter::new();
    w.add_tensor("t", &[32, 2], GgmlType::Q8_0, vec![0; 67]);
    let e = w.to_bytes().unwrap_err().to_string();
    assert_eq!(e, "GGUF tensor 't': Q8_0 dims [32, 2] need 68 bytes of data, got 67");

    let mut w = GgufWriter::new();
    w.add_tensor("t", &[33], GgmlType::Q8_0, vec![0; 34]);
    assert!(matches!(w.to_bytes(), Err(GgufError::BadTensor { .. })));

    let mut w = GgufWriter::new();
    w.add_tensor("t", &[], GgmlType::F32, vec![]);
    assert!(matches!(w.to_bytes(), Err(GgufError::BadTensor { .. })));

    let mut w = GgufWriter::new();
    w.add_tensor("t", &[1], GgmlType::F32, vec![0; 4]).add_tensor("t", &[1], GgmlType::F32, vec![0; 4]);
    assert!(matches!(w.to_bytes(), Err(GgufError::DuplicateTensor(name)) if name == "t"));

    let mut w = GgufWriter::new();
    w.add("k", Value::U8(1)).add("k", Value::U8(2));
    assert!(matches!(w.to_bytes(), Err(GgufError::DuplicateKey(k)) if k == "k"));

    let mut w = GgufWriter::new();
    w.add("k", Value::Array(vec![Value::U8(1), Value::I8(2)]));
    assert_eq!(w.to_bytes().unwrap_err().to_string(), "GGUF key 'k[1]' has type i8, expected u8");

    let deep = Value::Array(vec![Value::Array(vec![Value::Array(vec![])])]);
    let mut w = GgufWriter::new();
    w.add("deep", deep);
    assert!(matches!(w.to_bytes(), Err(GgufError::LimitExceeded { .. })));
}

#[test]
fn write_and_open_from_disk() {
    let dir = std::env::temp_dir().join(format!("gguf-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("tiny.gguf");
    let mut w = GgufWriter::new();
    w.add("general.architecture", "llama");
    w.add_tensor("x", &[4], GgmlType::F32, 1.0f32.to_le_bytes().repeat(4));
    w.write(&path).unwrap();
    let file = GgufFile::open(&path).unwrap();
    assert_eq!(file.architecture().unwrap(), "llama");
    assert_eq!(file.tensor_bytes(file.tensor("x").unwrap()), &1.0f32.to_le_bytes().repeat(4)[..]);
    drop(file);

    std::fs::write(&path, b"").unwrap();
    assert!(matches!(GgufFile::open(&path), Err(GgufError::Empty)));
    let missing = dir.join("missing.gguf");
    let e = GgufFile::open(&missing).unwrap_err().to_string();
    assert!(e.starts_with(&missing.display().to_string()), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}
