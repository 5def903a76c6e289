//! The Oobleck-rs engine: everything between a model and a cluster.
//!
//! ```text
//!   profiles ──► planning ──► Plan (templates, pipelines, batch split)
//!                   │                      │
//!   failures/joins ─┴──► reconfig ──► ReconfigPlan (new pipelines, layer copies, new split)
//!                                          │
//!   schedule: 1F1B instruction streams ◄───┘
//!                                          ▼
//!   model::{LayeredModel, Stage} ──► forward / backward per microbatch ──► optim::AdamW
//!                                          │
//!                                     checkpoint (safetensors + trainer.json, atomic)
//! ```
//!
//! - [`planning`], [`reconfig`] and [`schedule`] are pure: no Candle, no I/O, no clock, no
//!   global RNG. The same input gives the same output, byte for byte.
//! - [`model`] is the contract a model implements (an ordered list of layers with named
//!   parameters) and the [`model::Stage`] that runs a range of layers forward and backward.
//! - [`optim`] is AdamW whose state is exportable by parameter name (so it can be checkpointed
//!   and copied between replicas), gradient clipping and the learning-rate schedule.
//! - [`checkpoint`] writes and verifies checkpoints.

pub mod checkpoint;
pub mod elastic;
pub mod error;
pub mod execution;
pub mod model;
pub mod optim;
pub mod planning;
pub mod reconfig;
pub mod runtime;
pub mod schedule;

pub use error::{Error, Result};
