//! One choice's generated tokens turned into what the response carries: text deltas (cut at stop
//! strings), split into reasoning and content, tool calls parsed out of the content (or read from
//! a constrained output), and each token's log-probabilities.

use std::sync::Arc;

use tokio::sync::mpsc::{self, UnboundedReceiver};
use vt::reasoning::ReasoningParser;
use vt::tool_parser::{ToolCall, ToolDelta, ToolFormat, ToolParser};
use vt::{Detokenizer, Event, Finish, Request, StopStrings, TokenLogprobs, Tokenizer};

use super::agent::{constrained_calls, ToolChoice, Tools};
use super::error::ApiError;
use super::metrics::Usage;
use super::AppState;

/// A piece of one choice's output, in order.
#[derive(Debug)]
pub enum Out {
    Reasoning(String),
    Content(String),
    ToolCall {
        index: usize,
        call: ToolCall,
    },
    /// The log-probabilities of generated token `id`, with its text and its alternatives' texts.
    Logprobs {
        id: u32,
        token: String,
        lp: TokenLogprobs,
        top: Vec<String>,
    },
    Done {
        finish: &'static str,
        completion_tokens: usize,
    },
    Error(String),
}

/// How a chat choice's text is read.
pub struct ChatReading {
    /// The prompt left a `<think>` block open (`None`: no reasoning parsing).
    pub reasoning: Option<bool>,
    pub tool_format: ToolFormat,
    pub tools: Option<Tools>,
    /// Prefix of the call ids.
    pub call_id: String,
}

/// A choice's text pipeline.
pub struct Pipeline {
    detok: Detokenizer,
    stops: StopStrings,
    reasoning: Option<ReasoningParser>,
    tools: Option<ToolParser>,
    /// Keep only the first call (`parallel_tool_calls: false`).
    single_call: bool,
    /// A constrained tool choice: the whole content is the calls, read at the end.
    constrained: Option<(ToolChoice, String, String)>,
    generated: usize,
    calls: usize,
}

impl Pipeline {
    /// For completions: text only.
    pub fn text(stops: Vec<String>) -> Self {
        Pipeline {
            detok: Detokenizer::new(),
            stops: StopStrings::new(stops),
            reasoning: None,
            tools: None,
            single_call: false,
            constrained: None,
            generated: 0,
            calls: 0,
        }
    }

    pub fn chat(stops: Vec<String>, r: &ChatReading) -> Self {
        let mut p = Pipeline::text(stops);
        p.reasoning = r.reasoning.map(ReasoningParser::new);
        if let Some(t) = &r.tools {
            p.single_call = !t.parallel;
            match &t.choice {
                ToolChoice::Auto => p.tools = Some(ToolParser::new(r.tool_format, &t.tools, r.call_id.clone())),
                ToolChoice::Required | ToolChoice::Named(_) => {
                    p.constrained = Some((t.choice.clone(), String::new(), r.call_id.clone()))
                }
                ToolChoice::None => {}
            }
        }
        p
    }

    /// The pieces token `id` completes; `Some(true)` in the second place when a stop string ended
    /// the output (the caller then cancels the request).
    pub fn token(&mut self, tok: Option<&Tokenizer>, id: u32, lp: Option<TokenLogprobs>) -> (Vec<Out>, bool) {
        self.generated += 1;
        let mut out = Vec::new();
        if let (Some(lp), Some(t)) = (lp, tok) {
            let text = |id: u32| t.decode_token(id);
            let top = lp.top.iter().map(|&(i, _)| text(i)).collect();
            out.push(Out::Logprobs { id, token: text(id), lp, top });
        }
        let delta = tok.map(|t| self.detok.push(t, id).unwrap_or_default()).unwrap_or_default();
        let (text, stopped) = self.stops.push(&delta);
        self.route(text, &mut out);
        if stopped {
            self.end(true, &mut out);
        }
        (out, stopped)
    }

    /// The rest once the engine is done with the choice (`length`: it hit max_tokens).
    pub fn finish(&mut self, tok: Option<&Tokenizer>, length: bool) -> Vec<Out> {
        let mut out = Vec::new();
        let tail = tok.map(|t| self.detok.finish(t).unwrap_or_default()).unwrap_or_default();
        let (text, stopped) = self.stops.push(&tail);
        self.route(text, &mut out);
        if !stopped {
            let rest = self.stops.finish();
            self.route(rest, &mut out);
        }
        self.end(stopped || !length, &mut out);
        out
    }

    fn route(&mut self, text: String, out: &mut Vec<Out>) {
        if text.is_empty() {
            return;
        }
        let content = match &mut self.reasoning {
            Some(r) => {
                let s = r.push(&text);
                if !s.reasoning.is_empty() {
                    out.push(Out::Reasoning(s.reasoning));
                }
                s.content
            }
            None => text,
        };
        self.content(content, out);
    }

    fn content(&mut self, text: String, out: &mut Vec<Out>) {
        if text.is_empty() {
            return;
        }
        if let Some((_, all, _)) = &mut self.constrained {
            all.push_str(&text);
        } else if let Some(p) = &mut self.tools {
            let deltas = p.push(&text);
            self.deltas(deltas, out);
        } else {
            out.push(Out::Content(text));
        }
    }

    fn deltas(&mut self, deltas: Vec<ToolDelta>, out: &mut Vec<Out>) {
        for d in deltas {
            match d {
                ToolDelta::Content(t) => out.push(Out::Content(t)),
                ToolDelta::Call { index, call } => {
                    if !(self.single_call && index > 0) {
                        out.push(Out::ToolCall { index, call });
                        self.calls += 1;
                    }
                }
            }
        }
    }

    /// Flushes the parsers and sends `Done`; `stop`: it ended on a stop token or string.
    fn end(&mut self, stop: bool, out: &mut Vec<Out>) {
        if let Some(r) = &mut self.reasoning {
            let s = r.finish();
            if !s.reasoning.is_empty() {
                out.push(Out::Reasoning(s.reasoning));
            }
            self.content(s.content, out);
        }
        if let Some(p) = &mut self.tools {
            let deltas = p.finish();
            self.deltas(deltas, out);
        }
        if let Some((choice, all, id)) = self.constrained.take() {
            match constrained_calls(&choice, &all) {
                Some(calls) => {
                    let keep = if self.single_call { 1 } else { calls.len() };
                    for (index, (name, arguments)) in calls.into_iter().take(keep).enumerate() {
                        out.push(Out::ToolCall {
                            index,
                            call: ToolCall { id: format!("{id}{index}"), name, arguments },
                        });
                        self.calls += 1;
                    }
                }
                None => out.push(Out::Content(all)),
            }
        }
        let finish = if self.calls > 0 {
            "tool_calls"
        } else if stop {
            "stop"
        } else {
            "length"
        };
        out.push(Out::Done { finish, completion_tokens: self.generated });
    }
}

/// Submits `req` with one choice per pipeline (they share one prefill; choice `i` samples with
/// seed + i) and runs each pipeline over its choice's events on a task; receiver `i` gets choice
/// `i`'s outputs. Dropping a receiver cancels its choice.
pub fn start(s: &Arc<AppState>, req: Request, pipes: Vec<Pipeline>) -> Result<Vec<UnboundedReceiver<Out>>, ApiError> {
    let prompt_len = req.prompt.len();
    let (senders, receivers): (Vec<_>, Vec<_>) = pipes.iter().map(|_| mpsc::unbounded_channel::<Event>()).unzip();
    let sinks: Vec<vt::Sink> =
        senders.into_iter().map(|tx| Box::new(move |e| tx.send(e).is_ok()) as vt::Sink).collect();
    let cancels = s.engine.submit_choices(req, sinks)?;
    let usage = Usage::current(prompt_len);
    let mut outputs = Vec::with_capacity(pipes.len());
    for ((mut pipe, mut events), cancel) in pipes.into_iter().zip(receivers).zip(cancels) {
        let (out, rx) = mpsc::unbounded_channel();
        outputs.push(rx);
        let (state, usage) = (s.clone(), usage.clone());
        tokio::spawn(async move {
            let mut clock = state.metrics.start_request(prompt_len);
            let tok = state.tokenizer.as_ref();
            let mut logprobs = None;
            while let Some(e) = events.recv().await {
                let (pieces, end) = match e {
                    Event::Logprobs(lp) => {
                        logprobs = Some(lp);
                        continue;
                    }
                    Event::Token(id) => {
                        clock.token();
                        usage.token();
                        let (pieces, stopped) = pipe.token(tok, id, logprobs.take());
                        if stopped {
                            cancel.cancel();
                        }
                        (pieces, stopped)
                    }
                    Event::Done(f) => (pipe.finish(tok, f == Finish::Length), true),
                    Event::Failed(m) => (vec![Out::Error(m)], true),
                };
                for p in pieces {
                    if out.send(p).is_err() {
                        cancel.cancel();
                        return;
                    }
                }
                if end {
                    return;
                }
            }
        });
    }
    Ok(outputs)
}
