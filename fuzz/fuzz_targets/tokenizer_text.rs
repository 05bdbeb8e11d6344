//! Encoding and decoding arbitrary bytes with the real default models' tokenizers (SmolLM2: byte-level BPE,
//! Gemma 3: SentencePiece-style, Qwen2.5: BPE with the qwen2 pre-tokenizer). The first byte picks the model and
//! the flags; the rest is text (invalid UTF-8 replaced) and, read as little-endian u32s, ids to decode.
//! Models come from `SPECEE_FUZZ_MODELS` (colon-separated GGUF paths) or the default models (`specee fetch all`).
#![no_main]
use libfuzzer_sys::fuzz_target;
use std::sync::OnceLock;
use tokenizer::Tokenizer;

fn tokenizers() -> &'static [Tokenizer] {
    static ALL: OnceLock<Vec<Tokenizer>> = OnceLock::new();
    ALL.get_or_init(|| {
        let paths: Vec<std::path::PathBuf> = match std::env::var("SPECEE_FUZZ_MODELS") {
            Ok(list) => list.split(':').map(Into::into).collect(),
            Err(_) => engine::fetch::DefaultModel::ALL.into_iter().map(engine::fetch::model_path).collect(),
        };
        let all: Vec<Tokenizer> = paths
            .iter()
            .filter_map(|p| gguf::GgufFile::open(p).ok())
            .map(|f| Tokenizer::from_gguf(&f).expect("a default model's tokenizer loads"))
            .collect();
        assert!(!all.is_empty(), "no model found: set SPECEE_FUZZ_MODELS or run `specee fetch all`");
        all
    })
}

fuzz_target!(|data: &[u8]| {
    let Some((&first, rest)) = data.split_first() else { return };
    let all = tokenizers();
    let tok = &all[first as usize % all.len()];
    let (add, parse) = (first & 0x40 != 0, first & 0x80 != 0);
    let text = String::from_utf8_lossy(rest);
    let ids = tok.encode(&text, add, parse);
    assert!(ids.iter().all(|&id| (id as usize) < tok.vocab_size()));
    let back = tok.decode(&ids);
    // Qwen's byte-level BPE has a token for every byte, so text without special tokens comes back unchanged
    // (SmolLM2's drops some control bytes, as llama.cpp's does: its vocabulary lacks them).
    if !add && !parse && tok.token_id("<|fim_prefix|>").is_some() && std::str::from_utf8(rest).is_ok() {
        assert_eq!(back, text, "decode(encode(text)) changed the text");
    }
    let ids: Vec<u32> = rest.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
    let _ = tok.decode(&ids);
    let mut stream = tokenizer::StreamDecoder::new();
    for &id in &ids {
        let _ = stream.push(tok, id);
    }
    let _ = stream.flush();
});
