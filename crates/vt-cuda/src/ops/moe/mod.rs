//! The routed-experts block: the fused decode kernels for a few tokens (decode.rs), grouped
//! tensor-core GEMMs for prefill (grouped.rs), and a general path for the rest (general.rs), all
//! reading the expert table (table.rs) and routing as kernels/route.cuh does (routing.rs). The
//! Backend methods `moe` and `moe_block` (backend.rs) choose among them.

pub(crate) mod decode;
pub(crate) mod general;
pub(crate) mod grouped;
mod routing;
mod table;

pub(crate) use table::expert_table;
pub use table::CudaExpertTable;
#[cfg(test)]
pub(crate) use {decode::mirrors as decode_mirrors, routing::mirrors as routing_mirrors};
