//! The expert table every MoE path reads.
//!
//! The table is resident state derived from the experts, built on first use and kept in the
//! `MoeExperts`' own `ResidentSlot`, as vt-cpu does: a device array of `WeightDesc` (gate, up,
//! down) per expert, pointing at the experts' own weights, that the kernels index by expert id.
//! The kernels read gate row u and up row u together as one SwiGLU unit, so no fused copy is
//! needed. NVFP4 experts also get, at their first grouped prefill, a second array over
//! tensor-core repacked copies of the same matrices (w4a16.rs), kept in the same table.

use std::sync::OnceLock;

use vt_core::{Error, MoeExperts, Result};

use crate::alloc::CudaBuffer;
use crate::device::CudaBackend;
use crate::w4a16::PackedExperts;
use crate::weight::WeightDesc;

pub struct CudaExpertTable {
    /// `[experts, 3]` `WeightDesc`s: gate, up, down.
    table: CudaBuffer,
    /// The same, on the host (what the tensor-core layout is derived from).
    host: Vec<[WeightDesc; 3]>,
    /// NVFP4 experts in the tensor-core layout, built at the first grouped prefill.
    packed: OnceLock<PackedExperts>,
}

impl CudaExpertTable {
    /// Device address of the `[experts, 3]` `WeightDesc` array.
    pub(crate) fn descs(&self) -> u64 {
        self.table.ptr()
    }

    /// The NVFP4 experts' repacked table (w4a16.rs), built on first use and kept with this one.
    /// Concurrent first uses may both build; one is kept (the other's buffers free in stream
    /// order, after its repack ran).
    pub(crate) fn packed(&self, b: &CudaBackend, inter: usize, hidden: usize) -> Result<&PackedExperts> {
        if let Some(p) = self.packed.get() {
            return Ok(p);
        }
        let built = PackedExperts::new(b, &self.host, inter, hidden)?;
        Ok(self.packed.get_or_init(|| built))
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
    Ok(CudaExpertTable { table: b.upload_slice(&descs)?, host: descs, packed: OnceLock::new() })
}
