//! `specee sparsity fit|curve|plot`: activation sparsity's ceiling (issue #39; the zeroing is
//! `model::sparsity`, the file and the curve `engine::act_sparsity`).
//!
//! - `fit -m M --calib TEXT --out FILE [-c 256] [--chunks N]`: records every layer's matrix-input magnitudes on
//!   calibration text with the dense model and writes them (histograms + the model's identity) to FILE.
//! - `curve -m M --file FILE --text HELDOUT [--levels 0.1,0.2,…] [-c 256] [--chunks 8] [--json]`: teacher-forced
//!   quality per target sparsity on held-out text: perplexity against dense, agreement of top-1 with dense, and the
//!   sparsity actually reached (model-wide by weight columns, per matrix input, and over groups of 2 / 4 / 8
//!   consecutive rows: the columns a tree verification of that many rows could skip). `--sites` sparsifies only
//!   some matrix inputs; `--mix o=0.5,down=0.5` adds a point with a share per input. With `--json` one object.
//!   `--blocks N` (instead of `--file`) measures block sparsity: per row, the share of blocks of N inputs with the
//!   smallest norm is zeroed (a dense kernel could skip all-zero activation blocks); `--permute CALIB` forms the
//!   blocks from channels of similar mean magnitude on calibration text.
//! - `plot OUT.png CURVE.json…`: the curves of several `curve --json` outputs, one colour per model, left the
//!   perplexity increase (%, clipped at 30%; dotted: +3%), right the agreement with dense (%, dotted: 98%), both against the
//!   sparsity reached (%).

use super::ModelArgs;
use model::sparsity::SITES;
use model::Site;
use std::io::Write;
use std::path::PathBuf;

#[derive(clap::Subcommand)]
pub enum Action {
    /// Record the model's activation magnitudes on calibration text and write the thresholds file.
    Fit(FitArgs),
    /// Perplexity and agreement with dense against target sparsity on held-out text.
    Curve(CurveArgs),
    /// Draw the curves of `curve --json` outputs into one PNG.
    Plot(PlotArgs),
}

#[derive(clap::Args)]
pub struct Args {
    #[command(subcommand)]
    pub action: Action,
}

#[derive(clap::Args)]
pub struct FitArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Calibration text (keep it apart from the text `curve` evaluates on).
    #[arg(long)]
    pub calib: PathBuf,
    /// Where to write the histograms.
    #[arg(long)]
    pub out: PathBuf,
    /// Chunk length in tokens.
    #[arg(short = 'c', long = "ctx-size", default_value_t = 256)]
    pub ctx: usize,
    /// Use at most this many chunks (0 = all).
    #[arg(long, default_value_t = 0)]
    pub chunks: usize,
}

#[derive(clap::Args)]
pub struct CurveArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// The file `sparsity fit` wrote for this model (element sparsity by fitted thresholds).
    #[arg(long, required_unless_present = "blocks", conflicts_with = "blocks")]
    pub file: Option<PathBuf>,
    /// Block sparsity instead (an experiment): per row, zero the share of blocks of N consecutive inputs with the
    /// smallest norm (no calibration file).
    #[arg(long, value_name = "N")]
    pub blocks: Option<usize>,
    /// With `--blocks`: group input channels into blocks by their mean magnitude on this calibration text (16
    /// chunks, dense) instead of by position, as a model with permuted weight columns would.
    #[arg(long, value_name = "TEXT", requires = "blocks")]
    pub permute: Option<PathBuf>,
    /// Held-out text.
    #[arg(long)]
    pub text: PathBuf,
    /// Target sparsities (shares, comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "0.1,0.2,0.3,0.4,0.5,0.6")]
    pub levels: Vec<f64>,
    /// Sparsify only these matrix inputs (qkv, o, gate_up, down; default: all four).
    #[arg(long, value_delimiter = ',')]
    pub sites: Vec<String>,
    /// A further point with its own share per matrix input, e.g. `o=0.5,down=0.5` (the others dense); repeatable.
    #[arg(long)]
    pub mix: Vec<String>,
    /// Chunk length in tokens.
    #[arg(short = 'c', long = "ctx-size", default_value_t = 256)]
    pub ctx: usize,
    /// Evaluate at most this many chunks (0 = all).
    #[arg(long, default_value_t = 8)]
    pub chunks: usize,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

#[derive(clap::Args)]
pub struct PlotArgs {
    /// The PNG to write.
    pub out: PathBuf,
    /// Outputs of `specee sparsity curve --json`, one per model.
    #[arg(required = true)]
    pub curves: Vec<PathBuf>,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    match a.action {
        Action::Fit(a) => fit(a),
        Action::Curve(a) => curve(a),
        Action::Plot(a) => plot(a),
    }
}

fn read_text(path: &PathBuf) -> anyhow::Result<String> {
    std::fs::read_to_string(path).map_err(|e| anyhow::anyhow!("cannot read {}: {e}", path.display()))
}

fn fit(a: FitArgs) -> anyhow::Result<()> {
    let text = read_text(&a.calib)?;
    let (eng, path) = a.model.load_with_path()?;
    let start = std::time::Instant::now();
    let hist = engine::act_sparsity::fit(&eng, &text, a.ctx, a.chunks, a.model.threads(), |done, total| {
        eprint!("\rcalibrating [{done}/{total}]   ");
        let _ = std::io::stderr().flush();
    })?;
    eprintln!();
    let extra = [
        ("calib_text".to_string(), a.calib.display().to_string()),
        (
            "calib_sha256".to_string(),
            engine::identity::sha256_file(&a.calib).map_err(|e| anyhow::anyhow!("{}: {e}", a.calib.display()))?,
        ),
        ("ctx".to_string(), a.ctx.to_string()),
        ("chunks".to_string(), a.chunks.to_string()),
        ("created".to_string(), engine::identity::utc_now()),
    ];
    engine::act_sparsity::save(&a.out, &hist, &eng, &path, &extra)?;
    let tokens = hist.total(0, model::Site::GateUp) / eng.model.config.n_embd as u64;
    println!("wrote {} ({tokens} tokens recorded) in {:.1} s", a.out.display(), start.elapsed().as_secs_f64());
    Ok(())
}

fn curve(a: CurveArgs) -> anyhow::Result<()> {
    if let Some(bad) = a.levels.iter().find(|&&s| !(0.0..1.0).contains(&s)) {
        anyhow::bail!("--levels: {bad} is not a share in [0, 1)");
    }
    let site = |flag: &str, s: &str| {
        Site::ALL
            .into_iter()
            .find(|x| x.name() == s)
            .ok_or_else(|| anyhow::anyhow!("{flag}: unknown matrix input '{s}' (qkv, o, gate_up, down)"))
    };
    let sites: Vec<Site> = if a.sites.is_empty() {
        Site::ALL.to_vec()
    } else {
        a.sites.iter().map(|s| site("--sites", s)).collect::<anyhow::Result<_>>()?
    };
    let mut targets: Vec<[f64; SITES]> = a
        .levels
        .iter()
        .map(|&l| std::array::from_fn(|i| if sites.contains(&Site::ALL[i]) { l } else { 0.0 }))
        .collect();
    for spec in &a.mix {
        let mut t = [0f64; SITES];
        for part in spec.split(',') {
            let (name, share) = part
                .split_once('=')
                .ok_or_else(|| anyhow::anyhow!("--mix: '{part}' is not NAME=SHARE (e.g. down=0.5)"))?;
            let share: f64 = share.trim().parse().map_err(|_| anyhow::anyhow!("--mix: '{share}' is not a number"))?;
            if !(0.0..1.0).contains(&share) {
                anyhow::bail!("--mix: {share} is not a share in [0, 1)");
            }
            t[site("--mix", name.trim())? as usize] = share;
        }
        targets.push(t);
    }
    let text = read_text(&a.text)?;
    let (mut eng, path) = a.model.load_with_path()?;
    let hist = match &a.file {
        Some(file) => Some(engine::act_sparsity::load(file, &eng, &path)?),
        None => None,
    };
    let order = match &a.permute {
        Some(calib) => {
            let calib = read_text(calib)?;
            let rec = engine::act_sparsity::fit(&eng, &calib, a.ctx, 16, a.model.threads(), |_, _| {})?;
            Some(std::sync::Arc::new(rec.channel_orders()))
        }
        None => None,
    };
    let how = match (&hist, a.blocks) {
        (Some(h), _) => engine::act_sparsity::Sparsifier::Fitted(h),
        (None, Some(n)) if n >= 1 => engine::act_sparsity::Sparsifier::Blocks(n, order),
        (None, _) => anyhow::bail!("--blocks: a block holds at least 1 input"),
    };
    let quiet = a.json;
    let c = engine::act_sparsity::curve(&mut eng, how, &targets, &text, a.ctx, a.chunks, a.model.threads(), |d, n| {
        if !quiet {
            eprint!("\rforwards [{d}/{n}]   ");
            let _ = std::io::stderr().flush();
        }
    })?;
    let file_name =
        a.file.as_ref().map_or_else(|| format!("blocks of {}", a.blocks.unwrap_or(0)), |f| f.display().to_string());
    let sites = Site::ALL.map(|s| s.name());
    if a.json {
        let points: Vec<_> = c
            .points
            .iter()
            .map(|p| {
                serde_json::json!({
                    "target": sites.iter().zip(p.target).map(|(s, v)| (s.to_string(), serde_json::json!(v)))
                        .collect::<serde_json::Map<_, _>>(),
                    "achieved": p.achieved, "bytes_ceiling": p.ceiling, "ppl": p.ppl,
                    "ppl_increase": p.ppl / c.ppl_dense - 1.0, "agreement": p.agreement,
                    "rows_union": model::sparsity::GROUPS.iter().zip(p.groups)
                        .map(|(g, v)| (g.to_string(), serde_json::json!(v))).collect::<serde_json::Map<_, _>>(),
                    "per_site": sites.iter().zip(p.per_site).map(|(s, v)| (s.to_string(), serde_json::json!(v)))
                        .collect::<serde_json::Map<_, _>>(),
                })
            })
            .collect();
        println!(
            "{}",
            serde_json::json!({
                "model": path.display().to_string(), "file": file_name, "blocks": a.blocks,
                "text": a.text.display().to_string(), "ctx": a.ctx, "positions": c.positions,
                "ppl_dense": c.ppl_dense, "points": points, "seconds": c.seconds,
            })
        );
        return Ok(());
    }
    eprintln!();
    let (sites_b, head_b) = engine::act_sparsity::site_bytes(&eng.model);
    let layers_b: f64 = sites_b.iter().sum();
    println!(
        "{} positions of {}, dense PPL {:.4} ({:.0} s); a token reads {:.1} MB of layer matrices and {:.1} MB of head",
        c.positions,
        a.text.display(),
        c.ppl_dense,
        c.seconds,
        layers_b / 1e6,
        head_b / 1e6
    );
    let groups = model::sparsity::GROUPS.map(|g| format!("{:>8}", format!("{g} rows")));
    println!(
        "target  reached  ceiling  PPL       ΔPPL     agreement  {}{}",
        sites.map(|s| format!("{s:>8}")).join(""),
        groups.join("")
    );
    for p in &c.points {
        println!(
            "{:>6}  {:6.1}%  {:6.2}×  {:8.4}  {:+6.2}%  {:8.2}%  {}{}",
            target_label(&p.target),
            100.0 * p.achieved,
            p.ceiling,
            p.ppl,
            100.0 * (p.ppl / c.ppl_dense - 1.0),
            100.0 * p.agreement,
            p.per_site.map(|v| format!("{:7.1}%", 100.0 * v)).join(""),
            p.groups.map(|v| format!("{:7.1}%", 100.0 * v)).join("")
        );
    }
    Ok(())
}

/// `30%` for the same share at every input, else the shares in input order (`0/50/0/50`).
fn target_label(t: &[f64; SITES]) -> String {
    if t.iter().all(|&v| v == t[0]) {
        format!("{:.0}%", 100.0 * t[0])
    } else {
        t.map(|v| format!("{:.0}", 100.0 * v)).join("/")
    }
}

/// Colours of the models in `plot`, in argument order.
const COLOURS: [[u8; 3]; 6] = [[30, 90, 210], [210, 60, 30], [30, 150, 60], [150, 60, 180], [200, 150, 0], [0, 0, 0]];

fn plot(a: PlotArgs) -> anyhow::Result<()> {
    use train::plot::{plot_lines, Panel};
    let mut ppl = Vec::new();
    let mut agree = Vec::new();
    let mut x_max = 0.1f64;
    let mut y_ppl = 0.1f64;
    for (k, path) in a.curves.iter().enumerate() {
        let v: serde_json::Value = serde_json::from_str(&read_text(path)?)
            .map_err(|e| anyhow::anyhow!("{}: not a `sparsity curve --json` output: {e}", path.display()))?;
        let points = v["points"]
            .as_array()
            .ok_or_else(|| anyhow::anyhow!("{}: no 'points' (not a `sparsity curve --json` output)", path.display()))?;
        let num = |p: &serde_json::Value, key: &str| {
            p[key].as_f64().ok_or_else(|| anyhow::anyhow!("{}: a point without '{key}'", path.display()))
        };
        let (mut a1, mut a2) = (vec![(0.0, 0.0)], vec![(0.0, 1.0)]);
        for p in points {
            let x = num(p, "achieved")?;
            a1.push((x, num(p, "ppl_increase")?));
            a2.push((x, num(p, "agreement")?));
            x_max = x_max.max(x);
            y_ppl = y_ppl.max(num(p, "ppl_increase")?);
        }
        let colour = COLOURS[k % COLOURS.len()];
        eprintln!("{}: rgb{colour:?}", v["model"].as_str().unwrap_or("?"));
        ppl.push((a1, colour));
        agree.push((a2, colour));
    }
    let x_max = (x_max * 10.0).ceil() / 10.0;
    // The region that matters is a few percent: above 30% the curves are clipped.
    let y_ppl = (y_ppl.min(0.3) * 20.0).ceil() / 20.0;
    let panels = [
        Panel {
            x_max,
            x_tick: 0.1,
            y_min: 0.0,
            y_max: y_ppl,
            y_tick: if y_ppl > 0.15 { 0.05 } else { 0.01 },
            label_scale: 100.0,
            references: vec![0.03],
            series: ppl,
        },
        Panel {
            x_max,
            x_tick: 0.1,
            y_min: 0.5,
            y_max: 1.0,
            y_tick: 0.1,
            label_scale: 100.0,
            references: vec![0.98],
            series: agree,
        },
    ];
    plot_lines(&panels, &a.out)?;
    println!("wrote {}", a.out.display());
    Ok(())
}
