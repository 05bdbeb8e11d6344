//! The GGUF reader and the model loader: header, metadata, tensor index, tensor data bounds, then the
//! architecture's configuration and weight shapes. Every input is `Ok` or a typed error; on `Ok`, every typed
//! getter, every tensor's bytes and (for small models) the embedding of each token must be reachable without a
//! panic.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(file) = gguf::GgufFile::from_bytes(data.to_vec()) else { return };
    let _ = file.architecture();
    for (key, _) in &file.metadata {
        let _ = file.get_u32(key);
        let _ = file.get_u64(key);
        let _ = file.get_i64(key);
        let _ = file.get_f32(key);
        let _ = file.get_bool(key);
        let _ = file.get_str(key);
        let _ = file.get_str_array(key);
        let _ = file.get_f32_array(key);
        let _ = file.get_i32_array(key);
    }
    let mut total = 0usize;
    for info in &file.tensors {
        let bytes = file.tensor_bytes(info);
        total = total.wrapping_add(bytes.len()).wrapping_add(info.n_elements()).wrapping_add(info.n_rows());
        assert!(file.tensor(&info.name).is_some());
    }
    std::hint::black_box(total);
    let Ok(model) = model::Model::from_gguf(file) else { return };
    let c = &model.config;
    if c.n_embd <= 4096 && c.vocab_size <= 1 << 16 {
        let mut row = vec![0f32; c.n_embd];
        for id in [0, 1, c.vocab_size as u32 - 1, c.vocab_size as u32, u32::MAX] {
            let _ = model.embed(&[id], &mut row);
        }
    }
});
