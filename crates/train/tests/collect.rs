//! `collect` runs several records side by side (`CollectOptions::batch`), each in its own cache: on the real
//! SmolLM2 model its data (tokens, features, where answers start) equals, bit for bit, what running the records
//! one at a time through the speculative decoder gives, whatever the batch size, with chat records that stop at
//! end of generation or at `max_new`, texts, and records too short to use.

use std::path::PathBuf;
use train::data::{collect, collect_one_by_one, CollectOptions, Record};

fn smollm2() -> PathBuf {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let dir = std::env::var_os("SPECEE_MODELS_DIR").map(PathBuf::from).unwrap_or_else(|| root.join("models"));
    let p = dir.join("SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(p.exists(), "{} missing: run `cargo run --release -- fetch` first", p.display());
    p
}

fn chat(text: &str) -> Record {
    Record::Chat(vec![tokenizer::chat::Message::new("user", text)])
}

#[test]
fn batched_collection_equals_one_record_at_a_time() {
    let engine = engine::Engine::load(&smollm2()).unwrap();
    let records = vec![
        chat("What is the capital of France? One word."),
        Record::Text("The quick brown fox jumps over the lazy dog. It was a sunny day in the park.".into()),
        chat("Write a Python function that adds two numbers."),
        Record::Text("Hi".into()),
        chat("Say yes."),
        chat("List three colors."),
        Record::Text("def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n".into()),
    ];
    let opts = CollectOptions { max_new: 24, max_input: 40, threads: 2, batch: 1 };
    let want = collect_one_by_one(&engine, &records, opts).unwrap();
    assert_eq!(want.n_sequences(), 6, "the 1-token text is skipped");
    let answers: Vec<usize> = (0..6).map(|s| want.sequence(s).end - want.generated_from(s)).collect();
    assert!(answers.contains(&24), "an answer cut at max_new: {answers:?}");
    assert!(answers.iter().any(|&n| (1..24).contains(&n)), "an answer ended by the model: {answers:?}");
    for batch in [1, 3, 8] {
        let mut calls = Vec::new();
        let got = collect(&engine, &records, CollectOptions { batch, ..opts }, |done, _| calls.push(done)).unwrap();
        assert_eq!(calls, (1..=records.len()).collect::<Vec<_>>(), "batch {batch}: progress after every record");
        assert_eq!(got.tokens, want.tokens, "batch {batch}: tokens");
        assert_eq!(got.seq_starts, want.seq_starts, "batch {batch}");
        assert_eq!(got.gen_starts, want.gen_starts, "batch {batch}");
        assert!(got.features == want.features, "batch {batch}: features differ");
    }
}
