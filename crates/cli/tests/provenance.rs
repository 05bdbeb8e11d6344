//! Trusted training caches and the manifests of shipped artifacts, through the CLI: a cache collected from other
//! records, options, held-out files or another model is rebuilt and says why (or reused with `--reuse-cache`,
//! naming what differs); an unchanged rerun reuses it; a head or predictor file made for another model is a
//! one-line error naming both; every shipped file carries a manifest that `specee inspect` prints, whose command
//! `heads/README.md` gives, and whose tensors are those shipped before manifests existed.

mod common;

use common::*;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::time::Duration;

fn run(args: &[String]) -> (bool, String) {
    let v: Vec<&str> = args.iter().map(String::as_str).collect();
    let o = specee(&v, Duration::from_secs(300));
    (o.status.success(), stderr(&o))
}

fn synthetic(name: &str) -> String {
    reference_dir().join("synthetic").join(name).to_str().unwrap().to_string()
}

struct Dir(PathBuf);

impl Dir {
    fn new(tag: &str) -> Dir {
        let dir = std::env::temp_dir().join(format!("specee-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Dir(dir)
    }
    fn write(&self, name: &str, text: &str) -> String {
        let p = self.0.join(name);
        std::fs::write(&p, text).unwrap();
        p.to_str().unwrap().to_string()
    }
    fn path(&self, name: &str) -> String {
        self.0.join(name).to_str().unwrap().to_string()
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Every case of a stale draft-head cache, on the tiny synthetic models (collection takes a moment).
#[test]
fn draft_caches_are_rebuilt_when_what_they_were_collected_from_changes() {
    let dir = Dir::new("cache-keys");
    let records = dir.write("recs.jsonl", "{\"text\": \"The quick brown fox jumps over the lazy dog.\"}\n");
    let held1 = dir.write("h1.jsonl", "{\"text\": \"A held-out sentence about the sea.\"}\n");
    let held2 = dir.write("h2.jsonl", "{\"text\": \"Another held-out sentence, about the hills.\"}\n");
    let out = dir.path("head.safetensors");
    let (llama, qwen) = (synthetic("synthetic-llama-gqa.gguf"), synthetic("synthetic-qwen2.gguf"));
    let train = |model: &str, held: &str, extra: &[&str]| -> (bool, String) {
        let base = ["train-draft", "-m", model, "--data", &records, "--heldout", held, "--out", &out, "--epochs", "0"];
        run(&base.iter().chain(extra).map(|s| s.to_string()).collect::<Vec<_>>())
    };
    let data_cache = dir.path("head.train-data.recs.safetensors");
    let held_cache = dir.path("head.heldout-data.safetensors");

    let (ok, err) = train(&llama, &held1, &["--max-new", "8"]);
    assert!(ok, "{err}");
    assert_eq!(err.matches("collected 1 sequences").count(), 2, "{err}");
    // Unchanged: both caches reused, nothing collected.
    let (ok, err) = train(&llama, &held1, &["--max-new", "8"]);
    assert!(ok, "{err}");
    assert!(err.contains(&format!("using cached {data_cache}")) && err.contains(&format!("using cached {held_cache}")));
    assert!(!err.contains("collected 1 sequences"), "{err}");
    // Another held-out file: the held-out cache (named after --out alone) is rebuilt, the training one kept.
    let (ok, err) = train(&llama, &held2, &["--max-new", "8"]);
    assert!(ok, "{err}");
    assert!(err.contains(&format!("rebuilding {held_cache}: records changed ({held2})")), "{err}");
    assert!(err.contains(&format!("using cached {data_cache}")), "{err}");
    // Edited records.
    std::fs::write(&records, "{\"text\": \"The lazy dog sleeps while the fox runs.\"}\n").unwrap();
    let (ok, err) = train(&llama, &held2, &["--max-new", "8"]);
    assert!(ok, "{err}");
    assert!(err.contains(&format!("rebuilding {data_cache}: records changed ({records})")), "{err}");
    // A changed option, accepted as it is with --reuse-cache (and named), else rebuilt.
    let (ok, err) = train(&llama, &held2, &["--max-new", "12", "--reuse-cache"]);
    assert!(ok, "{err}");
    assert!(err.contains(&format!("--reuse-cache: using {data_cache} although --max-new 8 -> 12")), "{err}");
    assert!(!err.contains("collected 1 sequences"), "{err}");
    let (ok, err) = train(&llama, &held2, &["--max-new", "12"]);
    assert!(ok, "{err}");
    assert!(err.contains(&format!("rebuilding {data_cache}: --max-new 8 -> 12")), "{err}");
    assert!(err.contains(&format!("rebuilding {held_cache}: --max-new 8 -> 12")), "{err}");
    // Another model.
    let (ok, err) = train(&qwen, &held2, &["--max-new", "12"]);
    assert!(ok, "{err}");
    let why = "another model (synthetic-llama-gqa.gguf -> synthetic-qwen2.gguf)";
    assert!(err.contains(&format!("rebuilding {data_cache}: {why}")), "{err}");
    // A cache from before keys existed is not trusted: stripping its key makes it one.
    let (ok, err) = run(&["inspect", &data_cache, "--set", "cache.entries="].map(String::from));
    assert!(ok, "{err}");
    let (ok, err) = train(&qwen, &held2, &["--max-new", "12"]);
    assert!(ok, "{err}");
    assert!(err.contains(&format!("rebuilding {data_cache}: made before caches were keyed")), "{err}");
    // `inspect` shows what a cache was collected from.
    let o = specee(&["inspect", &data_cache], Duration::from_secs(30));
    let text = stdout(&o);
    assert!(text.contains("cache key (what this cache was collected from):"), "{text}");
    assert!(text.contains("model: synthetic-qwen2.gguf ") && text.contains("--max-new: 12"), "{text}");
}

/// `train-exit`'s traces are keyed too (here its perfect-head trace, which stops after tracing).
#[test]
fn exit_traces_are_rebuilt_when_their_inputs_change() {
    let dir = Dir::new("exit-trace-keys");
    let m = smollm2();
    let m = m.to_str().unwrap();
    let records = dir.write(
        "recs.jsonl",
        "{\"text\": \"The quick brown fox jumps over the lazy dog.\"}\n{\"text\": \"Rivers run to the sea.\"}\n",
    );
    let out = dir.path("exit.safetensors");
    let trace = dir.path("exit.perfect-trace.recs.safetensors");
    let exit = |extra: &[&str]| {
        let base = ["train-exit", "-m", m, "--data", &records, "--out", &out, "--perfect-head", "-t", "2"];
        run(&base.iter().chain(extra).map(|s| s.to_string()).collect::<Vec<_>>())
    };
    let (ok, err) = exit(&[]);
    assert!(ok, "{err}");
    assert!(!err.contains("using cached"), "{err}");
    let (ok, err) = exit(&[]);
    assert!(ok && err.contains(&format!("using cached {trace}")), "{err}");
    let (ok, err) = exit(&["--limit", "1"]);
    assert!(ok && err.contains(&format!("rebuilding {trace}: --limit 0 -> 1")), "{err}");
    let head = workspace_root().join("heads/SmolLM2-135M-Instruct.Q4_1.draft.safetensors");
    let copy = dir.path("other-head.safetensors");
    std::fs::copy(&head, &copy).unwrap();
    // The same head under another name is the same input; an amended one is not.
    let (ok, err) = exit(&["--limit", "1", "--draft", &copy]);
    assert!(ok && err.contains(&format!("using cached {trace}")), "{err}");
    let (ok, err) = run(&["inspect", &copy, "--set", "note=amended"].map(String::from));
    assert!(ok, "{err}");
    let (ok, err) = exit(&["--limit", "1", "--draft", &copy]);
    assert!(ok && err.contains(&format!("rebuilding {trace}: draft head changed ({copy})")), "{err}");
    // A second record file is traced into its own cache; the first one's is used as it is.
    let more = dir.write("more.jsonl", "{\"text\": \"Seven swans swam over the still lake at dawn.\"}\n");
    let more_trace = dir.path("exit.perfect-trace.more.safetensors");
    let (ok, err) = exit(&["--limit", "1", "--draft", &copy, "--data", &more]);
    assert!(
        ok && err.contains(&format!("using cached {trace}")) && !err.contains(&format!("using cached {more_trace}")),
        "{err}"
    );
    assert!(std::path::Path::new(&more_trace).is_file(), "{err}");
    let (ok, err) = exit(&["--limit", "1", "--draft", &copy, "--data", &more]);
    assert!(ok && err.contains(&format!("using cached {more_trace}")), "{err}");
    // Two files of one name would share a cache: refused before anything runs.
    std::fs::create_dir_all(dir.path("sub")).unwrap();
    let same = dir.write("sub/recs.jsonl", "{\"text\": \"Another file of the same name.\"}\n");
    let (ok, err) = exit(&["--data", &same]);
    assert!(!ok && err.contains("two --data files are named \"recs\""), "{err}");
}

/// `train-exit --keep-states L` writes the normed state of every traced token after layers L.. beside the trace;
/// a file whose states are missing is traced again although its trace is cached.
#[test]
fn exit_traces_keep_the_hidden_states_asked_for() {
    let dir = Dir::new("exit-states");
    let m = smollm2();
    let m = m.to_str().unwrap();
    // Six texts (every fifth record is validation), teacher-forced after their first 16 tokens.
    let text: String = (0..6)
        .map(|i| {
            format!(
                "{{\"text\": \"Story {i}: the quick brown fox jumps over the lazy dog, then runs down the hill to \
                 the river, where it drinks the cold water and sleeps.\"}}\n"
            )
        })
        .collect();
    let records = dir.write("recs.jsonl", &text);
    let out = dir.path("exit.safetensors");
    let states = dir.path("exit.states.recs.f16");
    let exit = |extra: &[&str]| {
        let base = ["train-exit", "-m", m, "--data", &records, "--out", &out, "--epochs", "1", "--calibrate", "0"];
        run(&base.iter().chain(extra).chain(&["-t", "2"]).map(|s| s.to_string()).collect::<Vec<_>>())
    };
    let (ok, err) = exit(&["--keep-states", "28"]);
    assert!(ok, "{err}");
    let tokens: usize =
        err.split(" tokens traced").next().and_then(|s| s.rsplit('\n').next()).unwrap().trim().parse().unwrap();
    // SmolLM2: 30 layers, so layers 28 and 29, 576 values each, 2 bytes a value.
    assert!(tokens > 0);
    assert_eq!(std::fs::metadata(&states).unwrap().len() as usize, tokens * 2 * 576 * 2, "{err}");
    std::fs::remove_file(&states).unwrap();
    let (ok, err) = exit(&["--keep-states", "28"]);
    assert!(ok && !err.contains("using cached") && Path::new(&states).is_file(), "{err}");
    let (ok, err) = exit(&["--keep-states", "28"]);
    assert!(ok && err.contains("using cached"), "{err}");
    // Other layers: the cached trace's states do not fit, so it is traced again (one layer now).
    let (ok, err) = exit(&["--keep-states", "29"]);
    assert!(ok && err.contains("exit.states.recs.f16 does not fit that trace (other layers or tokens)"), "{err}");
    assert_eq!(std::fs::metadata(&states).unwrap().len() as usize, tokens * 576 * 2, "{err}");
    // Traced again without --keep-states (another --limit): the old states no longer match and are removed.
    let (ok, err) = exit(&["--limit", "5"]);
    assert!(ok && !err.contains("using cached") && !Path::new(&states).exists(), "{err}");
    let (ok, err) = exit(&["--keep-states", "30"]);
    assert!(!ok && err.contains("--keep-states 30: the model has layers 0..29"), "{err}");
}

fn shipped(name: &str) -> String {
    workspace_root().join("heads").join(name).to_str().unwrap().to_string()
}

/// A SmolLM2 head or predictor file on Gemma is one line naming both models, in every command that loads them.
#[test]
fn artifacts_made_for_another_model_are_refused_in_one_line() {
    let gemma = gemma3();
    let gemma = gemma.to_str().unwrap();
    let smol_head = shipped("SmolLM2-135M-Instruct.Q4_1.draft.safetensors");
    let smol_exit = shipped("SmolLM2-135M-Instruct.Q4_1.exit.safetensors");
    let gen = ["generate", "-m", gemma, "-p", "Hello", "-n", "4", "-t", "2"];
    let cases: [&[&str]; 3] = [
        &["--mode", "eagle", "--draft", &smol_head],
        &["--mode", "specee", "--draft", &smol_head],
        &["--mode", "specee", "--exit", &smol_exit],
    ];
    for extra in cases {
        let args: Vec<&str> = gen.iter().chain(extra).copied().collect();
        let o = specee(&args, Duration::from_secs(120));
        let err = stderr(&o);
        assert!(!o.status.success(), "{extra:?} ran: {err}");
        assert_eq!(err.trim_end().lines().count(), 1, "{extra:?}: {err}");
        assert!(err.starts_with("error: "), "{err}");
        assert!(err.contains("was made for SmolLM2-135M-Instruct.Q4_1.gguf (llama, 30 layers"), "{err}");
        assert!(err.contains("not for gemma-3-270m-q4_k_m.gguf (gemma3, 18 layers"), "{err}");
    }
}

/// The SHA-256 of each shipped file's tensors (`specee inspect`'s `tensor_sha256`): for the first four as shipped
/// before manifests were added (rewriting the files with manifests changed no tensor), for Qwen2.5-Coder's head
/// as fine-tuned on code (session 44), for its reasoning signal heads as first trained (session 45), for its exit
/// predictors as first shipped (session 63). A retrained file changes its entry here, on purpose.
const SHIPPED_TENSORS: [(&str, &str); 7] = [
    (
        "SmolLM2-135M-Instruct.Q4_1.draft.safetensors",
        "d93e1e2f766234d936ea2abaeb01ade4683a91f29c67bd6b5c402823a450a9ea",
    ),
    ("SmolLM2-135M-Instruct.Q4_1.exit.safetensors", "73833f9a6bbe67355d932bfc466846417dc7c367fbaa7773cd833611859f0428"),
    ("gemma-3-270m-q4_k_m.draft.safetensors", "3fc4efc4b9d8f6e9abafa13109dbfa2458946f2291e9ff2914f6884e206ed63c"),
    ("gemma-3-270m-q4_k_m.exit.safetensors", "46db67fcc463b8700f88a5fa0809a9c3c5314c36605ae023700c950c37ed3d16"),
    (
        "Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.draft.safetensors",
        "efb73348321e04463c840703e6c498e56b1dfd8b4c731b66889c91f0940bfe23",
    ),
    (
        "Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.exit.safetensors",
        "6cb849c3d1933c12c0de29a3f58c77fc8bf968941468ba735e6f7185918f240b",
    ),
    (
        "Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.reasoning.safetensors",
        "b4efae0a1f80ea7497e7732eb1f45fe64adc1b70a04ee6e57f04d26a4b8014f2",
    ),
];

/// The commands of `heads/README.md`'s section on `file` (`## <file> …` up to the next `## `), continuation
/// lines joined and whitespace collapsed.
fn readme_commands(readme: &str, file: &str) -> Vec<String> {
    let start = readme.find(&format!("\n## {file}")).unwrap_or_else(|| panic!("heads/README.md has no `## {file}`"));
    let section = &readme[start + 1..];
    let section = &section[..section[3..].find("\n## ").map_or(section.len(), |e| e + 3)];
    let mut commands = Vec::new();
    let mut current = String::new();
    for line in section.lines().filter(|l| l.starts_with("    ")) {
        let line = line.split("  #").next().unwrap().trim();
        current.push_str(line.trim_end_matches('\\'));
        current.push(' ');
        if !line.ends_with('\\') {
            commands.push(current.split_whitespace().collect::<Vec<_>>().join(" "));
            current.clear();
        }
    }
    commands
}

#[test]
fn shipped_files_carry_manifests_that_heads_readme_reproduces() {
    let readme = std::fs::read_to_string(workspace_root().join("heads/README.md")).unwrap();
    let mut files: Vec<String> = std::fs::read_dir(workspace_root().join("heads"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".safetensors"))
        .collect();
    files.sort();
    let listed: Vec<&str> = SHIPPED_TENSORS.iter().map(|(f, _)| *f).collect();
    for file in &files {
        let o = specee(&["inspect", "--json", &shipped(file)], Duration::from_secs(30));
        assert!(o.status.success(), "{file}: {}", stderr(&o));
        let v: Value = serde_json::from_str(stdout(&o).trim()).unwrap();
        let meta = &v["metadata"];
        let field =
            |k: &str| meta[k].as_str().unwrap_or_else(|| panic!("{file}: no `{k}` in its manifest")).to_string();
        // The base model matches the file name: `<model file stem>.<kind>.safetensors`.
        let base = field("base_model");
        let stem = Path::new(&base).file_stem().unwrap().to_string_lossy().into_owned();
        assert!(file.starts_with(&format!("{stem}.")), "{file} was made for {base}");
        for key in ["base_model.arch", "base_model.n_layers", "base_model.fingerprint", "date", "data.sha256"] {
            assert!(!field(key).is_empty(), "{file}: empty `{key}`");
        }
        let command = field("command");
        assert!(command.starts_with("specee train-"), "{file}: {command}");
        let commands = readme_commands(&readme, file);
        assert!(
            commands.contains(&command),
            "heads/README.md's section on {file} does not give its manifest's command\n  {command}\namong\n  {}",
            commands.join("\n  ")
        );
        let expected = SHIPPED_TENSORS.iter().find(|(f, _)| f == file).map(|(_, d)| *d);
        let expected = expected.unwrap_or_else(|| panic!("{file} is not in SHIPPED_TENSORS ({listed:?})"));
        assert_eq!(v["tensor_sha256"].as_str(), Some(expected), "{file}: its tensors changed");
    }
    assert_eq!(files.len(), SHIPPED_TENSORS.len(), "{files:?}");
}
