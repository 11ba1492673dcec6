//! The `vt` command's library half: the OpenAI-compatible server (so tests can run it in-process)
//! the benchmark driver and the ranks a split model runs on.

pub mod bench;
pub mod hub;
pub mod ranks;
pub mod server;
