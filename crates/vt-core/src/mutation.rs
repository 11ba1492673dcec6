//! THE ORIGINAL BUG, kept only as the lifetime tests' mutation arm (feature
//! `mutation-address-keyed-cache`). Derived state lives in a process-wide map keyed by the
//! owner's storage address, so a new weight placed at a dropped weight's address reads the dropped
//! weight's state, and the map keeps that state alive forever. The lifetime tests must fail with
//! this compiled in; CI proves they do. Never enable it anywhere else.

use std::any::Any;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::Result;

type Derived = Arc<dyn Any + Send + Sync>;

static ADDRESS_KEYED_CACHE: Mutex<Option<HashMap<usize, Derived>>> = Mutex::new(None);

pub(crate) fn address_keyed_lookup(addr: usize, build: impl FnOnce() -> Result<Derived>) -> Result<Derived> {
    let mut guard = ADDRESS_KEYED_CACHE.lock().unwrap_or_else(|p| p.into_inner());
    let map = guard.get_or_insert_with(HashMap::new);
    if let Some(hit) = map.get(&addr) {
        return Ok(hit.clone());
    }
    let built = build()?;
    map.insert(addr, built.clone());
    Ok(built)
}
