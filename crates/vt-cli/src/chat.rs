//! `vt chat`: a terminal conversation through the model's chat template, with line editing and
//! history (rustyline). Ctrl-C during a reply stops it and keeps the conversation; at the prompt
//! it clears the line; Ctrl-D or an empty line ends.

use std::io::Write;
use std::ops::ControlFlow;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use rustyline::error::ReadlineError;
use vt::{Backend, ChatMessage, Detokenizer, GenerateOptions, Model, Tokenizer};

pub fn run<B: Backend>(
    m: &Model<B>,
    tok: &Tokenizer,
    opts: GenerateOptions,
    ctx: usize,
) -> Result<(), Box<dyn std::error::Error>> {
    // While a reply runs the terminal is in cooked mode and Ctrl-C is SIGINT: it raises this flag
    // instead of ending the process. At the prompt rustyline reads Ctrl-C as a key.
    let interrupted = Arc::new(AtomicBool::new(false));
    let flag = interrupted.clone();
    ctrlc::set_handler(move || flag.store(true, Ordering::Relaxed))?;
    let mut editor = rustyline::DefaultEditor::new()?;
    let mut messages: Vec<ChatMessage> = Vec::new();
    loop {
        let line = match editor.readline("> ") {
            Ok(line) => line,
            Err(ReadlineError::Interrupted) => continue,
            Err(ReadlineError::Eof) => return Ok(()),
            Err(e) => return Err(e.into()),
        };
        if line.trim().is_empty() {
            return Ok(());
        }
        let _ = editor.add_history_entry(line.as_str());
        messages.push(ChatMessage { role: "user".into(), content: line.trim_end().to_string() });
        let ids = tok.encode(&tok.apply_chat_template(&messages, true)?, false)?;
        if ids.len() >= ctx {
            messages.pop();
            eprintln!("[the conversation would have {} tokens; the model's context is {ctx}]", ids.len());
            continue;
        }
        let turn = GenerateOptions { max_new_tokens: opts.max_new_tokens.min(ctx - ids.len()), ..opts.clone() };
        let mut detok = Detokenizer::new();
        let mut reply = String::new();
        interrupted.store(false, Ordering::Relaxed);
        vt::generate_with(m, &ids, &turn, |id| {
            let delta = detok.push(tok, id).unwrap_or_default();
            reply.push_str(&delta);
            print!("{delta}");
            let _ = std::io::stdout().flush();
            if interrupted.load(Ordering::Relaxed) {
                ControlFlow::Break(())
            } else {
                ControlFlow::Continue(())
            }
        })?;
        reply.push_str(&detok.finish(tok)?);
        if interrupted.swap(false, Ordering::Relaxed) {
            print!(" [stopped]");
        }
        println!();
        messages.push(ChatMessage { role: "assistant".into(), content: reply });
    }
}
