//! `ResidentSlot<B>`: state a backend derives from a weight, owned by that weight.
//!
//! The slot is a field of the weight struct it was derived from. It is built on first use, never
//! rebuilt, and dropped with its owner, so derived state can never be read by a weight that merely
//! occupies the same memory later. Nothing here is process-wide.

use std::any::Any;
use std::marker::PhantomData;
use std::sync::{Arc, OnceLock};

use crate::backend::{Device, StepRecording};
use crate::{Error, Result};

type Derived = Arc<dyn Any + Send + Sync>;

pub struct ResidentSlot<B: Device> {
    cell: OnceLock<Derived>,
    /// The backend instance whose weights this slot belongs to; a slot is never read by another.
    backend_id: u64,
    /// Address of the owner's storage. Only the mutation arm keys anything by it.
    #[cfg_attr(not(feature = "mutation-address-keyed-cache"), allow(dead_code))]
    storage_addr: usize,
    _backend: PhantomData<fn() -> B>,
}

impl<B: Device> ResidentSlot<B> {
    /// An empty slot for a weight of `backend` whose storage starts at `storage_addr`.
    pub fn new(backend: &B, storage_addr: usize) -> Self {
        ResidentSlot { cell: OnceLock::new(), backend_id: backend.instance_id(), storage_addr, _backend: PhantomData }
    }

    pub fn is_empty(&self) -> bool {
        self.cell.get().is_none()
    }

    /// The derived state, built by `build` on first use. Concurrent first uses may both build;
    /// exactly one result is kept and every caller sees that one.
    pub fn get_or_try_init<R: Any + Send + Sync>(&self, backend: &B, build: impl FnOnce() -> Result<R>) -> Result<&R>
    where
        B: StepRecording,
    {
        if backend.instance_id() != self.backend_id {
            return Err(Error::backend(
                backend.name(),
                format!(
                    "resident slot of backend instance {} read by instance {}",
                    self.backend_id,
                    backend.instance_id()
                ),
            ));
        }
        let derived = match self.cell.get() {
            Some(d) => d,
            // A recorder's memory and work belong to its recording, not to the weight.
            None if backend.is_recording() => {
                return Err(Error::backend(backend.name(), "a weight's derived state cannot be built while recording"))
            }
            None => {
                let built = self.build(build)?;
                // A racing initialiser may have won; `get_or_init` keeps whichever came first.
                self.cell.get_or_init(|| built)
            }
        };
        derived.downcast_ref::<R>().ok_or_else(|| {
            Error::backend(
                backend.name(),
                format!("resident slot holds another type than {}", std::any::type_name::<R>()),
            )
        })
    }

    #[cfg(not(feature = "mutation-address-keyed-cache"))]
    fn build<R: Any + Send + Sync>(&self, build: impl FnOnce() -> Result<R>) -> Result<Derived> {
        Ok(Arc::new(build()?))
    }

    #[cfg(feature = "mutation-address-keyed-cache")]
    fn build<R: Any + Send + Sync>(&self, build: impl FnOnce() -> Result<R>) -> Result<Derived> {
        crate::mutation::address_keyed_lookup(self.storage_addr, || Ok(Arc::new(build()?)))
    }
}

impl<B: Device> std::fmt::Debug for ResidentSlot<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResidentSlot").field("filled", &!self.is_empty()).field("backend_id", &self.backend_id).finish()
    }
}
