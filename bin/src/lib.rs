//! Shared code of the `train` and `oobleck` binaries.
//!
//! ```text
//!  train:   TrainArgs ─► TrainConfig (defaults < job.toml < flags) ─► Trainer ─► run dir
//!  oobleck: models | plan | generate | bench ...
//! ```

pub mod args;
pub mod bench;
pub mod cluster;
pub mod config;
pub mod exit;
pub mod generate;
pub mod placement;
pub mod plan_cmd;
pub(crate) mod plotting;
pub mod profile_cmd;
pub mod progress;
pub mod report;
pub mod run_dir;
pub mod simulate_cmd;
pub mod status_page;
pub mod trainer;
