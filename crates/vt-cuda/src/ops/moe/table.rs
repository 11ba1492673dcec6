//! The expert table every MoE path reads.
//!
//! The table is resident state derived from the experts, built on first use and kept in the
//! `MoeExperts`' own `ResidentSlot`, as vt-cpu does: a device array of `WeightDesc` (gate, up,
//! down) per expert, pointing at the experts' own weights, that the kernels index by expert id.
//! The kernels read gate row u and up row u together as one SwiGLU unit, so no fused copy is
//! needed; NVFP4 experts are read in their own (tiled) storage by every kernel, so they need no
//! other copy either.

use vt_core::{Error, MoeExperts, Result};

use crate::alloc::CudaBuffer;
use crate::device::CudaBackend;
use crate::weight::WeightDesc;

pub struct CudaExpertTable {
    /// `[experts, 3]` `WeightDesc`s: gate, up, down.
    table: CudaBuffer,
}

impl CudaExpertTable {
    /// Device address of the `[experts, 3]` `WeightDesc` array.
    pub(crate) fn descs(&self) -> u64 {
        self.table.ptr()
    }
}

/// The experts' table, built into their resident slot on first use.
pub(crate) fn expert_table<'e>(b: &CudaBackend, experts: &'e MoeExperts<CudaBackend>) -> Result<&'e CudaExpertTable> {
    experts.resident.get_or_try_init(b, || build_table(b, experts))
}

fn build_table(b: &CudaBackend, experts: &MoeExperts<CudaBackend>) -> Result<CudaExpertTable> {
    let mut descs = Vec::with_capacity(experts.experts.len());
    for (e, ex) in experts.experts.iter().enumerate() {
        let [gate, up, down] = [&ex.gate, &ex.up, &ex.down].map(|w| WeightDesc::of(w, "moe"));
        let (gate, up) = (gate?, up?);
        if gate.kind != up.kind {
            return Err(Error::tensor(format!("expert {e}"), "gate and up projections must share one storage format"));
        }
        descs.push([gate, up, down?]);
    }
    Ok(CudaExpertTable { table: b.upload_slice(&descs)? })
}
