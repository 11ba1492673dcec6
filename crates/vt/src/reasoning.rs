//! `<think>...</think>` reasoning split from the answer, streamed or not (Qwen3, Qwen3.5/3.6 and
//! Laguna all write it so). A prompt whose template opened the block (thinking on: it ends with
//! `<think>`) starts in reasoning; otherwise output that begins with `<think>` does. Text that
//! may be the start of a tag is held back until it is known not to be one.

const OPEN: &str = "<think>";
const CLOSE: &str = "</think>";

/// Whether a rendered prompt leaves a reasoning block open for the model to continue.
pub fn prompt_opens_reasoning(prompt: &str) -> bool {
    prompt.rfind(OPEN).is_some_and(|open| prompt.rfind(CLOSE).is_none_or(|close| close < open))
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// Nothing seen yet: the output may still open a block.
    Start,
    Reasoning,
    Content,
}

/// Splits streamed text into reasoning and content.
pub struct ReasoningParser {
    state: State,
    buf: String,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Split {
    pub reasoning: String,
    pub content: String,
}

impl ReasoningParser {
    pub fn new(prompt_open: bool) -> Self {
        ReasoningParser { state: if prompt_open { State::Reasoning } else { State::Start }, buf: String::new() }
    }

    pub fn push(&mut self, text: &str) -> Split {
        self.buf.push_str(text);
        let mut out = Split::default();
        loop {
            match self.state {
                State::Start => {
                    let lead = self.buf.trim_start();
                    if let Some(rest) = lead.strip_prefix(OPEN) {
                        self.buf = rest.to_string();
                        self.state = State::Reasoning;
                    } else if OPEN.starts_with(lead) {
                        break; // maybe `<think>`, not yet complete
                    } else {
                        self.state = State::Content;
                    }
                }
                State::Reasoning => {
                    if let Some(at) = self.buf.find(CLOSE) {
                        out.reasoning.push_str(&self.buf[..at]);
                        self.buf.drain(..at + CLOSE.len());
                        self.state = State::Content;
                        continue;
                    }
                    let hold = (1..CLOSE.len()).rev().find(|&k| self.buf.ends_with(&CLOSE[..k])).unwrap_or(0);
                    out.reasoning.extend(self.buf.drain(..self.buf.len() - hold));
                    break;
                }
                State::Content => {
                    out.content.push_str(&std::mem::take(&mut self.buf));
                    break;
                }
            }
        }
        out
    }

    /// Whatever is held back, once generation ends.
    pub fn finish(&mut self) -> Split {
        let rest = std::mem::take(&mut self.buf);
        match self.state {
            State::Reasoning => Split { reasoning: rest, content: String::new() },
            State::Start | State::Content => Split { reasoning: String::new(), content: rest },
        }
    }

    /// Whether the output is past its reasoning (or never had any).
    pub fn in_content(&self) -> bool {
        self.state == State::Content
    }
}
