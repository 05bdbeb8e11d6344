//! Published EAGLE checkpoints saved by `torch.save` (`pytorch_model.bin`: a zip archive holding a pickle),
//! read through candle's pickle reader. The input is the archive; it is written to a private folder beside a
//! fixed valid `config.json` and loaded as a user would load it.
#![no_main]
use libfuzzer_sys::fuzz_target;
use std::path::PathBuf;
use std::sync::OnceLock;

fn dir() -> &'static PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let base = std::env::var_os("XDG_RUNTIME_DIR").map(PathBuf::from).unwrap_or_else(std::env::temp_dir);
        let dir = base.join(format!("specee-fuzz-pytorch-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(
            dir.join("config.json"),
            r#"{"num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 32, "vocab_size": 64}"#,
        )
        .unwrap();
        dir
    })
}

fuzz_target!(|data: &[u8]| {
    let weights = dir().join("pytorch_model.bin");
    std::fs::write(&weights, data).unwrap();
    let _ = decode::speculative::PublishedHead::load(dir());
});
