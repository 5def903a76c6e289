//! GPT-2, GPT-3 and OPT in Candle, as layer lists the Oobleck-rs engine can pipeline.
//!
//! ```text
//!  preset name / HF config.json ──► ModelConfig ──► Arc<dyn LayeredModel> (Gpt | Opt)
//!  HF safetensors (dir or hub cache) ──► hf::load_weights ──► ParamSource::Tensors
//!  corpus + GPT-2 BPE ──► data::Dataset ──► microbatches by (seed, epoch, iteration, k)
//! ```
//!
//! Each family lives in one file (`gpt2.rs`, `opt.rs`) and implements
//! `oobleck_core::model::LayeredModel`; the engine builds any layer range of it on any device.

pub mod config;
pub mod data;
pub mod error;
mod fused;
mod fused_attention;
mod fused_bmm;
mod fused_linear;
pub mod gpt2;
pub mod hf;
mod lanes;
mod nn;
pub mod opt;
pub mod recipe;
pub mod workload;

pub use config::{preset_names, ModelConfig};
pub use error::{Error, Result};
