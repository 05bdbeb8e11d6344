//! `specee bench -m PATH [-t N] [-p P] [-n N] [-d D] [-r R] [--batch-curve] [--llama-cpp] [--json]`: prompt and
//! decode speed (median, min, max over R runs; after D tokens of context with `-d`, as llama-bench's `-d`),
//! optionally the multi-row batch curve and llama.cpp measured side by side in the same run with the ratio: its
//! own `llama-bench` (built once from the `llama-cpp-python` source archive by `scripts/build_llama_cpp.sh`), or
//! with `--llama-cpp-binding` the Python package itself.
//!
//! `specee bench --mode eagle|ngram|specee|specee-eagle|dense --prompts FILE.jsonl [-n N]`: decodes N tokens (greedy, stopping
//! at end of generation) after every prompt of the file (`{"prompt": "..."}` raw, or `{"messages": [...]}`
//! rendered with the chat template) densely and with the mode, and reports decode tok/s of both and the speed-up.
//! Lossless modes (eagle, ngram) must give ids identical to dense (the command fails otherwise) and report τ
//! (tokens per target forward, bonus included) and the time shares of drafting and verifying; the lossy
//! `specee` and `specee-eagle` report their agreement with dense (mean matching prefix, exact matches), average
//! layers run (per token; per tree forward for `specee-eagle`), predictor calls and failed verifications per
//! token, and τ for `specee-eagle`; the tree modes also print the draft tree they ran (`tree` in `--json`).

use super::{generate_with, ModeArgs, ModelArgs, RunStats};
use engine::bench::{bench, bench_tokens, median, read_prompts, BenchParams};
use serde_json::{json, Value};
use std::process::Command;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub mode: ModeArgs,
    /// Prompt set for comparing decoding modes (JSON lines: {"prompt": ...} or {"messages": [...]}).
    #[arg(long)]
    pub prompts: Option<std::path::PathBuf>,
    /// Prompt tokens for the prompt-processing test.
    #[arg(short = 'p', long = "n-prompt", default_value_t = 128)]
    pub prompt: usize,
    /// Tokens for the decode test.
    #[arg(short = 'n', long = "n-gen", default_value_t = 128)]
    pub gen: usize,
    /// Tokens of context already in the cache before each prompt and decode test (llama-bench's `-d`): speed
    /// deep into a conversation, where attention reads the whole cache every token.
    #[arg(short = 'd', long = "n-depth", default_value_t = 0, conflicts_with = "prompts")]
    pub depth: usize,
    /// Repetitions (after one warm-up).
    #[arg(short = 'r', long = "repetitions", default_value_t = 5)]
    pub reps: usize,
    /// Also measure one forward of k = 1, 2, 4, 8, 16 rows with logits for every row.
    #[arg(long)]
    pub batch_curve: bool,
    /// Also measure llama.cpp on the same model, threads and token counts with its own `llama-bench` (built once
    /// from the llama-cpp-python source archive by scripts/build_llama_cpp.sh), and print the ratio.
    #[arg(long)]
    pub llama_cpp: bool,
    /// With --llama-cpp: measure through the llama-cpp-python package instead of llama-bench (its per-token
    /// Python overhead makes it read low on small models).
    #[arg(long, requires = "llama_cpp")]
    pub llama_cpp_binding: bool,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

fn stats(v: &[f64]) -> Value {
    let min = v.iter().copied().fold(f64::INFINITY, f64::min);
    let max = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    json!({ "median": median(v), "min": min, "max": max })
}

/// llama.cpp's figures, one per repetition (no prompt figures for a decode-only measurement).
struct LlamaCpp {
    prompt: Vec<f64>,
    decode: Vec<f64>,
    version: String,
    /// `llama-bench` or `llama-cpp-python`.
    tool: &'static str,
}

impl LlamaCpp {
    /// The `llama_cpp` object of `--json`: medians, min–max, version and tool (prompt figures when measured).
    fn summary(&self) -> Value {
        let mut v = json!({ "decode_tokens_per_s": median(&self.decode), "decode": stats(&self.decode),
            "version": self.version, "tool": self.tool });
        if !self.prompt.is_empty() {
            v["prompt_tokens_per_s"] = json!(median(&self.prompt));
            v["prompt"] = stats(&self.prompt);
        }
        v
    }
}

/// Per-repetition figures under `key` of a JSON object (`[x, …]`).
fn figures(v: &Value, key: &str) -> Vec<f64> {
    v[key].as_array().map(|a| a.iter().filter_map(|x| x.as_f64()).collect()).unwrap_or_default()
}

/// llama.cpp's speed on the same model and threads: `llama-bench` (llama.cpp's own C++ tool, built once by
/// `scripts/build_llama_cpp.sh`), or with `--llama-cpp-binding` the `llama-cpp-python` package on the same token
/// ids. An empty `prompt` measures decoding only.
fn llama_cpp(a: &Args, path: &str, threads: usize, prompt: &[u32], decode: &[u32]) -> anyhow::Result<LlamaCpp> {
    let reps = a.reps.max(1);
    if !a.llama_cpp_binding {
        return llama_bench(path, threads, reps, [prompt.len(), decode.len().saturating_sub(1).max(1), a.depth]);
    }
    if a.depth > 0 {
        anyhow::bail!("--n-depth is measured on llama.cpp's side by llama-bench, not by --llama-cpp-binding");
    }
    // The binding's script always times a prompt too: one token when only decoding is wanted, its figure dropped.
    let v = llama_cpp_binding(path, threads, reps, if prompt.is_empty() { &decode[..1] } else { prompt }, decode)?;
    Ok(LlamaCpp {
        prompt: if prompt.is_empty() { Vec::new() } else { figures(&v, "prompt_tokens_per_s") },
        decode: figures(&v, "decode_tokens_per_s"),
        version: v["version"].as_str().unwrap_or("?").to_string(),
        tool: "llama-cpp-python",
    })
}

/// The paths `scripts/build_llama_cpp.sh` prints (`KEY=PATH` lines), building llama.cpp's tools first if needed.
struct LlamaCppTools {
    lines: String,
}

impl LlamaCppTools {
    const SCRIPT: &'static str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../scripts/build_llama_cpp.sh");

    fn build() -> anyhow::Result<Self> {
        let built = Command::new("bash")
            .arg(Self::SCRIPT)
            .stderr(std::process::Stdio::inherit())
            .output()
            .map_err(|e| anyhow::anyhow!("cannot run bash for {}: {e}", Self::SCRIPT))?;
        if !built.status.success() {
            anyhow::bail!(
                "llama.cpp's tools are not built (scripts/build_llama_cpp.sh failed, see above); \
                 --llama-cpp-binding measures the llama-cpp-python package instead"
            );
        }
        Ok(Self { lines: String::from_utf8_lossy(&built.stdout).into_owned() })
    }

    fn get(&self, key: &str) -> Option<&str> {
        self.lines.lines().find_map(|l| l.strip_prefix(key).and_then(|r| r.strip_prefix('=')))
    }

    fn path(&self, key: &str) -> anyhow::Result<&str> {
        self.get(key).ok_or_else(|| anyhow::anyhow!("{} printed no {key} path", Self::SCRIPT))
    }

    fn version(&self) -> &str {
        self.get("LLAMA_CPP_VERSION").unwrap_or("?")
    }
}

/// Runs `llama-bench -p P -n N -r R -t T -o json` (P = 0: decode only) and keeps its per-repetition figures.
/// llama-bench's figures: `n_prompt` / `n_gen` tokens after `depth` tokens of context.
fn llama_bench(path: &str, threads: usize, reps: usize, n: [usize; 3]) -> anyhow::Result<LlamaCpp> {
    let [n_prompt, n_gen, depth] = n;
    let tools = LlamaCppTools::build()?;
    let bench = tools.path("LLAMA_BENCH")?;
    let out = Command::new(bench)
        .args(["-m", path, "-t", &threads.to_string(), "-r", &reps.to_string(), "-o", "json"])
        .args(["-p", &n_prompt.to_string(), "-n", &n_gen.to_string(), "-d", &depth.to_string()])
        .output()
        .map_err(|e| anyhow::anyhow!("cannot run {bench}: {e}"))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        anyhow::bail!("llama-bench failed ({}): {}", out.status, err.lines().last().unwrap_or("no output"));
    }
    let tests: Value =
        serde_json::from_slice(&out.stdout).map_err(|e| anyhow::anyhow!("llama-bench printed no JSON ({e})"))?;
    parse_llama_bench(&tests, tools.version())
}

/// llama.cpp's decode speed on the same prompts (our token ids, chat prompts already rendered) from its own
/// `llama-server` (`scripts/llama_server_bench.py`: greedy, `n_gen` tokens each, the server's own timings of the
/// generated tokens), and the ids it wrote per prompt.
fn llama_server(
    path: &str,
    threads: usize,
    prompts: &[Vec<u32>],
    n_gen: usize,
    ctx: usize,
) -> anyhow::Result<(LlamaCpp, Vec<Vec<u32>>)> {
    use std::io::Write;
    let tools = LlamaCppTools::build()?;
    let server = tools.path("LLAMA_SERVER")?;
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../../scripts/llama_server_bench.py");
    let mut child = Command::new("python3")
        .args([script, "--server", server, "--model", path, "--threads", &threads.to_string()])
        .args(["--n", &n_gen.to_string(), "--ctx", &ctx.to_string()])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .map_err(|e| anyhow::anyhow!("cannot run python3 for {script}: {e}"))?;
    let mut stdin = child.stdin.take().expect("piped stdin");
    for ids in prompts {
        writeln!(stdin, "{}", ids.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(","))?;
    }
    drop(stdin);
    let out = child.wait_with_output()?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        anyhow::bail!("llama-server's side failed: {}", err.lines().last().unwrap_or("no output"));
    }
    let v: Value =
        serde_json::from_slice(&out.stdout).map_err(|e| anyhow::anyhow!("{script} printed no JSON ({e})"))?;
    parse_llama_server(&v, tools.version(), prompts.len())
}

/// `scripts/llama_server_bench.py`'s JSON as one figure (all tokens over all decode time) and the ids per prompt.
fn parse_llama_server(v: &Value, version: &str, n_prompts: usize) -> anyhow::Result<(LlamaCpp, Vec<Vec<u32>>)> {
    let rows = v["per_prompt"].as_array().filter(|r| r.len() == n_prompts).ok_or_else(|| {
        anyhow::anyhow!("llama-server's side answered for another number of prompts than the {n_prompts} sent")
    })?;
    let (mut tokens, mut ms) = (0f64, 0f64);
    let mut ids = Vec::new();
    for r in rows {
        tokens += r["tokens"].as_f64().unwrap_or(0.0);
        ms += r["decode_ms"].as_f64().unwrap_or(0.0);
        let row = r["ids"].as_array().map(|a| a.iter().filter_map(|x| x.as_u64()).map(|x| x as u32).collect());
        ids.push(row.unwrap_or_default());
    }
    anyhow::ensure!(tokens > 0.0 && ms > 0.0, "llama-server reported no decode timings");
    let decode = vec![tokens * 1000.0 / ms];
    Ok((LlamaCpp { prompt: Vec::new(), decode, version: version.to_string(), tool: "llama-server" }, ids))
}

/// llama-bench's JSON (one object per test: `n_prompt`, `n_gen`, `samples_ts`) as our per-repetition figures.
fn parse_llama_bench(tests: &Value, version: &str) -> anyhow::Result<LlamaCpp> {
    let tests = tests.as_array().ok_or_else(|| anyhow::anyhow!("llama-bench's JSON is not a list of tests"))?;
    // Prompt tests have n_gen 0, decode tests n_prompt 0.
    let samples = |prompt_test: bool| -> Vec<f64> {
        let key = if prompt_test { "n_gen" } else { "n_prompt" };
        tests.iter().filter(|t| t[key].as_u64() == Some(0)).flat_map(|t| figures(t, "samples_ts")).collect()
    };
    let decode = samples(false);
    if decode.is_empty() {
        anyhow::bail!("llama-bench's JSON has no decode (tg) figures");
    }
    Ok(LlamaCpp { prompt: samples(true), decode, version: version.to_string(), tool: "llama-bench" })
}

fn llama_cpp_binding(path: &str, threads: usize, reps: usize, prompt: &[u32], decode: &[u32]) -> anyhow::Result<Value> {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../../scripts/llama_cpp_bench.py");
    let join = |v: &[u32]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(",");
    let out = Command::new("python3")
        .args([script, "--model", path, "--threads", &threads.to_string(), "--reps", &reps.to_string()])
        .args(["--prompt-ids", &join(prompt), "--decode-ids", &join(decode)])
        .output()
        .map_err(|e| anyhow::anyhow!("cannot run python3 for the llama.cpp side: {e}"))?;
    if !out.status.success() {
        use std::os::unix::process::ExitStatusExt;
        if let Some(sig) = out.status.signal() {
            // Seen on an Intel CPU with AMX: llama-cpp-python built with GGML_NATIVE dies in ggml's AMX path.
            anyhow::bail!(
                "llama.cpp crashed (signal {sig}). On a CPU with AMX, a natively built llama-cpp-python can crash in \
                 its AMX matmul: rebuild it with CMAKE_ARGS=\"-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON \
                 -DGGML_F16C=ON -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF\" \
                 pip install --force-reinstall --no-deps llama-cpp-python (see README)"
            );
        }
        let err = String::from_utf8_lossy(&out.stderr);
        anyhow::bail!("llama.cpp (llama-cpp-python) failed: {}", err.lines().last().unwrap_or("no output"));
    }
    Ok(serde_json::from_slice(&out.stdout)?)
}

pub fn run(a: Args) -> anyhow::Result<()> {
    if a.prompts.is_some() || a.mode.mode() != engine::speculative::Mode::Dense {
        return run_prompts(a);
    }
    let path = engine::resolve_model(a.model.model.clone(), true)?;
    let eng = engine::Engine::load(&path)?;
    let threads = a.model.threads();
    let p = BenchParams {
        prompt_tokens: a.prompt,
        decode_tokens: a.gen,
        depth: a.depth,
        repetitions: a.reps.max(1),
        threads,
        batch_curve: if a.batch_curve { vec![1, 2, 4, 8, 16] } else { Vec::new() },
    };
    let quiet = a.json;
    let r = bench(&eng, &p, |line| {
        if !quiet {
            eprintln!("{line}");
        }
    })?;
    let pp: Vec<f64> = r.runs.iter().map(|x| x.prompt_tokens_per_s).collect();
    let tg: Vec<f64> = r.runs.iter().map(|x| x.decode_tokens_per_s).collect();
    let mut out = json!({
        "model": path.display().to_string(),
        "threads": threads,
        "isa": kernels::detected_isa(),
        "n_prompt": a.prompt,
        "n_gen": a.gen,
        "n_depth": a.depth,
        "prompt_tokens_per_s": median(&pp),
        "decode_tokens_per_s": median(&tg),
        "prompt": stats(&pp),
        "decode": stats(&tg),
        "runs": r.runs.iter().map(|x| json!({"prompt_tokens_per_s": x.prompt_tokens_per_s, "decode_tokens_per_s": x.decode_tokens_per_s})).collect::<Vec<_>>(),
    });
    if !r.curve.is_empty() {
        out["batch_curve"] =
            r.curve.iter().map(|c| json!({"rows": c.rows, "ms": c.ms, "relative": c.relative})).collect();
    }
    if a.llama_cpp {
        let prompt = bench_tokens(&eng, a.prompt.max(1));
        let decode = bench_tokens(&eng, a.gen.max(1) + 1);
        let l = llama_cpp(&a, &path.display().to_string(), threads, &prompt, &decode)?;
        out["llama_cpp"] = l.summary();
        out["ratio"] = json!({ "prompt": median(&pp) / median(&l.prompt), "decode": median(&tg) / median(&l.decode) });
    }
    if a.json {
        println!("{out}");
        return Ok(());
    }
    let s = |v: &Value| {
        format!(
            "{:8.1} ({:.1}–{:.1})",
            v["median"].as_f64().unwrap_or(0.0),
            v["min"].as_f64().unwrap_or(0.0),
            v["max"].as_f64().unwrap_or(0.0)
        )
    };
    let at = if a.depth > 0 { format!(" @ d{}", a.depth) } else { String::new() };
    println!("| engine | threads | pp{}{at} tok/s (min–max) | tg{}{at} tok/s (min–max) |", a.prompt, a.gen);
    println!("| --- | --- | --- | --- |");
    println!(
        "| specee ({}) | {threads} | {} | {} |",
        out["isa"].as_str().unwrap_or("?"),
        s(&out["prompt"]),
        s(&out["decode"])
    );
    if let Some(l) = out.get("llama_cpp") {
        println!(
            "| llama.cpp {} ({}) | {threads} | {} | {} |",
            l["version"].as_str().unwrap_or("?"),
            l["tool"].as_str().unwrap_or("?"),
            s(&l["prompt"]),
            s(&l["decode"])
        );
        println!(
            "\nratio specee / llama.cpp: prompt {:.2}×, decode {:.2}×",
            out["ratio"]["prompt"].as_f64().unwrap_or(0.0),
            out["ratio"]["decode"].as_f64().unwrap_or(0.0)
        );
    }
    if let Some(curve) = out.get("batch_curve").and_then(|c| c.as_array()) {
        println!("\n| rows k | ms per forward (logits for all k) | time vs k=1 |");
        println!("| --- | --- | --- |");
        for c in curve {
            println!(
                "| {} | {:.2} | {:.2}× |",
                c["rows"],
                c["ms"].as_f64().unwrap_or(0.0),
                c["relative"].as_f64().unwrap_or(0.0)
            );
        }
    }
    Ok(())
}

/// `--prompts`: dense vs the mode on a prompt set.
fn run_prompts(a: Args) -> anyhow::Result<()> {
    let mode = a.mode.mode();
    let Some(prompts_path) = a.prompts.as_deref() else {
        anyhow::bail!("--mode {} needs --prompts FILE.jsonl", mode);
    };
    let (eng, path) = a.model.load_with_path()?;
    let threads = a.model.threads();
    let prompts = read_prompts(&eng, prompts_path)?;
    // The steady state: the head screen (if the model uses one) is built now, not during a timed prompt.
    eng.model.warm_head_screen(threads);
    let params = engine::GenerateParams { max_tokens: a.gen, ..Default::default() };
    let ctx = prompts.iter().map(|p| p.len()).max().unwrap_or(0) + a.gen + 128;
    let (mut dense_s, mut mode_s, mut tokens, mut identical) = (0f64, 0f64, 0usize, true);
    let mut total = decode::speculative::SpeculativeStats::default();
    let mut exit_total = decode::specee::SpecEeStats::default();
    let mut merged_total = decode::specee::MergedStats::default();
    let (mut prefix_sum, mut exact) = (0usize, 0usize);
    let lossless = mode.is_lossless();
    let mut per_prompt = Vec::new();
    let mut dense_ids = Vec::new();
    let mut tree = None;
    for (i, ids) in prompts.iter().enumerate() {
        let dense = eng.generate(ids, &params, ctx, threads, |_| true)?;
        let runner = a.mode.runner(&eng, &path)?;
        tree = runner.tree();
        let (g, run_stats) = generate_with(&eng, runner, ids, &params, ctx, threads, |_| true)?;
        let st = run_stats.speculative().unwrap_or_default();
        match run_stats {
            RunStats::Specee(s) => exit_total.add(&s),
            RunStats::Merged(s) => merged_total.add(&s),
            _ => {}
        }
        let same = g.generated_ids == dense.generated_ids;
        identical &= same;
        let prefix = dense.generated_ids.iter().zip(&g.generated_ids).take_while(|(x, y)| x == y).count();
        prefix_sum += prefix;
        exact += usize::from(same);
        dense_s += dense.timings.decode_seconds;
        mode_s += g.timings.decode_seconds;
        tokens += g.generated_ids.len();
        total.add(&st);
        let row = json!({
            "prompt_tokens": ids.len(),
            "tokens": g.generated_ids.len(),
            "dense_tokens_per_s": dense.timings.decode_tokens_per_s(),
            "tokens_per_s": g.timings.decode_tokens_per_s(),
            "acceptance_length": st.acceptance_length(),
            "identical_to_dense": same,
            "matching_prefix": prefix,
        });
        if !a.json {
            eprintln!(
                "prompt {}/{}: {} tokens, dense {:.1} tok/s, {} {:.1} tok/s, τ {:.2}{}",
                i + 1,
                prompts.len(),
                g.generated_ids.len(),
                dense.timings.decode_tokens_per_s(),
                mode,
                g.timings.decode_tokens_per_s(),
                st.acceptance_length(),
                match (same, lossless) {
                    (true, _) => String::new(),
                    (false, true) => " — OUTPUT DIFFERS FROM DENSE".to_string(),
                    (false, false) => format!(", same as dense for {prefix} tokens"),
                }
            );
        }
        per_prompt.push(row);
        dense_ids.push(dense.generated_ids);
    }
    let decode_share = (total.draft_time + total.verify_time).as_secs_f64().max(1e-9);
    let mut out = json!({
        "model": path.display().to_string(),
        "mode": mode.name(),
        "threads": threads,
        "prompts": prompts.len(),
        "n_gen": a.gen,
        "tokens": tokens,
        "dense_decode_tokens_per_s": tokens as f64 / dense_s.max(1e-9),
        "decode_tokens_per_s": tokens as f64 / mode_s.max(1e-9),
        "speedup_vs_dense": dense_s / mode_s.max(1e-9),
        "acceptance_length": total.acceptance_length(),
        "drafted_per_forward": total.drafted_nodes as f64 / total.target_forwards.max(1) as f64,
        "draft_share": total.draft_time.as_secs_f64() / decode_share,
        "verify_share": total.verify_time.as_secs_f64() / decode_share,
        "identical_to_dense": identical,
        "tree": tree.map(|t| t.to_string()),
        "per_prompt": per_prompt,
    });
    let exits: engine::early_exit::ExitSummary = match mode {
        engine::speculative::Mode::SpeceeEagle => (&merged_total).into(),
        _ => (&exit_total).into(),
    };
    if !lossless {
        let k = prompts.len().max(1) as f64;
        out["mean_matching_prefix"] = json!(prefix_sum as f64 / k);
        out["exact_match"] = json!(exact as f64 / k);
        out["avg_layers"] = json!(exits.avg_layers);
        out["exit_rate"] = json!(exits.exit_rate);
        out["predictor_calls_per_token"] = json!(exits.predictor_calls_per_token);
        out["verify_failures_per_token"] = json!(exits.verify_failures_per_token);
    }
    if a.llama_cpp {
        let model = path.display().to_string();
        let l = if a.llama_cpp_binding {
            llama_cpp(&a, &model, threads, &[], &bench_tokens(&eng, a.gen.max(1) + 1))?.summary()
        } else {
            let (l, ids) = llama_server(&model, threads, &prompts, a.gen, ctx)?;
            // Its greedy answers, against our dense ones (the same up to near-ties and EOS handling).
            let same = ids.iter().zip(&dense_ids).filter(|(l, d)| same_answer(l, d)).count();
            let common: usize =
                ids.iter().zip(&dense_ids).map(|(l, d)| l.iter().zip(d).take_while(|(x, y)| x == y).count()).sum();
            let mut v = l.summary();
            v["same_as_dense"] = json!(same);
            v["mean_prefix_as_dense"] = json!(common as f64 / prompts.len().max(1) as f64);
            v
        };
        out["ratio_vs_llama_cpp"] = json!(
            out["decode_tokens_per_s"].as_f64().unwrap_or(0.0) / l["decode_tokens_per_s"].as_f64().unwrap_or(1.0)
        );
        out["llama_cpp"] = l;
    }
    if a.json {
        println!("{out}");
    } else {
        println!("| mode | prompts | tokens | dense tok/s | mode tok/s | speed-up | τ | drafting | identical |");
        println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- |");
        println!(
            "| {} | {} | {} | {:.1} | {:.1} | {:.2}× | {:.2} | {:.0}% | {} |",
            out["mode"].as_str().unwrap_or(""),
            prompts.len(),
            tokens,
            out["dense_decode_tokens_per_s"].as_f64().unwrap_or(0.0),
            out["decode_tokens_per_s"].as_f64().unwrap_or(0.0),
            out["speedup_vs_dense"].as_f64().unwrap_or(0.0),
            out["acceptance_length"].as_f64().unwrap_or(0.0),
            100.0 * out["draft_share"].as_f64().unwrap_or(0.0),
            identical
        );
        if let Some(t) = tree {
            println!("\ndraft tree {t} (depth, top-k, budget, least path probability)");
        }
        if !lossless {
            println!(
                "\nagreement with dense: mean matching prefix {:.1} tokens, {:.0}% of outputs identical; \
                 {:.2} of {} layers per {}, {:.0}% settled by a predictor, {:.2} predictor calls and {:.3} failed \
                 verifications per token",
                out["mean_matching_prefix"].as_f64().unwrap_or(0.0),
                100.0 * out["exact_match"].as_f64().unwrap_or(0.0),
                exits.avg_layers,
                eng.model.config.n_layers,
                if mode.is_lossless() || mode == engine::speculative::Mode::Specee { "token" } else { "tree forward" },
                100.0 * exits.exit_rate,
                exits.predictor_calls_per_token,
                exits.verify_failures_per_token
            );
        }
        if let Some(l) = out.get("llama_cpp") {
            let what = match l["same_as_dense"].as_u64() {
                Some(same) => format!(
                    "the same {} prompts; its greedy answers are our dense ones on {same}, for {:.1} tokens on average",
                    prompts.len(),
                    l["mean_prefix_as_dense"].as_f64().unwrap_or(0.0)
                ),
                None => format!("tg{}", a.gen),
            };
            println!(
                "\nllama.cpp {} decode ({}, {what}): {:.1} tok/s; {} / llama.cpp: {:.2}×",
                l["version"].as_str().unwrap_or("?"),
                l["tool"].as_str().unwrap_or("?"),
                l["decode_tokens_per_s"].as_f64().unwrap_or(0.0),
                out["mode"].as_str().unwrap_or(""),
                out["ratio_vs_llama_cpp"].as_f64().unwrap_or(0.0)
            );
        }
    }
    if lossless && !identical {
        anyhow::bail!("the {} output differs from dense greedy on some prompt", mode);
    }
    Ok(())
}

/// Whether llama.cpp's greedy answer `theirs` is ours: the same ids, where one may stop at an end-of-generation
/// token the other keeps (llama-server returns it, our generate does not).
fn same_answer(theirs: &[u32], ours: &[u32]) -> bool {
    let n = theirs.len().min(ours.len());
    theirs[..n] == ours[..n] && theirs.len().abs_diff(ours.len()) <= 1
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The shape `llama-bench -o json` prints (fields trimmed): one object per test, pp then tg.
    const LLAMA_BENCH_JSON: &str = r#"[
      {"build_commit": "x", "model_type": "qwen2 1B Q4_K - Medium", "n_threads": 2, "n_prompt": 128, "n_gen": 0,
       "avg_ts": 201.5, "stddev_ts": 1.5, "samples_ns": [1, 2], "samples_ts": [200.0, 203.0]},
      {"build_commit": "x", "model_type": "qwen2 1B Q4_K - Medium", "n_threads": 2, "n_prompt": 0, "n_gen": 64,
       "avg_ts": 40.5, "stddev_ts": 0.5, "samples_ns": [1, 2], "samples_ts": [40.0, 41.0]}
    ]"#;

    #[test]
    fn llama_bench_json_becomes_per_repetition_figures() {
        let v = parse_llama_bench(&serde_json::from_str(LLAMA_BENCH_JSON).unwrap(), "0.3.36").unwrap();
        assert_eq!(v.prompt, [200.0, 203.0]);
        assert_eq!(v.decode, [40.0, 41.0]);
        assert_eq!(v.tool, "llama-bench");
        assert_eq!(v.version, "0.3.36");
    }

    #[test]
    fn llama_server_answers_become_one_figure_over_all_prompts() {
        let v = json!({"per_prompt": [{"tokens": 100, "decode_ms": 2000.0, "ids": [5, 6, 2]},
                                      {"tokens": 50, "decode_ms": 1000.0, "ids": [7]}]});
        let (l, ids) = parse_llama_server(&v, "0.3.36", 2).unwrap();
        assert_eq!(l.decode, [50.0]);
        assert_eq!((l.tool, ids), ("llama-server", vec![vec![5, 6, 2], vec![7]]));
        assert!(parse_llama_server(&v, "0.3.36", 3).is_err());
        let silent = json!({"per_prompt": [{"tokens": 0, "decode_ms": 0.0, "ids": []}]});
        assert_eq!(
            parse_llama_server(&silent, "0.3.36", 1).err().unwrap().to_string(),
            "llama-server reported no decode timings"
        );
        assert!(same_answer(&[5, 6, 2], &[5, 6]) && same_answer(&[5, 6], &[5, 6]));
        assert!(!same_answer(&[5, 7], &[5, 6]) && !same_answer(&[5], &[5, 6, 7]));
    }

    #[test]
    fn llama_bench_json_without_decode_figures_is_an_error() {
        let only_pp: Value = serde_json::from_str(LLAMA_BENCH_JSON).unwrap();
        let only_pp = json!([only_pp[0].clone()]);
        let e = parse_llama_bench(&only_pp, "0.3.36").err().unwrap().to_string();
        assert_eq!(e, "llama-bench's JSON has no decode (tg) figures");
        let e = parse_llama_bench(&json!({"error": 1}), "0.3.36").err().unwrap().to_string();
        assert_eq!(e, "llama-bench's JSON is not a list of tests");
    }
}
