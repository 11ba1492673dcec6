//! The `vt` command's library half: the OpenAI-compatible server, so tests can run it in-process.

pub mod server;
