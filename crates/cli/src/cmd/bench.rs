//! `specee bench -m PATH [-t N] [-p P] [-n N] [-r R] [--batch-curve] [--llama-cpp] [--json]`: prompt and decode
//! speed (median, min, max over R runs), optionally the multi-row batch curve and llama.cpp measured side by
//! side in the same run (through the `llama-cpp-python` package) with the ratio.

use super::ModelArgs;
use engine::bench::{bench, bench_tokens, median, BenchParams};
use serde_json::{json, Value};
use std::process::Command;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Prompt tokens for the prompt-processing test.
    #[arg(short = 'p', long = "n-prompt", default_value_t = 128)]
    pub prompt: usize,
    /// Tokens for the decode test.
    #[arg(short = 'n', long = "n-gen", default_value_t = 128)]
    pub gen: usize,
    /// Repetitions (after one warm-up).
    #[arg(short = 'r', long = "repetitions", default_value_t = 5)]
    pub reps: usize,
    /// Also measure one forward of k = 1, 2, 4, 8, 16 rows with logits for every row.
    #[arg(long)]
    pub batch_curve: bool,
    /// Also measure llama.cpp (llama-cpp-python) on the same model, threads and tokens, and print the ratio.
    #[arg(long)]
    pub llama_cpp: bool,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

fn stats(v: &[f64]) -> Value {
    let min = v.iter().copied().fold(f64::INFINITY, f64::min);
    let max = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    json!({ "median": median(v), "min": min, "max": max })
}

fn llama_cpp(path: &str, threads: usize, reps: usize, prompt: &[u32], decode: &[u32]) -> anyhow::Result<Value> {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../../scripts/llama_cpp_bench.py");
    let join = |v: &[u32]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(",");
    let out = Command::new("python3")
        .args([script, "--model", path, "--threads", &threads.to_string(), "--reps", &reps.to_string()])
        .args(["--prompt-ids", &join(prompt), "--decode-ids", &join(decode)])
        .output()
        .map_err(|e| anyhow::anyhow!("cannot run python3 for the llama.cpp side: {e}"))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        anyhow::bail!("llama.cpp side failed: {}", err.lines().last().unwrap_or("no output"));
    }
    Ok(serde_json::from_slice(&out.stdout)?)
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let path = engine::resolve_model(a.model.model.clone(), true)?;
    let eng = engine::Engine::load(&path)?;
    let threads = a.model.threads();
    let p = BenchParams {
        prompt_tokens: a.prompt,
        decode_tokens: a.gen,
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
        let l = llama_cpp(&path.display().to_string(), threads, p.repetitions, &prompt, &decode)?;
        let as_vec = |k: &str| {
            l[k].as_array().map(|v| v.iter().filter_map(|x| x.as_f64()).collect::<Vec<_>>()).unwrap_or_default()
        };
        let (lpp, ltg) = (as_vec("prompt_tokens_per_s"), as_vec("decode_tokens_per_s"));
        out["llama_cpp"] = json!({ "prompt_tokens_per_s": median(&lpp), "decode_tokens_per_s": median(&ltg), "prompt": stats(&lpp), "decode": stats(&ltg), "version": l["version"] });
        out["ratio"] = json!({ "prompt": median(&pp) / median(&lpp), "decode": median(&tg) / median(&ltg) });
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
    println!("| engine | threads | pp{} tok/s (min–max) | tg{} tok/s (min–max) |", a.prompt, a.gen);
    println!("| --- | --- | --- | --- |");
    println!(
        "| specee ({}) | {threads} | {} | {} |",
        out["isa"].as_str().unwrap_or("?"),
        s(&out["prompt"]),
        s(&out["decode"])
    );
    if let Some(l) = out.get("llama_cpp") {
        println!("| llama.cpp | {threads} | {} | {} |", s(&l["prompt"]), s(&l["decode"]));
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
