//! `specee serve` end to end, on a real loopback port with the default SmolLM2 model: the official `openai`
//! Python client (chat and completions, streamed and not, greedy answers equal to `specee generate`), a
//! malformed-request suite (4xx JSON errors, the server stays up), 8 concurrent clients, 429 with
//! `Retry-After` when full, a mid-stream disconnect freeing its slot, and SIGTERM draining in-flight work.
//! Generations are kept short (≤ 16 tokens) so the suite stays fast on slow kernels.

mod common;

use common::*;
use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

const CHAT_PROMPT: &str = "Name three colors.";
const CHAT_MAX_TOKENS: usize = 16;
const COMPLETION_PROMPT: &str = "The capital of France is";
const COMPLETION_MAX_TOKENS: usize = 8;

/// A `specee serve` child process on a free loopback port; killed when dropped.
struct Server {
    child: Child,
    port: u16,
}

impl Server {
    fn start(extra: &[&str]) -> Server {
        Server::start_model(&smollm2(), extra)
    }

    fn start_model(model: &std::path::Path, extra: &[&str]) -> Server {
        let mut child = Command::new(env!("CARGO_BIN_EXE_specee"))
            .args(["serve", "-m", model.to_str().unwrap(), "--port", "0", "-t", "2"])
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn specee serve");
        // The server prints `listening on http://127.0.0.1:PORT` once it accepts connections.
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Some(addr) = line.strip_prefix("listening on http://") {
                    let _ = tx.send(addr.rsplit(':').next().and_then(|p| p.parse::<u16>().ok()));
                }
            }
        });
        match rx.recv_timeout(Duration::from_secs(60)) {
            Ok(Some(port)) => Server { child, port },
            other => {
                let _ = child.kill();
                panic!("specee serve did not report its port: {other:?}");
            }
        }
    }

    fn request(&self, method: &str, path: &str, body: &[u8]) -> Response {
        http(self.port, method, path, body)
    }

    fn post_json(&self, path: &str, body: &Value) -> Response {
        self.request("POST", path, body.to_string().as_bytes())
    }

    /// The value of a metric line without labels (or with exactly `labels`).
    fn metric(&self, name: &str) -> f64 {
        let r = self.request("GET", "/metrics", b"");
        assert_eq!(r.status, 200);
        r.body
            .lines()
            .find_map(|l| {
                l.strip_prefix(name).and_then(|rest| rest.strip_prefix(' ')).map(|v| v.trim().parse::<f64>().unwrap())
            })
            .unwrap_or_else(|| panic!("no metric {name} in\n{}", r.body))
    }

    /// Waits (bounded) until no request is generating or queued.
    fn wait_idle(&self, timeout: Duration) {
        let start = Instant::now();
        while self.metric("specee_requests_in_flight") != 0.0 || self.metric("specee_queue_depth") != 0.0 {
            assert!(start.elapsed() < timeout, "the server is still busy after {timeout:?}");
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A parsed HTTP response.
#[derive(Debug)]
struct Response {
    status: u16,
    headers: Vec<(String, String)>,
    body: String,
}

impl Response {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }

    fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", self.body))
    }
}

fn send_request(port: u16, method: &str, path: &str, body: &[u8]) -> TcpStream {
    let mut s = TcpStream::connect(("127.0.0.1", port)).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(300))).unwrap();
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).unwrap();
    if body.len() <= 64 << 10 {
        s.write_all(body).unwrap();
        return s;
    }
    // A server may answer (413) before reading a large body and close. Write from another thread (ignoring
    // errors) so the caller reads the answer as soon as it comes, before a reset can discard it.
    let mut writer = s.try_clone().expect("clone stream");
    let body = body.to_vec();
    std::thread::spawn(move || {
        let _ = writer.write_all(&body);
    });
    s
}

/// One HTTP/1.1 request with `Connection: close`; reads the whole response (de-chunked).
fn http(port: u16, method: &str, path: &str, body: &[u8]) -> Response {
    let mut s = send_request(port, method, path, body);
    let mut raw = Vec::new();
    if let Err(e) = s.read_to_end(&mut raw) {
        // A reset after a complete early answer (e.g. 413 before the body was read) still counts.
        assert!(!raw.is_empty(), "reading the response to {method} {path}: {e}");
    }
    parse_response(&raw)
}

fn parse_response(raw: &[u8]) -> Response {
    let split = raw.windows(4).position(|w| w == b"\r\n\r\n").expect("end of headers");
    let head = String::from_utf8_lossy(&raw[..split]).into_owned();
    let mut lines = head.lines();
    let status = lines.next().unwrap().split(' ').nth(1).unwrap().parse().unwrap();
    let headers: Vec<(String, String)> =
        lines.filter_map(|l| l.split_once(':')).map(|(k, v)| (k.trim().to_string(), v.trim().to_string())).collect();
    let mut body = raw[split + 4..].to_vec();
    if headers.iter().any(|(k, v)| k.eq_ignore_ascii_case("transfer-encoding") && v.contains("chunked")) {
        body = dechunk(&body);
    }
    Response { status, headers, body: String::from_utf8_lossy(&body).into_owned() }
}

fn dechunk(mut data: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(end) = data.windows(2).position(|w| w == b"\r\n") {
        let size = usize::from_str_radix(String::from_utf8_lossy(&data[..end]).trim(), 16).unwrap_or(0);
        if size == 0 {
            break;
        }
        let start = end + 2;
        out.extend_from_slice(&data[start..(start + size).min(data.len())]);
        data = &data[(start + size + 2).min(data.len())..];
    }
    out
}

/// Asserts an OpenAI-style error body and returns it.
fn assert_error(r: &Response, status: u16, what: &str) -> Value {
    assert_eq!(r.status, status, "{what}: {r:?}");
    assert!(r.header("content-type").is_some_and(|c| c.starts_with("application/json")), "{what}: {r:?}");
    let v = r.json();
    let e = &v["error"];
    assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{what}: {v}");
    assert!(e["type"].is_string(), "{what}: {v}");
    assert!(e.get("param").is_some() && e.get("code").is_some(), "{what}: {v}");
    v
}

/// `specee generate --json` text for a prompt (greedy, as the server runs it with `threads` per request).
fn generate_text(prompt: &str, n: usize, chat: bool, threads: usize) -> String {
    let model = smollm2();
    let n = n.to_string();
    let threads = threads.to_string();
    let mut args = vec!["generate", "-m", model.to_str().unwrap(), "-p", prompt, "-n", &n, "-t", &threads, "--json"];
    if chat {
        args.push("--chat");
    }
    let o = specee(&args, Duration::from_secs(300));
    assert!(o.status.success(), "{}", stderr(&o));
    let v: Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    v["text"].as_str().unwrap().to_string()
}

fn chat_body(max_tokens: usize) -> Value {
    json!({"model": "x", "messages": [{"role": "user", "content": CHAT_PROMPT}], "max_tokens": max_tokens, "temperature": 0})
}

fn python() -> PathBuf {
    PathBuf::from(std::env::var_os("SPECEE_PYTHON").unwrap_or_else(|| "python3".into()))
}

#[test]
fn openai_client_drives_chat_and_completions() {
    let probe = Command::new(python()).args(["-c", "import openai"]).output().expect("python3 must be installed");
    assert!(
        probe.status.success(),
        "the `openai` Python package is missing (`python3 -m pip install openai`; .ci/run installs it): {}",
        String::from_utf8_lossy(&probe.stderr)
    );
    let chat = generate_text(CHAT_PROMPT, CHAT_MAX_TOKENS, true, 2);
    let completion = generate_text(COMPLETION_PROMPT, COMPLETION_MAX_TOKENS, false, 2);
    let server = Server::start(&[]);
    let model_id = smollm2().file_stem().unwrap().to_string_lossy().into_owned();
    let expect = json!({
        "model": model_id,
        "chat": {"prompt": CHAT_PROMPT, "max_tokens": CHAT_MAX_TOKENS, "text": chat},
        "completion": {"prompt": COMPLETION_PROMPT, "max_tokens": COMPLETION_MAX_TOKENS, "text": completion},
    });
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/server/openai_client.py");
    let mut child = Command::new(python())
        .arg(&script)
        .env("SPECEE_BASE_URL", format!("http://127.0.0.1:{}/v1", server.port))
        .env("SPECEE_EXPECT", expect.to_string())
        // The client must reach the loopback server directly even where a proxy is configured.
        .env("NO_PROXY", "127.0.0.1,localhost")
        .env("no_proxy", "127.0.0.1,localhost")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run the openai client script");
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if start.elapsed() > Duration::from_secs(600) {
            let _ = child.kill();
            panic!("the openai client script did not finish in 600 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let out = child.wait_with_output().unwrap();
    let log = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(status.success(), "openai client checks failed:\n{log}");
    assert!(log.contains("all openai client checks passed"), "{log}");
    assert_eq!(server.request("GET", "/health", b"").status, 200);
}

/// Runs a Python script of `tests/server/` against `server` with `env`, failing the test on its failure.
fn run_client_script(server: &Server, script: &str, env: &[(&str, &str)], done: &str) -> String {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/server").join(script);
    let out = Command::new(python())
        .arg(&script)
        .env("SPECEE_BASE_URL", format!("http://127.0.0.1:{}/v1", server.port))
        .envs(env.iter().copied())
        .env("NO_PROXY", "127.0.0.1,localhost")
        .env("no_proxy", "127.0.0.1,localhost")
        .output()
        .expect("run the client script");
    let log = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && log.contains(done), "{script:?} failed:\n{log}");
    log
}

#[test]
fn json_schema_responses_validate_and_eagle_equals_dense_through_the_openai_client() {
    // Varied schemas (tests/server/structured_output.py; 60 of them in the closing note's run), validated with
    // `jsonschema`; greedy answers of the default mode (eagle) compared with dense's; json_object, streaming,
    // the client's `parse` with a pydantic model, bad schemas as 400s.
    let server = Server::start(&[]);
    let env = [("SPECEE_CASES", "8"), ("SPECEE_COMPARE_DENSE", "1")];
    let log = run_client_script(&server, "structured_output.py", &env, "all structured-output checks passed");
    assert!(log.contains("structured: 8/8 valid, 8/8 eagle == dense"), "{log}");
    // The early-exit modes follow the schema too (lossy: validity only).
    for mode in ["specee", "specee-eagle"] {
        let env = [("SPECEE_CASES", "4"), ("SPECEE_COMPARE_DENSE", "0"), ("SPECEE_MODE", mode)];
        let log = run_client_script(&server, "structured_output.py", &env, "all structured-output checks passed");
        assert!(log.contains("structured: 4/4 valid, 0/0 eagle == dense"), "{mode}: {log}");
    }
    // The batching server masks its rows too (4 clients at once).
    let server = Server::start(&["--parallel", "4"]);
    let env = [("SPECEE_CASES", "8"), ("SPECEE_CLIENTS", "4"), ("SPECEE_COMPARE_DENSE", "0")];
    let log = run_client_script(&server, "structured_output.py", &env, "all structured-output checks passed");
    assert!(log.contains("structured: 8/8 valid"), "{log}");
}

#[test]
fn logprobs_of_eagle_equal_dense_streamed_and_not_through_the_openai_client() {
    // tests/server/logprobs.py: chat and completions, streamed and not, greedy (eagle vs dense within 1e-4) and
    // sampled, entries that join to the answer, bad counts as 400s.
    let server = Server::start(&[]);
    run_client_script(&server, "logprobs.py", &[], "all logprobs checks passed");
    // The batching server computes its rows' entries from the full logits (4 clients at once).
    let server = Server::start(&["--parallel", "4"]);
    let env = [("SPECEE_CLIENTS", "4"), ("SPECEE_COMPARE_EAGLE", "0")];
    run_client_script(&server, "logprobs.py", &env, "all logprobs checks passed");
}

#[test]
fn tool_calls_round_trip_on_qwen_coder_through_the_openai_client() {
    // tests/server/tools.py: auto, required and named choices, the call -> tool message -> answer round trip,
    // streamed calls, tool_choice none, malformed tools as 400s.
    let server = Server::start_model(&qwen_coder(), &[]);
    run_client_script(&server, "tools.py", &[], "all tool checks passed");
    // A template without a tools section (SmolLM2's) refuses tools.
    let server = Server::start(&[]);
    let body = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                      "tools": [{"type": "function", "function": {"name": "f"}}]});
    let r = server.post_json("/v1/chat/completions", &body);
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.body.contains("no tools section"), "{}", r.body);
}

#[test]
fn malformed_requests_get_json_errors() {
    let server = Server::start(&["--ctx-size", "64"]);
    let msgs = json!([{"role": "user", "content": "hi"}]);
    let chat = "/v1/chat/completions";
    let cases: Vec<(&str, &str, Vec<u8>, u16)> = vec![
        ("invalid JSON", chat, b"{\"messages\": [".to_vec(), 400),
        ("not an object", chat, b"[1, 2]".to_vec(), 400),
        ("empty body", chat, Vec::new(), 400),
        ("not UTF-8", chat, vec![0xff, 0xfe, 0x00], 400),
        ("messages missing", chat, json!({"model": "x"}).to_string().into_bytes(), 400),
        ("messages wrong type", chat, json!({"messages": "hi"}).to_string().into_bytes(), 400),
        ("messages empty", chat, json!({"messages": []}).to_string().into_bytes(), 400),
        (
            "content wrong type",
            chat,
            json!({"messages": [{"role": "user", "content": 5}]}).to_string().into_bytes(),
            400,
        ),
        ("unknown role", chat, json!({"messages": [{"role": "wizard", "content": "x"}]}).to_string().into_bytes(), 400),
        ("max_tokens negative", chat, json!({"messages": msgs, "max_tokens": -1}).to_string().into_bytes(), 400),
        ("max_tokens zero", chat, json!({"messages": msgs, "max_tokens": 0}).to_string().into_bytes(), 400),
        ("max_tokens string", chat, json!({"messages": msgs, "max_tokens": "9"}).to_string().into_bytes(), 400),
        ("max_tokens float", chat, json!({"messages": msgs, "max_tokens": 1.5}).to_string().into_bytes(), 400),
        ("max_tokens huge float", chat, json!({"messages": msgs, "max_tokens": 1e300}).to_string().into_bytes(), 400),
        ("temperature wrong type", chat, json!({"messages": msgs, "temperature": "hot"}).to_string().into_bytes(), 400),
        ("temperature out of range", chat, json!({"messages": msgs, "temperature": 7}).to_string().into_bytes(), 400),
        ("top_p out of range", chat, json!({"messages": msgs, "top_p": 2}).to_string().into_bytes(), 400),
        ("stream wrong type", chat, json!({"messages": msgs, "stream": "yes"}).to_string().into_bytes(), 400),
        ("stop wrong type", chat, json!({"messages": msgs, "stop": 3}).to_string().into_bytes(), 400),
        ("n > 1", chat, json!({"messages": msgs, "n": 4}).to_string().into_bytes(), 400),
        ("tools", chat, json!({"messages": msgs, "tools": [{"type": "function"}]}).to_string().into_bytes(), 400),
        (
            "top_logprobs too many",
            chat,
            json!({"messages": msgs, "logprobs": true, "top_logprobs": 50}).to_string().into_bytes(),
            400,
        ),
        (
            "response_format unknown type",
            chat,
            json!({"messages": msgs, "response_format": {"type": "xml"}}).to_string().into_bytes(),
            400,
        ),
        ("unknown field", chat, json!({"messages": msgs, "frobnicate": 1}).to_string().into_bytes(), 400),
        ("unknown mode", chat, json!({"messages": msgs, "specee": {"mode": "warp"}}).to_string().into_bytes(), 400),
        (
            "image content",
            chat,
            json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})
                .to_string()
                .into_bytes(),
            400,
        ),
        (
            "prompt too long",
            chat,
            json!({"messages": [{"role": "user", "content": "word ".repeat(200)}]}).to_string().into_bytes(),
            400,
        ),
        (
            "prompt too long (streamed)",
            "/v1/completions",
            json!({"prompt": "word ".repeat(200), "stream": true}).to_string().into_bytes(),
            400,
        ),
        ("prompt missing", "/v1/completions", json!({"max_tokens": 2}).to_string().into_bytes(), 400),
        ("several prompts", "/v1/completions", json!({"prompt": ["a", "b"]}).to_string().into_bytes(), 400),
        ("token id out of range", "/v1/completions", json!({"prompt": [1, 99999999]}).to_string().into_bytes(), 400),
        ("echo", "/v1/completions", json!({"prompt": "a", "echo": true}).to_string().into_bytes(), 400),
        (
            "body over 1 MiB",
            "/v1/completions",
            format!("{{\"prompt\": \"{}\"}}", "a".repeat(2 << 20)).into_bytes(),
            413,
        ),
        ("unknown route", "/v1/embeddings", json!({"input": "x"}).to_string().into_bytes(), 404),
    ];
    for (what, path, body, status) in &cases {
        let r = server.request("POST", path, body);
        let v = assert_error(&r, *status, what);
        if *what == "prompt too long" {
            assert_eq!(v["error"]["code"], "context_length_exceeded", "{v}");
        }
        if *what == "n > 1" {
            assert_eq!(v["error"]["param"], "n", "{v}");
        }
    }
    assert_error(&server.request("GET", chat, b""), 405, "GET on a POST route");
    assert_error(&server.request("DELETE", "/health", b""), 405, "DELETE /health");

    // Absurd max_tokens is capped at the context: a prompt near the context's end generates only the rest.
    let r = server.post_json("/v1/completions", &json!({"prompt": "one two three four five six seven eight nine ten ".repeat(5), "max_tokens": 1_000_000_000_000_i64, "temperature": 0, "specee": {"ignore_eos": true}}));
    assert_eq!(r.status, 200, "{r:?}");
    let v = r.json();
    let usage = &v["usage"];
    assert_eq!(usage["total_tokens"].as_u64().unwrap(), 64, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "length", "{v}");

    // Still up and answering.
    assert_eq!(server.request("GET", "/health", b"").json()["status"], "ok");
    let r = server.post_json(chat, &chat_body(2));
    assert_eq!(r.status, 200, "{r:?}");
    let metrics = server.request("GET", "/metrics", b"").body;
    assert!(metrics.contains("specee_requests_total{endpoint=\"/v1/chat/completions\",status=\"400\"}"), "{metrics}");
    // Greedy requests without a mode run eagle (`--mode auto`, the default), which the model's shipped head allows.
    assert!(metrics.contains("specee_generations_total{mode=\"eagle\",finish=\"length\"} 2"), "{metrics}");
    assert!(metrics.contains("specee_generations_total{mode=\"dense\",finish=\"length\"} 0"), "{metrics}");
}

#[test]
fn eight_concurrent_clients_all_answered() {
    // Two slots share the 2 threads: one thread per generation.
    let want = generate_text(CHAT_PROMPT, 8, true, 1);
    let server = Server::start(&["--parallel", "2", "--queue", "8"]);
    let port = server.port;
    let handles: Vec<_> = (0..8)
        .map(|i| {
            std::thread::spawn(move || {
                let stream = i % 2 == 1;
                let mut body = chat_body(8);
                body["stream"] = json!(stream);
                let r = http(port, "POST", "/v1/chat/completions", body.to_string().as_bytes());
                assert_eq!(r.status, 200, "client {i}: {r:?}");
                if !stream {
                    return r.json()["choices"][0]["message"]["content"].as_str().unwrap().to_string();
                }
                let mut text = String::new();
                let events: Vec<&str> = r.body.lines().filter_map(|l| l.strip_prefix("data: ")).collect();
                assert_eq!(events.last(), Some(&"[DONE]"), "client {i}: {}", r.body);
                for e in &events[..events.len() - 1] {
                    let v: Value = serde_json::from_str(e).unwrap();
                    text += v["choices"][0]["delta"]["content"].as_str().unwrap_or("");
                }
                text
            })
        })
        .collect();
    for (i, h) in handles.into_iter().enumerate() {
        assert_eq!(h.join().unwrap(), want, "client {i}");
    }
    server.wait_idle(Duration::from_secs(30));
    assert_eq!(server.request("GET", "/health", b"").status, 200);
}

#[test]
fn full_server_answers_429_and_a_disconnect_frees_the_slot() {
    let server = Server::start(&["--parallel", "1", "--queue", "0", "--ctx-size", "2048"]);
    // A long streamed generation occupies the only slot.
    let mut body = chat_body(2000);
    body["stream"] = json!(true);
    body["specee"] = json!({"ignore_eos": true});
    let mut stream = send_request(server.port, "POST", "/v1/chat/completions", body.to_string().as_bytes());
    let mut first = [0u8; 256];
    let n = stream.read(&mut first).unwrap();
    assert!(
        String::from_utf8_lossy(&first[..n]).starts_with("HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&first[..n])
    );
    assert_eq!(server.metric("specee_requests_in_flight"), 1.0);

    // Full: a well-formed 429 with Retry-After.
    let r = server.post_json("/v1/chat/completions", &chat_body(2));
    let v = assert_error(&r, 429, "full server");
    assert_eq!(v["error"]["code"], "rate_limit_exceeded");
    assert!(r.header("retry-after").and_then(|s| s.parse::<u64>().ok()).is_some(), "{r:?}");

    // The client goes away mid-stream: the generation is cancelled and the slot freed (2000 tokens would
    // take far longer than the bound).
    drop(stream);
    server.wait_idle(Duration::from_secs(60));
    let metrics = server.request("GET", "/metrics", b"").body;
    assert!(metrics.contains("specee_generations_total{mode=\"eagle\",finish=\"cancelled\"} 1"), "{metrics}");
    let r = server.post_json("/v1/chat/completions", &chat_body(2));
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(server.request("GET", "/health", b"").status, 200);
}

#[cfg(unix)]
#[test]
fn sigterm_drains_in_flight_requests() {
    let mut server = Server::start(&[]);
    let port = server.port;
    let client =
        std::thread::spawn(move || http(port, "POST", "/v1/chat/completions", chat_body(8).to_string().as_bytes()));
    let start = Instant::now();
    while server.metric("specee_requests_in_flight") < 1.0 {
        assert!(start.elapsed() < Duration::from_secs(60), "the request never started");
        std::thread::sleep(Duration::from_millis(20));
    }
    let pid = server.child.id().to_string();
    assert!(Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
    let r = client.join().unwrap();
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(r.json()["usage"]["completion_tokens"].as_u64().unwrap(), 8);
    let start = Instant::now();
    let status = loop {
        if let Some(s) = server.child.try_wait().unwrap() {
            break s;
        }
        assert!(start.elapsed() < Duration::from_secs(60), "the server did not exit after SIGTERM");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "exit status after SIGTERM: {status:?}");
    assert!(TcpStream::connect(("127.0.0.1", port)).is_err(), "still accepting connections after SIGTERM");
}

/// `serve --reasoning PROFILE` reports `usage.completion_tokens_details.reasoning_tokens` as `generate --reasoning
/// PROFILE` counts them on the same question (the server renders the same messages); without the flag SmolLM2 (no
/// think section) reports no details. The profile (a file: profiles are data) ends the reasoning at SmolLM2's
/// second numbered step, so that the count is neither 0 nor every token.
#[test]
fn reasoning_tokens_are_counted_as_generate_counts_them() {
    let question = "Tom has 3 apples and buys 4 more. How many apples does he have?";
    let profile = std::env::temp_dir().join(format!("specee-steps-profile-{}.json", std::process::id()));
    let suffix = "\nThink step by step.";
    std::fs::write(
        &profile,
        json!({"name": "steps", "system": null, "user_suffix": suffix, "end": "\n2.", "exit_text": "\n2.",
               "answer": "boxed", "boundary": "\n"})
        .to_string(),
    )
    .unwrap();
    let p = profile.to_str().unwrap();
    let o = specee(
        &["generate", "-m", smollm2().to_str().unwrap(), "--reasoning", p, "-p", question, "-n", "48", "--json"],
        Duration::from_secs(300),
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let gen: Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    let (reasoning, n) =
        (gen["reasoning"]["reasoning_tokens"].as_u64().unwrap(), gen["generated_ids"].as_array().unwrap().len());
    assert!(reasoning > 0 && (reasoning as usize) < n, "{gen}");
    let body = json!({"model": "x", "messages": [{"role": "user", "content": format!("{question}{suffix}")}],
                      "max_tokens": 48, "temperature": 0});
    let server = Server::start(&["--reasoning", p]);
    let r = server.post_json("/v1/chat/completions", &body);
    assert_eq!(r.status, 200, "{}", r.body);
    let usage = &r.json()["usage"];
    assert_eq!(usage["completion_tokens"], json!(n), "{usage}");
    assert_eq!(usage["completion_tokens_details"]["reasoning_tokens"], json!(reasoning), "{usage}");
    drop(server);
    let plain = Server::start(&[]);
    let r = plain.post_json("/v1/chat/completions", &body);
    std::fs::remove_file(&profile).ok();
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(r.json()["usage"].get("completion_tokens_details").is_none(), "{}", r.body);
}

/// The server's resident memory in KiB (Linux `/proc`).
fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

#[test]
fn one_gigabyte_bodies_are_refused_without_being_read() {
    let server = Server::start(&[]);
    let pid = server.child.id();
    let healthy = |what: &str| {
        let r = server.request("GET", "/health", b"");
        assert_eq!(r.status, 200, "{what}: the server no longer answers");
    };
    healthy("start");
    let before = rss_kib(pid);
    // A declared 1 GB body: answered 413 from the header alone.
    let mut s = TcpStream::connect(("127.0.0.1", server.port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let head = "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1073741824\r\nConnection: close\r\n\r\n{\"messages\": [";
    s.write_all(head.as_bytes()).unwrap();
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    assert_eq!(parse_response(&raw).status, 413, "declared 1 GB: {}", String::from_utf8_lossy(&raw));
    // A chunked body with no declared length, streamed toward 1 GB: cut at the limit.
    let mut s = TcpStream::connect(("127.0.0.1", server.port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n";
    s.write_all(head.as_bytes()).unwrap();
    let mut writer = s.try_clone().unwrap();
    let sender = std::thread::spawn(move || {
        let chunk = format!("{:x}\r\n{}\r\n", 1 << 20, "a".repeat(1 << 20));
        let mut sent = 0usize;
        while sent < 1 << 30 && writer.write_all(chunk.as_bytes()).is_ok() {
            sent += 1 << 20;
        }
        sent
    });
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    drop(s);
    let sent = sender.join().unwrap();
    assert_eq!(parse_response(&raw).status, 413, "chunked: {}", String::from_utf8_lossy(&raw));
    assert!(sent < 1 << 30, "the server read the whole gigabyte");
    let after = rss_kib(pid);
    assert!(after < before + 64 * 1024, "RSS grew from {before} KiB to {after} KiB");
    healthy("after the large bodies");
}

/// The prompts of the soak, with their greedy answers.
const SOAK_PROMPTS: [&str; 4] =
    ["Name three colors.", "What is 2+2?", "Write a haiku about the sea.", "Give one tip for learning to code."];
const SOAK_MAX_TOKENS: usize = 8;

/// One soak request of kind `i`, checked; returns its status. Kinds, by `i % 20`: 0 malformed (4xx JSON, 5%);
/// 1 and 2 streamed then dropped after the first bytes (10%); the rest greedy or sampled, streamed or not, greedy
/// answers compared with `want`.
fn soak_request(port: u16, i: usize, want: &[String]) -> u16 {
    let p = i % SOAK_PROMPTS.len();
    let kind = i % 20;
    if kind == 0 {
        let bodies: [&[u8]; 4] = [
            b"{\"messages\": [",
            b"{\"messages\": \"hello\"}",
            b"{\"model\": \"x\", \"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"n\": 2}",
            b"{\"model\": \"x\", \"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"max_tokens\": -3}",
        ];
        let r = http(port, "POST", "/v1/chat/completions", bodies[(i / 20) % bodies.len()]);
        assert_error(&r, 400, &format!("malformed soak request {i}"));
        return r.status;
    }
    let greedy = i % 2 == 0;
    let stream = (i / 2) % 2 == 0 || kind <= 2;
    let mut body = json!({"model": "x", "messages": [{"role": "user", "content": SOAK_PROMPTS[p]}],
                          "max_tokens": SOAK_MAX_TOKENS, "stream": stream});
    if greedy {
        body["temperature"] = json!(0);
    } else {
        body["temperature"] = json!(0.8);
        body["seed"] = json!(i);
    }
    if kind <= 2 {
        // Disconnects mid-stream: a long generation, dropped once its first bytes arrived.
        body["max_tokens"] = json!(256);
        body["specee"] = json!({"ignore_eos": true});
        let mut s = send_request(port, "POST", "/v1/chat/completions", body.to_string().as_bytes());
        let mut first = [0u8; 64];
        let n = s.read(&mut first).unwrap_or(0);
        assert!(String::from_utf8_lossy(&first[..n]).starts_with("HTTP/1.1 200"), "soak request {i}");
        return 200;
    }
    let r = http(port, "POST", "/v1/chat/completions", body.to_string().as_bytes());
    assert_eq!(r.status, 200, "soak request {i}: {r:?}");
    let text = if stream {
        let events: Vec<&str> = r.body.lines().filter_map(|l| l.strip_prefix("data: ")).collect();
        assert_eq!(events.last(), Some(&"[DONE]"), "soak request {i}: {}", r.body);
        let mut text = String::new();
        for e in &events[..events.len() - 1] {
            let v: Value = serde_json::from_str(e).unwrap();
            text += v["choices"][0]["delta"]["content"].as_str().unwrap_or("");
        }
        text
    } else {
        r.json()["choices"][0]["message"]["content"].as_str().unwrap().to_string()
    };
    if greedy {
        assert_eq!(text, want[p], "soak request {i}: a wrong greedy answer");
    }
    r.status
}

/// Runs `count` soak requests (kinds `first..first + count`) from `clients` threads.
fn soak_round(port: u16, clients: usize, first: usize, count: usize, want: &std::sync::Arc<Vec<String>>) {
    let next = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(first));
    let handles: Vec<_> = (0..clients)
        .map(|_| {
            let (next, want) = (std::sync::Arc::clone(&next), std::sync::Arc::clone(want));
            std::thread::spawn(move || loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if i >= first + count {
                    return;
                }
                soak_request(port, i, &want);
            })
        })
        .collect();
    for h in handles {
        h.join().expect("a soak client failed");
    }
}

/// Issue #32's soak: 64 concurrent clients, 2,000+ requests mixing streamed and not, greedy and sampled, 10%
/// disconnecting mid-stream and 5% malformed, against the batching server (`--parallel 32`). Every greedy answer
/// must equal `specee generate`'s, nothing may fail with a 5xx, every slot and KV reservation must be free at the
/// end, and resident memory after the run within 10% of what it was after a warm-up of the same mix.
#[test]
fn soak_of_2000_mixed_requests_from_64_clients_on_the_batching_server() {
    let want: Vec<String> = SOAK_PROMPTS.iter().map(|p| generate_text(p, SOAK_MAX_TOKENS, true, 2)).collect();
    let want = std::sync::Arc::new(want);
    let server = Server::start(&["--parallel", "32", "--queue", "64", "--ctx-size", "512", "--prefix-cache", "512"]);
    let pid = server.child.id();
    let started = Instant::now();
    soak_round(server.port, 64, 0, 320, &want);
    server.wait_idle(Duration::from_secs(120));
    let warm = rss_kib(pid);
    soak_round(server.port, 64, 320, 2000, &want);
    server.wait_idle(Duration::from_secs(120));
    let after = rss_kib(pid);
    eprintln!(
        "soak: 2,320 requests in {:.1} s; RSS after warm-up {warm} KiB, after the run {after} KiB",
        started.elapsed().as_secs_f64()
    );
    let metrics = server.request("GET", "/metrics", b"").body;
    for family in ["specee_requests_in_flight", "specee_queue_depth", "specee_kv_reserved_tokens"] {
        assert_eq!(server.metric(family), 0.0, "{family} after the soak:\n{metrics}");
    }
    assert!(server.metric("specee_prefix_cache_tokens") <= 512.0, "{metrics}");
    assert!(!metrics.lines().any(|l| l.starts_with("specee_requests_total") && l.contains("status=\"5")), "{metrics}");
    assert!(metrics.contains("specee_generations_total{mode=\"dense\",finish=\"error\"} 0"), "{metrics}");
    // Disconnected clients were cancelled, not generated to the end (256 tokens each).
    let cancelled: f64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("specee_generations_total{mode=\"dense\",finish=\"cancelled\"} "))
        .and_then(|v| v.parse().ok())
        .unwrap();
    assert!(cancelled >= 100.0, "only {cancelled} cancelled generations of ~232 disconnects:\n{metrics}");
    assert!((after as f64) <= warm as f64 * 1.10, "RSS grew from {warm} KiB after warm-up to {after} KiB");
    assert_eq!(server.request("GET", "/health", b"").status, 200);
}

/// The batching server's prefix cache: a second chat turn resending the first turn and its answer reuses the
/// cached prefix (`specee_prefix_cache_hit_tokens_total` counts it) and answers exactly what a server without
/// the cache answers.
#[test]
fn second_chat_turn_reuses_the_first_turns_cache_and_answers_the_same() {
    let turn1 = json!([{"role": "system", "content": "You are a helpful assistant who answers in one sentence."},
                       {"role": "user", "content": "Name three colors and say which one is the warmest."}]);
    let ask = |server: &Server, messages: &Value| {
        let r = server.post_json(
            "/v1/chat/completions",
            &json!({"model": "x", "messages": messages, "max_tokens": 12, "temperature": 0}),
        );
        assert_eq!(r.status, 200, "{r:?}");
        let v = r.json();
        (
            v["choices"][0]["message"]["content"].as_str().unwrap().to_string(),
            v["usage"]["prompt_tokens"].as_u64().unwrap(),
        )
    };
    let mut answers = Vec::new();
    // Batching with and without the prefix cache, and the single worker (eagle) keeping its last cache.
    for (parallel, cache) in [("2", "0"), ("2", "4096"), ("1", "4096")] {
        let server = Server::start(&["--parallel", parallel, "--prefix-cache", cache]);
        let (first, first_prompt) = ask(&server, &turn1);
        let mut turn2 = turn1.as_array().unwrap().clone();
        turn2.push(json!({"role": "assistant", "content": first}));
        turn2.push(json!({"role": "user", "content": "And the coldest?"}));
        let (second, _) = ask(&server, &Value::Array(turn2));
        let hits = server.metric("specee_prefix_cache_hit_tokens_total");
        if cache == "0" {
            assert_eq!(hits, 0.0);
        } else {
            // At least the whole blocks of the first turn's prompt (its answer may retokenize differently).
            let blocks = (first_prompt / 16 * 16) as f64;
            assert!(blocks >= 32.0 && hits >= blocks, "only {hits} prompt tokens reused of {first_prompt}");
            assert_eq!(server.metric("specee_prefix_cache_lookups_total"), 2.0);
        }
        answers.push((first, second));
    }
    assert_eq!(answers[0], answers[1]);
    assert_eq!(answers[0], answers[2]);
}

/// Greedy eagle requests on the batching server draft trees: alone, a request's answer says `eagle`, with more than
/// one token per forward, and is exactly `specee generate`'s; a second request admitted while the first generates
/// drafts too, its tree verified in the same forwards as the first's (it is never alone), and both answer as
/// `specee generate` does. With `--tree-rows 1` only a lone request drafts: the second runs dense rows.
#[test]
fn draft_trees_of_several_requests_share_the_batching_servers_forwards() {
    for tree_rows in ["8", "1"] {
        let server = Server::start(&["--parallel", "4", "--tree-rows", tree_rows]);
        let ask = |body: &Value| {
            let r = server.post_json("/v1/chat/completions", body);
            assert_eq!(r.status, 200, "{r:?}");
            r.json()
        };
        let v = ask(&chat_body(48));
        assert_eq!(v["choices"][0]["message"]["content"].as_str().unwrap(), generate_text(CHAT_PROMPT, 48, true, 2));
        assert_eq!(v["specee"]["mode"], "eagle", "{v}");
        assert_eq!(v["specee"]["tree"], "2,1,2,0.4", "{v}");
        let tau = v["specee"]["acceptance_length"].as_f64().unwrap();
        assert!(tau > 1.0, "alone, it took one forward per token: {v}");

        // A long streamed answer (400 tokens, no end before) starts alone; a second request joins it part-way.
        let (long_prompt, long) = ("Write a long story about a dragon who learns to bake bread.", 400);
        let other_prompt = "Write a haiku about the sea.";
        let body = |prompt: &str, n: usize| json!({"model": "x", "messages": [{"role": "user", "content": prompt}], "max_tokens": n, "temperature": 0});
        let other = body(other_prompt, 24);
        let mut body = body(long_prompt, long);
        body["stream"] = json!(true);
        let port = server.port;
        let first = std::thread::spawn(move || {
            let r = http(port, "POST", "/v1/chat/completions", body.to_string().as_bytes());
            assert_eq!(r.status, 200, "{r:?}");
            let events: Vec<&str> = r.body.lines().filter_map(|l| l.strip_prefix("data: ")).collect();
            let mut text = String::new();
            for e in &events[..events.len() - 1] {
                let v: Value = serde_json::from_str(e).unwrap();
                text += v["choices"][0]["delta"]["content"].as_str().unwrap_or("");
            }
            text
        });
        // Once the first is generating, the second arrives (well before the first's 400 tokens are done).
        let start = Instant::now();
        while server.metric("specee_requests_in_flight") == 0.0 {
            assert!(start.elapsed() < Duration::from_secs(30), "the first request never started");
            std::thread::sleep(Duration::from_millis(5));
        }
        std::thread::sleep(Duration::from_millis(100));
        let second = ask(&other);
        let want_mode = if tree_rows == "1" { "dense" } else { "eagle" };
        assert_eq!(second["specee"]["mode"], want_mode, "--tree-rows {tree_rows}: {second}");
        let want_tree = if want_mode == "dense" { Value::Null } else { json!("2,1,2,0.4") };
        assert_eq!(second["specee"]["tree"], want_tree, "a dense answer names no tree: {second}");
        let text = second["choices"][0]["message"]["content"].as_str().unwrap();
        assert_eq!(text, generate_text(other_prompt, 24, true, 2));
        assert_eq!(first.join().unwrap(), generate_text(long_prompt, long, true, 2));
        // The long one drafted (at least while alone): it counts as eagle, as the first request did.
        let eagle =
            |finish: &str| server.metric(&format!("specee_generations_total{{mode=\"eagle\",finish=\"{finish}\"}}"));
        let eagles = if tree_rows == "1" { 2.0 } else { 3.0 };
        assert_eq!(eagle("stop") + eagle("length"), eagles, "--tree-rows {tree_rows}");
        server.wait_idle(Duration::from_secs(30));
    }
}

/// Runs `tests/server/browser_chat.py` (headless Chromium driving the chat page) against `server`; its JSON.
fn browser(server: &Server, args: &[&str]) -> Value {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/server/browser_chat.py");
    let base = format!("http://127.0.0.1:{}", server.port);
    let mut cmd = Command::new(python());
    cmd.arg(&script)
        .arg(&base)
        .args(args)
        .env("NO_PROXY", "127.0.0.1,localhost")
        .env("no_proxy", "127.0.0.1,localhost");
    let out = cmd.output().expect("run browser_chat.py");
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "browser_chat.py {args:?} failed (needs Debian's chromium; .ci/run installs it):\n{log}"
    );
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("browser_chat.py printed no JSON ({e}): {log}"))
}

#[test]
fn chat_page_in_a_real_browser_streams_the_greedy_answer_with_every_tokens_provenance() {
    let server = Server::start(&[]);
    let page = server.request("GET", "/", b"");
    assert_eq!(page.status, 200);
    assert!(page.header("content-type").unwrap().starts_with("text/html"));
    assert!(
        !page.body.contains("http://") && !page.body.contains("https://"),
        "the page must fetch nothing from elsewhere"
    );
    let message = "Write a Python function that adds two numbers.";
    for mode in ["eagle", "specee-eagle"] {
        // The API's own greedy answer to the same conversation.
        let r = server.post_json(
            "/v1/chat/completions",
            &json!({"model": "x", "messages": [{"role": "user", "content": message}], "max_tokens": 40,
                    "temperature": 0, "specee": {"mode": mode}}),
        );
        assert_eq!(r.status, 200, "{r:?}");
        let api = r.json();
        // The draft tree that ran (SmolLM2's head has none of its own: the default).
        assert_eq!(api["specee"]["tree"], "2,1,2,0.4", "{mode}: {api}");
        let want = api["choices"][0]["message"]["content"].as_str().unwrap().to_string();
        let n = api["usage"]["completion_tokens"].as_u64().unwrap();
        let v = browser(&server, &["send", message, "--mode", mode, "--max-tokens", "40"]);
        assert_eq!(v["error"], Value::Null, "{v}");
        assert_eq!(v["content"].as_str().unwrap(), want, "{mode}: the page's answer differs from the API's");
        // Every answer token has its span, and the spans spell the answer.
        let spans = v["spans"].as_array().unwrap();
        assert_eq!(v["tokens"].as_u64().unwrap(), n, "{v}");
        assert_eq!(spans.len() as u64, n, "{mode}: one span per answer token");
        let spelled: String = spans.iter().map(|s| s["text"].as_str().unwrap()).collect();
        assert_eq!(spelled, want);
        let sources: Vec<&str> = spans.iter().map(|s| s["source"].as_str().unwrap()).collect();
        assert!(sources.iter().all(|s| ["plain", "draft", "lookup", "bonus"].contains(s)), "{sources:?}");
        assert!(sources.iter().any(|s| *s != "plain"), "{mode}: no token came from a draft: {sources:?}");
        let layers: Vec<u64> = spans.iter().map(|s| s["layers"].as_u64().unwrap()).collect();
        assert!(layers.iter().all(|&l| (1..=30).contains(&l)), "{layers:?}");
        if mode == "eagle" {
            assert!(layers.iter().all(|&l| l == 30), "eagle runs every layer: {layers:?}");
        }
        assert!(v["stats"].as_str().unwrap().starts_with(mode), "{v}");
        assert!(v["stats"].as_str().unwrap().contains(" · tree 2,1,2,0.4"), "{v}");
    }
    // Clients that do not ask get standard chunks.
    let r = server.post_json(
        "/v1/chat/completions",
        &json!({"model": "x", "messages": [{"role": "user", "content": message}], "max_tokens": 4, "stream": true}),
    );
    assert!(r.body.contains("chat.completion.chunk") && !r.body.contains("\"specee\""), "{}", r.body);
}

#[test]
fn a_browser_tab_closed_mid_stream_frees_the_slot() {
    let server = Server::start(&[]);
    let v = browser(&server, &["close-mid-stream", "Tell me a long story about a dragon.", "--max-tokens", "2000"]);
    assert_eq!(v["closed"], true);
    server.wait_idle(Duration::from_secs(60));
    assert_eq!(server.metric("specee_requests_in_flight"), 0.0);
    // The server answers the next request at once.
    let r = server.post_json("/v1/chat/completions", &chat_body(4));
    assert_eq!(r.status, 200, "{r:?}");
}
