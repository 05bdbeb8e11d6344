//! `specee chat` end to end on SmolLM2: driven through a pipe (answers equal `generate --messages` of the same
//! conversation, slash commands, bad input, a context that fills up), and under a real terminal in tmux (line
//! editing, Ctrl-C in the middle of an answer, Ctrl-D to leave).

mod common;

use common::*;
use serde_json::Value;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn tmp_dir() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("specee-chat-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Runs `specee chat args…` with `input` on stdin; (stdout, stderr, success).
fn chat(args: &[&str], input: &str) -> (String, String, bool) {
    let model = smollm2();
    let mut child = Command::new(env!("CARGO_BIN_EXE_specee"))
        .args(["chat", "-m", model.to_str().unwrap(), "-t", "2"])
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn specee chat");
    child.stdin.take().unwrap().write_all(input.as_bytes()).unwrap();
    let start = Instant::now();
    while child.try_wait().unwrap().is_none() {
        assert!(start.elapsed() < Duration::from_secs(300), "specee chat did not finish");
        std::thread::sleep(Duration::from_millis(20));
    }
    let o = child.wait_with_output().unwrap();
    (stdout(&o), stderr(&o), o.status.success())
}

/// `generate --messages FILE --json`'s answer.
fn generate_messages(file: &Path, n: usize, mode: &str) -> String {
    let model = smollm2();
    let n = n.to_string();
    let args = ["generate", "-m", model.to_str().unwrap(), "--messages", file.to_str().unwrap(), "-n", &n, "-t", "2"];
    let o = specee(&[&args[..], &["--mode", mode, "--json"]].concat(), Duration::from_secs(300));
    assert!(o.status.success(), "{}", stderr(&o));
    let v: Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    v["text"].as_str().unwrap().to_string()
}

#[test]
fn piped_turns_answer_as_generate_does_for_the_same_conversation() {
    let dir = tmp_dir();
    for mode in ["dense", "eagle"] {
        let saved = dir.join(format!("conversation-{mode}.json"));
        let input =
            format!("What is the capital of France?\nAnd of Italy?\n/stats\n/save {}\n", saved.to_str().unwrap());
        let (out, err, ok) = chat(&["--mode", mode, "-n", "24", "--system", "Answer briefly."], &input);
        assert!(ok && !err.contains("panicked"), "{err}");
        let messages: Value = serde_json::from_str(&std::fs::read_to_string(&saved).unwrap()).unwrap();
        let messages = messages.as_array().unwrap();
        let roles: Vec<&str> = messages.iter().map(|m| m["role"].as_str().unwrap()).collect();
        assert_eq!(roles, ["system", "user", "assistant", "user", "assistant"]);
        // The second answer, from the cache kept since turn 1, equals a fresh run over the whole conversation.
        let upto = dir.join(format!("upto-{mode}.json"));
        std::fs::write(&upto, Value::Array(messages[..4].to_vec()).to_string()).unwrap();
        let second = messages[4]["content"].as_str().unwrap();
        assert_eq!(second, generate_messages(&upto, 24, "dense"), "{mode}");
        assert!(out.contains(second), "{out}");
        // /stats: the second turn reused the first turn's cache.
        let stats = err.lines().find(|l| l.starts_with("last answer:")).unwrap_or_else(|| panic!("{err}"));
        let reused: usize = stats.split(", ").find_map(|p| p.strip_suffix(" from the cache")?.parse().ok()).unwrap();
        assert!(reused >= 20, "{stats}");
        if mode == "eagle" {
            assert!(stats.contains("τ "), "{stats}");
        }
    }
}

#[test]
fn bad_input_gets_clear_messages_and_the_conversation_goes_on() {
    let dir = tmp_dir();
    let bad = dir.join("bad.json");
    std::fs::write(&bad, "[{\"role\": \"user\"}]").unwrap();
    let long = "word ".repeat(400);
    let input = format!(
        "/bogus\n/load {}\n/load {}\n/save\n{long}\nHi!\n/reset\n/stats\n",
        bad.to_str().unwrap(),
        dir.join("missing.json").to_str().unwrap()
    );
    let (_, err, ok) = chat(&["-c", "256", "-n", "8", "--mode", "dense"], &input);
    assert!(ok && !err.contains("panicked"), "{err}");
    assert!(err.contains("error: unknown command /bogus (try /help)"), "{err}");
    assert!(err.contains("\"content\" must be a string"), "{err}");
    assert!(err.contains("cannot read"), "{err}");
    assert!(err.contains("error: /save needs a file name"), "{err}");
    assert!(err.contains("but the context holds 256 (raise -c/--ctx-size)"), "{err}");
    assert!(err.contains("(conversation cleared)"), "{err}");
}

#[test]
fn a_full_context_drops_the_oldest_turns_and_keeps_the_system_prompt() {
    let dir = tmp_dir();
    let saved = dir.join("trimmed.json");
    let mut input = String::new();
    for i in 0..8 {
        input += &format!("Tell me fact number {i} about the sea, in detail please.\n");
    }
    input += &format!("/save {}\n", saved.to_str().unwrap());
    let (_, err, ok) = chat(&["-c", "200", "-n", "32", "--mode", "dense", "--system", "Be brief."], &input);
    assert!(ok && !err.contains("panicked"), "{err}");
    assert!(err.contains("oldest messages were dropped, the system prompt kept"), "{err}");
    let messages: Value = serde_json::from_str(&std::fs::read_to_string(&saved).unwrap()).unwrap();
    let messages = messages.as_array().unwrap();
    assert_eq!(messages[0]["role"], "system");
    assert!(messages.len() < 17, "nothing was dropped: {} messages", messages.len());
    assert!(messages.last().unwrap()["role"] == "assistant");
}

fn tmux(args: &[&str]) -> String {
    let o = Command::new("tmux").args(args).output().expect("tmux must be installed (.ci/run installs it)");
    assert!(o.status.success(), "tmux {args:?}: {}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// Polls the pane until `pred` holds for its text.
fn wait_pane(session: &str, what: &str, pred: impl Fn(&str) -> bool) -> String {
    let start = Instant::now();
    loop {
        let pane = tmux(&["capture-pane", "-p", "-t", session, "-S", "-200"]);
        if pred(&pane) {
            return pane;
        }
        assert!(start.elapsed() < Duration::from_secs(120), "timed out waiting for {what}; the pane:\n{pane}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn terminal_chat_in_tmux_stops_an_answer_on_ctrl_c_and_leaves_on_ctrl_d() {
    let session = format!("specee-chat-{}", std::process::id());
    let model = smollm2();
    let command = format!(
        "{} chat -m {} -t 2 -n 3000 --mode dense; echo EXITED-$?; sleep 30",
        env!("CARGO_BIN_EXE_specee"),
        model.to_str().unwrap()
    );
    tmux(&["new-session", "-d", "-s", &session, "-x", "200", "-y", "50", &command]);
    let _guard = KillSession(session.clone());
    wait_pane(&session, "the prompt", |p| p.contains("Ctrl-D to leave") && p.lines().any(|l| l.starts_with('>')));
    tmux(&["send-keys", "-t", &session, "Tell me a very long story about a dragon and a knight.", "Enter"]);
    // Some answer text, then Ctrl-C in the middle of it.
    std::thread::sleep(Duration::from_millis(1500));
    tmux(&["send-keys", "-t", &session, "C-c"]);
    let pane = wait_pane(&session, "the stop note", |p| p.contains("(stopped)"));
    assert!(!pane.contains("EXITED"), "Ctrl-C ended the program:\n{pane}");
    // Back at the prompt: a slash command, then Ctrl-D.
    tmux(&["send-keys", "-t", &session, "/stats", "Enter"]);
    wait_pane(&session, "the stats", |p| p.contains("last answer:"));
    tmux(&["send-keys", "-t", &session, "C-d"]);
    let pane = wait_pane(&session, "the exit", |p| p.contains("EXITED-"));
    assert!(pane.contains("EXITED-0"), "{pane}");
    assert!(!pane.contains("panicked"), "{pane}");
}

struct KillSession(String);

impl Drop for KillSession {
    fn drop(&mut self) {
        let _ = Command::new("tmux").args(["kill-session", "-t", &self.0]).output();
    }
}
