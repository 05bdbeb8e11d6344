//! `specee fetch [smollm2|gemma3|all]`: download and verify the default models.

use engine::fetch::{ensure_model, DefaultModel};

#[derive(clap::Args)]
pub struct Args {
    /// Which model: smollm2, gemma3 or all.
    #[arg(default_value = "all")]
    pub which: String,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let models = match a.which.as_str() {
        "all" => vec![DefaultModel::SmolLM2, DefaultModel::Gemma3],
        name => vec![DefaultModel::from_name(name)
            .ok_or_else(|| anyhow::anyhow!("unknown model '{name}' (expected smollm2, gemma3 or all)"))?],
    };
    for m in models {
        let path = ensure_model(m, true)?;
        println!("{}", path.display());
    }
    Ok(())
}
