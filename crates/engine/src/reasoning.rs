//! Reasoning: how a model is asked to reason, where its reasoning ends and what its final answer is — the ground
//! SpecExit and DEER (issue #30) stand on, and what `generate --reasoning`, `eval-reasoning` and the server's
//! `reasoning_tokens` count with.
//!
//! A [`ReasoningProfile`] is data (a JSON file; `profiles/` holds the built-in ones, and a user passes their own
//! path): the system message and the text appended to the question that ask for step-by-step reasoning, the text
//! that opens the assistant's turn (`<think>\n` for think models), the marker that ends the reasoning (`</think>`;
//! none for instruct models, whose reasoning is every paragraph before the one holding the final answer), the text
//! an early exit emits to cut the reasoning short, the answer format (`\boxed{N}` or a line `Answer: N`), and the
//! paragraph boundary (`\n\n`) at which a cut may happen.
//!
//! A model "reasons" natively when its vocabulary has a `</think>` token (Qwen3, DeepSeek-R1-Distill): then the
//! `think` profile applies by default, else `boxed`.

use crate::error::EngineError;
use crate::session::Engine;
use serde::Deserialize;
use std::path::Path;
use tokenizer::chat::Message;

/// One problem with a known numeric answer (a line `{"question": "...", "answer": 42}` of a problems file).
#[derive(Clone, Debug, PartialEq)]
pub struct Problem {
    pub question: String,
    pub answer: f64,
}

/// The problems of a JSON-lines file (blank lines skipped); a line that is not `{"question": string, "answer":
/// number}` is an error naming the file and line.
pub fn read_problems(path: &Path) -> Result<Vec<Problem>, EngineError> {
    let text = std::fs::read_to_string(path).map_err(|e| EngineError::Io { path: path.to_path_buf(), source: e })?;
    parse_problems(&text, path)
}

/// [`read_problems`] on a file's text (`path` names it in errors).
pub fn parse_problems(text: &str, path: &Path) -> Result<Vec<Problem>, EngineError> {
    let mut problems = Vec::new();
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let bad = |why: String| EngineError::PromptFile { path: path.to_path_buf(), line: i + 1, why };
        let v: serde_json::Value = serde_json::from_str(line).map_err(|e| bad(e.to_string()))?;
        let question = v["question"].as_str().filter(|q| !q.trim().is_empty());
        let answer = v["answer"].as_f64();
        match (question, answer) {
            (Some(q), Some(a)) => problems.push(Problem { question: q.to_string(), answer: a }),
            _ => return Err(bad("expected {\"question\": \"...\", \"answer\": NUMBER}".into())),
        }
    }
    if problems.is_empty() {
        return Err(EngineError::NoPrompts(path.to_path_buf()));
    }
    Ok(problems)
}

/// How the final answer is written.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum AnswerFormat {
    /// The number inside the last `\boxed{…}`.
    Boxed,
    /// The number after the last `Answer:` (the rest of its line).
    AnswerLine,
}

/// How a model is asked to reason and how its reasoning and answer are told apart (see the module doc).
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ReasoningProfile {
    pub name: String,
    /// What the profile is for (shown by nothing; for the reader of the file).
    #[serde(default)]
    pub about: String,
    /// A system message, if any.
    pub system: Option<String>,
    /// Appended to the question (the user's message).
    #[serde(default)]
    pub user_suffix: String,
    /// Opens the assistant's turn, after the chat template's own opening (e.g. `<think>\n`).
    #[serde(default)]
    pub assistant_prefix: String,
    /// The text that ends the reasoning (it counts as reasoning); `None`: the reasoning is every paragraph before
    /// the one holding the final answer.
    pub end: Option<String>,
    /// What an early exit emits at a paragraph boundary to end the reasoning and start the answer.
    pub exit_text: String,
    pub answer: AnswerFormat,
    /// The paragraph boundary: where the reasoning may be cut.
    pub boundary: String,
}

/// The built-in profiles, by name: the files of `profiles/`.
const BUILT_IN: [(&str, &str); 2] =
    [("boxed", include_str!("../../../profiles/boxed.json")), ("think", include_str!("../../../profiles/think.json"))];

/// Where a generated answer's reasoning ends, in tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReasoningSplit {
    /// Tokens of the reasoning (the end marker included).
    pub reasoning_tokens: usize,
    /// Tokens after it.
    pub answer_tokens: usize,
    /// Whether the reasoning ended (the end marker, or a final answer, was written).
    pub ended: bool,
}

impl ReasoningProfile {
    /// A built-in profile by name, or the profile file at `name_or_path`; `None`: the model's default (`think`
    /// when its vocabulary has a `</think>` token, else `boxed`).
    pub fn resolve(name_or_path: Option<&str>, engine: &Engine) -> Result<ReasoningProfile, EngineError> {
        let name = match name_or_path {
            Some(n) => n,
            None if Self::is_native(engine) => "think",
            None => "boxed",
        };
        if let Some((_, text)) = BUILT_IN.iter().find(|(n, _)| *n == name) {
            return Self::parse(text, Path::new(name));
        }
        let path = Path::new(name);
        if !path.is_file() {
            let names: Vec<&str> = BUILT_IN.iter().map(|(n, _)| *n).collect();
            return Err(EngineError::Profile(format!(
                "no reasoning profile named {name} (built in: {}; or a profile file's path)",
                names.join(", ")
            )));
        }
        let text =
            std::fs::read_to_string(path).map_err(|e| EngineError::Io { path: path.to_path_buf(), source: e })?;
        Self::parse(&text, path)
    }

    /// The profile a `--reasoning [PROFILE]` flag asks for: none without the flag, the model's default for the
    /// flag alone (an empty value), else the one named.
    pub fn from_flag(flag: Option<&str>, engine: &Engine) -> Result<Option<ReasoningProfile>, EngineError> {
        flag.map(|f| Self::resolve((!f.is_empty()).then_some(f), engine)).transpose()
    }

    /// Whether the model reasons natively (its vocabulary has a `</think>` token).
    pub fn is_native(engine: &Engine) -> bool {
        engine.tokenizer.token_id("</think>").is_some()
    }

    /// Parses and checks a profile's JSON (`path` names it in errors).
    pub fn parse(text: &str, path: &Path) -> Result<ReasoningProfile, EngineError> {
        let bad = |why: String| EngineError::Profile(format!("reasoning profile {}: {why}", path.display()));
        let p: ReasoningProfile = serde_json::from_str(text).map_err(|e| bad(e.to_string()))?;
        if p.boundary.is_empty() || p.exit_text.is_empty() || p.end.as_deref() == Some("") {
            return Err(bad("`boundary`, `exit_text` and `end` (when given) must not be empty".into()));
        }
        Ok(p)
    }

    /// The prompt text for `question`: the profile's messages rendered with the model's chat template, the
    /// assistant's turn opened with the profile's prefix.
    pub fn render(&self, engine: &Engine, question: &str) -> Result<String, EngineError> {
        let mut messages = Vec::new();
        if let Some(system) = &self.system {
            messages.push(Message::new("system", system.as_str()));
        }
        messages.push(Message::new("user", format!("{question}{}", self.user_suffix)));
        Ok(engine.render_chat(&messages)? + &self.assistant_prefix)
    }

    /// Byte offset in `text` where the reasoning ends (`None` while it has not).
    pub fn reasoning_end(&self, text: &[u8]) -> Option<usize> {
        match &self.end {
            Some(end) => find(text, end.as_bytes(), false).map(|i| i + end.len()),
            None => {
                // The start of the paragraph that holds the final answer.
                let at = self.answer_start(text)?;
                Some(find(&text[..at], self.boundary.as_bytes(), true).map_or(0, |i| i + self.boundary.len()))
            }
        }
    }

    /// Byte offset of the last answer marker in `text`.
    fn answer_start(&self, text: &[u8]) -> Option<usize> {
        find(text, self.marker().as_bytes(), true)
    }

    fn marker(&self) -> &'static str {
        match self.answer {
            AnswerFormat::Boxed => "\\boxed{",
            AnswerFormat::AnswerLine => "Answer:",
        }
    }

    /// Reasoning and answer tokens of generated `ids`: a token belongs to the reasoning when it ends at or before
    /// the reasoning's end (a token straddling it is reasoning). All tokens are reasoning while it has not ended.
    pub fn split(&self, engine: &Engine, ids: &[u32]) -> ReasoningSplit {
        let pieces: Vec<&[u8]> = ids.iter().map(|&id| engine.tokenizer.token_bytes(id)).collect();
        self.split_pieces(&pieces)
    }

    /// [`ReasoningProfile::split`] over the tokens' bytes.
    fn split_pieces(&self, pieces: &[&[u8]]) -> ReasoningSplit {
        let bytes = pieces.concat();
        let Some(end) = self.reasoning_end(&bytes) else {
            return ReasoningSplit { reasoning_tokens: pieces.len(), answer_tokens: 0, ended: false };
        };
        // A token is reasoning when it starts before the end.
        let mut start = 0;
        let n = pieces
            .iter()
            .take_while(|p| {
                let before = start < end;
                start += p.len();
                before
            })
            .count();
        ReasoningSplit { reasoning_tokens: n, answer_tokens: pieces.len() - n, ended: true }
    }

    /// The final answer of a generated `text`: the number after the reasoning's end (anywhere when the profile
    /// has no end marker) in the profile's format. Strict: the box (or the rest of the `Answer:` line) must hold
    /// one number and nothing else but spaces, `$` signs, a trailing full stop, and thousands commas in their
    /// places; anything else is no answer.
    pub fn answer(&self, text: &str) -> Option<f64> {
        let after = match &self.end {
            Some(_) => &text[self.reasoning_end(text.as_bytes())?..],
            None => text,
        };
        let start = after.rfind(self.marker())? + self.marker().len();
        let rest = &after[start..];
        let inner = match self.answer {
            AnswerFormat::Boxed => &rest[..box_close(rest)?],
            AnswerFormat::AnswerLine => rest.lines().next().unwrap_or(""),
        };
        parse_number(inner)
    }

    /// Whether `text` ends a final answer in the profile's format: its last answer marker is followed by the
    /// box's closing brace, or by the end of the `Answer:` line.
    pub fn answer_complete(&self, text: &str) -> bool {
        let Some(i) = text.rfind(self.marker()) else { return false };
        let rest = &text[i + self.marker().len()..];
        match self.answer {
            AnswerFormat::Boxed => box_close(rest).is_some(),
            AnswerFormat::AnswerLine => rest.contains('\n'),
        }
    }
}

/// Byte offset of the brace that closes a box whose opening brace came just before `rest`.
fn box_close(rest: &str) -> Option<usize> {
    let mut depth = 1usize;
    rest.char_indices().find_map(|(i, c)| {
        match c {
            '{' => depth += 1,
            '}' => depth -= 1,
            _ => {}
        }
        (depth == 0).then_some(i)
    })
}

/// A number written as an answer: optional `$` signs and spaces around, an optional trailing full stop, an
/// optional minus, digits with commas only between groups of three, an optional decimal part.
pub fn parse_number(s: &str) -> Option<f64> {
    let s = s.trim().trim_end_matches('.').trim().trim_matches('$').trim();
    let (neg, s) = match s.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, s),
    };
    let (int, frac) = match s.split_once('.') {
        Some((i, f)) => (i, Some(f)),
        None => (s, None),
    };
    let groups: Vec<&str> = int.split(',').collect();
    let grouped_ok = groups.len() == 1
        || (!groups[0].is_empty() && groups[0].len() <= 3 && groups[1..].iter().all(|g| g.len() == 3));
    let digits = |t: &str| !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit());
    if !grouped_ok || !groups.iter().all(|g| digits(g)) || frac.is_some_and(|f| !digits(f)) {
        return None;
    }
    let v: f64 = format!("{}{}", groups.concat(), frac.map(|f| format!(".{f}")).unwrap_or_default()).parse().ok()?;
    Some(if neg { -v } else { v })
}

/// Byte offset of the first (or with `last`, the last) occurrence of `needle` in `hay`.
fn find(hay: &[u8], needle: &[u8], last: bool) -> Option<usize> {
    if needle.is_empty() || needle.len() > hay.len() {
        return None;
    }
    let mut hits = hay.windows(needle.len()).enumerate().filter(|(_, w)| *w == needle).map(|(i, _)| i);
    if last {
        hits.last()
    } else {
        hits.next()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn profile(name: &str) -> ReasoningProfile {
        let text = BUILT_IN.iter().find(|(n, _)| *n == name).unwrap().1;
        ReasoningProfile::parse(text, Path::new(name)).unwrap()
    }

    #[test]
    fn numbers_are_parsed_strictly() {
        assert_eq!(parse_number("42"), Some(42.0));
        assert_eq!(parse_number(" $1,250.50$ "), Some(1250.5));
        assert_eq!(parse_number("-7."), Some(-7.0));
        assert_eq!(parse_number("1,234,567"), Some(1234567.0));
        for bad in ["", "12 apples", "1,23", "12,", ",123", "3/4", "x", "1.2.3", "12e3", "--3", "1 000", "\\text{5}"] {
            assert_eq!(parse_number(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn the_answer_is_the_last_box_or_answer_line() {
        let boxed = profile("boxed");
        assert_eq!(boxed.answer("So it is \\(\\boxed{15}\\)."), Some(15.0));
        assert_eq!(boxed.answer("first \\boxed{3}, then \\boxed{ 1,024 }"), Some(1024.0));
        assert_eq!(boxed.answer("\\boxed{\\frac{1}{2}}"), None);
        assert_eq!(boxed.answer("\\boxed{15 apples}"), None);
        assert_eq!(boxed.answer("\\boxed{15"), None);
        assert_eq!(boxed.answer("The answer is 15."), None);
        let line = ReasoningProfile { answer: AnswerFormat::AnswerLine, ..boxed };
        assert_eq!(line.answer("work\nAnswer: 96\nmore"), Some(96.0));
        assert_eq!(line.answer("Answer: 12\nAnswer: -3."), Some(-3.0));
        assert_eq!(line.answer("Answer: N"), None);
        let think = profile("think");
        // Only after the reasoning: a box inside the think section is not the answer.
        assert_eq!(think.answer("maybe \\boxed{4}\n</think>\n\n\\boxed{5}"), Some(5.0));
        assert_eq!(think.answer("maybe \\boxed{4} and no end"), None);
    }

    #[test]
    fn reasoning_ends_at_the_marker_or_before_the_answers_paragraph() {
        let boxed = profile("boxed");
        let text = b"Step one.\n\nStep two.\n\nTherefore it is \\boxed{7}.";
        assert_eq!(boxed.reasoning_end(text), Some(22));
        assert_eq!(&text[22..26], b"Ther");
        assert_eq!(boxed.reasoning_end(b"\\boxed{7}"), Some(0));
        assert_eq!(boxed.reasoning_end(b"Step one.\n\nStep two."), None);
        let think = profile("think");
        assert_eq!(think.reasoning_end(b"a\n\nb</think>\n\\boxed{1}"), Some(12));
        assert_eq!(think.reasoning_end(b"a\n\nb"), None);
    }

    #[test]
    fn tokens_are_reasoning_when_they_start_before_its_end() {
        let think = profile("think");
        let pieces: [&[u8]; 6] = [b"a\n\n", b"b", b"</think>", b"\n\n\\boxed{", b"1", b"}"];
        let s = think.split_pieces(&pieces);
        assert_eq!(s, ReasoningSplit { reasoning_tokens: 3, answer_tokens: 3, ended: true });
        // A token straddling the end counts as reasoning.
        let straddle: [&[u8]; 3] = [b"x</thi", b"nk>\n", b"\\boxed{2}"];
        assert_eq!(think.split_pieces(&straddle).reasoning_tokens, 2);
        let open: [&[u8]; 2] = [b"still", b" thinking"];
        assert_eq!(think.split_pieces(&open), ReasoningSplit { reasoning_tokens: 2, answer_tokens: 0, ended: false });
        // Without an end marker: the answer's paragraph is the answer.
        let boxed = profile("boxed");
        let pieces: [&[u8]; 5] = [b"Step", b" one.\n\n", b"So", b" \\boxed{", b"3}"];
        assert_eq!(boxed.split_pieces(&pieces), ReasoningSplit { reasoning_tokens: 2, answer_tokens: 3, ended: true });
    }

    #[test]
    fn problem_files_are_read_strictly() {
        let dir = std::env::temp_dir().join(format!("specee-problems-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("p.jsonl");
        std::fs::write(&path, "{\"question\": \"1+1?\", \"answer\": 2}\n\n{\"question\": \"x\", \"answer\": -1.5}\n")
            .unwrap();
        let p = read_problems(&path).unwrap();
        assert_eq!(
            p,
            [Problem { question: "1+1?".into(), answer: 2.0 }, Problem { question: "x".into(), answer: -1.5 }]
        );
        for (text, want) in [
            ("{\"question\": \"q\", \"answer\": \"2\"}", ":1: expected {\"question\": \"...\", \"answer\": NUMBER}"),
            ("{\"question\": \"q\", \"answer\": 2}\nnot json", ":2: expected ident at line 1 column 2"),
            ("\n", " has no prompts"),
        ] {
            std::fs::write(&path, text).unwrap();
            let e = read_problems(&path).err().unwrap().to_string();
            assert!(e.ends_with(want), "{e}");
        }
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn malformed_profiles_are_one_line_errors() {
        let p = Path::new("my.json");
        for (text, want) in [
            ("{", "reasoning profile my.json: EOF while parsing an object at line 1 column 1"),
            (
                r#"{"name": "x", "end": null, "exit_text": "", "answer": "boxed", "boundary": "\n\n", "system": null}"#,
                "reasoning profile my.json: `boundary`, `exit_text` and `end` (when given) must not be empty",
            ),
        ] {
            let e = ReasoningProfile::parse(text, p).err().unwrap().to_string();
            assert_eq!(e, want);
            assert!(!e.contains('\n'));
        }
        let e = ReasoningProfile::parse(r#"{"name": "x", "answer": "words"}"#, p).err().unwrap().to_string();
        assert!(e.starts_with("reasoning profile my.json: unknown variant `words`"), "{e}");
        let e = ReasoningProfile::parse(r#"{"name": "x", "colour": 1}"#, p).err().unwrap().to_string();
        assert!(e.starts_with("reasoning profile my.json: unknown field `colour`"), "{e}");
    }
}
