//! Tensor checksums checked while the model runs: a loaded model's tensors are hashed on a
//! background thread (in table order, which is roughly the order a forward first reads them),
//! and the generation loop refuses to go on once a corrupt tensor is found. A damaged file is
//! thus an error naming the tensor, not silently wrong text, and the time to the first token
//! does not wait for a full read of a multi-GB file.
//!
//! `CORTIQ_VERIFY=off` skips the check; `CORTIQ_VERIFY=sync` hashes everything before the first
//! token. Either way the check stops at the first bad tensor; `cortiq inspect --verify` lists
//! every one.

use std::sync::{Arc, Condvar, Mutex, Weak};

use crate::model::LoadedModel;

/// A corrupt tensor found by the check.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error(
    "{detail}: the file is damaged (re-download or re-convert it; `cortiq inspect --verify` lists \
     every bad tensor)"
)]
pub struct IntegrityError {
    /// The first bad tensor's name.
    pub tensor: String,
    /// The checksum error, naming the file and the tensor.
    pub detail: String,
}

/// Where the check stands.
#[derive(Debug, Clone, PartialEq)]
pub enum Status {
    /// Not started (or switched off).
    Idle,
    /// Hashing: tensors done of the total.
    Running {
        /// Tensors checked.
        done: usize,
        /// Tensors in the file.
        total: usize,
    },
    /// Every tensor matched its checksum.
    Clean,
    /// At least one did not; the check stops at the first.
    Corrupt(IntegrityError),
}

/// The shared state of one model's check.
#[derive(Debug)]
pub struct Integrity {
    status: Mutex<Status>,
    changed: Condvar,
}

impl Default for Integrity {
    fn default() -> Self {
        Integrity {
            status: Mutex::new(Status::Idle),
            changed: Condvar::new(),
        }
    }
}

impl Integrity {
    /// The current status.
    pub fn status(&self) -> Status {
        self.status
            .lock()
            .map(|s| s.clone())
            .unwrap_or(Status::Idle)
    }

    /// `Err` once a corrupt tensor has been found (cheap: what the generation loop calls).
    pub fn check(&self) -> Result<(), IntegrityError> {
        match self.status() {
            Status::Corrupt(e) => Err(e),
            _ => Ok(()),
        }
    }

    /// Waits for a running check to end; `Err` if it found a corrupt tensor.
    pub fn wait(&self) -> Result<(), IntegrityError> {
        let Ok(mut s) = self.status.lock() else {
            return Ok(());
        };
        while matches!(*s, Status::Running { .. }) {
            s = match self.changed.wait(s) {
                Ok(s) => s,
                Err(_) => return Ok(()),
            };
        }
        match &*s {
            Status::Corrupt(e) => Err(e.clone()),
            _ => Ok(()),
        }
    }

    fn set(&self, status: Status) {
        if let Ok(mut s) = self.status.lock() {
            *s = status;
        }
        self.changed.notify_all();
    }

    /// Starts checking `model` (once; later calls do nothing): on a background thread, or here
    /// and now under `CORTIQ_VERIFY=sync`.
    pub fn start(model: &Arc<LoadedModel>) {
        let integrity = model.integrity();
        let mode = std::env::var("CORTIQ_VERIFY").unwrap_or_default();
        {
            let Ok(mut s) = integrity.status.lock() else {
                return;
            };
            if *s != Status::Idle || mode == "off" {
                return;
            }
            *s = Status::Running {
                done: 0,
                total: model.cmf().tensors().len(),
            };
        }
        if mode == "sync" {
            run(model);
            return;
        }
        let weak = Arc::downgrade(model);
        let spawned = std::thread::Builder::new()
            .name("cortiq-verify".into())
            .spawn(move || run_weak(weak));
        if spawned.is_err() {
            // No thread to spare: check now rather than not at all.
            run(model);
        }
    }
}

fn run_weak(weak: Weak<LoadedModel>) {
    let total = match weak.upgrade() {
        Some(m) => m.cmf().tensors().len(),
        None => return,
    };
    for i in 0..total {
        // The model may be dropped meanwhile (the command ended): stop quietly.
        let Some(model) = weak.upgrade() else {
            return;
        };
        if !step(&model, i, total) {
            return;
        }
    }
    if let Some(model) = weak.upgrade() {
        model.integrity().set(Status::Clean);
    }
}

fn run(model: &LoadedModel) {
    let total = model.cmf().tensors().len();
    for i in 0..total {
        if !step(model, i, total) {
            return;
        }
    }
    model.integrity().set(Status::Clean);
}

/// Checks tensor `i`; `false` (and the status set) when it is corrupt.
fn step(model: &LoadedModel, i: usize, total: usize) -> bool {
    let cmf = model.cmf();
    let name = &cmf.tensors()[i].name;
    if let Err(e) = cmf.verify_tensor(name) {
        model.integrity().set(Status::Corrupt(IntegrityError {
            tensor: name.clone(),
            detail: e.to_string(),
        }));
        return false;
    }
    model
        .integrity()
        .set(Status::Running { done: i + 1, total });
    true
}
