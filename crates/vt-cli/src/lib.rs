//! The `vt` command's library half: the OpenAI-compatible server (so tests can run it in-process)
//! and the benchmark driver.

pub mod bench;
pub mod hub;
pub mod server;
