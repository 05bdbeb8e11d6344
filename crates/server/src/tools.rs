//! Tool calls on chat completions: `tools` and `tool_choice` checked (400s naming the field), the tools rendered
//! by the model's own chat template (its `tools` section: Qwen2.5's, Hermes-style), the model's
//! `<tool_call>{"name": …, "arguments": {…}}</tool_call>` blocks parsed into `message.tool_calls`, and
//! `tool_choice` `required` or a named function enforced by a grammar: the answer is then exactly one call whose
//! arguments validate against the function's `parameters` schema.
//!
//! A template without a tools section refuses `tools` (400). An answer whose blocks do not parse (bad JSON, an
//! unknown function) stays text with `finish_reason` `stop`: the client sees what the model wrote.

use crate::error::ApiError;
use serde_json::{json, Map, Value};

/// What `tool_choice` asks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ToolChoice {
    /// The model decides (the default).
    Auto,
    /// The model must call one of the tools.
    Required,
    /// The model must call this one.
    Named(String),
}

/// A request's tools, checked.
#[derive(Clone, Debug, PartialEq)]
pub struct Tools {
    /// The `tools` array as the template reads it (every entry `{"type": "function", "function": {…}}`).
    pub spec: Value,
    /// Each function's name and `parameters` schema.
    pub functions: Vec<(String, Value)>,
    pub choice: ToolChoice,
}

/// Most tools one request may declare.
pub const MAX_TOOLS: usize = 128;

/// The opening and closing tags of a call in the Hermes / Qwen2.5 format.
pub const CALL_OPEN: &str = "<tool_call>";
pub const CALL_CLOSE: &str = "</tool_call>";

/// One call the model made, as the API returns it.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct ToolCall {
    pub id: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub function: FunctionCall,
}

#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct FunctionCall {
    pub name: String,
    /// The arguments as a JSON text (OpenAI's shape).
    pub arguments: String,
}

/// A call id unique within this server's life (`call_…`).
pub fn next_call_id() -> String {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let start = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    format!("call_{start:x}{n:06x}")
}

fn bad(param: &str, why: impl Into<String>) -> ApiError {
    ApiError::invalid_param(param, why.into())
}

/// Checks `tools` and `tool_choice`; `None` when no tool may be called (none given, or `tool_choice` `none`).
pub fn parse(tools: Option<Value>, choice: Option<Value>) -> Result<Option<Tools>, ApiError> {
    let choice = match choice {
        None | Some(Value::Null) => ToolChoice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "none" => return Ok(None),
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            other => {
                return Err(bad(
                    "tool_choice",
                    format!("unknown tool_choice '{other}' (none, auto, required, or {{\"type\": \"function\", …}})"),
                ))
            }
        },
        Some(Value::Object(o)) => match o.get("function").and_then(|f| f.get("name")).and_then(Value::as_str) {
            Some(name) if o.get("type").and_then(Value::as_str) == Some("function") => {
                ToolChoice::Named(name.to_string())
            }
            _ => {
                return Err(bad(
                    "tool_choice",
                    "a tool_choice object must be {\"type\": \"function\", \"function\": {\"name\": …}}",
                ))
            }
        },
        Some(_) => return Err(bad("tool_choice", "'tool_choice' must be a string or an object")),
    };
    let list = match tools {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(a)) => a,
        Some(_) => return Err(bad("tools", "'tools' must be an array")),
    };
    if list.is_empty() {
        return match choice {
            ToolChoice::Auto => Ok(None),
            _ => Err(bad("tool_choice", "'tool_choice' asks for a call but 'tools' is empty")),
        };
    }
    if list.len() > MAX_TOOLS {
        return Err(bad("tools", format!("'tools' holds {} tools; at most {MAX_TOOLS} are accepted", list.len())));
    }
    if Value::Array(list.clone()).to_string().len() > crate::request::MAX_GRAMMAR_BYTES {
        return Err(bad("tools", format!("'tools' is larger than {} bytes", crate::request::MAX_GRAMMAR_BYTES)));
    }
    let mut functions: Vec<(String, Value)> = Vec::new();
    let mut spec = Vec::new();
    for (i, tool) in list.into_iter().enumerate() {
        let at = |f: &str| format!("tools[{i}]{f}");
        let Value::Object(tool) = tool else { return Err(bad(&at(""), format!("'{}' must be an object", at("")))) };
        if tool.get("type").and_then(Value::as_str) != Some("function") {
            return Err(bad(&at(".type"), format!("'{}' must be \"function\"", at(".type"))));
        }
        let Some(Value::Object(f)) = tool.get("function") else {
            return Err(bad(&at(".function"), format!("'{}' must be an object", at(".function"))));
        };
        let name = f.get("name").and_then(Value::as_str).unwrap_or("");
        let valid = !name.is_empty()
            && name.len() <= 64
            && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-' || c == '.');
        if !valid {
            let why = format!("'{}' must be 1 to 64 letters, digits, '_', '-' or '.'", at(".function.name"));
            return Err(bad(&at(".function.name"), why));
        }
        if functions.iter().any(|(n, _)| n == name) {
            return Err(bad(&at(".function.name"), format!("two tools are named '{name}'")));
        }
        let parameters = match f.get("parameters") {
            None | Some(Value::Null) => json!({"type": "object", "properties": {}}),
            Some(p @ Value::Object(_)) => p.clone(),
            Some(_) => {
                return Err(bad(
                    &at(".function.parameters"),
                    format!("'{}' must be a JSON schema", at(".function.parameters")),
                ))
            }
        };
        if f.get("description").is_some_and(|d| !d.is_string() && !d.is_null()) {
            return Err(bad(
                &at(".function.description"),
                format!("'{}' must be a string", at(".function.description")),
            ));
        }
        let mut function = Map::new();
        function.insert("name".into(), name.into());
        if let Some(d) = f.get("description").filter(|d| d.is_string()) {
            function.insert("description".into(), d.clone());
        }
        function.insert("parameters".into(), parameters.clone());
        spec.push(json!({"type": "function", "function": function}));
        functions.push((name.to_string(), parameters));
    }
    if let ToolChoice::Named(name) = &choice {
        if !functions.iter().any(|(n, _)| n == name) {
            return Err(bad("tool_choice", format!("tool_choice names '{name}', which is not among 'tools'")));
        }
    }
    Ok(Some(Tools { spec: Value::Array(spec), functions, choice }))
}

impl Tools {
    /// The grammar a `required` or named choice forces (one call of the allowed functions, its arguments
    /// following the function's schema), in llguidance's Lark dialect; `open` / `close` are the tags as the
    /// grammar writes them (a single special token `<[id]>` where the vocabulary has one). `None` for `auto`.
    pub fn grammar(&self, open: &str, close: &str) -> Option<String> {
        let allowed: Vec<&(String, Value)> = match &self.choice {
            ToolChoice::Auto => return None,
            ToolChoice::Required => self.functions.iter().collect(),
            ToolChoice::Named(name) => self.functions.iter().filter(|(n, _)| n == name).collect(),
        };
        let calls: Vec<Value> = allowed
            .iter()
            .map(|(name, parameters)| {
                json!({"type": "object", "properties": {"name": {"const": name}, "arguments": parameters},
                       "required": ["name", "arguments"], "additionalProperties": false})
            })
            .collect();
        let schema = if calls.len() == 1 { calls[0].clone() } else { json!({"anyOf": calls}) };
        Some(format!("start: {open} \"\\n\" call \"\\n\" {close}\ncall: %json {schema}\n"))
    }

    /// The calls in `text` and the text around them, when `text` holds at least one call block and every block
    /// parses as `{"name": <one of the tools>, "arguments": {…}}`; `None` otherwise (the text stays text).
    pub fn parse_calls(&self, text: &str) -> Option<(String, Vec<ToolCall>)> {
        if !text.contains(CALL_OPEN) {
            return self.parse_bare_calls(text).map(|calls| (String::new(), calls));
        }
        let mut content = String::new();
        let mut calls = Vec::new();
        let mut rest = text;
        while let Some(start) = rest.find(CALL_OPEN) {
            content.push_str(&rest[..start]);
            let after = &rest[start + CALL_OPEN.len()..];
            let (body, next) = match after.find(CALL_CLOSE) {
                Some(end) => (&after[..end], &after[end + CALL_CLOSE.len()..]),
                // The answer ended (e.g. at max_tokens or an end token) before the closing tag.
                None => (after, ""),
            };
            calls.push(self.call(&serde_json::from_str(body.trim()).ok()?)?);
            rest = next;
        }
        if calls.is_empty() {
            return None;
        }
        content.push_str(rest);
        Some((content.trim().to_string(), calls))
    }

    /// Calls written without tags, as small models often answer: the whole text is one or more call objects.
    fn parse_bare_calls(&self, text: &str) -> Option<Vec<ToolCall>> {
        let mut text = text.trim();
        // …or in a Markdown code block.
        if let Some(inner) = text.strip_prefix("```json").or_else(|| text.strip_prefix("```")) {
            text = inner.strip_suffix("```")?.trim();
        }
        if !text.starts_with('{') {
            return None;
        }
        let calls = serde_json::Deserializer::from_str(text)
            .into_iter::<Value>()
            .map(|v| self.call(&v.ok()?))
            .collect::<Option<Vec<_>>>()?;
        (!calls.is_empty()).then_some(calls)
    }

    /// `{"name": <one of the tools>, "arguments": {…}}` as a call.
    fn call(&self, v: &Value) -> Option<ToolCall> {
        let name = v.get("name")?.as_str()?;
        if !self.functions.iter().any(|(n, _)| n == name) {
            return None;
        }
        let arguments = match v.get("arguments") {
            None | Some(Value::Null) => json!({}),
            Some(a @ Value::Object(_)) => a.clone(),
            // Some models write the arguments as a JSON text.
            Some(Value::String(s)) => serde_json::from_str::<Value>(s).ok().filter(Value::is_object)?,
            Some(_) => return None,
        };
        let function = FunctionCall { name: name.to_string(), arguments: arguments.to_string() };
        Some(ToolCall { id: String::new(), kind: "function", function })
    }
}

/// An assistant message's `tool_calls` (OpenAI's shape, arguments a JSON text) as chat templates read them
/// (arguments an object); `at` names the field in errors.
pub fn template_calls(calls: Value, at: &str) -> Result<Value, ApiError> {
    let Value::Array(calls) = calls else { return Err(bad(at, format!("'{at}' must be an array"))) };
    let mut out = Vec::new();
    for (i, call) in calls.into_iter().enumerate() {
        let f = call.get("function").filter(|f| f.is_object());
        let name = f.and_then(|f| f.get("name")).and_then(Value::as_str);
        let Some(name) = name else {
            return Err(bad(&format!("{at}[{i}]"), format!("'{at}[{i}]' needs a function with a name")));
        };
        let arguments = match f.and_then(|f| f.get("arguments")) {
            None | Some(Value::Null) => json!({}),
            Some(Value::String(s)) => serde_json::from_str(s).unwrap_or_else(|_| Value::String(s.clone())),
            Some(v) => v.clone(),
        };
        out.push(json!({"type": "function", "function": {"name": name, "arguments": arguments}}));
    }
    Ok(Value::Array(out))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tools(choice: Value) -> Result<Option<Tools>, ApiError> {
        let t = json!([
            {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
             "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
            {"type": "function", "function": {"name": "now"}}
        ]);
        parse(Some(t), Some(choice))
    }

    fn param(e: ApiError) -> Option<String> {
        e.param
    }

    #[test]
    fn tools_and_choices_are_checked() {
        let t = tools(Value::Null).unwrap().unwrap();
        assert_eq!(t.choice, ToolChoice::Auto);
        assert_eq!(t.functions[1], ("now".to_string(), json!({"type": "object", "properties": {}})));
        assert!(tools(json!("none")).unwrap().is_none());
        assert_eq!(tools(json!("required")).unwrap().unwrap().choice, ToolChoice::Required);
        let named = json!({"type": "function", "function": {"name": "now"}});
        assert_eq!(tools(named).unwrap().unwrap().choice, ToolChoice::Named("now".into()));
        for (choice, want) in [
            (json!("sometimes"), "tool_choice"),
            (json!({"type": "function", "function": {"name": "fly"}}), "tool_choice"),
            (json!({"function": {"name": "now"}}), "tool_choice"),
            (json!(3), "tool_choice"),
        ] {
            assert_eq!(param(tools(choice).unwrap_err()).as_deref(), Some(want));
        }
        for (t, want) in [
            (json!({"type": "function"}), "tools"),
            (json!([{"type": "retrieval"}]), "tools[0].type"),
            (json!([{"type": "function"}]), "tools[0].function"),
            (json!([{"type": "function", "function": {"name": "a b"}}]), "tools[0].function.name"),
            (json!([{"type": "function", "function": {"name": "f", "parameters": 3}}]), "tools[0].function.parameters"),
            (
                json!([{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "f"}}]),
                "tools[1].function.name",
            ),
        ] {
            assert_eq!(param(parse(Some(t), None).unwrap_err()).as_deref(), Some(want));
        }
        assert!(parse(Some(json!([])), None).unwrap().is_none());
        assert_eq!(param(parse(Some(json!([])), Some(json!("required"))).unwrap_err()).as_deref(), Some("tool_choice"));
    }

    #[test]
    fn calls_are_parsed_from_hermes_blocks_or_left_as_text() {
        let t = tools(Value::Null).unwrap().unwrap();
        let text = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"now\"}\n</tool_call>";
        let (content, calls) = t.parse_calls(text).unwrap();
        assert_eq!(content, "Let me check.");
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[0].function.name, "get_weather");
        assert_eq!(serde_json::from_str::<Value>(&calls[0].function.arguments).unwrap(), json!({"city": "Paris"}));
        assert_eq!(calls[1].function.arguments, "{}");
        // Unclosed at the end, arguments as a string.
        let (_, calls) = t.parse_calls("<tool_call>{\"name\": \"now\", \"arguments\": \"{}\"}").unwrap();
        assert_eq!(calls[0].function.name, "now");
        // Without tags, as Qwen2.5-Coder-0.5B answers: the whole text is calls.
        let (content, calls) = t.parse_calls(" {\"name\": \"now\", \"arguments\": {}}\n{\"name\": \"now\"}\n").unwrap();
        assert_eq!((content.as_str(), calls.len()), ("", 2));
        let (_, calls) = t.parse_calls("```json\n{\"name\": \"now\"}\n```").unwrap();
        assert_eq!(calls.len(), 1);
        for text in [
            "no call here",
            "<tool_call>{\"name\": \"fly\"}</tool_call>",
            "<tool_call>{not json</tool_call>",
            "{\"name\": \"now\"} and more",
            "{\"city\": \"Paris\"}",
        ] {
            assert!(t.parse_calls(text).is_none(), "{text}");
        }
    }

    #[test]
    fn forcing_choices_make_a_grammar_of_the_allowed_functions() {
        assert!(tools(Value::Null).unwrap().unwrap().grammar("<a>", "<b>").is_none());
        let named = json!({"type": "function", "function": {"name": "get_weather"}});
        let g = tools(named).unwrap().unwrap().grammar("<[7]>", "<[8]>").unwrap();
        assert!(g.starts_with("start: <[7]> \"\\n\" call \"\\n\" <[8]>\ncall: %json {"), "{g}");
        assert!(g.contains("\"const\":\"get_weather\"") && !g.contains("anyOf"), "{g}");
        let g = tools(json!("required")).unwrap().unwrap().grammar("\"<tool_call>\"", "\"</tool_call>\"").unwrap();
        assert!(g.contains("anyOf") && g.contains("\"const\":\"now\""), "{g}");
    }

    #[test]
    fn assistant_tool_calls_become_the_templates_objects() {
        let calls =
            json!([{"id": "c1", "type": "function", "function": {"name": "now", "arguments": "{\"tz\": \"UTC\"}"}}]);
        assert_eq!(
            template_calls(calls, "m").unwrap(),
            json!([{"type": "function", "function": {"name": "now", "arguments": {"tz": "UTC"}}}])
        );
        assert!(template_calls(json!([{"id": "x"}]), "m").is_err());
        assert!(template_calls(json!("x"), "m").is_err());
    }
}
