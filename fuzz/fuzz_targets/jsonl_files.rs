//! The JSON-lines and JSON files users hand to commands: prompt files (`bench --prompts`, `eval`), reasoning
//! problems (`eval-reasoning`), training records (`train-draft`, `train-exit`) and reasoning profiles.
#![no_main]
use libfuzzer_sys::fuzz_target;
use std::path::Path;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let path = Path::new("fuzz.jsonl");
    let _ = engine::bench::parse_prompt_lines(text, path);
    let _ = engine::reasoning::parse_problems(text, path);
    let _ = train::data::parse_records(text, path);
    let _ = engine::reasoning::ReasoningProfile::parse(text, path);
});
