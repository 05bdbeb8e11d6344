//! # train — training the small networks specee runs beside a model (candle autograd on CPU)
//!
//! - [`artifact`]: the safetensors files specee writes, read and amended without touching their tensors.
//! - [`cache`]: the keys that make the caches of collected data trustworthy (rebuilt, with the reason, whenever
//!   the model, the records or an option that shapes them changed).
//! - [`data`]: collects training data by running the target model itself (its greedy answers to chat
//!   prompts and its reading of raw text), keeping the feature (final-normed hidden state) at every position.
//! - [`head`]: the EAGLE-style draft head as a candle network (same computation as
//!   [`decode::speculative::eagle`], which runs it at inference on our kernels) and its safetensors file.
//! - [`train_draft`]: the training loop — reduced draft vocabulary (the N most frequent tokens of the
//!   training data), a loss on the draft's token choice (cross-entropy against the next token) plus a
//!   smooth-L1 loss on its predicted feature, unrolled over `steps` draft steps that feed on their own
//!   predicted features as the tree does at inference; AdamW with a cosine learning-rate decay; held-out
//!   acceptance printed per epoch; a checkpoint after every epoch, from which a rerun resumes.
//! - [`eagle3`]: EAGLE-3-style heads (one attention layer over the context on three fused target layers),
//!   trained on whole sequences and written in the published EAGLE-3 layout.
//! - [`exit`]: SpecEE's per-layer exit predictors — traced full-depth decoding, one small MLP per layer, the
//!   offline schedule and thresholds, and a plot of where tokens exit.
//! - [`plot`]: line charts as PNG (activation sparsity's quality curves).

pub mod artifact;
pub mod cache;
pub mod data;
pub mod eagle3;
pub mod exit;
pub mod head;
pub mod plot;
pub mod reasoning;

use candle_core::{DType, Device, Tensor};
use candle_nn::{AdamW, Optimizer, ParamsAdamW};
use data::DraftData;
use head::{HeadNet, HeadShape, Lcg};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// What can go wrong while collecting data or training.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    #[error("{0}: {1}")]
    Io(String, #[source] std::io::Error),
    #[error("{file}:{line}: {why}")]
    BadRecord { file: String, line: usize, why: String },
    #[error("{0}")]
    Format(String),
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    #[error(transparent)]
    Engine(#[from] engine::EngineError),
    #[error(transparent)]
    Speculative(#[from] decode::speculative::SpeculativeError),
    #[error(transparent)]
    Model(#[from] model::ModelError),
    #[error("{0}")]
    Invalid(String),
}

/// Settings of [`train_draft`].
#[derive(Clone, Debug)]
pub struct TrainOptions {
    /// Draft vocabulary size N.
    pub vocab: usize,
    /// Feed-forward width of the head.
    pub ff: usize,
    pub epochs: usize,
    pub batch: usize,
    pub lr: f64,
    /// Learning rate at the end of training as a fraction of `lr` (cosine decay over all batches of all
    /// epochs; 1 keeps it constant). A run resumed with another `epochs` continues on the new schedule.
    pub lr_end: f64,
    /// Draft steps unrolled per sample (1 = teacher-forced only).
    pub steps: usize,
    /// Weight of the feature (smooth-L1) loss against the token (cross-entropy) loss.
    pub reg_weight: f64,
    pub seed: u64,
    /// Held-out positions evaluated per epoch.
    pub eval_positions: usize,
    /// Checkpoint path (resumed from when present).
    pub checkpoint: PathBuf,
    /// Show progress bars.
    pub progress: bool,
    /// Layers whose inputs the head fuses with the final-normed feature (EAGLE-3 style; empty: EAGLE-1 style).
    /// The data must carry them as aux rows ([`data::trace_layer_inputs`]).
    pub fuse_layers: Vec<usize>,
    /// What the token loss compares the draft with (MLP heads).
    pub labels: Labels,
    /// A head to start from (fine-tuning on new data) instead of a fresh one: its draft vocabulary is kept, and
    /// its width and fused layers must match. A checkpoint at `checkpoint` still takes precedence (resuming).
    pub init: Option<PathBuf>,
}

/// The token loss's target for an MLP head.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Labels {
    /// The next token of the data: the model's own greedy answer on the generated part, the text elsewhere.
    #[default]
    Data,
    /// The target's own next-token distribution, from its head rows of the draft vocabulary applied to the next
    /// position's feature (EAGLE's classification loss): what the draft must imitate, also where the data is text
    /// the model would not have written.
    Teacher,
}

/// Held-out acceptance of a head, teacher-forced at the first step, on the positions whose predicted token the
/// model generated itself (its answers to chat prompts: what drafting meets at run time; prompt text — e.g. a
/// system prompt repeated in every record — would flatter the numbers).
#[derive(Clone, Copy, Debug, Default)]
pub struct Acceptance {
    /// Step 1 (target feature in): the draft's top token equals the next token.
    pub top1: f64,
    /// Step 1: the next token is among the draft's top 3.
    pub top3: f64,
    /// Step 2 (the draft's own predicted feature in, after a correct step 1): top token right.
    pub top1_step2: f64,
}

impl Acceptance {
    /// A rough chain acceptance length: 1 + p1 + p1·p2 + p1·p2² + … over `depth` steps.
    pub fn chain_tau(&self, depth: usize) -> f64 {
        let (mut tau, mut p) = (1.0, 1.0);
        for k in 0..depth {
            p *= if k == 0 { self.top1 } else { self.top1_step2 };
            tau += p;
        }
        tau
    }
}

/// The draft vocabulary: the `n` most frequent tokens of `data` (ties to the lower id), as target ids.
pub fn draft_vocabulary(data: &DraftData, n: usize) -> Vec<u32> {
    let mut counts: HashMap<u32, u64> = HashMap::new();
    for &t in &data.tokens {
        *counts.entry(t).or_default() += 1;
    }
    let mut by_count: Vec<(u32, u64)> = counts.into_iter().collect();
    by_count.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    let mut vocab: Vec<u32> = by_count.into_iter().take(n).map(|(t, _)| t).collect();
    vocab.sort_unstable();
    vocab
}

/// The learning rate after `done` of `total` batches: cosine from `lr` down to `lr · end`.
pub fn cosine_lr(lr: f64, end: f64, done: usize, total: usize) -> f64 {
    let t = (done as f64 / total.max(1) as f64).clamp(0.0, 1.0);
    lr * (end + (1.0 - end) * 0.5 * (1.0 + (std::f64::consts::PI * t).cos()))
}

/// Positions `i` with room for `steps` unrolled draft steps inside their sequence.
fn sample_positions(data: &DraftData, steps: usize) -> Vec<u32> {
    let mut out = Vec::new();
    for s in 0..data.n_sequences() {
        let r = data.sequence(s);
        // Step k reads token i+1+k, feature i+k (input) and i+1+k (target), label token i+2+k; the last
        // token's feature row does not exist.
        for i in r.start..r.end.saturating_sub(steps + 1) {
            out.push(i as u32);
        }
    }
    out
}

/// Embeddings of every token of the data, compactly (the target's embedding is frozen).
pub(crate) struct EmbTable {
    index: HashMap<u32, usize>,
    rows: Vec<f32>,
    d: usize,
}

impl EmbTable {
    pub(crate) fn new(model: &model::Model, sets: &[&DraftData]) -> Result<EmbTable, TrainError> {
        let d = model.config.n_embd;
        let mut index = HashMap::new();
        let mut ids = Vec::new();
        for set in sets {
            for &t in &set.tokens {
                index.entry(t).or_insert_with(|| {
                    ids.push(t);
                    ids.len() - 1
                });
            }
        }
        let mut rows = vec![0f32; ids.len() * d];
        model.embed(&ids, &mut rows)?;
        Ok(EmbTable { index, rows, d })
    }
    /// The embedding of `t`, a token of the sets the table was built over.
    pub(crate) fn row(&self, t: u32) -> &[f32] {
        let i = self.index[&t];
        &self.rows[i * self.d..(i + 1) * self.d]
    }
}

/// One batch, step-major.
struct Batch {
    feat0: Tensor,
    /// The first positions' aux rows `[B, aux_width]` (fused heads).
    aux0: Option<Tensor>,
    emb: Vec<Tensor>,
    target: Vec<Tensor>,
    label: Vec<Tensor>,
    mask: Vec<Tensor>,
}

fn make_batch(
    data: &DraftData,
    table: &EmbTable,
    t2d: &HashMap<u32, u32>,
    positions: &[u32],
    steps: usize,
) -> Result<Batch, TrainError> {
    let (b, d) = (positions.len(), data.d);
    let dev = Device::Cpu;
    let mut feat0 = vec![0f32; b * d];
    for (r, &i) in positions.iter().enumerate() {
        data.feature(i as usize, &mut feat0[r * d..(r + 1) * d]);
    }
    let aux0 = if data.aux_width > 0 {
        let w = data.aux_width;
        let mut aux = vec![0f32; b * w];
        for (r, &i) in positions.iter().enumerate() {
            data.aux_row(i as usize, &mut aux[r * w..(r + 1) * w]);
        }
        Some(Tensor::from_vec(aux, (b, w), &dev)?)
    } else {
        None
    };
    let mut batch = Batch {
        feat0: Tensor::from_vec(feat0, (b, d), &dev)?,
        aux0,
        emb: Vec::new(),
        target: Vec::new(),
        label: Vec::new(),
        mask: Vec::new(),
    };
    for k in 0..steps {
        let (mut emb, mut target) = (vec![0f32; b * d], vec![0f32; b * d]);
        let (mut label, mut mask) = (vec![0u32; b], vec![0f32; b]);
        for (r, &i) in positions.iter().enumerate() {
            let i = i as usize;
            emb[r * d..(r + 1) * d].copy_from_slice(table.row(data.tokens[i + 1 + k]));
            data.feature(i + 1 + k, &mut target[r * d..(r + 1) * d]);
            if let Some(&j) = t2d.get(&data.tokens[i + 2 + k]) {
                label[r] = j;
                mask[r] = 1.0;
            }
        }
        batch.emb.push(Tensor::from_vec(emb, (b, d), &dev)?);
        batch.target.push(Tensor::from_vec(target, (b, d), &dev)?);
        batch.label.push(Tensor::from_vec(label, b, &dev)?);
        batch.mask.push(Tensor::from_vec(mask, b, &dev)?);
    }
    Ok(batch)
}

/// Masked mean cross-entropy of `logits` `[B, N]` against `label` `[B]`.
pub(crate) fn cross_entropy(logits: &Tensor, label: &Tensor, mask: &Tensor) -> candle_core::Result<Tensor> {
    let lp = candle_nn::ops::log_softmax(logits, 1)?;
    let picked = lp.gather(&label.unsqueeze(1)?, 1)?.squeeze(1)?;
    let n = mask.sum_all()?.to_scalar::<f32>()?.max(1.0);
    (picked * mask)?.sum_all()?.affine(-1.0 / n as f64, 0.0)
}

/// Mean smooth-L1 (Huber, δ = 1) distance.
fn smooth_l1(a: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
    let ad = (a - b)?.abs()?;
    let quad = (ad.sqr()? * 0.5)?;
    let lin = (&ad - 0.5)?;
    ad.lt(1.0)?.where_cond(&quad, &lin)?.mean_all()
}

/// Mean cross-entropy of `logits` `[B, N]` against the distributions `softmax(teacher_logits)`.
fn soft_cross_entropy(logits: &Tensor, teacher_logits: &Tensor) -> candle_core::Result<Tensor> {
    let p = candle_nn::ops::softmax_last_dim(teacher_logits)?;
    let lp = candle_nn::ops::log_softmax(logits, 1)?;
    (p * lp)?.sum(1)?.mean_all()?.neg()
}

/// Runs the head over `steps` unrolled steps; returns the loss and, per step, the logits. With `teacher` (the
/// target's head rows of the draft vocabulary, `[N, d]`) the token loss is [`Labels::Teacher`]'s.
fn unroll(
    net: &HeadNet,
    batch: &Batch,
    steps: usize,
    reg_weight: f64,
    teacher: Option<&Tensor>,
) -> candle_core::Result<(Tensor, Vec<Tensor>)> {
    let mut feat = net.fuse(&batch.feat0, batch.aux0.as_ref())?;
    let mut loss = Tensor::zeros((), DType::F32, &Device::Cpu)?;
    let mut all_logits = Vec::new();
    for k in 0..steps {
        let out = net.step(&batch.emb[k], &feat)?;
        let ce = match teacher {
            Some(rows) => soft_cross_entropy(&out.logits, &batch.target[k].matmul(&rows.t()?)?)?,
            None => cross_entropy(&out.logits, &batch.label[k], &batch.mask[k])?,
        };
        let reg = smooth_l1(&out.features, &batch.target[k])?;
        loss = (loss + ce + (reg * reg_weight)?)?;
        feat = out.features;
        all_logits.push(out.logits);
    }
    Ok(((loss / steps as f64)?, all_logits))
}

/// Held-out acceptance on up to `n` positions (deterministic choice).
fn evaluate(
    net: &HeadNet,
    data: &DraftData,
    table: &EmbTable,
    t2d: &HashMap<u32, u32>,
    n: usize,
) -> Result<(Acceptance, f64), TrainError> {
    let mut positions: Vec<u32> = sample_positions(data, 2);
    let generated: Vec<usize> = (0..data.n_sequences()).map(|s| data.generated_from(s)).collect();
    let seq_of = |i: usize| data.seq_starts.partition_point(|&st| st as usize <= i) - 1;
    // The first step's label (token i + 2) must be generated.
    positions.retain(|&i| i as usize + 2 >= generated[seq_of(i as usize)]);
    if positions.is_empty() {
        return Err(TrainError::Invalid("held-out data has no generated tokens (chat records)".into()));
    }
    let stride = (positions.len() / n.max(1)).max(1);
    positions = positions.into_iter().step_by(stride).take(n).collect();
    let (mut top1, mut top3, mut both, mut loss_sum, mut batches) = (0usize, 0usize, 0usize, 0f64, 0usize);
    for chunk in positions.chunks(512) {
        let batch = make_batch(data, table, t2d, chunk, 2)?;
        let (loss, logits) = unroll(net, &batch, 2, 0.0, None)?;
        loss_sum += loss.to_scalar::<f32>()? as f64;
        batches += 1;
        let l0 = logits[0].to_vec2::<f32>()?;
        let l1 = logits[1].to_vec2::<f32>()?;
        let labels0 = batch.label[0].to_vec1::<u32>()?;
        let labels1 = batch.label[1].to_vec1::<u32>()?;
        let masks0 = batch.mask[0].to_vec1::<f32>()?;
        let masks1 = batch.mask[1].to_vec1::<f32>()?;
        for r in 0..chunk.len() {
            let best = |row: &[f32]| (0..row.len()).max_by(|&a, &b| row[a].total_cmp(&row[b]).then(b.cmp(&a))).unwrap();
            let ok0 = masks0[r] > 0.0 && best(&l0[r]) as u32 == labels0[r];
            let l = labels0[r] as usize;
            let rank = l0[r].iter().filter(|&&v| v > l0[r][l]).count();
            top1 += ok0 as usize;
            top3 += (masks0[r] > 0.0 && rank < 3) as usize;
            both += (ok0 && masks1[r] > 0.0 && best(&l1[r]) as u32 == labels1[r]) as usize;
        }
    }
    let total = positions.len().max(1) as f64;
    let acc = Acceptance {
        top1: top1 as f64 / total,
        top3: top3 as f64 / total,
        top1_step2: if top1 > 0 { both as f64 / top1 as f64 } else { 0.0 },
    };
    Ok((acc, loss_sum / batches.max(1) as f64))
}

/// Learning-rate schedule and reporting of [`run_epochs`].
pub(crate) struct Schedule {
    pub lr: f64,
    pub lr_end: f64,
    pub epochs: usize,
    pub progress: bool,
}

/// What [`run_epochs`] drives: one head design's batches, held-out evaluation and checkpoints.
pub(crate) trait Trainee {
    /// Number of batches per epoch.
    fn batches(&self) -> usize;
    /// Orders the batches for `epoch` (the same order for the same epoch, so a resumed run repeats it).
    fn shuffle(&mut self, epoch: usize);
    /// Trains on batch `i` at learning rate `lr`; returns its loss.
    fn train_batch(&mut self, i: usize, lr: f64) -> Result<f64, TrainError>;
    /// Held-out acceptance and loss.
    fn evaluate(&mut self) -> Result<(Acceptance, f64), TrainError>;
    /// Writes the checkpoint after `epoch` (0-based).
    fn checkpoint(&mut self, epoch: usize) -> Result<(), TrainError>;
}

/// The epoch a checkpoint (its metadata and draft vocabulary, as loaded) was written after; refuses a checkpoint
/// of another draft vocabulary.
pub(crate) fn resumed_epoch(
    path: &Path,
    (meta, ckpt_vocab): (HashMap<String, String>, Vec<u32>),
    vocab: &[u32],
) -> Result<usize, TrainError> {
    if ckpt_vocab != vocab {
        return Err(TrainError::Invalid(format!(
            "checkpoint {} was made with another draft vocabulary (different data or --vocab); remove it",
            path.display()
        )));
    }
    let epoch = meta.get("epoch").and_then(|e| e.parse().ok()).unwrap_or(0);
    eprintln!("resuming from {} after epoch {epoch}", path.display());
    Ok(epoch)
}

/// The draft vocabulary of the head file at `path` (its `d2t`), which a head started from it keeps.
fn init_vocabulary(path: &Path) -> Result<Vec<u32>, TrainError> {
    let bytes = std::fs::read(path).map_err(|e| TrainError::Io(path.display().to_string(), e))?;
    let head = decode::speculative::DraftHead::from_bytes(&bytes)
        .map_err(|e| TrainError::Format(format!("{}: {e}", path.display())))?;
    Ok(head.d2t)
}

/// The line before training: what is trained on, and the untrained head's held-out figures.
pub(crate) fn report_start(what: &str, before: &Acceptance, loss: f64) {
    eprintln!(
        "{what}; held-out before: loss {loss:.3}, top-1 {:.3}, top-3 {:.3}, step-2 top-1 {:.3}",
        before.top1, before.top3, before.top1_step2
    );
}

/// Records how a head was trained in its file's metadata.
pub(crate) fn record_training(
    metadata: &mut HashMap<String, String>,
    epochs: usize,
    positions: usize,
    last: &Acceptance,
    settings: String,
) {
    metadata.insert("epochs".into(), epochs.to_string());
    metadata.insert("train_positions".into(), positions.to_string());
    metadata.insert("heldout_top1".into(), format!("{:.4}", last.top1));
    metadata.insert("heldout_top3".into(), format!("{:.4}", last.top3));
    metadata.insert("heldout_step2_top1".into(), format!("{:.4}", last.top1_step2));
    metadata.insert("settings".into(), settings);
}

/// Fisher–Yates shuffle with the epoch's own seed.
pub(crate) fn shuffle_for_epoch<T>(items: &mut [T], seed: u64, epoch: usize) {
    let mut rng = Lcg(seed.wrapping_add(epoch as u64 * 7919));
    for i in (1..items.len()).rev() {
        let j = (rng.next_u64() % (i as u64 + 1)) as usize;
        items.swap(i, j);
    }
}

/// The epoch loop every head design shares: epochs `first_epoch..` with a cosine learning rate over all batches, a
/// progress bar (or a line every tenth of an epoch without a terminal), held-out acceptance and a checkpoint after
/// each epoch. Returns the last acceptance (`before` when no epoch ran).
pub(crate) fn run_epochs(
    schedule: &Schedule,
    first_epoch: usize,
    before: Acceptance,
    start: Instant,
    trainee: &mut impl Trainee,
) -> Result<Acceptance, TrainError> {
    let Schedule { lr, lr_end, epochs, progress } = *schedule;
    let n_batches = trainee.batches();
    let mut last = before;
    for epoch in first_epoch..epochs {
        trainee.shuffle(epoch);
        let bar = progress_bar(progress, n_batches as u64, &format!("epoch {}/{epochs}", epoch + 1));
        let (mut loss_sum, mut seen) = (0f64, 0usize);
        for i in 0..n_batches {
            loss_sum += trainee.train_batch(i, cosine_lr(lr, lr_end, epoch * n_batches + i, epochs * n_batches))?;
            seen += 1;
            bar.set_message(format!("loss {:.3}", loss_sum / seen as f64));
            bar.inc(1);
            if bar.is_hidden() && progress && seen % (n_batches / 10).max(1) == 0 {
                // No terminal (a log file): a line every tenth of the epoch instead of the bar.
                eprintln!(
                    "epoch {}/{epochs}: batch {seen}/{n_batches}, loss {:.3}, {:.0} s",
                    epoch + 1,
                    loss_sum / seen as f64,
                    start.elapsed().as_secs_f64()
                );
            }
        }
        bar.finish_and_clear();
        let (acc, heldout_loss) = trainee.evaluate()?;
        last = acc;
        eprintln!(
            "epoch {}/{epochs}: train loss {:.3} | held-out loss {heldout_loss:.3}, top-1 {:.3}, top-3 {:.3}, step-2 \
             top-1 {:.3}, chain τ≈{:.2} | {:.0} s",
            epoch + 1,
            loss_sum / seen.max(1) as f64,
            acc.top1,
            acc.top3,
            acc.top1_step2,
            acc.chain_tau(4),
            start.elapsed().as_secs_f64()
        );
        trainee.checkpoint(epoch)?;
    }
    Ok(last)
}

/// The MLP head's side of [`run_epochs`]: shuffled positions in batches of `batch`.
struct MlpTrainee<'a, S> {
    net: &'a HeadNet,
    opt: AdamW,
    positions: Vec<u32>,
    batch: usize,
    steps: usize,
    reg_weight: f64,
    teacher: Option<Tensor>,
    seed: u64,
    train: &'a DraftData,
    heldout: &'a DraftData,
    table: &'a EmbTable,
    t2d: &'a HashMap<u32, u32>,
    eval_positions: usize,
    save: S,
}

impl<S: FnMut(usize) -> Result<(), TrainError>> Trainee for MlpTrainee<'_, S> {
    fn batches(&self) -> usize {
        self.positions.len().div_ceil(self.batch)
    }
    fn shuffle(&mut self, epoch: usize) {
        shuffle_for_epoch(&mut self.positions, self.seed, epoch);
    }
    fn train_batch(&mut self, i: usize, lr: f64) -> Result<f64, TrainError> {
        self.opt.set_learning_rate(lr);
        let chunk = &self.positions[i * self.batch..((i + 1) * self.batch).min(self.positions.len())];
        let batch = make_batch(self.train, self.table, self.t2d, chunk, self.steps)?;
        let (loss, _) = unroll(self.net, &batch, self.steps, self.reg_weight, self.teacher.as_ref())?;
        self.opt.backward_step(&loss)?;
        Ok(loss.to_scalar::<f32>()? as f64)
    }
    fn evaluate(&mut self) -> Result<(Acceptance, f64), TrainError> {
        evaluate(self.net, self.heldout, self.table, self.t2d, self.eval_positions)
    }
    fn checkpoint(&mut self, epoch: usize) -> Result<(), TrainError> {
        (self.save)(epoch)
    }
}

/// What [`train_draft`] reports.
#[derive(Clone, Debug)]
pub struct TrainReport {
    pub epochs_run: usize,
    pub train_positions: usize,
    pub heldout: Acceptance,
    pub seconds: f64,
}

/// Trains a draft head for `model` on `train` (evaluating on `heldout` after every epoch) and writes it to
/// `out` (F16). Resumes from `opts.checkpoint` when it exists.
pub fn train_draft(
    model: &model::Model,
    train: &DraftData,
    heldout: &DraftData,
    out: &Path,
    opts: &TrainOptions,
    mut metadata: HashMap<String, String>,
) -> Result<TrainReport, TrainError> {
    let d = model.config.n_embd;
    if train.d != d || heldout.d != d {
        return Err(TrainError::Invalid(format!(
            "data has hidden size {} / {}, the model {d}: collected with another model?",
            train.d, heldout.d
        )));
    }
    let aux_width = opts.fuse_layers.len() * d;
    if train.aux_width != aux_width || heldout.aux_width != aux_width {
        return Err(TrainError::Invalid(format!(
            "the head fuses {} layer inputs ({aux_width} floats) but the data carries {} / {} aux floats per row",
            opts.fuse_layers.len(),
            train.aux_width,
            heldout.aux_width
        )));
    }
    // The fused layers, which every file of the head (checkpoints too) must name.
    let fuse_meta: Option<(String, String)> = (!opts.fuse_layers.is_empty()).then(|| {
        let layers: Vec<String> = opts.fuse_layers.iter().map(|l| l.to_string()).collect();
        ("fuse_layers".to_string(), layers.join(","))
    });
    let start = Instant::now();
    let vocab = match &opts.init {
        Some(init) => init_vocabulary(init)?,
        None => draft_vocabulary(train, opts.vocab),
    };
    let t2d: HashMap<u32, u32> = vocab.iter().enumerate().map(|(j, &t)| (t, j as u32)).collect();
    let shape = HeadShape { d, ff: opts.ff, vocab: vocab.len(), aux: opts.fuse_layers.len() };
    let mut head_rows = vec![0f32; vocab.len() * d];
    for (j, &t) in vocab.iter().enumerate() {
        model.head_row(t, &mut head_rows[j * d..(j + 1) * d])?;
    }
    let net = HeadNet::new(shape, model.config.rms_eps as f64, &head_rows, opts.seed)?;
    let mut first_epoch = 0;
    if opts.checkpoint.exists() {
        first_epoch = resumed_epoch(&opts.checkpoint, net.load_into(&opts.checkpoint)?, &vocab)?;
    } else if let Some(init) = &opts.init {
        let (meta, _) = net.load_into(init)?;
        if meta.get("fuse_layers") != fuse_meta.as_ref().map(|(_, v)| v) {
            return Err(TrainError::Invalid(format!(
                "{} fuses layers {:?}, --fuse-layers asks for {:?}",
                init.display(),
                meta.get("fuse_layers").map(String::as_str).unwrap_or(""),
                fuse_meta.as_ref().map(|(_, v)| v.as_str()).unwrap_or("")
            )));
        }
        eprintln!("starting from {} (its draft vocabulary of {} tokens)", init.display(), vocab.len());
    }
    let table = EmbTable::new(model, &[train, heldout])?;
    let positions = sample_positions(train, opts.steps);
    if positions.is_empty() {
        return Err(TrainError::Invalid("no training positions (sequences too short?)".into()));
    }
    let opt = AdamW::new(net.vars(), ParamsAdamW { lr: opts.lr, weight_decay: 0.0, ..Default::default() })?;
    let (before, before_loss) = evaluate(&net, heldout, &table, &t2d, opts.eval_positions)?;
    let what = format!("draft vocabulary {} tokens; {} training positions", vocab.len(), positions.len());
    report_start(&what, &before, before_loss);
    let schedule = Schedule { lr: opts.lr, lr_end: opts.lr_end, epochs: opts.epochs, progress: opts.progress };
    let mut trainee = MlpTrainee {
        net: &net,
        opt,
        positions,
        batch: opts.batch,
        steps: opts.steps,
        reg_weight: opts.reg_weight,
        teacher: match opts.labels {
            Labels::Teacher => Some(Tensor::from_vec(head_rows.clone(), (vocab.len(), d), &Device::Cpu)?),
            Labels::Data => None,
        },
        seed: opts.seed,
        train,
        heldout,
        table: &table,
        t2d: &t2d,
        eval_positions: opts.eval_positions,
        save: |epoch: usize| {
            let mut ckpt_meta = HashMap::from([("epoch".to_string(), (epoch + 1).to_string())]);
            ckpt_meta.extend(fuse_meta.clone());
            net.save(&opts.checkpoint, &vocab, DType::F32, ckpt_meta)
        },
    };
    let last = run_epochs(&schedule, first_epoch, before, start, &mut trainee)?;
    let MlpTrainee { positions, .. } = trainee;
    let report = TrainReport {
        epochs_run: opts.epochs.saturating_sub(first_epoch),
        train_positions: positions.len(),
        heldout: last,
        seconds: start.elapsed().as_secs_f64(),
    };
    metadata.extend(fuse_meta);
    let settings = format!(
        "vocab={} ff={} batch={} lr={} lr_end={} steps={} reg_weight={} seed={} labels={:?}",
        opts.vocab, opts.ff, opts.batch, opts.lr, opts.lr_end, opts.steps, opts.reg_weight, opts.seed, opts.labels
    );
    record_training(&mut metadata, opts.epochs, positions.len(), &last, settings);
    net.save(out, &vocab, DType::F16, metadata)?;
    Ok(report)
}

/// A progress bar on stderr (hidden when `show` is false).
pub fn progress_bar(show: bool, len: u64, prefix: &str) -> indicatif::ProgressBar {
    if !show {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::new(len);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{prefix} [{bar:30}] {pos}/{len} {msg} ({eta} left)")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    bar.set_prefix(prefix.to_string());
    bar
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use decode::sampling::argmax;
    use decode::speculative::eagle::DraftScratch;
    use decode::speculative::DraftHead;

    #[test]
    fn cosine_learning_rate_runs_from_lr_to_its_end_fraction() {
        assert_eq!(cosine_lr(1e-3, 0.1, 0, 100), 1e-3);
        assert!((cosine_lr(1e-3, 0.1, 100, 100) - 1e-4).abs() < 1e-12);
        assert!((cosine_lr(1e-3, 0.1, 50, 100) - 5.5e-4).abs() < 1e-12);
        assert!((1..100).all(|i| cosine_lr(1e-3, 0.1, i, 100) < cosine_lr(1e-3, 0.1, i - 1, 100)));
        assert!((0..=100).all(|i| cosine_lr(1e-3, 1.0, i, 100) == 1e-3));
    }

    /// Sequences of a tiny model's vocabulary where every next token follows from the previous one
    /// (`t' = 5t + 3 mod V`) and features are noise: a head can learn the next token from its token input.
    pub(crate) fn synthetic(model: &model::Model, n_seq: usize, len: usize, seed: u64) -> DraftData {
        let (d, v) = (model.config.n_embd, model.config.vocab_size as u32);
        let mut rng = Lcg(seed);
        let mut data = DraftData { d, ..Default::default() };
        for _ in 0..n_seq {
            let mut t = (rng.next_u64() % v as u64) as u32;
            let tokens: Vec<u32> = (0..len)
                .map(|_| {
                    let cur = t;
                    t = (5 * t + 3) % v;
                    cur
                })
                .collect();
            let features: Vec<f32> = (0..(len - 1) * d).map(|_| rng.normal()).collect();
            data.push(&tokens, &features, 0);
        }
        data
    }

    /// Aux rows of noise for `layers` (their values do not matter to these tests, only that both sides read them).
    pub(crate) fn with_noise_aux(mut data: DraftData, layers: usize, seed: u64) -> DraftData {
        let mut rng = Lcg(seed);
        data.aux_width = layers * data.d;
        data.aux =
            (0..data.tokens.len() * data.aux_width).map(|_| half::f16::from_f32(rng.normal()).to_bits()).collect();
        data
    }

    /// Settings for the tiny test model's heads: 3 epochs of batches of 32 at lr 1e-2.
    fn tiny_options(checkpoint: PathBuf, fuse: &[usize], labels: Labels) -> TrainOptions {
        TrainOptions {
            vocab: 64,
            ff: 64,
            epochs: 3,
            batch: 32,
            lr: 1e-2,
            lr_end: 0.1,
            steps: 2,
            reg_weight: 0.1,
            seed: 1,
            eval_positions: 1000,
            checkpoint,
            progress: false,
            fuse_layers: fuse.to_vec(),
            labels,
            init: None,
        }
    }

    /// A head started from another keeps its draft vocabulary (even where the new data's most frequent tokens
    /// differ) and starts from what it had learnt; one of another width is refused.
    #[test]
    fn a_head_started_from_another_keeps_its_vocabulary_and_what_it_learnt() {
        let model = model::testing::tiny_model("llama", None, 3, 64);
        let (train, heldout) = (synthetic(&model, 40, 24, 1), synthetic(&model, 8, 24, 2));
        let dir = std::env::temp_dir().join(format!("specee-train-init-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let first = dir.join("first.safetensors");
        let opts = TrainOptions { vocab: 32, ..tiny_options(dir.join("first.ckpt.safetensors"), &[], Labels::Data) };
        let trained = train_draft(&model, &train, &heldout, &first, &opts, HashMap::new()).unwrap().heldout.top1;
        // New data of other tokens: its own vocabulary would differ from the first head's.
        let other = synthetic(&model, 40, 24, 11);
        assert_ne!(draft_vocabulary(&other, 32), draft_vocabulary(&train, 32));
        let second = dir.join("second.safetensors");
        let tuned = TrainOptions {
            epochs: 1,
            lr: 1e-5,
            init: Some(first.clone()),
            ..TrainOptions { checkpoint: dir.join("second.ckpt.safetensors"), ..opts.clone() }
        };
        let report = train_draft(&model, &other, &heldout, &second, &tuned, HashMap::new()).unwrap();
        assert_eq!(DraftHead::load(&second).unwrap().d2t, DraftHead::load(&first).unwrap().d2t);
        // At a tiny learning rate the head stays what it was: a fresh one would be near 0.
        assert!(report.heldout.top1 > trained - 0.05, "{} after, {trained} before", report.heldout.top1);
        let wider = TrainOptions { ff: 32, ..tuned.clone() };
        std::fs::remove_file(dir.join("second.ckpt.safetensors")).unwrap();
        assert!(train_draft(&model, &other, &heldout, &second, &wider, HashMap::new()).is_err());
        std::fs::remove_dir_all(&dir).ok();
    }

    /// Sequences of `len` tokens over a 64-token vocabulary whose features say what the target would write next:
    /// the feature at position `j` is the target's head row of `rule(token j)` (scaled so its softmax is peaked),
    /// while the tokens themselves follow the rule (`follow`) or are random text the target would not write.
    fn rule_data(model: &model::Model, n_seq: usize, len: usize, seed: u64, follow: bool) -> DraftData {
        let (d, v) = (model.config.n_embd, model.config.vocab_size as u32);
        let rule = |t: u32| (5 * t + 3) % v;
        let mut rng = Lcg(seed);
        let mut data = DraftData { d, ..Default::default() };
        let mut row = vec![0f32; d];
        for _ in 0..n_seq {
            let mut tokens = vec![(rng.next_u64() % v as u64) as u32];
            while tokens.len() < len {
                let last = *tokens.last().unwrap();
                tokens.push(if follow { rule(last) } else { (rng.next_u64() % v as u64) as u32 });
            }
            let mut features = Vec::new();
            for &t in &tokens[..len - 1] {
                model.head_row(rule(t), &mut row).unwrap();
                let norm2: f32 = row.iter().map(|x| x * x).sum();
                features.extend(row.iter().map(|x| x * 12.0 / norm2));
            }
            data.push(&tokens, &features, 0);
        }
        data
    }

    /// With teacher labels the head learns what the target's features say it would write, even from text that
    /// says otherwise; with data labels it learns the text (here: noise), and fails on the target's own output.
    #[test]
    fn teacher_labels_train_the_draft_to_imitate_the_target_not_the_text() {
        let model = model::testing::tiny_model("llama", None, 3, 64);
        let (train, heldout) = (rule_data(&model, 60, 24, 1, false), rule_data(&model, 8, 24, 2, true));
        let dir = std::env::temp_dir().join(format!("specee-train-teacher-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut top1 = Vec::new();
        for labels in [Labels::Teacher, Labels::Data] {
            let opts = TrainOptions {
                epochs: 4,
                ..tiny_options(dir.join(format!("{labels:?}.ckpt.safetensors")), &[], labels)
            };
            let out = dir.join(format!("{labels:?}.safetensors"));
            top1.push(train_draft(&model, &train, &heldout, &out, &opts, HashMap::new()).unwrap().heldout.top1);
        }
        std::fs::remove_dir_all(&dir).ok();
        assert!(top1[0] > 0.9 && top1[1] < 0.3, "held-out top-1 with teacher / data labels: {top1:?}");
    }

    #[test]
    fn training_learns_resumes_and_writes_the_head_inference_runs() {
        train_resume_and_compare(&[]);
    }

    #[test]
    fn fused_heads_train_and_run_as_trained() {
        train_resume_and_compare(&[1, 3]);
    }

    fn train_resume_and_compare(fuse: &[usize]) {
        let model = model::testing::tiny_model("llama", None, 3, 64);
        let (mut train, mut heldout) = (synthetic(&model, 40, 24, 1), synthetic(&model, 8, 24, 2));
        if !fuse.is_empty() {
            (train, heldout) = (with_noise_aux(train, fuse.len(), 3), with_noise_aux(heldout, fuse.len(), 4));
        }
        let dir = std::env::temp_dir().join(format!("specee-train-draft-{}-{}", std::process::id(), fuse.len()));
        std::fs::create_dir_all(&dir).unwrap();
        let out = dir.join("head.safetensors");
        let opts = tiny_options(dir.join("head.ckpt.safetensors"), fuse, Labels::Data);
        // Data without the aux rows the head fuses is refused.
        let bare = DraftData { aux_width: 0, aux: Vec::new(), ..heldout.clone() };
        let wrong = if fuse.is_empty() { with_noise_aux(bare, 1, 5) } else { bare };
        assert!(matches!(
            train_draft(&model, &train, &wrong, &out, &opts, HashMap::new()),
            Err(TrainError::Invalid(_))
        ));
        let report = train_draft(&model, &train, &heldout, &out, &opts, HashMap::new()).unwrap();
        assert_eq!(report.epochs_run, 3);
        assert!(report.heldout.top1 > 0.9, "held-out top-1 {}", report.heldout.top1);

        // A rerun with one more epoch resumes from the checkpoint instead of starting over.
        let more = TrainOptions { epochs: 4, ..opts.clone() };
        assert_eq!(train_draft(&model, &train, &heldout, &out, &more, HashMap::new()).unwrap().epochs_run, 1);

        // The written file, run by the inference code (F16 weights, Q8_0 kernels), agrees with the trained
        // network (the F32 checkpoint in candle) on the next token.
        let mut head = DraftHead::load(&out).unwrap();
        head.check_fits(&model).unwrap();
        let vocab = draft_vocabulary(&train, 64);
        let shape = HeadShape { d: 32, ff: 64, vocab: vocab.len(), aux: fuse.len() };
        let net = HeadNet::new(shape, model.config.rms_eps as f64, &vec![0.0; vocab.len() * 32], 9).unwrap();
        let (meta, _) = net.load_into(&opts.checkpoint).unwrap();
        if let Some((norm, w)) = &net.fuse {
            // Noise taught the fusion to ignore the aux rows: give it random weights, so that the comparison
            // below depends on both sides reading and norming them alike.
            let mut rng = Lcg(7);
            let mut random = |v: &candle_core::Var, scale: f32| {
                let values: Vec<f32> = (0..v.elem_count()).map(|_| rng.normal() * scale).collect();
                v.set(&Tensor::from_vec(values, v.dims(), &Device::Cpu).unwrap()).unwrap();
            };
            random(norm, 1.0);
            random(w, 0.2);
            let path = dir.join("randomized.safetensors");
            net.save(&path, &vocab, DType::F32, meta).unwrap();
            head = DraftHead::load(&path).unwrap();
        }
        let rows: Vec<usize> = (0..heldout.tokens.len() - 1).filter(|i| (i + 1) % 24 != 0).take(64).collect();
        let tokens: Vec<u32> = rows.iter().map(|&i| heldout.tokens[i + 1]).collect();
        // Feature rows as the decoder hands them over: the final-normed feature, then the aux rows.
        let (m, aw) = (rows.len(), heldout.aux_width);
        let (mut feats, mut aux) = (vec![0f32; m * 32], vec![0f32; m * aw]);
        let mut target_rows = Vec::new();
        for (r, &i) in rows.iter().enumerate() {
            heldout.feature(i, &mut feats[r * 32..(r + 1) * 32]);
            heldout.aux_row(i, &mut aux[r * aw..(r + 1) * aw]);
            target_rows.extend_from_slice(&feats[r * 32..(r + 1) * 32]);
            target_rows.extend_from_slice(&aux[r * aw..(r + 1) * aw]);
        }
        let (mut input, mut out_feat, mut logits) = (Vec::new(), Vec::new(), Vec::new());
        let (pool, mut scratch) = (kernels::ThreadPool::new(1), DraftScratch::default());
        head.first_input(&target_rows, m, &pool, &mut scratch, &mut input);
        head.forward(&model, &tokens, &input, &pool, &mut scratch, &mut out_feat, &mut logits).unwrap();
        let mut emb = vec![0f32; tokens.len() * 32];
        model.embed(&tokens, &mut emb).unwrap();
        let dev = Device::Cpu;
        let aux = (aw > 0).then(|| Tensor::from_vec(aux, (m, aw), &dev).unwrap());
        let fused = net.fuse(&Tensor::from_vec(feats, (m, 32), &dev).unwrap(), aux.as_ref()).unwrap();
        let want = net
            .step(&Tensor::from_vec(emb, (tokens.len(), 32), &dev).unwrap(), &fused)
            .unwrap()
            .logits
            .to_vec2::<f32>()
            .unwrap();
        let n = head.vocab;
        let same = (0..tokens.len()).filter(|&r| argmax(&logits[r * n..(r + 1) * n]) == argmax(&want[r])).count();
        assert!(same * 20 >= tokens.len() * 19, "{same} of {} rows agree", tokens.len());
        assert_eq!(head.d2t, vocab);
        std::fs::remove_dir_all(&dir).ok();
    }
}
