//! Helpers shared by the CLI's integration tests: running the built `specee` binary and locating models and
//! reference files.

#![allow(dead_code)]

use std::path::PathBuf;
use std::process::{Command, Output};
use std::time::Duration;

pub fn workspace_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

pub fn reference_dir() -> PathBuf {
    std::env::var_os("SPECEE_REFERENCE_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join("../shared/reference"))
}

pub fn models_dir() -> PathBuf {
    std::env::var_os("SPECEE_MODELS_DIR").map(PathBuf::from).unwrap_or_else(|| workspace_root().join("models"))
}

pub fn smollm2() -> PathBuf {
    let p = models_dir().join("SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(p.exists(), "{} missing: run `cargo run --release -- fetch` first", p.display());
    p
}

pub fn gemma3() -> PathBuf {
    let p = models_dir().join("gemma-3-270m-q4_k_m.gguf");
    assert!(p.exists(), "{} missing: run `cargo run --release -- fetch` first", p.display());
    p
}

/// Qwen2.5-Coder-0.5B-Instruct, the third default model.
pub fn qwen_coder() -> PathBuf {
    let p = models_dir().join("Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.gguf");
    assert!(p.exists(), "{} missing: run `cargo run --release -- fetch` first", p.display());
    p
}

/// This repository's own llama.cpp references for Qwen2.5-Coder (`scripts/llama_reference.py`).
pub fn qwen_reference_dir() -> PathBuf {
    workspace_root().join("reference/qwen-coder")
}

/// Runs `specee args…`, killing it after `timeout` (a hang is a failure).
pub fn specee(args: &[&str], timeout: Duration) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_specee"))
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn specee");
    let start = std::time::Instant::now();
    loop {
        if child.try_wait().expect("wait").is_some() {
            return child.wait_with_output().expect("output");
        }
        if start.elapsed() > timeout {
            let _ = child.kill();
            panic!("specee {args:?} did not finish within {timeout:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}
