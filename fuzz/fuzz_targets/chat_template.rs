//! The chat-template renderer with hostile templates: the input is the template, a NUL, then messages (one per
//! line, `role:content`). Loops and recursion must end in an error (fuel, recursion limit), output is bounded.
//!
//! Templates with `*` are skipped: in minijinja a list repeated a trillion times and then concatenated to a
//! string is one instruction of unbounded time and memory, which no limit of ours can see (fuzz/README.md,
//! "Known limit"). Everything else a template can do is fuzzed.
#![no_main]
use libfuzzer_sys::fuzz_target;
use tokenizer::chat::{render, Message};

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let (template, rest) = text.split_once('\0').unwrap_or((&text, "user:hi"));
    if template.contains('*') {
        return;
    }
    let messages: Vec<Message> = rest
        .lines()
        .take(64)
        .map(|l| {
            let (role, content) = l.split_once(':').unwrap_or(("user", l));
            Message::new(role, content)
        })
        .collect();
    let _ = render(template, &messages, data.len() % 2 == 0, "<s>", "</s>");
});
