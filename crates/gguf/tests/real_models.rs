//! The two default models (if present under `<workspace>/models/`): metadata, tensor table and data
//! placement must match what llama.cpp's own `gguf` Python reader reports. Skipped, with a message, when
//! the files have not been fetched.

use std::path::PathBuf;
use std::time::Instant;

use gguf::{GgmlType, GgufFile};

fn model(name: &str) -> Option<PathBuf> {
    let dir = std::env::var_os("SPECEE_MODELS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models"));
    let path = dir.join(name);
    if path.exists() {
        Some(path)
    } else {
        eprintln!("skipping: {} not found (fetch the default models first)", path.display());
        None
    }
}

/// Every tensor lies inside the file, and consecutive tensors do not overlap.
fn check_layout(file: &GgufFile) {
    let mut spans: Vec<(u64, usize)> = file.tensors.iter().map(|t| (t.offset, t.n_bytes)).collect();
    spans.sort_unstable();
    for pair in spans.windows(2) {
        assert!(pair[0].0 + pair[0].1 as u64 <= pair[1].0, "overlap at {:?}", pair);
    }
    for t in &file.tensors {
        assert_eq!(file.tensor_bytes(t).len(), t.n_bytes, "{}", t.name);
    }
}

#[test]
fn smollm2_q4_1() {
    let Some(path) = model("SmolLM2-135M-Instruct.Q4_1.gguf") else {
        return;
    };
    let file = GgufFile::open(&path).unwrap();
    assert_eq!(file.version, 3);
    assert_eq!(file.metadata.len(), 33);
    assert_eq!(file.tensors.len(), 272);
    assert_eq!(file.architecture().unwrap(), "llama");
    assert_eq!(file.get_u32("llama.block_count").unwrap(), 30);
    assert_eq!(file.get_u32("llama.embedding_length").unwrap(), 576);
    assert_eq!(file.get_u32("llama.attention.head_count_kv").unwrap(), 3);
    assert_eq!(file.get_f32("llama.rope.freq_base").unwrap(), 100_000.0);
    assert_eq!(file.get_str("tokenizer.ggml.pre").unwrap(), "smollm");
    assert!(!file.get_bool("tokenizer.ggml.add_bos_token").unwrap());
    let tokens = file.get_str_array("tokenizer.ggml.tokens").unwrap();
    assert_eq!(tokens.len(), 49152);
    assert_eq!(&tokens[..3], &["<|endoftext|>", "<|im_start|>", "<|im_end|>"]);
    assert_eq!(file.get_i32_array("tokenizer.ggml.token_type").unwrap().len(), 49152);
    assert_eq!(file.get_str_array("tokenizer.ggml.merges").unwrap().len(), 48900);
    assert!(file.get_str("tokenizer.chat_template").unwrap().contains("<|im_start|>"));

    assert_eq!(file.alignment(), 32);
    assert_eq!(file.data_offset(), 1_785_664);
    let embd = file.tensor("token_embd.weight").unwrap();
    assert_eq!((embd.ty, embd.dims.as_slice()), (GgmlType::Q8_0, &[576, 49152][..]));
    assert_eq!(embd.n_bytes, 30_081_024);
    assert_eq!(&file.tensor_bytes(embd)[..8], &[0x32, 0x19, 0xd6, 0x0d, 0x13, 0xf7, 0xe5, 0xee]);
    let ffn_down = file.tensor("blk.0.ffn_down.weight").unwrap();
    assert_eq!((ffn_down.ty, ffn_down.dims.as_slice()), (GgmlType::Q4_1, &[1536, 576][..]));
    check_layout(&file);
}

#[test]
fn gemma3_q4_k_m() {
    let Some(path) = model("gemma-3-270m-q4_k_m.gguf") else {
        return;
    };
    let start = Instant::now();
    let file = GgufFile::open(&path).unwrap();
    let elapsed = start.elapsed();
    eprintln!("opened {} in {elapsed:?}", path.display());
    assert_eq!(file.architecture().unwrap(), "gemma3");
    assert_eq!(file.get_u32("gemma3.block_count").unwrap(), 18);
    assert_eq!(file.get_u32("gemma3.attention.key_length").unwrap(), 256);
    assert_eq!(file.get_u32("gemma3.attention.sliding_window").unwrap(), 512);
    assert_eq!(file.get_f32("gemma3.rope.freq_base").unwrap(), 1_000_000.0);
    assert_eq!(file.get_str("tokenizer.ggml.model").unwrap(), "llama");
    let tokens = file.get_str_array("tokenizer.ggml.tokens").unwrap();
    assert_eq!(tokens.len(), 262_144);
    assert_eq!((tokens[0], tokens[2], tokens[262_143]), ("<pad>", "<bos>", "<unused6241>"));
    assert_eq!(file.get_f32_array("tokenizer.ggml.scores").unwrap().len(), 262_144);
    assert_eq!(file.tensors.len(), 236);

    assert_eq!(file.data_offset(), 6_525_120);
    let embd = file.tensor("token_embd.weight").unwrap();
    assert_eq!((embd.ty, embd.dims.as_slice()), (GgmlType::Q8_0, &[640, 262_144][..]));
    assert_eq!(embd.offset, 2560);
    assert_eq!(&file.tensor_bytes(embd)[..8], &[0xf2, 0x10, 0xf4, 0x47, 0xc7, 0xdd, 0xec, 0x30]);
    let types: std::collections::BTreeSet<_> = file.tensors.iter().map(|t| t.ty).collect();
    let expected = [GgmlType::F32, GgmlType::Q5_0, GgmlType::Q8_0, GgmlType::Q4_K, GgmlType::Q6_K];
    assert_eq!(types, expected.into_iter().collect());
    check_layout(&file);
    // The test profile is optimised; a debug build is allowed more.
    assert!(elapsed.as_secs_f64() < 2.0, "opening took {elapsed:?}");
}
