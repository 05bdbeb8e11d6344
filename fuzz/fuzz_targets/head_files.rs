//! Draft heads, exit predictors, n-gram datastores and reasoning signal heads (safetensors files of our own
//! formats), and published EAGLE checkpoints (`config.json` + safetensors). An input that starts with `{` is a
//! published checkpoint: its config up to the first NUL, the weights after it; any other input is offered to
//! each of our loaders.
#![no_main]
use libfuzzer_sys::fuzz_target;
use std::path::Path;

fuzz_target!(|data: &[u8]| {
    if data.first() == Some(&b'{') {
        let cut = data.iter().position(|&b| b == 0).unwrap_or(data.len());
        let config = String::from_utf8_lossy(&data[..cut]);
        let weights = data.get(cut + 1..).unwrap_or(&[]);
        let _ = decode::speculative::PublishedHead::from_parts(&config, weights);
        return;
    }
    let _ = decode::speculative::DraftHead::from_bytes(data);
    let _ = decode::specee::ExitPredictors::from_bytes(data);
    if let Ok(ds) = decode::speculative::Datastore::from_bytes(data) {
        let _ = ds.next(&[0, 1, 2, 3], &[4]);
    }
    let _ = engine::signals::SignalHead::from_bytes(data, Path::new("fuzz"));
});
