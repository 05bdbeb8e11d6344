//! `specee fetch [smollm2|gemma3|qwen-coder|all]`: download and verify the default models.

use engine::fetch::{ensure_model, DefaultModel};

#[derive(clap::Args)]
pub struct Args {
    /// Which model: smollm2, gemma3, qwen-coder or all.
    #[arg(default_value = "all")]
    pub which: String,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let models = match a.which.as_str() {
        "all" => DefaultModel::ALL.to_vec(),
        name => vec![DefaultModel::from_name(name)
            .ok_or_else(|| anyhow::anyhow!("unknown model '{name}' (expected smollm2, gemma3, qwen-coder or all)"))?],
    };
    for m in models {
        let path = ensure_model(m, true)?;
        println!("{}", path.display());
    }
    Ok(())
}
