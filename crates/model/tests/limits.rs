//! Resource limits of model loading: hyperparameters a crafted file declares are checked before anything is
//! sized by them (peak allocation measured per thread by a counting allocator).

#[path = "../../gguf/tests/support/peak_alloc.rs"]
mod peak_alloc;

use gguf::{GgufFile, GgufWriter, Value};
use model::Model;

#[global_allocator]
static ALLOC: peak_alloc::PeakAlloc = peak_alloc::PeakAlloc;

/// Found by the `gguf_file` fuzz target: a gemma3 file declaring 2^30 layers made the config allocate a
/// per-layer vector (1 GB, 5 s) before the layer count was checked. Every architecture now refuses it first.
#[test]
fn a_huge_layer_count_is_refused_before_anything_is_sized_by_it() {
    for arch in ["llama", "qwen2", "qwen3", "gemma3"] {
        let mut w = GgufWriter::new();
        w.add("general.architecture", Value::String(arch.into()));
        w.add(format!("{arch}.block_count"), Value::U32(1 << 30));
        w.add(format!("{arch}.embedding_length"), Value::U32(32));
        w.add(format!("{arch}.attention.head_count"), Value::U32(4));
        w.add(format!("{arch}.attention.sliding_window"), Value::U32(8));
        let file = GgufFile::from_bytes(w.to_bytes().unwrap()).unwrap();
        let (out, peak) = peak_alloc::measure(|| Model::from_gguf(file));
        let err = out.err().expect("refused").to_string();
        assert!(err.contains("block_count") && err.contains("1..=1024"), "{arch}: {err}");
        assert!(peak < 1 << 20, "{arch}: peak {peak} bytes");
    }
}
