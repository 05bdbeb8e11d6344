//! THROWAWAY diagnostics (delete before commit): dumps our logits along the reference path.
use model::{Logits, Model, Workspace};
use serde_json::{json, Value};

fn run(model_path: &str, file: &str, out: &str) {
    let m = Model::load(model_path).unwrap();
    let text = std::fs::read_to_string(file).unwrap();
    let mut ws = Workspace::new(2);
    let mut hidden = Vec::new();
    let mut recs = Vec::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let rec: Value = serde_json::from_str(line).unwrap();
        let ids = |k: &str| rec[k].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect::<Vec<_>>();
        let prompt = ids("prompt_ids");
        let greedy = ids("greedy_ids");
        let top10 = rec["top10_per_step"].as_array().unwrap();
        let mut kv = m.new_cache(prompt.len() + greedy.len() + 1);
        let mut logits = m.forward(&prompt, &mut kv, &mut ws, &mut hidden, Logits::Last).unwrap().to_vec();
        let mut steps = Vec::new();
        for (step, &want) in greedy.iter().enumerate() {
            let refs: Vec<u32> = top10[step].as_array().unwrap().iter().map(|p| p[0].as_u64().unwrap() as u32).collect();
            let ours: Vec<f32> = refs.iter().map(|&i| logits[i as usize]).collect();
            let mut idx: Vec<usize> = (0..logits.len()).collect();
            idx.select_nth_unstable_by(1, |&a, &b| logits[b].partial_cmp(&logits[a]).unwrap());
            let (a, b) = if logits[idx[0]] >= logits[idx[1]] { (idx[0], idx[1]) } else { (idx[1], idx[0]) };
            steps.push(json!({"ours": ours, "argmax": a, "second": b, "margin": logits[a] - logits[b]}));
            if step + 1 < greedy.len() {
                logits = m.forward(&[want], &mut kv, &mut ws, &mut hidden, Logits::Last).unwrap().to_vec();
            }
        }
        recs.push(json!(steps));
    }
    std::fs::write(out, serde_json::to_string(&recs).unwrap()).unwrap();
}

#[test]
fn diag_dump() {
    let r = "/work/shared/reference";
    let tag = std::env::var("DIAG_TAG").unwrap_or_else(|_| "cur".into());
    let only = std::env::var("DIAG_ONLY").unwrap_or_default();
    let jobs = [
        ("syn-llama", format!("{r}/synthetic/synthetic-llama-gqa.gguf"), format!("{r}/synthetic/synthetic-llama-gqa.greedy_raw.jsonl")),
        ("syn-qwen2", format!("{r}/synthetic/synthetic-qwen2.gguf"), format!("{r}/synthetic/synthetic-qwen2.greedy_raw.jsonl")),
        ("syn-qwen3", format!("{r}/synthetic/synthetic-qwen3.gguf"), format!("{r}/synthetic/synthetic-qwen3.greedy_raw.jsonl")),
        ("smol-raw", "/work/main/models/SmolLM2-135M-Instruct.Q4_1.gguf".into(), format!("{r}/smollm2.greedy_raw.jsonl")),
        ("smol-chat", "/work/main/models/SmolLM2-135M-Instruct.Q4_1.gguf".into(), format!("{r}/smollm2.greedy_chat.jsonl")),
        ("gemma", "/work/main/models/gemma-3-270m-q4_k_m.gguf".into(), format!("{r}/gemma3.greedy_raw.jsonl")),
    ];
    for (name, mp, f) in jobs {
        if !only.is_empty() && !only.split(',').any(|o| o == name) {
            continue;
        }
        run(&mp, &f, &format!("/tmp/diag/{name}.{tag}.json"));
    }
}
