//! The Oobleck-rs engine: everything between a model and a cluster.
//!
//! ```text
//!   your main() ── take_over(factory) ── runtime::run_job(workload, options)
//!                                           │ master: job::JobMachine decides, master acts;
//!                                           │ node agents and workers: your binary, re-run
//!                                           ▼
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
//! - [`runtime`] trains any [`runtime::Workload`] (a [`model::LayeredModel`] with its data,
//!   evaluation and planner profile) on a cluster that loses nodes, from the user's own
//!   binary: [`runtime::take_over`] first in `main`, then [`runtime::run_job`]. It is laid out
//!   by process: [`runtime::master`], [`runtime::node`] (the agent of one machine) and
//!   [`runtime::worker`] act; the job's decisions are a pure state machine
//!   ([`runtime::job`]); all they say to each other is in [`runtime::wire`]. Workers run
//!   [`execution`] (one rank's stage, gradient sync). `examples/residual_mlp` trains a model
//!   of its own this way.
//! - [`planning`], [`reconfig`], [`schedule`] and [`simulate`] are pure: no Candle, no I/O,
//!   no clock, no global RNG. The same input gives the same output, byte for byte.
//! - [`model`] is the contract a model implements (an ordered list of layers with named
//!   parameters) and the [`model::Stage`] that runs a range of layers forward and backward.
//! - [`optim`] is AdamW whose state is exportable by parameter name (so it can be checkpointed
//!   and copied between replicas), gradient clipping and the learning-rate schedule.
//! - [`checkpoint`] writes and verifies checkpoints.

pub mod checkpoint;
pub mod error;
pub mod execution;
pub mod model;
pub mod optim;
pub mod planning;
pub mod profiler;
pub mod reconfig;
pub mod runtime;
pub mod schedule;
pub mod simulate;

pub use error::{Error, Result};
