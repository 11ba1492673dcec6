//! What the engine tests share: a sink that keeps a request's events.

use std::sync::{Arc, Mutex};

use vt::Event;

pub type Log = Arc<Mutex<Vec<Event>>>;

/// A sink and the log its events go to.
pub fn collect() -> (Log, vt::Sink) {
    let log: Log = Arc::default();
    let l = log.clone();
    (
        log,
        Box::new(move |e| {
            l.lock().unwrap().push(e);
            true
        }),
    )
}
