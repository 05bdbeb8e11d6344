//! `specee tokenize -m PATH -p TEXT [--json]`: token ids as the model's tokenizer produces them for a prompt
//! (special-token text parsed, BOS where the model adds one).

use super::ModelArgs;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Text to tokenize.
    #[arg(short = 'p', long = "prompt")]
    pub prompt: String,
    /// Print `{"ids": [...]}`.
    #[arg(long)]
    pub json: bool,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let path = engine::resolve_model(a.model.model.clone(), true)?;
    let file = gguf::GgufFile::open(&path)?;
    let tok = tokenizer::Tokenizer::from_gguf(&file)?;
    let ids = tok.encode(&a.prompt, true, true);
    if a.json {
        println!("{}", serde_json::json!({ "ids": ids }));
    } else {
        for id in &ids {
            println!("{id:>6} {:?}", String::from_utf8_lossy(tok.token_bytes(*id)));
        }
    }
    Ok(())
}
