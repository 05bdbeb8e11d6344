use model::{Logits, Model, Workspace};
fn main() {
    let args: Vec<String> = std::env::args().collect();
    let m = Model::load(&args[1]).unwrap();
    let file = std::fs::read_to_string(&args[2]).unwrap();
    let rec: serde_json::Value = serde_json::from_str(file.lines().next().unwrap()).unwrap();
    let ids = |k: &str| rec[k].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect::<Vec<_>>();
    let prompt = ids("prompt_ids");
    let greedy = ids("greedy_ids");
    let mut ws = Workspace::new(2);
    let mut h = Vec::new();
    let mut kv = m.new_cache(256);
    let mut logits = m.forward(&prompt, &mut kv, &mut ws, &mut h, Logits::Last).unwrap().to_vec();
    for step in 0..4 {
        let refs = rec["top10_per_step"][step].as_array().unwrap();
        let diffs: Vec<String> = refs
            .iter()
            .map(|p| format!("{:+.3}", logits[p[0].as_u64().unwrap() as usize] - p[1].as_f64().unwrap() as f32))
            .collect();
        println!("step {step}: {}", diffs.join(" "));
        logits = m.forward(&[greedy[step]], &mut kv, &mut ws, &mut h, Logits::Last).unwrap().to_vec();
    }
}
