//! SpecExit's signal heads (issue #30): traces of the model's own reasoning, what an exit could save on them, and
//! the training of the three signals ([`engine::signals`]).
//!
//! 1. **Traces** ([`collect_traces`]): each problem answered greedily in full ([`Engine::reasoning_trace`]),
//!    with a trial answer forced at every paragraph boundary of the reasoning and the final-normed feature row of
//!    every reasoning token. Cached in chunks (`chunk-NNN.safetensors`, keyed by [`crate::cache`]): a rerun
//!    resumes where the last one stopped.
//! 2. **Ceilings and DEER offline** ([`Outcome`], [`simulate`]): a greedy exit at a boundary emits exactly the
//!    trial answer recorded there, so any policy that decides at boundaries can be replayed on the traces — the
//!    oracle (the first boundary whose trial answer is the final one: the most any exit can save without changing
//!    an answer) and DEER at each threshold.
//! 3. **Training** ([`train_signals`]): an `n_embd + 1 → hidden → 3` MLP on every reasoning row; labels
//!    confidence = whether the trial answer at the row's paragraph end equals the trace's final answer, progress
//!    = t / T, log remaining = ln(max(T − t, 1)); every fifth trace is validation. Per epoch: AUC of confidence at
//!    the boundaries, MAE of progress and of log remaining. Then the policy thresholds: the replayed policy
//!    (per-token EWMA) with the fewest reasoning tokens whose validation accuracy stays within the budget.

use crate::cache::CacheKey;
use crate::exit::{bce_with_logits, column_stats};
use crate::head::Lcg;
use crate::TrainError;
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{AdamW, Optimizer, ParamsAdamW, VarBuilder, VarMap};
use engine::reasoning::{Problem, ReasoningProfile};
use engine::signals::{ExitPolicy, SignalHead, Smoothed, POSITION_SCALE};
use engine::Engine;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};

/// A trial answer at one boundary of a trace.
#[derive(Clone, Debug, PartialEq)]
pub struct BoundaryTrial {
    /// Generated tokens up to and including the boundary.
    pub at: usize,
    pub answer: Option<f64>,
    pub mean_max_prob: f32,
    /// Answer tokens after the exit text.
    pub tokens: usize,
}

/// One problem's full reasoning trace.
#[derive(Clone, Debug, PartialEq)]
pub struct TraceRecord {
    /// Index of the problem in its file.
    pub problem: usize,
    pub expected: f64,
    /// The full trace's answer.
    pub answer: Option<f64>,
    pub generated: usize,
    /// Reasoning tokens T (all generated tokens when the reasoning never ended).
    pub reasoning: usize,
    pub ended: bool,
    /// Feature rows kept (the first `rows` reasoning tokens).
    pub rows: usize,
    pub trials: Vec<BoundaryTrial>,
    pub seconds: f64,
}

impl TraceRecord {
    pub fn correct(&self) -> bool {
        self.answer.is_some_and(|a| (a - self.expected).abs() < 1e-6)
    }

    /// Whether the trial at boundary `j` gives the trace's final answer.
    pub fn settled(&self, j: usize) -> bool {
        self.answer.is_some() && self.trials[j].answer == self.answer
    }

    fn to_json(&self) -> Value {
        json!({
            "problem": self.problem, "expected": self.expected, "answer": self.answer, "generated": self.generated,
            "reasoning": self.reasoning, "ended": self.ended, "rows": self.rows, "seconds": self.seconds,
            "trials": self.trials.iter().map(|t| json!([t.at, t.answer, t.mean_max_prob, t.tokens])).collect::<Vec<_>>(),
        })
    }

    fn from_json(v: &Value) -> Option<TraceRecord> {
        let n = |k: &str| v[k].as_u64().map(|x| x as usize);
        let trials = v["trials"]
            .as_array()?
            .iter()
            .map(|t| {
                Some(BoundaryTrial {
                    at: t[0].as_u64()? as usize,
                    answer: t[1].as_f64(),
                    mean_max_prob: t[2].as_f64()? as f32,
                    tokens: t[3].as_u64()? as usize,
                })
            })
            .collect::<Option<Vec<_>>>()?;
        Some(TraceRecord {
            problem: n("problem")?,
            expected: v["expected"].as_f64()?,
            answer: v["answer"].as_f64(),
            generated: n("generated")?,
            reasoning: n("reasoning")?,
            ended: v["ended"].as_bool()?,
            rows: n("rows")?,
            trials,
            seconds: v["seconds"].as_f64()?,
        })
    }
}

/// Traces with their feature rows (f16 bits, `rows × d`, record after record).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TraceSet {
    pub d: usize,
    pub records: Vec<TraceRecord>,
    pub features: Vec<u16>,
}

impl TraceSet {
    /// Appends another set (same width).
    pub fn append(&mut self, other: TraceSet) {
        self.d = other.d;
        self.records.extend(other.records);
        self.features.extend(other.features);
    }

    /// Where each record's rows start.
    pub fn starts(&self) -> Vec<usize> {
        let mut s = 0;
        self.records
            .iter()
            .map(|r| {
                let at = s;
                s += r.rows;
                at
            })
            .collect()
    }

    pub fn save(&self, path: &Path, key: &CacheKey) -> Result<(), TrainError> {
        use safetensors::tensor::TensorView;
        let bytes: Vec<u8> = self.features.iter().flat_map(|x| x.to_le_bytes()).collect();
        let rows = self.features.len() / self.d.max(1);
        let err = |e: safetensors::SafeTensorError| TrainError::Format(e.to_string());
        let view = TensorView::new(safetensors::Dtype::F16, vec![rows, self.d], &bytes).map_err(err)?;
        let mut meta = key.to_metadata();
        meta.insert("format".into(), "specee-reasoning-traces-1".into());
        meta.insert(
            "records".into(),
            Value::Array(self.records.iter().map(TraceRecord::to_json).collect()).to_string(),
        );
        safetensors::serialize_to_file(vec![("features", view)], Some(meta), path).map_err(err)
    }

    pub fn load(path: &Path) -> Result<TraceSet, TrainError> {
        let bad = |why: &str| TrainError::Format(format!("{}: {why}", path.display()));
        let bytes = std::fs::read(path).map_err(|e| TrainError::Io(path.display().to_string(), e))?;
        let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).map_err(|e| bad(&e.to_string()))?;
        let meta = meta.metadata().clone().unwrap_or_default();
        if meta.get("format").map(String::as_str) != Some("specee-reasoning-traces-1") {
            return Err(bad("not a reasoning-trace file"));
        }
        let records: Value = serde_json::from_str(meta.get("records").ok_or_else(|| bad("no records"))?)
            .map_err(|e| bad(&e.to_string()))?;
        let records = records
            .as_array()
            .ok_or_else(|| bad("records is not a list"))?
            .iter()
            .map(TraceRecord::from_json)
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| bad("a malformed record"))?;
        let st = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| bad(&e.to_string()))?;
        let f = st.tensor("features").map_err(|_| bad("no features"))?;
        let d = f.shape().get(1).copied().unwrap_or(0);
        let features: Vec<u16> = f.data().chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect();
        if records.iter().map(|r| r.rows).sum::<usize>() * d != features.len() {
            return Err(bad("feature rows do not match the records"));
        }
        Ok(TraceSet { d, records, features })
    }

    /// Feature row `i` as f32.
    pub fn row(&self, i: usize) -> Vec<f32> {
        self.features[i * self.d..(i + 1) * self.d].iter().map(|&b| half::f16::from_bits(b).to_f32()).collect()
    }
}

/// Settings of [`collect_traces`].
#[derive(Clone, Debug)]
pub struct TraceOptions {
    pub max_tokens: usize,
    pub threads: usize,
    /// Problems per cached chunk.
    pub chunk: usize,
    pub progress: bool,
}

/// Traces of `problems` (from the file `problems_path`) in `dir`, chunk by chunk, reusing chunks made from the
/// same inputs; `proposer` makes a fresh proposer for each problem (dense or eagle: the traces are the same).
pub fn collect_traces(
    engine: &Engine,
    model_path: &Path,
    problems_path: &Path,
    problems: &[Problem],
    profile: &ReasoningProfile,
    dir: &Path,
    opts: &TraceOptions,
    mut proposer: impl FnMut() -> Result<engine::speculative::AnyProposer, TrainError>,
) -> Result<TraceSet, TrainError> {
    std::fs::create_dir_all(dir).map_err(|e| TrainError::Io(dir.display().to_string(), e))?;
    let base = CacheKey::new()
        .model(model_path)?
        .file("problems", problems_path)?
        .option("--profile", format!("{} {:?} {:?}", profile.name, profile.exit_text, profile.boundary))
        .option("-n", opts.max_tokens)
        .option("--chunk", opts.chunk);
    let chunk = opts.chunk.max(1);
    let n_chunks = problems.len().div_ceil(chunk);
    let bar = crate::progress_bar(opts.progress, problems.len() as u64, "traces");
    let mut all = TraceSet { d: engine.model.config.n_embd, ..Default::default() };
    let params = engine::GenerateParams { max_tokens: opts.max_tokens, ..Default::default() };
    for c in 0..n_chunks {
        let path: PathBuf = dir.join(format!("chunk-{c:03}.safetensors"));
        let key = base.clone().option("chunk", c);
        let range = c * chunk..((c + 1) * chunk).min(problems.len());
        if crate::cache::check(&path, &key, false)? {
            all.append(TraceSet::load(&path)?);
            bar.inc(range.len() as u64);
            continue;
        }
        let mut set = TraceSet { d: all.d, ..Default::default() };
        for i in range {
            let p = &problems[i];
            let ids = engine.tokenize_prompt(&profile.render(engine, &p.question)?);
            let start = std::time::Instant::now();
            let ctx = ids.len() + opts.max_tokens + 64;
            let trace = engine.reasoning_trace(&ids, &params, ctx, opts.threads, proposer()?, profile)?;
            let g = &trace.generation;
            let split = profile.split(engine, &g.generated_ids);
            let rows = (trace.features.len() / set.d).min(split.reasoning_tokens);
            set.features.extend(trace.features[..rows * set.d].iter().map(|&x| half::f16::from_f32(x).to_bits()));
            let trials = trace
                .trials
                .iter()
                .map(|(at, t)| BoundaryTrial {
                    at: *at,
                    answer: t.answer,
                    mean_max_prob: t.mean_max_prob,
                    tokens: t.tokens.len(),
                })
                .collect();
            set.records.push(TraceRecord {
                problem: i,
                expected: p.answer,
                answer: profile.answer(&g.text),
                generated: g.generated_ids.len(),
                reasoning: split.reasoning_tokens,
                ended: split.ended,
                rows,
                trials,
                seconds: start.elapsed().as_secs_f64(),
            });
            bar.inc(1);
        }
        set.save(&path, &key)?;
        if !opts.progress {
            let secs: f64 = set.records.iter().map(|r| r.seconds).sum();
            eprintln!("traces: chunk {}/{n_chunks} written ({} problems, {secs:.0} s)", c + 1, set.records.len());
        }
        all.append(set);
    }
    bar.finish_and_clear();
    Ok(all)
}

/// What a policy does over a set of traces.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Outcome {
    pub accuracy: f64,
    pub mean_reasoning: f64,
    /// Share of traces cut short.
    pub exited: f64,
    /// Share of traces whose answer changed.
    pub changed: f64,
}

impl Outcome {
    /// The share of reasoning tokens saved against `full`.
    pub fn reduction(&self, full: &Outcome) -> f64 {
        if full.mean_reasoning > 0.0 {
            1.0 - self.mean_reasoning / full.mean_reasoning
        } else {
            0.0
        }
    }
}

/// Replays a policy over `records`: `decide` gives the boundary (index into `trials`) each trace exits at, if
/// any; an exit's answer is the trial answer recorded there.
pub fn simulate(records: &[TraceRecord], mut decide: impl FnMut(usize, &TraceRecord) -> Option<usize>) -> Outcome {
    let n = records.len().max(1) as f64;
    let mut o = Outcome::default();
    for (i, r) in records.iter().enumerate() {
        let (reasoning, answer) = match decide(i, r) {
            Some(j) => {
                o.exited += 1.0;
                (r.trials[j].at, r.trials[j].answer)
            }
            None => (r.reasoning, r.answer),
        };
        o.mean_reasoning += reasoning as f64 / n;
        o.accuracy += f64::from(u8::from(answer.is_some_and(|a| (a - r.expected).abs() < 1e-6))) / n;
        o.changed += f64::from(u8::from(answer != r.answer)) / n;
    }
    o.exited /= n;
    o
}

/// The boundaries of a trace that lie inside its reasoning (a trial at the reasoning's very end saves nothing).
fn inside(r: &TraceRecord) -> impl Iterator<Item = usize> + '_ {
    (0..r.trials.len()).filter(|&j| r.trials[j].at < r.reasoning)
}

/// Full reasoning, the oracle exit and DEER at `thresholds`, as markdown table rows (`| policy | accuracy |
/// reasoning tokens | reduction | exited | answers changed |`), with the outcomes.
pub fn ceilings(records: &[TraceRecord], thresholds: &[f32]) -> Vec<(String, Outcome)> {
    let mut rows = vec![("full reasoning".to_string(), simulate(records, |_, _| None))];
    rows.push((
        "oracle: first boundary whose trial answer is the final one".into(),
        simulate(records, |_, r| inside(r).find(|&j| r.settled(j))),
    ));
    rows.push((
        "oracle: first boundary from which every trial answer is the final one".into(),
        simulate(records, |_, r| {
            let js: Vec<usize> = inside(r).collect();
            (0..js.len()).find(|&k| js[k..].iter().all(|&j| r.settled(j))).map(|k| js[k])
        }),
    ));
    rows.push((
        "oracle on accuracy alone: right answers kept right, wrong ones cut at the first boundary".into(),
        simulate(records, |_, r| {
            let right = |a: Option<f64>| a.is_some_and(|a| (a - r.expected).abs() < 1e-6);
            if r.correct() {
                inside(r).find(|&j| right(r.trials[j].answer))
            } else {
                inside(r).next()
            }
        }),
    ));
    for &t in thresholds {
        rows.push((
            format!("DEER, mean top probability > {t}"),
            simulate(records, |_, r| inside(r).find(|&j| r.trials[j].mean_max_prob > t)),
        ));
    }
    rows
}

/// [`ceilings`] as a markdown table.
pub fn ceilings_table(records: &[TraceRecord], thresholds: &[f32]) -> String {
    let rows = ceilings(records, thresholds);
    let full = rows[0].1;
    let mut s = String::from(
        "| policy | accuracy | reasoning tokens | reduction | exited | answers changed |\n| --- | --- | --- | --- | --- | --- |\n",
    );
    for (name, o) in &rows {
        s += &format!(
            "| {name} | {:.1}% | {:.1} | {:.1}% | {:.0}% | {:.0}% |\n",
            100.0 * o.accuracy,
            o.mean_reasoning,
            100.0 * o.reduction(&full),
            100.0 * o.exited,
            100.0 * o.changed
        );
    }
    s
}

/// Settings of [`train_signals`].
#[derive(Clone, Debug)]
pub struct SignalOptions {
    pub hidden: usize,
    pub epochs: usize,
    pub batch: usize,
    pub lr: f64,
    pub seed: u64,
    /// Most accuracy (a fraction) the chosen policy may lose on the validation traces against full reasoning.
    pub budget: f64,
    pub progress: bool,
}

/// Per-epoch validation metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct SignalMetrics {
    /// AUC of confidence at the boundaries inside the reasoning (does it rank settled ones above unsettled ones).
    pub auc: f64,
    pub progress_mae: f64,
    pub log_remaining_mae: f64,
}

/// The rows of the traces in `records` (indices into `set.records`) with their inputs and labels.
struct Rows {
    x: Vec<f32>,
    /// `[confidence, progress, log remaining]` per row.
    y: Vec<[f32; 3]>,
    /// Whether the row's token ends a boundary inside the reasoning (where an exit can save something).
    boundary: Vec<bool>,
}

/// Inputs (feature row, then `ln(1 + t) / 8`) and labels of every row of the traces `which`.
fn rows(set: &TraceSet, which: &[usize]) -> Rows {
    let starts = set.starts();
    let mut out = Rows { x: Vec::new(), y: Vec::new(), boundary: Vec::new() };
    for &k in which {
        let r = &set.records[k];
        let t_end = r.reasoning as f32;
        for i in 0..r.rows {
            let t = i + 1;
            // The paragraph end at or after this token: its trial is what an exit there would answer.
            let Some(j) = r.trials.iter().position(|b| b.at >= t) else { continue };
            out.x.extend(set.row(starts[k] + i));
            out.x.push((1.0 + t as f32).ln() / POSITION_SCALE);
            let settled = if r.settled(j) { 1.0 } else { 0.0 };
            out.y.push([settled, t as f32 / t_end, (t_end - t as f32).max(1.0).ln()]);
            // Boundaries inside the reasoning: the last one (where the answer's paragraph starts) is always settled.
            out.boundary.push(r.trials[j].at == t && t < r.reasoning);
        }
    }
    out
}

/// Area under the ROC curve of `scores` for binary `labels` (ties counted half).
pub fn auc(scores: &[f32], labels: &[bool]) -> f64 {
    let mut idx: Vec<usize> = (0..scores.len()).collect();
    idx.sort_by(|&a, &b| scores[a].total_cmp(&scores[b]));
    let (mut rank_sum, mut i) = (0f64, 0);
    while i < idx.len() {
        let mut j = i;
        while j + 1 < idx.len() && scores[idx[j + 1]] == scores[idx[i]] {
            j += 1;
        }
        let mid = (i + j) as f64 / 2.0 + 1.0;
        rank_sum += (i..=j).filter(|&k| labels[idx[k]]).count() as f64 * mid;
        i = j + 1;
    }
    let pos = labels.iter().filter(|&&l| l).count() as f64;
    let neg = labels.len() as f64 - pos;
    if pos == 0.0 || neg == 0.0 {
        return 0.5;
    }
    (rank_sum - pos * (pos + 1.0) / 2.0) / (pos * neg)
}

/// Validation metrics of `head` on `rows`.
fn metrics(head: &SignalHead, r: &Rows) -> SignalMetrics {
    let nf = head.n_embd + 1;
    let (mut scores, mut labels) = (Vec::new(), Vec::new());
    let (mut pe, mut re) = (0f64, 0f64);
    for (i, y) in r.y.iter().enumerate() {
        let x = &r.x[i * nf..(i + 1) * nf];
        let raw = head.raw_input(x);
        let p = 1.0 / (1.0 + (-raw[1]).exp());
        pe += (p - y[1]).abs() as f64;
        re += (raw[2] - y[2]).abs() as f64;
        if r.boundary[i] {
            scores.push(raw[0]);
            labels.push(y[0] > 0.5);
        }
    }
    let n = r.y.len().max(1) as f64;
    SignalMetrics { auc: auc(&scores, &labels), progress_mae: pe / n, log_remaining_mae: re / n }
}

/// Replays a SpecExit policy on one trace from its per-token signals (`signals[i]`: row `i`): smoothed with the
/// policy's α, an exit at the first boundary inside the reasoning where the smoothed signals (over the rows up to
/// it) pass.
pub fn first_exit(signals: &[[f32; 3]], r: &TraceRecord, policy: &ExitPolicy) -> Option<usize> {
    let mut s = Smoothed::default();
    let js: Vec<usize> = inside(r).collect();
    let mut next = 0;
    for (i, sig) in signals.iter().enumerate() {
        s.update(std::slice::from_ref(sig), policy.alpha);
        while next < js.len() && r.trials[js[next]].at < i + 1 {
            next += 1;
        }
        if next < js.len() && r.trials[js[next]].at == i + 1 && policy.passes(&s) {
            return Some(js[next]);
        }
    }
    None
}

/// The policy with the fewest reasoning tokens on the traces `which` whose accuracy stays within `budget` of
/// full reasoning, searched over a grid (α, confidence, progress, remaining); with its outcome.
pub fn choose_policy(head: &SignalHead, set: &TraceSet, which: &[usize], budget: f64) -> (ExitPolicy, Outcome) {
    let starts = set.starts();
    let records: Vec<TraceRecord> = which.iter().map(|&k| set.records[k].clone()).collect();
    let full = simulate(&records, |_, _| None);
    // Signals once per row; the grid replays them.
    let signals: Vec<Vec<[f32; 3]>> = which
        .iter()
        .map(|&k| (0..set.records[k].rows).map(|i| head.signals(&set.row(starts[k] + i), i + 1)).collect())
        .collect();
    let mut best = (ExitPolicy { confidence: 2.0, ..ExitPolicy::default() }, full);
    for alpha in [0.1f32, 0.3, 1.0] {
        for confidence in [0.5f32, 0.6, 0.7, 0.8, 0.9, 0.95, 0.98, 0.99] {
            for progress in [0.0f32, 0.2, 0.3, 0.5] {
                for remaining in [50f32, 100.0, 200.0, 1e9] {
                    let policy = ExitPolicy { alpha, confidence, progress, remaining };
                    let o = simulate(&records, |i, r| first_exit(&signals[i], r, &policy));
                    if o.accuracy >= full.accuracy - budget - 1e-9 && o.mean_reasoning < best.1.mean_reasoning {
                        best = (policy, o);
                    }
                }
            }
        }
    }
    best
}

/// What [`train_signals`] returns.
pub struct SignalReport {
    pub head: SignalHead,
    pub policy: ExitPolicy,
    /// On the validation traces: full reasoning and the chosen policy.
    pub full: Outcome,
    pub chosen: Outcome,
    pub metrics: SignalMetrics,
    /// Validation trace indices (every fifth).
    pub validation: Vec<usize>,
}

/// Trains the signal heads on every fifth-excluded trace of `set` (traces whose reasoning never ended are left
/// out) and chooses the policy on the rest. `log` receives one line per epoch.
pub fn train_signals(
    set: &TraceSet,
    opts: &SignalOptions,
    mut log: impl FnMut(&str),
) -> Result<SignalReport, TrainError> {
    let usable: Vec<usize> =
        (0..set.records.len()).filter(|&k| set.records[k].ended && set.records[k].rows > 0).collect();
    let validation: Vec<usize> = usable.iter().copied().filter(|k| k % 5 == 4).collect();
    let train: Vec<usize> = usable.iter().copied().filter(|k| k % 5 != 4).collect();
    if train.is_empty() || validation.is_empty() {
        return Err(TrainError::Invalid(format!(
            "{} traces with an ended reasoning: too few to train and validate signal heads",
            usable.len()
        )));
    }
    let (tr, va) = (rows(set, &train), rows(set, &validation));
    let nf = set.d + 1;
    let (mean, std) = column_stats(&tr.x, nf);
    let xt: Vec<f32> =
        tr.x.chunks_exact(nf).flat_map(|x| (0..nf).map(|f| (x[f] - mean[f]) / std[f]).collect::<Vec<_>>()).collect();
    let dev = Device::Cpu;
    let mut rng = Lcg(opts.seed);
    let mut varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &dev);
    let l1 = candle_nn::linear(nf, opts.hidden, vb.pp("l1"))?;
    let l2 = candle_nn::linear(opts.hidden, 3, vb.pp("l2"))?;
    for (name, fan_in, shape) in [
        ("l1.weight", nf, vec![opts.hidden, nf]),
        ("l1.bias", nf, vec![opts.hidden]),
        ("l2.weight", opts.hidden, vec![3, opts.hidden]),
        ("l2.bias", opts.hidden, vec![3]),
    ] {
        let bound = 1.0 / (fan_in as f32).sqrt();
        let n: usize = shape.iter().product();
        let values: Vec<f32> = (0..n).map(|_| (rng.uniform() * 2.0 - 1.0) * bound).collect();
        varmap.set_one(name, Tensor::from_vec(values, shape, &dev)?)?;
    }
    let mut opt = AdamW::new(varmap.all_vars(), ParamsAdamW { lr: opts.lr, weight_decay: 1e-4, ..Default::default() })?;
    let n = tr.y.len();
    let mut order: Vec<usize> = (0..n).collect();
    let export = |l1: &candle_nn::Linear, l2: &candle_nn::Linear| -> Result<SignalHead, TrainError> {
        let mut w1: Vec<f32> = l1.weight().flatten_all()?.to_vec1()?;
        let mut b1: Vec<f32> = l1.bias().expect("linear has a bias").to_vec1()?;
        for (w, b) in w1.chunks_exact_mut(nf).zip(b1.iter_mut()) {
            for f in 0..nf {
                w[f] /= std[f];
                *b -= w[f] * mean[f];
            }
        }
        Ok(SignalHead {
            n_embd: set.d,
            hidden: opts.hidden,
            w1,
            b1,
            w2: l2.weight().flatten_all()?.to_vec1()?,
            b2: l2.bias().expect("linear has a bias").to_vec1()?,
            metadata: Default::default(),
        })
    };
    let bar = crate::progress_bar(opts.progress, opts.epochs as u64, "signal heads");
    let mut last = SignalMetrics::default();
    for epoch in 0..opts.epochs {
        crate::shuffle_for_epoch(&mut order, opts.seed, epoch);
        let mut total = 0f64;
        for chunk in order.chunks(opts.batch.max(1)) {
            let mut xb = Vec::with_capacity(chunk.len() * nf);
            let mut yb = Vec::with_capacity(chunk.len() * 3);
            for &i in chunk {
                xb.extend_from_slice(&xt[i * nf..(i + 1) * nf]);
                yb.extend_from_slice(&tr.y[i]);
            }
            let x = Tensor::from_vec(xb, (chunk.len(), nf), &dev)?;
            let y = Tensor::from_vec(yb, (chunk.len(), 3), &dev)?;
            let z = l2.forward(&l1.forward(&x)?.relu()?)?;
            let conf = bce_with_logits(&z.narrow(1, 0, 1)?, &y.narrow(1, 0, 1)?)?;
            let prog = bce_with_logits(&z.narrow(1, 1, 1)?, &y.narrow(1, 1, 1)?)?;
            let rem = (z.narrow(1, 2, 1)? - y.narrow(1, 2, 1)?)?.sqr()?.mean_all()?;
            let loss = ((conf + prog)? + (rem * 0.1)?)?;
            total += loss.to_scalar::<f32>()? as f64 * chunk.len() as f64;
            opt.backward_step(&loss)?;
        }
        last = metrics(&export(&l1, &l2)?, &va);
        log(&format!(
            "epoch {}/{}: train loss {:.4}; validation: confidence AUC at boundaries inside the reasoning {:.3}, progress MAE {:.3}, log-remaining MAE {:.3}",
            epoch + 1,
            opts.epochs,
            total / n.max(1) as f64,
            last.auc,
            last.progress_mae,
            last.log_remaining_mae
        ));
        bar.inc(1);
    }
    bar.finish_and_clear();
    let head = export(&l1, &l2)?;
    let (policy, chosen) = choose_policy(&head, set, &validation, opts.budget);
    let full = simulate(&validation.iter().map(|&k| set.records[k].clone()).collect::<Vec<_>>(), |_, _| None);
    Ok(SignalReport { head, policy, full, chosen, metrics: last, validation })
}

/// Writes a signal-head file with `metadata` (the policy's entries are added).
pub fn save_signal_head(
    head: &SignalHead,
    policy: &ExitPolicy,
    mut metadata: std::collections::HashMap<String, String>,
    path: &Path,
) -> Result<(), TrainError> {
    use safetensors::tensor::TensorView;
    let err = |e: safetensors::SafeTensorError| TrainError::Format(e.to_string());
    let b = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let (w1, b1, w2, b2) = (b(&head.w1), b(&head.b1), b(&head.w2), b(&head.b2));
    let f32 = safetensors::Dtype::F32;
    let views = vec![
        ("w1", TensorView::new(f32, vec![head.hidden, head.n_embd + 1], &w1).map_err(err)?),
        ("b1", TensorView::new(f32, vec![head.hidden], &b1).map_err(err)?),
        ("w2", TensorView::new(f32, vec![3, head.hidden], &w2).map_err(err)?),
        ("b2", TensorView::new(f32, vec![3], &b2).map_err(err)?),
    ];
    metadata.insert("format".into(), engine::signals::FORMAT.into());
    metadata.extend(policy.to_metadata());
    safetensors::serialize_to_file(views, Some(metadata), path).map_err(err)
}

/// Draws the three signals (confidence blue, progress green, remaining red as a share of the trace's length)
/// against their labels (the same colours, pale) along up to `n` traces of `which`, one panel each, as PNG;
/// boundaries are grey ticks.
pub fn plot_signals(
    head: &SignalHead,
    set: &TraceSet,
    which: &[usize],
    n: usize,
    path: &Path,
) -> Result<(), TrainError> {
    const H: usize = 120;
    const GAP: usize = 12;
    let starts = set.starts();
    let panels: Vec<usize> = which.iter().copied().take(n).collect();
    let w = panels.iter().map(|&k| set.records[k].rows * 2).max().unwrap_or(1).max(1) + 2 * GAP;
    let h = panels.len().max(1) * (H + GAP) + GAP;
    let mut img = vec![255u8; w * h * 3];
    let mut put = |x: usize, y: usize, c: [u8; 3]| {
        if x < w && y < h {
            img[(y * w + x) * 3..(y * w + x) * 3 + 3].copy_from_slice(&c);
        }
    };
    for (p, &k) in panels.iter().enumerate() {
        let r = &set.records[k];
        let top = GAP + p * (H + GAP);
        let y_of = |v: f32| top + H - 1 - ((v.clamp(0.0, 1.0) * (H - 1) as f32) as usize);
        for x in GAP..GAP + r.rows * 2 {
            put(x, top + H, [0, 0, 0]);
        }
        for b in &r.trials {
            for dy in 0..6 {
                put(GAP + b.at * 2, top + H - dy, [120, 120, 120]);
            }
        }
        let labels = rows(set, &[k]);
        let t_end = r.reasoning as f32;
        for i in 0..r.rows.min(labels.y.len()) {
            let s = head.signals(&set.row(starts[k] + i), i + 1);
            let y = labels.y[i];
            let x = GAP + i * 2;
            for (v, c) in [
                (y[0], [170, 190, 240]),
                (y[1], [170, 230, 170]),
                (y[2].exp() / t_end, [240, 180, 180]),
                (s[0], [30, 60, 220]),
                (s[1], [20, 150, 40]),
                (s[2] / t_end, [210, 30, 30]),
            ] {
                put(x, y_of(v), c);
                put(x + 1, y_of(v), c);
            }
        }
    }
    crate::exit::write_png(path, w, h, &img)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Traces whose answer settles at a random paragraph; feature 0 carries the progress, feature 1 whether the
    /// current paragraph's trial is settled, the rest noise.
    fn synthetic(n: usize, d: usize) -> TraceSet {
        let mut rng = Lcg(7);
        let mut set = TraceSet { d, ..Default::default() };
        for k in 0..n {
            let paragraphs = 4 + (rng.next_u64() % 5) as usize;
            let settle = (rng.next_u64() % paragraphs as u64) as usize;
            let len = 8 + (rng.next_u64() % 8) as usize;
            let t_end = paragraphs * len;
            let answer = Some(k as f64);
            let trials = (0..paragraphs)
                .map(|j| BoundaryTrial {
                    at: (j + 1) * len,
                    answer: if j >= settle { answer } else { Some(-1.0) },
                    mean_max_prob: if j >= settle { 0.97 } else { 0.6 },
                    tokens: 3,
                })
                .collect();
            for i in 0..t_end {
                let j = i / len;
                let mut row = vec![0f32; d];
                row[0] = (i + 1) as f32 / t_end as f32 + 0.02 * rng.normal();
                row[1] = if j >= settle { 1.0 } else { 0.0 } + 0.1 * rng.normal();
                for x in &mut row[2..] {
                    *x = rng.normal();
                }
                set.features.extend(row.iter().map(|&x| half::f16::from_f32(x).to_bits()));
            }
            set.records.push(TraceRecord {
                problem: k,
                expected: if k % 3 == 0 { -2.0 } else { k as f64 },
                answer,
                generated: t_end + 5,
                reasoning: t_end,
                ended: true,
                rows: t_end,
                trials,
                seconds: 1.0,
            });
        }
        set
    }

    #[test]
    fn trained_signals_follow_their_labels_and_the_policy_keeps_accuracy() {
        let set = synthetic(200, 6);
        let opts = SignalOptions { hidden: 16, epochs: 30, batch: 64, lr: 3e-3, seed: 1, budget: 0.0, progress: false };
        let report = train_signals(&set, &opts, |_| {}).unwrap();
        let m = report.metrics;
        assert!(m.auc > 0.95, "{m:?}");
        assert!(m.progress_mae < 0.08, "{m:?}");
        assert!(m.log_remaining_mae < 0.6, "{m:?}");
        assert_eq!(report.validation.len(), 40);
        assert!(report.chosen.accuracy >= report.full.accuracy - 1e-9, "{:?} vs {:?}", report.chosen, report.full);
        assert!(report.chosen.reduction(&report.full) > 0.2, "{:?} vs {:?}", report.chosen, report.full);
        // A head that learnt nothing (zero weights: confidence 0.5) is never chosen to exit at 0.5 or above.
        let dead = SignalHead { w1: vec![0.0; report.head.w1.len()], w2: vec![0.0; 3 * 16], ..report.head.clone() };
        let (_, o) = choose_policy(&SignalHead { b2: vec![-5.0, 0.0, 0.0], ..dead }, &set, &report.validation, 0.0);
        assert_eq!(o.exited, 0.0);
        // The file round-trips and carries the policy.
        let path = std::env::temp_dir().join(format!("specee-signals-{}.safetensors", std::process::id()));
        save_signal_head(&report.head, &report.policy, Default::default(), &path).unwrap();
        let back = SignalHead::load(&path).unwrap();
        std::fs::remove_file(&path).ok();
        assert_eq!((back.w1.clone(), back.b2.clone()), (report.head.w1.clone(), report.head.b2.clone()));
        assert_eq!(ExitPolicy::from_metadata(&back.metadata), report.policy);
    }

    #[test]
    fn ceilings_replay_the_oracle_and_deer_exactly() {
        let set = synthetic(30, 4);
        let rows = ceilings(&set.records, &[0.9, 0.99]);
        let full = rows[0].1;
        // The oracle answers as the full trace does, at the settling boundary (unless that is the last one).
        let oracle = rows[1].1;
        assert_eq!((oracle.accuracy, oracle.changed), (full.accuracy, 0.0));
        let want: f64 = set
            .records
            .iter()
            .map(|r| {
                let j = (0..r.trials.len()).find(|&j| r.settled(j)).unwrap();
                if r.trials[j].at < r.reasoning {
                    r.trials[j].at
                } else {
                    r.reasoning
                }
            })
            .sum::<usize>() as f64
            / 30.0;
        assert!((oracle.mean_reasoning - want).abs() < 1e-9);
        assert_eq!(rows[2].1, oracle, "the settled answer stays settled here");
        // DEER at 0.9 exits exactly at the settling boundary (probability 0.97); at 0.99 never.
        assert_eq!(rows[4].1, oracle);
        assert_eq!(rows[5].1, full);
        // Knowing which answers are right, every wrong trace is cut at its first boundary and accuracy holds.
        let by_accuracy = rows[3].1;
        assert!(by_accuracy.accuracy >= full.accuracy && by_accuracy.mean_reasoning <= oracle.mean_reasoning);
        assert!(ceilings_table(&set.records, &[0.9]).lines().count() == 7);
    }

    #[test]
    fn auc_counts_ranked_pairs_and_ties_half() {
        assert_eq!(auc(&[0.1, 0.2, 0.8, 0.9], &[false, false, true, true]), 1.0);
        assert_eq!(auc(&[0.9, 0.8, 0.2, 0.1], &[false, false, true, true]), 0.0);
        assert_eq!(auc(&[0.5, 0.5], &[false, true]), 0.5);
        assert_eq!(auc(&[0.1, 0.4, 0.35, 0.8], &[false, false, true, true]), 0.75);
    }

    #[test]
    fn trace_sets_round_trip_through_a_keyed_file() {
        let set = synthetic(5, 3);
        let path = std::env::temp_dir().join(format!("specee-traces-{}.safetensors", std::process::id()));
        let key = CacheKey::new().option("-n", 512);
        set.save(&path, &key).unwrap();
        let back = TraceSet::load(&path).unwrap();
        assert_eq!(CacheKey::stored(&path).unwrap(), Some(key));
        std::fs::remove_file(&path).ok();
        assert_eq!(back, set);
    }
}
