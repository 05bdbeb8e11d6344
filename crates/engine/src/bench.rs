//! Speed measurement, like llama-bench: prompt processing (`P` tokens in one batch) and decode (`N` single-token
//! steps, each with the greedy head), both after `D` tokens already in the cache (llama-bench's `-d`: 0 by
//! default, a fresh cache), repeated `R` times after one warm-up; and the **batch curve** — the cost of one
//! forward of `k` rows with head logits for all `k` rows, relative to `k = 1`, which decides whether draft trees
//! can pay. Also the prompt files that comparisons of decoding modes run over ([`read_prompts`]).

use crate::error::EngineError;
use crate::session::Engine;
use model::{Logits, Workspace};
use std::time::Instant;

/// What to measure.
#[derive(Clone, Debug)]
pub struct BenchParams {
    pub prompt_tokens: usize,
    pub decode_tokens: usize,
    /// Tokens in the cache before each prompt and decode test (llama-bench's `-d`, "depth"): how fast a long
    /// conversation runs. Prefilled once, untimed; each test starts from them.
    pub depth: usize,
    pub repetitions: usize,
    pub threads: usize,
    /// Row counts for the batch curve (empty = skip).
    pub batch_curve: Vec<usize>,
}

/// One repetition.
#[derive(Clone, Copy, Debug)]
pub struct BenchRun {
    pub prompt_tokens_per_s: f64,
    pub decode_tokens_per_s: f64,
}

/// One point of the batch curve.
#[derive(Clone, Copy, Debug)]
pub struct CurvePoint {
    pub rows: usize,
    /// Median milliseconds of one forward over `rows` rows.
    pub ms: f64,
    /// `ms / ms(k = 1)`.
    pub relative: f64,
}

/// All measurements.
#[derive(Clone, Debug)]
pub struct BenchResult {
    pub runs: Vec<BenchRun>,
    pub curve: Vec<CurvePoint>,
}

/// Median of a non-empty list.
pub fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let n = s.len();
    if n == 0 {
        0.0
    } else if n % 2 == 1 {
        s[n / 2]
    } else {
        (s[n / 2 - 1] + s[n / 2]) / 2.0
    }
}

/// Deterministic benchmark tokens: an English paragraph's tokens, repeated.
pub fn bench_tokens(engine: &Engine, n: usize) -> Vec<u32> {
    const TEXT: &str = "The history of computing is a story of people who wanted to calculate faster than they \
        could by hand. Mechanical calculators gave way to electronic machines, and those machines grew smaller, \
        cheaper and more capable every year, until a computer fit in every pocket.";
    let base = engine.tokenizer.encode(TEXT, false, false);
    base.iter().copied().cycle().take(n).collect()
}

/// Runs the benchmark.
pub fn bench(engine: &Engine, p: &BenchParams, mut progress: impl FnMut(&str)) -> Result<BenchResult, EngineError> {
    let m = &engine.model;
    let prompt = bench_tokens(engine, p.prompt_tokens.max(1));
    let decode = bench_tokens(engine, p.decode_tokens.max(1) + 1);
    let max_curve = p.batch_curve.iter().copied().max().unwrap_or(0);
    let ctx = (p.depth + p.prompt_tokens.max(p.decode_tokens + 1)).max(64 + max_curve) + 1;
    let mut kv = m.new_cache(ctx);
    let mut ws = Workspace::new(p.threads);
    let mut hidden = Vec::new();
    let mut runs = Vec::new();
    // The steady state: the head screen (if the model uses one) is built now, not during a timed run.
    m.warm_head_screen(p.threads);
    if p.depth > 0 {
        progress(&format!("filling the cache with {} tokens of context (untimed)", p.depth));
        m.forward(&bench_tokens(engine, p.depth), &mut kv, &mut ws, &mut hidden, Logits::None)?;
    }
    for rep in 0..=p.repetitions {
        // Prompt processing: one batch, logits for the last row (as llama-bench).
        kv.truncate(p.depth);
        let t = Instant::now();
        m.forward(&prompt, &mut kv, &mut ws, &mut hidden, Logits::Last)?;
        let pp = prompt.len() as f64 / t.elapsed().as_secs_f64();
        // Decode: single tokens, each step's greedy token as `generate` computes it (the head screen, exact;
        // `SPECEE_HEAD_SCREEN=0` computes the full logits instead).
        kv.truncate(p.depth);
        m.forward_argmax(&decode[..1], &mut kv, &mut ws, &mut hidden)?;
        let t = Instant::now();
        for &tok in &decode[1..] {
            m.forward_argmax(&[tok], &mut kv, &mut ws, &mut hidden)?;
        }
        let tg = p.decode_tokens as f64 / t.elapsed().as_secs_f64();
        if rep > 0 {
            runs.push(BenchRun { prompt_tokens_per_s: pp, decode_tokens_per_s: tg });
            progress(&format!("run {rep}/{}: pp {pp:.1} tok/s, tg {tg:.1} tok/s", p.repetitions));
        }
    }
    let mut curve = Vec::new();
    if !p.batch_curve.is_empty() {
        kv.clear();
        let base = 64;
        m.forward(&bench_tokens(engine, base), &mut kv, &mut ws, &mut hidden, Logits::None)?;
        let rows_tokens = bench_tokens(engine, max_curve);
        // Repetitions outside, sizes inside: a slow spell of the machine hits every size alike instead of
        // skewing the ratios (the first round warms up and is dropped).
        let mut times = vec![Vec::new(); p.batch_curve.len()];
        for rep in 0..=p.repetitions.max(7) {
            for (i, &k) in p.batch_curve.iter().enumerate() {
                let t = Instant::now();
                m.forward(&rows_tokens[..k], &mut kv, &mut ws, &mut hidden, Logits::All)?;
                let ms = t.elapsed().as_secs_f64() * 1e3;
                kv.truncate(base);
                if rep > 0 {
                    times[i].push(ms);
                }
            }
        }
        for (&k, t) in p.batch_curve.iter().zip(&times) {
            curve.push(CurvePoint { rows: k, ms: median(t), relative: 0.0 });
        }
        let one = curve.iter().find(|c| c.rows == 1).map_or(curve[0].ms, |c| c.ms);
        for c in &mut curve {
            c.relative = c.ms / one;
        }
    }
    Ok(BenchResult { runs, curve })
}

/// One line of a prompt file: raw text, or a conversation for the chat template.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PromptLine {
    /// `{"prompt": "..."}`: tokenized as it is.
    Raw(String),
    /// `{"messages": [{"role": …, "content": …}, …]}`: rendered with the model's chat template.
    Chat(Vec<tokenizer::chat::Message>),
}

/// The `messages` array of a JSON line as chat messages; `None` when the line has no such array.
pub fn json_messages(v: &serde_json::Value) -> Option<Result<Vec<tokenizer::chat::Message>, String>> {
    let msgs = v.get("messages")?.as_array()?;
    Some(
        msgs.iter()
            .map(|m| {
                let role = m.get("role").and_then(|r| r.as_str());
                let content = m.get("content").and_then(|c| c.as_str());
                match (role, content) {
                    (Some(r), Some(c)) => Ok(tokenizer::chat::Message::new(r, c)),
                    _ => Err("a message needs `role` and `content` strings".to_string()),
                }
            })
            .collect(),
    )
}

/// Parses the text of a prompt file (`path` names it in errors): one JSON object per line, blank lines skipped.
pub fn parse_prompt_lines(text: &str, path: &std::path::Path) -> Result<Vec<PromptLine>, EngineError> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let bad = |why: String| EngineError::PromptFile { path: path.into(), line: i + 1, why };
        let v: serde_json::Value = serde_json::from_str(line).map_err(|e| bad(e.to_string()))?;
        out.push(if let Some(p) = v.get("prompt").and_then(|p| p.as_str()) {
            PromptLine::Raw(p.to_string())
        } else if let Some(messages) = json_messages(&v) {
            PromptLine::Chat(messages.map_err(bad)?)
        } else {
            return Err(bad("expected {\"prompt\": ...} or {\"messages\": [...]}".into()));
        });
    }
    if out.is_empty() {
        return Err(EngineError::NoPrompts(path.into()));
    }
    Ok(out)
}

/// The prompts of a prompt file (`specee bench --prompts`), as token ids: one JSON object per line,
/// `{"prompt": "..."}` (raw) or `{"messages": [{"role": …, "content": …}, …]}` (rendered with the chat template).
pub fn read_prompts(engine: &Engine, path: &std::path::Path) -> Result<Vec<Vec<u32>>, EngineError> {
    let text = std::fs::read_to_string(path).map_err(|source| EngineError::Io { path: path.into(), source })?;
    parse_prompt_lines(&text, path)?
        .into_iter()
        .map(|line| {
            let rendered = match line {
                PromptLine::Raw(p) => p,
                PromptLine::Chat(messages) => engine.render_chat(&messages)?,
            };
            Ok(engine.tokenize_prompt(&rendered))
        })
        .collect()
}
