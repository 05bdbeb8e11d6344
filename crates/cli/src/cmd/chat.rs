//! `specee chat [-m MODEL] [--mode M] [--system TEXT] [-c CTX] [-n N] [sampling flags]`: a conversation in the
//! terminal with the model's chat template. Answers stream as they are decoded; the KV cache is kept between
//! turns ([`engine::conversation`]), so a turn runs only its new tokens. Line editing and history come from
//! `rustyline` when stdin is a terminal; otherwise plain lines are read, so scripts and tests can drive it.
//!
//! Ctrl-C stops the answer being written (the part written stays in the conversation) and returns to the prompt;
//! at the prompt it clears the line. Ctrl-D (or the end of piped input) leaves. Slash commands: `/help`.

use super::{ModeArgs, ModelArgs, Runner, SamplingArgs};
use engine::conversation::{ChatDecoder, Conversation, Turn};
use engine::speculative::Mode;
use engine::GenerateParams;
use std::io::{BufRead, IsTerminal, Write};
use std::sync::atomic::{AtomicBool, Ordering};

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub mode: ModeArgs,
    /// System prompt (the first message of the conversation; kept when old turns are dropped).
    #[arg(long)]
    pub system: Option<String>,
    /// Context size in tokens: the conversation and the answer being written must fit in it.
    #[arg(short = 'c', long = "ctx-size", default_value_t = 4096)]
    pub ctx: usize,
    /// Most tokens one answer may have.
    #[arg(short = 'n', long = "n-predict", default_value_t = 512)]
    pub n: usize,
    #[command(flatten)]
    pub sampling: SamplingArgs,
}

const HELP: &str = "\
commands:
  /reset         forget the conversation (the system prompt stays)
  /stats         speed, τ and layers per token of the last answer
  /system TEXT   set the system prompt (/system alone removes it)
  /save FILE     write the conversation as OpenAI-style JSON messages
  /load FILE     read a conversation written by /save (or any [{role, content}, …] list)
  /help          this list
  Ctrl-C stops an answer; Ctrl-D leaves.";

/// Set while an answer is being generated: Ctrl-C then stops it instead of ending the program.
static GENERATING: AtomicBool = AtomicBool::new(false);
/// Set by Ctrl-C during an answer.
static STOP: AtomicBool = AtomicBool::new(false);

pub fn run(a: Args) -> anyhow::Result<()> {
    let (eng, model_path) = a.model.load_with_path()?;
    anyhow::ensure!(a.ctx >= 16, "-c/--ctx-size {} is too small for a conversation", a.ctx);
    anyhow::ensure!(a.n >= 1, "-n/--n-predict must be at least 1");
    if eng.tokenizer.chat_template().is_none() {
        anyhow::bail!("{} has no chat template, so it cannot chat (use `specee generate`)", model_path.display());
    }
    let params = GenerateParams { max_tokens: a.n, sampling: a.sampling.params(), ..Default::default() };
    let mut mode_args = a.mode.clone();
    let auto = || engine::speculative::auto_mode(&model_path, a.mode.draft.as_deref(), &params.sampling);
    let mode = *mode_args.mode.get_or_insert_with(auto);
    let mut runner = mode_args.runner(&eng, &model_path)?;
    let threads = a.model.threads();
    // The early-exit setups stay in `runner` (the decoders borrow them); a proposer moves into its decoder.
    let proposer = match &mut runner {
        Runner::Speculative(p) => Some(std::mem::replace(p, engine::speculative::AnyProposer::Dense)),
        _ => None,
    };
    let decoder = match (&runner, proposer) {
        (_, Some(p)) => ChatDecoder::tree(&eng, a.ctx, threads, p, &params),
        (Runner::Specee(setup), _) => ChatDecoder::specee(&eng, a.ctx, threads, setup),
        (Runner::Merged(setup), _) => ChatDecoder::merged(&eng, a.ctx, threads, setup),
        _ => ChatDecoder::dense(&eng, a.ctx, threads),
    };
    if matches!(mode, Mode::Specee | Mode::SpeceeEagle) && !params.sampling.is_greedy() {
        anyhow::bail!("--mode {mode} decodes greedily only (use --temp 0)");
    }
    let mut chat = Conversation::new(&eng, decoder);
    chat.set_system(a.system.as_deref());

    let name = model_path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    eprintln!("specee chat: {name}, mode {mode}, context {} tokens. /help for commands, Ctrl-D to leave.", a.ctx);
    let mut input = Input::new()?;
    // After the line editor, which installs a SIGINT handler of its own (at its prompt it reads Ctrl-C as a key).
    ctrlc::set_handler(|| {
        if GENERATING.load(Ordering::SeqCst) {
            STOP.store(true, Ordering::SeqCst);
        } else {
            // Piped input waiting for a line: nothing to return to.
            std::process::exit(130);
        }
    })?;
    let mut last: Option<Turn> = None;
    while let Some(line) = input.read("> ")? {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        if let Some(command) = line.strip_prefix('/') {
            match slash_command(command, &mut chat, last.as_ref(), mode, eng.model.config.n_layers) {
                Ok(text) => eprintln!("{text}"),
                Err(e) => eprintln!("error: {e}"),
            }
            continue;
        }
        match answer(&mut chat, line, &params) {
            Ok(turn) => last = Some(turn),
            Err(e) => eprintln!("error: {e}"),
        }
    }
    Ok(())
}

/// Streams the answer to `line` to stdout, with notes (dropped turns, a stop, a full context) on stderr.
fn answer(chat: &mut Conversation<'_>, line: &str, params: &GenerateParams) -> Result<Turn, engine::EngineError> {
    STOP.store(false, Ordering::SeqCst);
    GENERATING.store(true, Ordering::SeqCst);
    let mut out = std::io::stdout().lock();
    let result = chat.say(line, params, |piece| {
        let _ = out.write_all(piece.as_bytes());
        let _ = out.flush();
        !STOP.load(Ordering::SeqCst)
    });
    GENERATING.store(false, Ordering::SeqCst);
    let _ = writeln!(out);
    let _ = out.flush();
    drop(out);
    let turn = result?;
    if turn.dropped_messages > 0 {
        eprintln!(
            "(the conversation outgrew the context of {} tokens: its {} oldest messages were dropped, the system \
             prompt kept)",
            chat.ctx(),
            turn.dropped_messages
        );
    }
    match turn.generation.finish {
        engine::FinishReason::Cancelled => eprintln!("(stopped)"),
        engine::FinishReason::ContextFull => eprintln!("(the context is full: the answer was cut; /reset starts over)"),
        engine::FinishReason::Length => eprintln!("(the answer reached -n/--n-predict {} tokens)", params.max_tokens),
        engine::FinishReason::Stop => {}
    }
    Ok(turn)
}

/// Runs `/command`; returns what to print.
fn slash_command(
    command: &str,
    chat: &mut Conversation<'_>,
    last: Option<&Turn>,
    mode: Mode,
    n_layers: usize,
) -> anyhow::Result<String> {
    let (name, arg) = command.split_once(char::is_whitespace).unwrap_or((command, ""));
    let arg = arg.trim();
    match name {
        "help" | "?" => Ok(HELP.into()),
        "reset" => {
            chat.reset();
            Ok("(conversation cleared)".into())
        }
        "system" => {
            chat.set_system((!arg.is_empty()).then_some(arg));
            Ok(if arg.is_empty() { "(system prompt removed)".into() } else { "(system prompt set)".into() })
        }
        "save" => {
            anyhow::ensure!(!arg.is_empty(), "/save needs a file name");
            let json = engine::conversation::messages_json(chat.messages());
            std::fs::write(arg, json + "\n").map_err(|e| anyhow::anyhow!("cannot write {arg}: {e}"))?;
            Ok(format!("(saved {} messages to {arg})", chat.messages().len()))
        }
        "load" => {
            anyhow::ensure!(!arg.is_empty(), "/load needs a file name");
            let json = std::fs::read_to_string(arg).map_err(|e| anyhow::anyhow!("cannot read {arg}: {e}"))?;
            let messages = engine::conversation::parse_messages(&json).map_err(|e| anyhow::anyhow!("{arg}: {e}"))?;
            let n = messages.len();
            chat.set_messages(messages);
            Ok(format!("(loaded {n} messages from {arg}; the next message continues that conversation)"))
        }
        "stats" => Ok(match last {
            None => "(no answer yet)".into(),
            Some(t) => stats_line(t, mode, n_layers),
        }),
        other => anyhow::bail!("unknown command /{other} (try /help)"),
    }
}

/// `/stats`: the last answer's speeds and the mode's counters.
fn stats_line(t: &Turn, mode: Mode, n_layers: usize) -> String {
    let g = &t.generation.timings;
    let mut s = format!(
        "last answer: {} tokens at {:.1} tok/s ({mode}); prompt {} tokens, {} from the cache, the other {} run in \
         {:.1} ms",
        g.decode_tokens,
        g.decode_tokens_per_s(),
        g.prompt_tokens,
        t.reused_tokens,
        g.prompt_tokens - t.reused_tokens,
        1000.0 * g.prompt_seconds
    );
    if let Some(tau) = t.acceptance_length {
        s += &format!("; τ {tau:.2} tokens per target forward");
    }
    let unit = if mode == Mode::SpeceeEagle { "tree forward" } else { "token" };
    s += &format!("; {:.1} of {n_layers} layers per {unit}", t.layers_per_token);
    s
}

/// Lines from the terminal (with editing and history) or from piped stdin.
enum Input {
    Terminal(Box<rustyline::DefaultEditor>),
    Piped(std::io::StdinLock<'static>),
}

impl Input {
    fn new() -> anyhow::Result<Input> {
        if std::io::stdin().is_terminal() {
            Ok(Input::Terminal(Box::new(rustyline::DefaultEditor::new()?)))
        } else {
            Ok(Input::Piped(std::io::stdin().lock()))
        }
    }

    /// The next line; `None` at the end (Ctrl-D, or the end of piped input).
    fn read(&mut self, prompt: &str) -> anyhow::Result<Option<String>> {
        match self {
            Input::Terminal(editor) => loop {
                match editor.readline(prompt) {
                    Ok(line) => {
                        if !line.trim().is_empty() {
                            let _ = editor.add_history_entry(line.as_str());
                        }
                        return Ok(Some(line));
                    }
                    // Ctrl-C at the prompt clears the line, as in a shell.
                    Err(rustyline::error::ReadlineError::Interrupted) => continue,
                    Err(rustyline::error::ReadlineError::Eof) => return Ok(None),
                    Err(e) => return Err(e.into()),
                }
            },
            Input::Piped(stdin) => {
                let mut line = String::new();
                if stdin.read_line(&mut line)? == 0 {
                    return Ok(None);
                }
                Ok(Some(line))
            }
        }
    }
}
