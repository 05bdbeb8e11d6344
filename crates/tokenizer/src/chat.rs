//! Chat templates: render a conversation with the model's Hugging Face Jinja template
//! (`tokenizer.chat_template`), as `transformers`' `apply_chat_template` does.
//!
//! The environment matches Hugging Face's: `trim_blocks` and `lstrip_blocks` on, the variables
//! `messages`, `add_generation_prompt`, `bos_token`, `eos_token`, the function `raise_exception(msg)`,
//! and Python string/dict/list methods (`.strip()`, `.startswith()`, `.items()`…) through
//! `minijinja-contrib`'s pycompat layer, and `tojson` as `transformers` defines it (Python's
//! `json.dumps` with `ensure_ascii=False`: `", "` and `": "` separators, keys in insertion order,
//! `indent=` and `sort_keys=` honoured; no HTML escaping).
//!
//! Templates come with model files from anyone, so a rendering is bounded: [`MAX_FUEL`] instructions (loops),
//! minijinja's recursion limit (macros), [`MAX_TEMPLATE_BYTES`] of source and an output limit. Not bounded: a
//! template that doubles a string in every step (`{% set x = x ~ x %}` thirty times) or concatenates a list
//! repeated a trillion times builds gigabytes in a few instructions — minijinja limits `*` on strings but not
//! concatenation or list repetition, and no hook sees a value's size (fuzz/README.md, "Known limit").

use crate::TokenizerError;
use minijinja::value::{Kwargs, ValueKind};
use minijinja::{context, Environment, Error, ErrorKind, Value};
use serde::Serialize;

/// One chat message.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Message {
    /// `system`, `user`, `assistant`, …
    pub role: String,
    /// The message text.
    pub content: String,
    /// An assistant message's tool calls, as chat templates read them (`[{"type": "function", "function":
    /// {"name": …, "arguments": {…}}}]`, arguments an object); absent from the template's view when `None`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<serde_json::Value>,
}

impl Message {
    /// A message with the given role and content.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Message {
        Message { role: role.into(), content: content.into(), tool_calls: None }
    }
}

/// Whether `template` renders the `tools` variable (a tool-aware template, such as Qwen2.5's).
pub fn template_supports_tools(template: &str) -> bool {
    template.contains("tools")
}

/// Renders `messages` with `template`. With `add_generation_prompt`, the template appends the
/// assistant turn's opening (e.g. `<|im_start|>assistant\n`).
pub fn render(
    template: &str,
    messages: &[Message],
    add_generation_prompt: bool,
    bos_token: &str,
    eos_token: &str,
) -> Result<String, TokenizerError> {
    render_with_tools(template, messages, None, add_generation_prompt, bos_token, eos_token)
}

/// [`render`] with `tools` (OpenAI's `tools` array: `[{"type": "function", "function": {"name", "description",
/// "parameters"}}]`) as the template's `tools` variable.
pub fn render_with_tools(
    template: &str,
    messages: &[Message],
    tools: Option<&serde_json::Value>,
    add_generation_prompt: bool,
    bos_token: &str,
    eos_token: &str,
) -> Result<String, TokenizerError> {
    let mut env = Environment::new();
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function("raise_exception", |message: String| -> Result<String, Error> {
        Err(Error::new(ErrorKind::InvalidOperation, message))
    });
    env.add_filter("tojson", tojson);
    env.set_fuel(Some(MAX_FUEL));
    if template.len() > MAX_TEMPLATE_BYTES {
        return Err(TokenizerError::Template(format!(
            "the chat template is {} bytes; at most {MAX_TEMPLATE_BYTES} are accepted",
            template.len()
        )));
    }
    env.add_template("chat", template).map_err(template_error)?;
    let tmpl = env.get_template("chat").map_err(template_error)?;
    let input: usize = messages.iter().map(|m| m.role.len() + m.content.len()).sum::<usize>()
        + tools.map_or(0, |t| t.to_string().len());
    let mut out = Bounded { text: Vec::new(), limit: MAX_RENDERED_BASE + 4 * input, full: false };
    let rendered = tmpl.render_captured_to(
        context! {
            messages => messages,
            tools => tools.map(Value::from_serialize),
            add_generation_prompt => add_generation_prompt,
            bos_token => bos_token,
            eos_token => eos_token,
        },
        &mut out,
    );
    if out.full {
        return Err(TokenizerError::Template(format!(
            "the chat template's output passed {} bytes for {input} bytes of messages",
            out.limit
        )));
    }
    rendered.map_err(template_error)?;
    String::from_utf8(out.text).map_err(|_| TokenizerError::Template("the chat template wrote invalid UTF-8".into()))
}

/// The most template instructions one rendering may run: real chat templates take a few hundred per message,
/// a hostile one (`{% for i in range(99999) %}{% for j in range(99999) %}`) is stopped in well under a second.
pub const MAX_FUEL: u64 = 5_000_000;
/// The largest template source accepted (real ones are a few KB; Qwen2.5's with tools is under 3 KB).
pub const MAX_TEMPLATE_BYTES: usize = 1 << 20;
/// A rendering may write this much more than 4× the messages' own bytes.
pub const MAX_RENDERED_BASE: usize = 1 << 20;

/// The rendering's output, refusing to grow past `limit`.
struct Bounded {
    text: Vec<u8>,
    limit: usize,
    full: bool,
}

impl std::io::Write for Bounded {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.text.len() + buf.len() > self.limit {
            self.full = true;
            return Err(std::io::Error::other("the chat template's output is too long"));
        }
        self.text.extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// `json.dumps(value, ensure_ascii=False, indent=indent, sort_keys=sort_keys)`.
fn tojson(value: Value, kwargs: Kwargs) -> Result<String, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    // accepted for compatibility; the output is always ensure_ascii=False with default separators
    let _: Option<Value> = kwargs.get("ensure_ascii")?;
    let _: Option<Value> = kwargs.get("separators")?;
    kwargs.assert_all_used()?;
    let mut out = String::new();
    write_json(&value, indent, sort_keys.unwrap_or(false), 0, &mut out)?;
    Ok(out)
}

fn write_json(
    value: &Value,
    indent: Option<usize>,
    sort_keys: bool,
    depth: usize,
    out: &mut String,
) -> Result<(), Error> {
    let newline = |out: &mut String, depth: usize| {
        if let Some(width) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(width * depth));
        }
    };
    let item_separator = if indent.is_some() { "," } else { ", " };
    match value.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => out.push_str(&value.to_string()),
        ValueKind::String | ValueKind::Bytes => {
            let text = value.as_str().map(str::to_owned).unwrap_or_else(|| value.to_string());
            out.push_str(
                &serde_json::to_string(&text).map_err(|e| Error::new(ErrorKind::BadSerialization, e.to_string()))?,
            );
        }
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_separator);
                }
                newline(out, depth + 1);
                write_json(item, indent, sort_keys, depth + 1, out)?;
            }
            if !items.is_empty() {
                newline(out, depth);
            }
            out.push(']');
        }
        ValueKind::Map => {
            let mut keys: Vec<Value> = value.try_iter()?.collect();
            if sort_keys {
                keys.sort();
            }
            out.push('{');
            for (i, key) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_separator);
                }
                newline(out, depth + 1);
                let name = key.as_str().map(str::to_owned).unwrap_or_else(|| key.to_string());
                out.push_str(
                    &serde_json::to_string(&name)
                        .map_err(|e| Error::new(ErrorKind::BadSerialization, e.to_string()))?,
                );
                out.push_str(": ");
                write_json(&value.get_item(key)?, indent, sort_keys, depth + 1, out)?;
            }
            if !keys.is_empty() {
                newline(out, depth);
            }
            out.push('}');
        }
        _ => out.push_str(&serde_json::to_string(&value.to_string()).unwrap_or_default()),
    }
    Ok(())
}

fn template_error(e: Error) -> TokenizerError {
    let mut message = e.to_string();
    if let Some(detail) = e.detail() {
        if !message.contains(detail) {
            message = format!("{message}: {detail}");
        }
    }
    TokenizerError::Template(message)
}

#[cfg(test)]
mod tests {
    use super::*;

    const CHATML: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    #[test]
    fn chatml() {
        let out = render(CHATML, &[Message::new("user", "Hi")], true, "", "").unwrap();
        assert_eq!(out, "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
    }

    #[test]
    fn python_methods_raise_exception_and_trim_blocks() {
        let template = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system') }}{% endif %}\n{% for m in messages %}\n[{{ m['content'].strip() | upper }}]{{ eos_token }}\n{% endfor %}";
        let out = render(template, &[Message::new("user", "  hi  ")], false, "<s>", "</s>").unwrap();
        assert_eq!(out, "[HI]</s>\n", "as Python's jinja2 with trim_blocks and lstrip_blocks");
        let err = render(template, &[Message::new("system", "x")], false, "", "").unwrap_err();
        assert!(err.to_string().contains("no system"), "{err}");
        assert!(matches!(render("{% if %}", &[], false, "", ""), Err(TokenizerError::Template(_))));
    }

    #[test]
    fn tojson_like_python_json_dumps() {
        let messages = [Message::new("user", "a\"bé\n")];
        let out = render("{{ messages[0] | tojson }}", &messages, false, "", "").unwrap();
        assert_eq!(out, r#"{"role": "user", "content": "a\"bé\n"}"#);
        let out = render("{{ messages | tojson(indent=2) }}", &messages[..0], false, "", "").unwrap();
        assert_eq!(out, "[]");
        let template = "{{ {'a': [1, 2.5, none, true], 'b': {}} | tojson(indent=2) }}";
        let out = render(template, &[], false, "", "").unwrap();
        assert_eq!(out, "{\n  \"a\": [\n    1,\n    2.5,\n    null,\n    true\n  ],\n  \"b\": {}\n}");
    }
}
