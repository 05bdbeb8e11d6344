//! Resource limits on hostile input: a chat template that loops or writes without end, a template too large,
//! and a GGUF that declares a 100M-entry vocabulary are refused quickly, with a clear error and little memory
//! (measured by a counting allocator, per thread).

#[path = "../../gguf/tests/support/peak_alloc.rs"]
mod peak_alloc;

use gguf::{GgufFile, GgufWriter, Value};
use tokenizer::chat::{render, Message, MAX_TEMPLATE_BYTES};
use tokenizer::{Tokenizer, TokenizerError};

#[global_allocator]
static ALLOC: peak_alloc::PeakAlloc = peak_alloc::PeakAlloc;

const MIB: usize = 1 << 20;

fn render_one(template: &str) -> (Result<String, TokenizerError>, usize) {
    peak_alloc::measure(|| render(template, &[Message::new("user", "hi")], true, "<s>", "</s>"))
}

#[test]
fn a_template_that_loops_runs_out_of_fuel() {
    let template = "{% for i in range(99999) %}{% for j in range(99999) %}{{ i }}{% endfor %}{% endfor %}";
    let (out, peak) = render_one(template);
    let err = out.unwrap_err().to_string();
    assert!(err.contains("fuel"), "{err}");
    assert!(peak < 16 * MIB, "peak {peak} bytes");
}

#[test]
fn a_template_that_writes_without_end_is_cut_at_the_output_limit() {
    let (out, peak) = render_one("{% for i in range(99999) %}{{ 'x' * 50000 }}{% endfor %}");
    let err = out.unwrap_err().to_string();
    assert!(err.contains("output passed"), "{err}");
    assert!(peak < 16 * MIB, "peak {peak} bytes");
}

#[test]
fn a_template_that_recurses_without_end_is_an_error() {
    let (out, peak) = render_one("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}");
    let err = out.unwrap_err().to_string();
    assert!(err.contains("recursion"), "{err}");
    assert!(peak < 64 * MIB, "peak {peak} bytes");
}

#[test]
fn a_template_too_large_is_refused_before_it_is_compiled() {
    let template = "x".repeat(MAX_TEMPLATE_BYTES + 1);
    let err = render(&template, &[], false, "", "").unwrap_err().to_string();
    assert!(err.contains("bytes; at most"), "{err}");
}

#[test]
fn real_templates_with_long_conversations_stay_within_the_limits() {
    let chatml = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";
    let messages: Vec<Message> =
        (0..2000).map(|i| Message::new(if i % 2 == 0 { "user" } else { "assistant" }, "y".repeat(500))).collect();
    let out = render(chatml, &messages, true, "", "").unwrap();
    assert!(out.len() > 2000 * 500);
}

/// A GGUF holding only `tokenizer.ggml.tokens`, its array length field overwritten with `declared`.
fn vocab_file(declared: u64) -> Vec<u8> {
    let mut w = GgufWriter::new();
    w.add("tokenizer.ggml.model", "gpt2").add("tokenizer.ggml.tokens", Value::Array(vec!["a".into(), "b".into()]));
    let mut bytes = w.to_bytes().unwrap();
    let key = b"tokenizer.ggml.tokens";
    let at = bytes.windows(key.len()).position(|w| w == key).unwrap() + key.len();
    // the value's type (u32), the element type (u32), then the length (u64)
    bytes[at + 8..at + 16].copy_from_slice(&declared.to_le_bytes());
    bytes
}

#[test]
fn a_vocabulary_of_100m_entries_is_refused_with_little_memory() {
    for declared in [100_000_000u64, 60_000_000, 3] {
        let (out, peak) = peak_alloc::measure(|| GgufFile::from_bytes(vocab_file(declared)));
        let err = out.unwrap_err().to_string();
        assert!(err.contains("tokenizer.ggml.tokens"), "{declared}: {err}");
        assert!(peak < MIB, "{declared}: peak {peak} bytes");
    }
    // the same file with its true length loads, and builds a (tiny) tokenizer or a clear error
    let file = GgufFile::from_bytes(vocab_file(2)).unwrap();
    assert!(matches!(Tokenizer::from_gguf(&file), Ok(_) | Err(TokenizerError::MissingKey(_))));
}
