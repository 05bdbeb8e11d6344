//! What grammar-constrained decoding would cost per token with `llguidance` (issue #37 asks to measure this before
//! writing anything): for each model, builds llguidance's token trie from our own tokenizer's token bytes, compiles
//! a few JSON schemas, then walks a valid instance of each (tokenized by our tokenizer, as a model would write it)
//! token by token: the time of `compute_mask` before each token, and how often the grammar forces what comes next.
//!
//!     cargo run --release --manifest-path bench/llg_mask/Cargo.toml -- models/SmolLM2-135M-Instruct.Q4_1.gguf …
//!
//! Prints one table row per model and schema: compile ms, mask µs (median, p90, max), steps, and the steps before
//! which the grammar forced the next bytes (`compute_ff_bytes`: text jump-forward could commit without the model).

use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
use std::sync::Arc;
use std::time::Instant;
use toktrie::{ApproximateTokEnv, TokRxInfo, TokTrie};

/// (name, schema, a valid instance as a model would write it).
fn cases() -> Vec<(&'static str, serde_json::Value, &'static str)> {
    use serde_json::json;
    vec![
        (
            "person",
            json!({"type": "object", "properties": {
                "name": {"type": "string"}, "age": {"type": "integer"},
                "email": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}},
                "required": ["name", "age", "email", "tags"], "additionalProperties": false}),
            r#"{"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "tags": ["math", "engines", "poetry"]}"#,
        ),
        (
            "enums",
            json!({"type": "object", "properties": {
                "status": {"enum": ["pending", "approved", "rejected", "cancelled", "on_hold"]},
                "priority": {"enum": ["low", "medium", "high", "critical"]},
                "department": {"enum": ["engineering", "marketing", "sales", "support", "finance", "legal"]}},
                "required": ["status", "priority", "department"], "additionalProperties": false}),
            r#"{"status": "approved", "priority": "critical", "department": "engineering"}"#,
        ),
        (
            "nested",
            json!({"type": "object", "properties": {
                "order_id": {"type": "integer"},
                "customer": {"type": "object", "properties": {
                    "name": {"type": "string"}, "address": {"type": "object", "properties": {
                        "street": {"type": "string"}, "city": {"type": "string"}, "zip": {"type": "string"}},
                        "required": ["street", "city", "zip"], "additionalProperties": false}},
                    "required": ["name", "address"], "additionalProperties": false},
                "items": {"type": "array", "items": {"type": "object", "properties": {
                    "sku": {"type": "string"}, "quantity": {"type": "integer"}, "price": {"type": "number"}},
                    "required": ["sku", "quantity", "price"], "additionalProperties": false}}},
                "required": ["order_id", "customer", "items"], "additionalProperties": false}),
            r#"{"order_id": 1042, "customer": {"name": "Grace Hopper", "address": {"street": "12 Harbor Road", "city": "Arlington", "zip": "22201"}}, "items": [{"sku": "KB-101", "quantity": 2, "price": 49.5}, {"sku": "MS-7", "quantity": 1, "price": 19.99}]}"#,
        ),
        ("free json", json!({}), r#"{"answer": "The capital of France is Paris.", "confidence": 0.97, "sources": ["atlas"]}"#),
    ]
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn main() {
    let paths: Vec<String> = std::env::args().skip(1).collect();
    if paths.is_empty() {
        eprintln!("usage: llg-mask MODEL.gguf …");
        std::process::exit(2);
    }
    println!("| model | vocab | trie ms | schema | compile ms | steps | mask µs median / p90 / max | steps with forced bytes |");
    println!("| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: |");
    for path in &paths {
        let file = gguf::GgufFile::open(path).expect("open the GGUF file");
        let tok = tokenizer::Tokenizer::from_gguf(&file).expect("read its tokenizer");
        let n = tok.vocab_size();
        let t0 = Instant::now();
        // Special tokens get llguidance's marker byte, so no grammar can produce them as text.
        let words: Vec<Vec<u8>> = (0..n as u32)
            .map(|i| {
                let bytes = tok.token_bytes(i).to_vec();
                if tok.is_special(i) {
                    [vec![TokTrie::SPECIAL_TOKEN_MARKER], bytes].concat()
                } else {
                    bytes
                }
            })
            .collect();
        let eos = tok.eos().unwrap_or(0);
        let trie = TokTrie::from(&TokRxInfo::new(n as u32, eos), &words);
        let env: toktrie::TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        let factory = ParserFactory::new_simple(&env).expect("parser factory");
        let trie_ms = t0.elapsed().as_secs_f64() * 1e3;
        let name = std::path::Path::new(path).file_stem().unwrap().to_string_lossy().into_owned();
        for (schema_name, schema, instance) in cases() {
            let t1 = Instant::now();
            let parser = factory.create_parser(TopLevelGrammar::from_json_schema(schema));
            let mut matcher = Matcher::new(parser);
            let compile_ms = t1.elapsed().as_secs_f64() * 1e3;
            let ids = tok.encode(instance, false, false);
            let mut times = Vec::new();
            let (mut forced, mut forced_bytes) = (0, 0);
            for &id in &ids {
                let ff = matcher.compute_ff_bytes().len();
                forced += ff.min(1);
                forced_bytes += ff;
                let t = Instant::now();
                let mask = matcher.compute_mask().unwrap_or_else(|e| panic!("{name} {schema_name}: {e}"));
                times.push(t.elapsed().as_secs_f64() * 1e6);
                assert!(mask.is_allowed(id), "{name} {schema_name}: token {id} not allowed by the grammar");
                matcher.consume_token(id).unwrap_or_else(|e| panic!("{name} {schema_name}: {e}"));
            }
            times.sort_by(f64::total_cmp);
            println!(
                "| {name} | {n} | {trie_ms:.0} | {schema_name} | {compile_ms:.1} | {} | {:.0} / {:.0} / {:.0} | {forced} ({forced_bytes} bytes) |",
                ids.len(),
                percentile(&times, 0.5),
                percentile(&times, 0.9),
                times.last().unwrap()
            );
        }
    }
}
