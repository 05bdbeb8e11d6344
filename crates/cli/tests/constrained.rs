//! Grammar-constrained generation on the real default models (`generate --json-schema / --grammar`): outputs
//! parse and follow their schema, eagle's constrained output is identical to dense's, the early-exit modes follow
//! it too, generation ends where the grammar does, and bad schemas, grammars and modes are clear one-line errors, never hangs.

mod common;

use common::*;
use serde_json::{json, Value};
use std::path::PathBuf;
use std::time::Duration;

fn write(name: &str, text: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("specee-constrained-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

/// `generate --json` with `extra` flags (`-n 160` unless they give one); the parsed output object.
fn generate(model: &str, prompt: &str, extra: &[&str]) -> Value {
    generate_as(model, prompt, true, extra)
}

/// [`generate`], the prompt rendered with the model's chat template when `chat` (Gemma 270M has none).
fn generate_as(model: &str, prompt: &str, chat: bool, extra: &[&str]) -> Value {
    let mut args = vec!["generate", "-m", model, "-p", prompt, "-t", "2", "--json"];
    if chat {
        args.push("--chat");
    }
    if !extra.contains(&"-n") {
        args.extend_from_slice(&["-n", "160"]);
    }
    args.extend_from_slice(extra);
    let o = specee(&args, Duration::from_secs(300));
    assert!(o.status.success(), "{args:?}: {}", stderr(&o));
    serde_json::from_str(&stdout(&o)).unwrap()
}

/// The schemas of these tests, each with a prompt that asks for it. Strings are bounded (a 135M model can
/// otherwise write one string forever) — as any user's schema for a small model should be.
fn cases() -> Vec<(&'static str, Value, &'static str)> {
    vec![
        (
            "person",
            json!({"type": "object", "properties": {
                "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
                "city": {"type": "string", "maxLength": 40}},
                "required": ["name", "age", "city"], "additionalProperties": false}),
            "Describe a person who lives in Paris as JSON.",
        ),
        (
            "enum",
            json!({"type": "object", "properties": {
                "sentiment": {"enum": ["positive", "negative", "neutral"]},
                "confidence": {"type": "number", "minimum": 0, "maximum": 1}},
                "required": ["sentiment", "confidence"], "additionalProperties": false}),
            "What is the sentiment of 'I loved this film'? Answer as JSON.",
        ),
        (
            "list",
            json!({"type": "object", "properties": {
                "items": {"type": "array", "items": {"type": "string", "maxLength": 20}, "minItems": 2, "maxItems": 4}},
                "required": ["items"], "additionalProperties": false}),
            "List some fruits as JSON.",
        ),
    ]
}

/// Checks `v` against the few schema keywords `cases` uses (the server test validates with `jsonschema`).
fn check(schema: &Value, v: &Value, at: &str) {
    if let Some(choices) = schema.get("enum") {
        assert!(choices.as_array().unwrap().contains(v), "{at}: {v} not in {choices}");
        return;
    }
    match schema["type"].as_str().unwrap() {
        "object" => {
            let o = v.as_object().unwrap_or_else(|| panic!("{at}: {v} is not an object"));
            let props = schema["properties"].as_object().unwrap();
            for key in schema["required"].as_array().unwrap() {
                assert!(o.contains_key(key.as_str().unwrap()), "{at}: {key} missing from {v}");
            }
            for (k, x) in o {
                let sub = props.get(k).unwrap_or_else(|| panic!("{at}: unexpected key {k}"));
                check(sub, x, &format!("{at}.{k}"));
            }
        }
        "array" => {
            let a = v.as_array().unwrap_or_else(|| panic!("{at}: {v} is not an array"));
            let (lo, hi) = (schema["minItems"].as_u64().unwrap(), schema["maxItems"].as_u64().unwrap());
            assert!((lo..=hi).contains(&(a.len() as u64)), "{at}: {} items", a.len());
            a.iter().for_each(|x| check(&schema["items"], x, at));
        }
        "string" => {
            let s = v.as_str().unwrap_or_else(|| panic!("{at}: {v} is not a string"));
            assert!(s.chars().count() as u64 <= schema["maxLength"].as_u64().unwrap(), "{at}: too long");
        }
        "integer" => {
            let n = v.as_i64().unwrap_or_else(|| panic!("{at}: {v} is not an integer"));
            assert!(n >= schema["minimum"].as_i64().unwrap() && n <= schema["maximum"].as_i64().unwrap());
        }
        "number" => {
            let n = v.as_f64().unwrap_or_else(|| panic!("{at}: {v} is not a number"));
            assert!(n >= schema["minimum"].as_f64().unwrap() && n <= schema["maximum"].as_f64().unwrap());
        }
        other => panic!("{at}: type {other} not used by these tests"),
    }
}

#[test]
fn json_schema_outputs_parse_validate_and_eagle_equals_dense() {
    let models = [smollm2(), qwen_coder()];
    for model in &models {
        let model = model.to_str().unwrap();
        for (name, schema, prompt) in cases() {
            let file = write(&format!("{name}.json"), &schema.to_string());
            let file = file.to_str().unwrap();
            let dense = generate(model, prompt, &["--json-schema", file, "--mode", "dense"]);
            let eagle = generate(model, prompt, &["--json-schema", file, "--mode", "eagle"]);
            let text = dense["text"].as_str().unwrap();
            let v: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{model} {name}: {text:?}: {e}"));
            check(&schema, &v, name);
            assert_eq!(dense["finish_reason"], "stop", "{model} {name}: the grammar's end ends generation");
            assert_eq!(eagle["generated_ids"], dense["generated_ids"], "{model} {name}: eagle differs from dense");
            assert!(eagle["speculative"]["acceptance_length"].as_f64().unwrap() > 1.0, "{model} {name}");
        }
    }
}

/// The early-exit modes under a schema: outputs parse and validate and end with the grammar; with an exit
/// threshold no predictor reaches they are constrained dense decoding, token for token (so a grammar's veto is
/// the only thing between a forbidden exit and the output). SmolLM2 and Gemma: the models with shipped predictors.
#[test]
fn early_exit_modes_follow_a_schema_and_never_exiting_is_constrained_dense() {
    let mut exits = 0.0;
    for (model, chat) in [(smollm2(), true), (gemma3(), false)] {
        let model = model.to_str().unwrap();
        let generate = |prompt: &str, extra: &[&str]| generate_as(model, prompt, chat, extra);
        for (name, mut schema, prompt) in cases() {
            // Unbounded digits: Gemma 270M without a chat template writes `1.000…` until the token limit.
            if let Some(c) = schema["properties"].get_mut("confidence") {
                *c = json!({"type": "integer", "minimum": 0, "maximum": 100});
            }
            let file = write(&format!("exit-{name}.json"), &schema.to_string());
            let file = file.to_str().unwrap();
            let dense = generate(prompt, &["--json-schema", file, "--mode", "dense"]);
            for mode in ["specee", "specee-eagle"] {
                let g = generate(prompt, &["--json-schema", file, "--mode", mode]);
                let text = g["text"].as_str().unwrap();
                let v: Value =
                    serde_json::from_str(text).unwrap_or_else(|e| panic!("{model} {mode} {name}: {text:?}: {e}"));
                check(&schema, &v, name);
                assert_eq!(g["finish_reason"], "stop", "{model} {mode} {name}");
                exits += g["early_exit"]["exit_rate"].as_f64().unwrap();
                let never = generate(prompt, &["--json-schema", file, "--mode", mode, "--exit-threshold", "2"]);
                assert_eq!(never["generated_ids"], dense["generated_ids"], "{model} {mode} {name}: never exiting");
                assert_eq!(never["early_exit"]["exit_rate"].as_f64(), Some(0.0));
            }
        }
    }
    assert!(exits > 0.0, "some tokens should exit under the schemas");
}

#[test]
fn checked_jump_forward_makes_the_tokens_of_decoding_without_it_in_fewer_forwards() {
    let models = [smollm2(), qwen_coder()];
    for model in &models {
        let model = model.to_str().unwrap();
        let (mut same, mut forced) = (0, 0);
        for (name, schema, prompt) in cases() {
            let file = write(&format!("jump-{name}.json"), &schema.to_string());
            let file = file.to_str().unwrap();
            let run = |how: &str, extra: &[&str]| {
                let mut args = vec!["--json-schema", file, "--mode", "dense", "--logprobs", "2", "--jump-forward", how];
                args.extend_from_slice(extra);
                generate(model, prompt, &args)
            };
            let (off, checked, unchecked) = (run("off", &[]), run("checked", &[]), run("unchecked", &[]));
            assert_eq!(
                checked["generated_ids"], off["generated_ids"],
                "{model} {name}: checked jump-forward is lossless"
            );
            assert_eq!(off["timings"]["forced_tokens"], 0, "{model} {name}");
            let n = checked["timings"]["forced_tokens"].as_u64().unwrap();
            assert!(n > 0, "{model} {name}: the schema forces keys");
            forced += n;
            // Every token, forced ones included, carries its log probability under the model: the forced rows
            // are rows of the same forwards, so the values are those of one forward per token.
            for (a, b) in checked["logprobs"].as_array().unwrap().iter().zip(off["logprobs"].as_array().unwrap()) {
                let (a, b) = (a["logprob"].as_f64().unwrap(), b["logprob"].as_f64().unwrap());
                assert!((a - b).abs() < 2e-3, "{model} {name}: {a} vs {b}");
            }
            // Unchecked: valid, its forced tokens committed as they are.
            let text = unchecked["text"].as_str().unwrap();
            let v: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{model} {name}: {text:?}: {e}"));
            check(&schema, &v, name);
            assert_eq!(unchecked["finish_reason"], "stop", "{model} {name}");
            same += usize::from(unchecked["generated_ids"] == off["generated_ids"]);
            // A token budget that ends inside a forced run is met exactly, with the same tokens.
            let ids = checked["generated_ids"].as_array().unwrap();
            let cut = ids.len() / 2;
            for how in ["checked", "unchecked"] {
                let short = run(how, &["-n", &cut.to_string()]);
                assert_eq!(short["generated_ids"].as_array().unwrap().len(), cut, "{model} {name} {how}: -n {cut}");
                assert_eq!(short["finish_reason"], "length");
            }
        }
        eprintln!(
            "{model}: jump-forward fed {forced} forced tokens; unchecked made {same} of {} answers as dense",
            cases().len()
        );
    }
}

#[test]
fn checked_jump_forward_under_sampling_draws_what_sampling_without_it_draws() {
    // Sampling wide (no top-k/top-p/min-p cut, temperature 1.5) over a grammar that forces nonsense: the model
    // sometimes draws another split of the forced bytes than the canonical tokens, which checked jump-forward must
    // then take instead (and the draws stay in step with the seed's), unchecked not.
    let model = smollm2();
    let model = model.to_str().unwrap();
    let lark =
        write("odd.lark", "start: \"Answer: xqzj-wvvkp Zyxx \" /[0-9]{1,3}/ \" and Qopfrab\" /[a-z]{1,6}/ \".\"\n");
    let mut rejected = 0;
    for seed in 1..=6 {
        let seed = seed.to_string();
        let run = |how: &str| {
            let args = ["--grammar", lark.to_str().unwrap(), "--mode", "dense", "--temp", "1.5", "--top-k", "0"];
            let mut args = args.to_vec();
            args.extend_from_slice(&["--top-p", "1", "--min-p", "0", "--seed", &seed, "--jump-forward", how]);
            generate(model, "Say something.", &args)
        };
        let (off, checked, unchecked) = (run("off"), run("checked"), run("unchecked"));
        assert_eq!(checked["generated_ids"], off["generated_ids"], "seed {seed}");
        assert!(checked["text"].as_str().unwrap().starts_with("Answer: xqzj-wvvkp Zyxx "), "{checked}");
        let forced = |g: &Value| g["timings"]["forced_tokens"].as_u64().unwrap();
        assert!(forced(&checked) > 0 && forced(&checked) <= forced(&unchecked), "seed {seed}");
        rejected += usize::from(forced(&checked) < forced(&unchecked));
    }
    assert!(rejected > 0, "no seed drew another split of the forced bytes: the check was never exercised");
}

#[test]
fn a_lark_grammar_and_sampling_under_a_schema() {
    let model = smollm2();
    let model = model.to_str().unwrap();
    let lark = write("yes-no.lark", "start: (\"yes\" | \"no\") \".\"\n");
    let g = generate(model, "Is Paris in France?", &["--grammar", lark.to_str().unwrap()]);
    assert!(["yes.", "no."].contains(&g["text"].as_str().unwrap()), "{g}");
    let (_, schema, prompt) = cases().remove(0);
    let file = write("sampled.json", &schema.to_string());
    for seed in ["1", "2", "3"] {
        let g = generate(model, prompt, &["--json-schema", file.to_str().unwrap(), "--temp", "0.8", "--seed", seed]);
        assert_eq!(g["mode"], "dense", "sampled decoding runs dense");
        let v: Value = serde_json::from_str(g["text"].as_str().unwrap()).unwrap();
        check(&schema, &v, "sampled");
    }
}

#[test]
fn bad_schemas_grammars_and_modes_are_one_line_errors() {
    let model = smollm2();
    let model = model.to_str().unwrap();
    let not_json = write("not.json", "{\"type\": ");
    let bad_type = write("bad-type.json", r#"{"type": "no-such-type"}"#);
    let bad_lark = write("bad.lark", "start: undefined_rule\n");
    let empty = write("empty.lark", "start: \"a\" & \n");
    let schema = write("ok.json", r#"{"type": "object"}"#);
    // Unsatisfiable schemas: no JSON value could follow them.
    let empty_range = write("empty-range.json", r#"{"type": "integer", "minimum": 5, "maximum": 3}"#);
    let no_type = write("no-type.json", r#"{"allOf": [{"type": "string"}, {"type": "integer"}]}"#);
    // A 20,000-value enum, 50 levels of objects (100 of JSON, within serde_json's recursion limit of 128; deeper files are
    // refused as not JSON): compiled (or refused) quickly, never a hang.
    let values: Vec<String> = (0..20_000).map(|i| format!("value-{i}")).collect();
    let huge = write("huge.json", &json!({"enum": values}).to_string());
    let mut deep = json!({"type": "integer"});
    for _ in 0..50 {
        deep = json!({"type": "object", "properties": {"a": deep}, "required": ["a"], "additionalProperties": false});
    }
    let deep = write("deep.json", &deep.to_string());
    let cases: [(Vec<&str>, &str); 9] = [
        (vec!["--json-schema", empty_range.to_str().unwrap()], "Unsatisfiable schema"),
        (vec!["--json-schema", no_type.to_str().unwrap()], "Unsatisfiable schema"),
        (vec!["--json-schema", not_json.to_str().unwrap()], "not JSON"),
        (vec!["--json-schema", bad_type.to_str().unwrap()], "grammar:"),
        (vec!["--grammar", bad_lark.to_str().unwrap()], "grammar:"),
        (vec!["--grammar", empty.to_str().unwrap()], "grammar:"),
        (vec!["--json-schema", "/no/such/schema.json"], "/no/such/schema.json"),
        (vec!["--json-schema", schema.to_str().unwrap(), "--mode", "specee-eagle", "--temp", "0.7"], "greedily only"),
        (vec!["--json-schema", schema.to_str().unwrap(), "--mode", "eagle", "--temp", "0.7"], "greedy"),
    ];
    for (extra, want) in cases {
        let mut args = vec!["generate", "-m", model, "-p", "Hello", "-n", "8", "-t", "2"];
        args.extend_from_slice(&extra);
        let o = specee(&args, Duration::from_secs(120));
        let err = stderr(&o);
        assert!(!o.status.success(), "{extra:?} should fail");
        assert!(err.contains(want), "{extra:?}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{extra:?}: one line: {err}");
        assert!(!err.contains("panicked"), "{extra:?}: {err}");
    }
    for file in [&huge, &deep] {
        let args = ["generate", "-m", model, "-p", "Pick one.", "--chat", "-n", "16", "-t", "2", "--json-schema"];
        let mut args = args.to_vec();
        args.push(file.to_str().unwrap());
        let o = specee(&args, Duration::from_secs(60));
        let err = stderr(&o);
        assert!(o.status.success() || err.starts_with("error: grammar:"), "{file:?}: {err}");
    }
}
