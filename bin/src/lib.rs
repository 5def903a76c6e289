//! Shared code of the `train` and `oobleck` binaries.
//!
//! ```text
//!  train:   args::TrainArgs ─► config::TrainConfig (defaults < job.toml < flags)
//!             ├─ one process: trainer::Trainer ─► run_dir
//!             └─ a cluster:   cluster::job (TrainingSpec + workload settings from config)
//!                              ─► oobleck_core::runtime::run_job ─► run_dir, status_page
//!  oobleck: models | plan | profile | simulate | generate | status | kill-node | drain |
//!           add-node | report | bench ...  (bench/: measurements only, not the product)
//! ```
//!
//! Modules import downwards: `args` -> `run_dir` -> `config`; `cluster` -> `config`,
//! `run_dir`, `status_page`; nothing imports `bench`.

pub mod args;
pub mod bench;
pub mod cluster;
pub mod config;
pub mod data_cmd;
pub mod exit;
pub mod generate;
pub mod logging;
pub mod placement;
pub mod plan_cmd;
pub(crate) mod plotting;
pub mod profile_cmd;
pub mod progress;
pub mod report;
pub mod run_dir;
pub mod simulate_cmd;
pub mod status_page;
pub mod stop_signals;
pub mod trainer;
