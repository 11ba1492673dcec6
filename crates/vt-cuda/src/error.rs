//! vt-cuda's errors: every failure is an `Error::backend("cuda", ...)` naming the op, the kernel or
//! the driver call that failed.

use cudarc::driver::DriverError;
use vt_core::{Error, Result};

pub(crate) fn err(reason: impl Into<String>) -> Error {
    Error::backend("cuda", reason)
}

/// `Ok` when `cond` holds, else an error naming `op` and `what` went wrong.
pub(crate) fn check(cond: bool, op: &str, what: impl FnOnce() -> String) -> Result<()> {
    if cond {
        Ok(())
    } else {
        Err(err(format!("{op}: {}", what())))
    }
}

/// A failed driver call, named by `what`.
pub(crate) fn driver_err(what: &str, e: DriverError) -> Error {
    err(format!("{what}: {e:?}"))
}
