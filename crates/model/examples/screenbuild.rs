//! Times building the head screen: `cargo run --release -p model --example screenbuild -- MODEL.gguf [threads]`.
use std::time::Instant;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let m = model::Model::load(&args[1]).unwrap();
    let threads = args.get(2).map_or(2, |s| s.parse().unwrap());
    let t = Instant::now();
    assert!(m.force_head_screen(threads));
    println!("head screen built in {:.3} s on {threads} threads", t.elapsed().as_secs_f64());
}
