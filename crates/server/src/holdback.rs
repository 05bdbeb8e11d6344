//! Streaming with stop strings: text is sent only once it can no longer turn out to be the start of a stop
//! string, so a streamed answer never shows part of a stop string that the final answer cuts off. The
//! engine's final text is the authority; [`Holdback::finish`] sends what remains of it.
//!
//! With tools, a call's opening tag is a marker: from it on nothing is streamed as text (the calls are sent
//! parsed at the end, the text around them as content).

/// Holds back the tail of the generated text that could begin a stop string.
#[derive(Debug, Default)]
pub struct Holdback {
    stops: Vec<String>,
    /// Everything generated so far.
    seen: String,
    /// Bytes of `seen` already sent.
    sent: usize,
    /// Where text stops being streamed once it appears.
    marker: Option<&'static str>,
}

impl Holdback {
    pub fn new(stops: Vec<String>) -> Holdback {
        Holdback { stops, ..Default::default() }
    }

    /// The holdback of a request: its stop strings, and with tools the tool-call marker.
    pub fn for_request(request: &crate::request::GenerationRequest) -> Holdback {
        let marker = request.tools.as_ref().map(|_| crate::tools::CALL_OPEN);
        Holdback { marker, ..Holdback::new(request.stop.clone()) }
    }

    /// Adds a generated piece; returns the text that is now safe to send (possibly empty).
    pub fn push(&mut self, piece: &str) -> &str {
        self.seen.push_str(piece);
        let held = self
            .stops
            .iter()
            .map(String::as_str)
            .chain(self.marker)
            .map(|s| longest_suffix_prefix(&self.seen, s))
            .max()
            .unwrap_or(0);
        let mut safe = self.seen.len() - held;
        if let Some(at) = self.marker.and_then(|m| self.seen.find(m)) {
            safe = safe.min(at);
        }
        // An answer that opens with `{` may be calls written without tags: held until the end decides.
        let start = self.seen.trim_start();
        let maybe_calls =
            start.is_empty() || start.starts_with('{') || "```".starts_with(start) || start.starts_with("```");
        if self.marker.is_some() && self.sent == 0 && maybe_calls {
            safe = 0;
        }
        let start = self.sent;
        if safe > start {
            self.sent = safe;
        }
        self.seen.get(start..self.sent).unwrap_or("")
    }

    /// What remains to send of the final text (which starts with everything sent so far).
    pub fn finish<'t>(&self, final_text: &'t str) -> &'t str {
        final_text.get(self.sent..).unwrap_or("")
    }
}

/// Length of the longest proper prefix of `stop` that `text` ends with (cut at a character boundary).
fn longest_suffix_prefix(text: &str, stop: &str) -> usize {
    (1..stop.len())
        .rev()
        .find(|&k| stop.is_char_boundary(k) && text.as_bytes().ends_with(&stop.as_bytes()[..k]))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passes_through_without_stops() {
        let mut h = Holdback::new(Vec::new());
        assert_eq!(h.push("ab"), "ab");
        assert_eq!(h.push("c"), "c");
        assert_eq!(h.finish("abc"), "");
    }

    #[test]
    fn holds_back_possible_stop_starts() {
        let mut h = Holdback::new(vec!["\n\nUser".into()]);
        assert_eq!(h.push("Hello"), "Hello");
        assert_eq!(h.push("\n"), "");
        assert_eq!(h.push("\nUs"), "");
        // Not the stop after all: released.
        assert_eq!(h.push("a"), "\n\nUsa");
        assert_eq!(h.push("\n\nUse"), "");
        // The engine found the stop and cut the text there.
        assert_eq!(h.finish("Hello\n\nUsa"), "");
    }

    #[test]
    fn finish_sends_held_text_the_engine_kept() {
        let mut h = Holdback::new(vec!["END".into()]);
        assert_eq!(h.push("xE"), "x");
        assert_eq!(h.finish("xE"), "E");
    }

    #[test]
    fn nothing_streams_from_the_tool_call_marker_on() {
        let mut h = Holdback { marker: Some("<tool_call>"), ..Holdback::new(Vec::new()) };
        assert_eq!(h.push("Sure. <tool"), "Sure. ");
        assert_eq!(h.push("_call>\n{\"name\""), "");
        assert_eq!(h.push("}</tool_call>"), "");
        assert_eq!(h.finish("Sure."), "");
        let mut h = Holdback { marker: Some("<tool_call>"), ..Holdback::new(Vec::new()) };
        assert_eq!(h.push(" "), "");
        assert_eq!(h.push("{\"name\""), "");
        assert_eq!(h.finish(""), "");
        let mut h = Holdback { marker: Some("<tool_call>"), ..Holdback::new(Vec::new()) };
        assert_eq!(h.push("a <to"), "a ");
        assert_eq!(h.push("o much"), "<too much");
    }

    #[test]
    fn multibyte_stop() {
        let mut h = Holdback::new(vec!["é!".into()]);
        assert_eq!(h.push("aé"), "a");
        assert_eq!(h.push("b"), "éb");
    }
}
