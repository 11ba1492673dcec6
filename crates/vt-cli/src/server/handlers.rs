//! The endpoints' handlers: `/v1/models`, `/v1/completions`, `/v1/chat/completions`.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::response::Response;
use axum::Json;
use serde_json::{json, Map, Value};
use tokio::sync::mpsc::UnboundedReceiver;
use vt::grammar::ConstraintSpec;
use vt::{ChatInput, Tokenizer};

use super::agent::{self, Options, ToolChoice};
use super::choice::{start, ChatReading, Out, Pipeline};
use super::error::ApiError;
use super::request::{parse, prepare, Common, OneOrMany, Prepared, Prompt};
use super::respond::{respond, Kind, Shape};
use super::{now, AppState};

fn model_card(s: &AppState) -> Value {
    json!({"id": s.model_id, "object": "model", "created": 0, "owned_by": "vt", "max_model_len": s.engine.config().max_context})
}

pub async fn models(State(s): State<Arc<AppState>>) -> Json<Value> {
    Json(json!({"object": "list", "data": [model_card(&s)]}))
}

pub async fn model(State(s): State<Arc<AppState>>, Path(id): Path<String>) -> Result<Json<Value>, ApiError> {
    if id != s.model_id {
        return Err(ApiError::not_found(format!(
            "the model `{id}` does not exist; this server serves `{}`",
            s.model_id
        )));
    }
    Ok(Json(model_card(&s)))
}

fn tokenizer(s: &AppState) -> Result<&Tokenizer, ApiError> {
    s.tokenizer.as_ref().ok_or_else(|| ApiError::bad("this model has no tokenizer.json; send prompts as token ids"))
}

/// The body as a JSON object, its fields checked against `allowed`, and the shared fields.
pub fn body(bytes: &Bytes, allowed: &[&str]) -> Result<(Map<String, Value>, Common), ApiError> {
    let map: Map<String, Value> = parse(bytes)?;
    agent::check_fields(&map, allowed).map_err(ApiError::bad)?;
    let common: Common = serde_json::from_value(Value::Object(map.clone()))
        .map_err(|e| ApiError::bad(format!("invalid request body: {e}")))?;
    Ok((map, common))
}

/// Submits `p` with its `n` choices (one prefill; choice i samples with seed + i), each read by
/// `pipe(i)`.
fn start_choices(
    s: &Arc<AppState>,
    p: Prepared,
    o: &Options,
    constraint: Option<ConstraintSpec>,
    pipe: impl Fn(usize) -> Pipeline,
) -> Result<Vec<UnboundedReceiver<Out>>, ApiError> {
    let grammar = match constraint {
        None => None,
        Some(spec) => {
            let compiler = s.agent.grammar.as_ref().ok_or_else(|| {
                ApiError::bad("constrained output (response_format, tool_choice) needs the model's tokenizer.json")
            })?;
            Some(compiler.compile(&spec).map_err(|e| ApiError::bad(e.to_string()))?)
        }
    };
    let mut req = p.req;
    req.logprobs = o.logprobs;
    req.sampling.logit_bias = o.logit_bias.clone();
    req.stop_token_ids.extend(&o.stop_token_ids);
    req.grammar = grammar;
    start(s, req, (0..o.n).map(pipe).collect())
}

fn shape(s: &AppState, kind: Kind, prompt_tokens: usize, o: &Options, echo: Option<String>) -> Shape {
    let prefix = if kind == Kind::Chat { "chatcmpl" } else { "cmpl" };
    Shape {
        kind,
        id: format!("{prefix}-{}", s.next_id.fetch_add(1, Ordering::Relaxed)),
        created: now(),
        model: s.model_id.clone(),
        prompt_tokens,
        include_usage: o.include_usage,
        token_ids: o.token_ids,
        echo,
    }
}

pub async fn completions(State(s): State<Arc<AppState>>, bytes: Bytes) -> Result<Response, ApiError> {
    let (map, common) = body(&bytes, agent::COMPLETION_FIELDS)?;
    let prompt: Prompt = serde_json::from_value(map.get("prompt").cloned().unwrap_or(Value::Null))
        .map_err(|_| ApiError::bad("prompt must be a string or a list of token ids"))?;
    let (prompt, text) = match prompt {
        Prompt::Ids(ids) => (ids, None),
        Prompt::Text(OneOrMany::One(t)) => {
            (tokenizer(&s)?.encode(&t, true).map_err(|e| ApiError::bad(e.to_string()))?, Some(t))
        }
        Prompt::Text(OneOrMany::Many(v)) if v.len() == 1 => {
            (tokenizer(&s)?.encode(&v[0], true).map_err(|e| ApiError::bad(e.to_string()))?, v.into_iter().next())
        }
        Prompt::Text(OneOrMany::Many(_)) => return Err(ApiError::bad("only one prompt per request is supported")),
    };
    let o = agent::options(&map, false, s.engine.spec().vocab).map_err(ApiError::bad)?;
    let constraint = agent::constraint(&map, None, false).map_err(ApiError::bad)?;
    let echo = match (o.echo, text, &s.tokenizer) {
        (false, _, _) => None,
        (true, Some(t), _) => Some(t),
        (true, None, Some(tok)) => Some(tok.decode(&prompt).map_err(|e| ApiError::bad(e.to_string()))?),
        (true, None, None) => Some(String::new()),
    };
    let prompt_len = prompt.len();
    // OpenAI's default for completions.
    let p = prepare(&s, common, prompt, 16)?;
    let stream = p.stream;
    let stops = p.stops.clone();
    let choices = start_choices(&s, p, &o, constraint, |_| Pipeline::text(stops.clone()))?;
    Ok(respond(choices, stream, shape(&s, Kind::Completion, prompt_len, &o, echo)).await)
}

pub async fn chat_completions(State(s): State<Arc<AppState>>, bytes: Bytes) -> Result<Response, ApiError> {
    let (map, common) = body(&bytes, agent::CHAT_FIELDS)?;
    let messages = match map.get("messages") {
        Some(Value::Array(m)) if !m.is_empty() => agent::normalize_messages(m).map_err(ApiError::bad)?,
        Some(Value::Array(_)) => return Err(ApiError::bad("messages must not be empty")),
        _ => return Err(ApiError::bad("messages must be a list of messages")),
    };
    let tools = agent::tools(&map).map_err(ApiError::bad)?;
    let kwargs = match map.get("chat_template_kwargs") {
        None | Some(Value::Null) => Map::new(),
        Some(Value::Object(k)) => k.clone(),
        Some(_) => return Err(ApiError::bad("chat_template_kwargs must be an object")),
    };
    let flag = |key: &str, default: bool| match map.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(ApiError::bad(format!("{key} must be a boolean"))),
    };
    let continue_final_message = flag("continue_final_message", false)?;
    let input = ChatInput {
        messages: &messages,
        tools: (!tools.tools.is_empty()).then_some(tools.tools.as_slice()),
        add_generation_prompt: flag("add_generation_prompt", !continue_final_message)?,
        continue_final_message,
        kwargs: &kwargs,
    };
    let tok = tokenizer(&s)?;
    // The template already holds any BOS the model wants.
    let prompt =
        tok.chat_prompt(&input, s.agent.special_tokens_in_messages).map_err(|e| ApiError::bad(e.to_string()))?;
    let reasoning_open = s.agent.reasoning && vt::reasoning::prompt_opens_reasoning(&prompt.text);
    let o = agent::options(&map, true, s.engine.spec().vocab).map_err(ApiError::bad)?;
    let constraint = agent::constraint(&map, Some(&tools), reasoning_open).map_err(ApiError::bad)?;
    let prompt_len = prompt.ids.len();
    let p = prepare(&s, common, prompt.ids, s.chat_max_tokens)?;
    let stream = p.stream;
    let stops = p.stops.clone();
    let shape = shape(&s, Kind::Chat, prompt_len, &o, None);
    let reading = |i: usize| ChatReading {
        reasoning: s.agent.reasoning.then_some(reasoning_open),
        tool_format: s.agent.tool_format,
        tools: (tools.choice != ToolChoice::None).then(|| tools.clone()),
        call_id: format!("call_{}_{i}_", shape.id),
    };
    let choices = start_choices(&s, p, &o, constraint, |i| Pipeline::chat(stops.clone(), &reading(i)))?;
    Ok(respond(choices, stream, shape).await)
}
