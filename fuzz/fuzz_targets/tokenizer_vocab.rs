//! The tokenizer built from hostile GGUF metadata (tokens, merges, scores, token types, special-token ids, pre-
//! tokenizer name), then encoding and decoding arbitrary text with it. The input is structured (`Arbitrary`) so
//! that most executions reach the tokenizer instead of failing in the GGUF reader.
#![no_main]
use arbitrary::Arbitrary;
use gguf::{GgufFile, GgufWriter, Value};
use libfuzzer_sys::fuzz_target;

#[derive(Arbitrary, Debug)]
struct Input {
    spm: bool,
    pre: u8,
    tokens: Vec<String>,
    merges: Vec<String>,
    scores: Option<Vec<f32>>,
    types: Option<Vec<i32>>,
    specials: Vec<(u8, u32)>,
    add_bos: Option<bool>,
    template: Option<String>,
    text: String,
    ids: Vec<u32>,
}

const PRE: [&str; 8] = ["default", "smollm", "qwen2", "llama-bpe", "gpt2", "tekken", "unknown-pre", ""];
const SPECIAL_KEYS: [&str; 6] = [
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.unknown_token_id",
    "tokenizer.ggml.padding_token_id",
    "tokenizer.ggml.eot_token_id",
    "tokenizer.ggml.eom_token_id",
];

fuzz_target!(|input: Input| {
    if input.tokens.len() > 4096 || input.merges.len() > 4096 {
        return;
    }
    let mut w = GgufWriter::new();
    w.add("tokenizer.ggml.model", if input.spm { "llama" } else { "gpt2" });
    w.add("tokenizer.ggml.pre", PRE[input.pre as usize % PRE.len()]);
    w.add("tokenizer.ggml.tokens", Value::Array(input.tokens.iter().map(|t| t.as_str().into()).collect()));
    w.add("tokenizer.ggml.merges", Value::Array(input.merges.iter().map(|t| t.as_str().into()).collect()));
    if let Some(scores) = &input.scores {
        w.add("tokenizer.ggml.scores", Value::Array(scores.iter().map(|&s| Value::F32(s)).collect()));
    }
    if let Some(types) = &input.types {
        w.add("tokenizer.ggml.token_type", Value::Array(types.iter().map(|&t| Value::I32(t)).collect()));
    }
    for &(key, id) in input.specials.iter().take(6) {
        w.add(SPECIAL_KEYS[key as usize % SPECIAL_KEYS.len()], Value::U32(id));
    }
    if let Some(b) = input.add_bos {
        w.add("tokenizer.ggml.add_bos_token", Value::Bool(b));
    }
    if let Some(t) = &input.template {
        w.add("tokenizer.chat_template", t.as_str());
    }
    let Ok(bytes) = w.to_bytes() else { return };
    let file = GgufFile::from_bytes(bytes).expect("our own writer's file reads back");
    let Ok(tok) = tokenizer::Tokenizer::from_gguf(&file) else { return };
    for (add, parse) in [(false, false), (true, true)] {
        let ids = tok.encode(&input.text, add, parse);
        assert!(ids.iter().all(|&id| (id as usize) < tok.vocab_size()), "an id outside the vocabulary");
        let _ = tok.decode(&ids);
    }
    let _ = tok.decode(&input.ids);
    let mut stream = tokenizer::StreamDecoder::new();
    for &id in &input.ids {
        let _ = stream.push(&tok, id);
        let _ = tok.token_text(id);
        let _ = tok.is_special(id);
        let _ = tok.is_eog(id);
    }
    let _ = stream.flush();
    if tok.chat_template().is_some() {
        let _ = tok.render_chat(&[tokenizer::chat::Message::new("user", input.text.as_str())], true);
    }
});
