//! Planning: profiles -> pipeline templates -> instantiation -> batch split. Pure: no I/O, no
//! clock, no global RNG, no printing; the same input gives byte-identical output.
//!
//! ```text
//!  ModelProfile (measured, or analytical::profile(shape, device))
//!      + ClusterSpec (G, device memory, links) + JobSpec (f, b, B, state bytes)
//!        │
//!        ▼ template::generate_templates      n0 from memory; one exact template per n in [n0, N - f*n0]
//!  TemplateSet
//!        │
//!        ▼ instantiate::instantiate           template counts summing to N, >= f+1 pipelines,
//!  Plan { generation, templates, pipelines, microbatches per pipeline, predicted time }
//!        │
//!        ▼ reconfig::decide (on lost / joined nodes)
//!  ReconfigPlan { plan, copies, missing layers, fault tolerance left }
//! ```
//!
//! Times are integer nanoseconds inside the planner (see [`profile`]), so optimality checks
//! are exact.

pub mod analytical;
pub mod instantiate;
pub mod profile;
pub mod report;
pub mod template;

pub use analytical::{analytical_profile, DeviceSpec, Dtype, TransformerShape};
pub use instantiate::{
    gradient_sync_ns, instantiate, instantiate_with_sizes, plan_with_pipelines, split_batch,
    Pipeline, Plan,
};
pub use profile::{
    ClusterSpec, Fingerprint, JobSpec, LayerProfile, LinkModel, ModelProfile, Nanos,
    TemplateMicrobatches,
};
pub use template::{generate_templates, Stage, Template, TemplateSet};

/// Why a plan cannot be made. Every variant carries the numbers a user needs to fix the input.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PlanError {
    #[error("profile layer {layer}: {field} = {value} is not valid (must be finite and >= 0)")]
    InvalidProfile {
        layer: usize,
        field: &'static str,
        value: f64,
    },
    #[error("profile is not valid JSON for a model profile: {0}")]
    ProfileFormat(String),
    #[error("cluster/job setting {field} = {value} is not valid")]
    InvalidCluster { field: &'static str, value: f64 },
    #[error("profile was made for {found:?}, but this job needs {expected:?}; re-profile")]
    StaleProfile {
        found: Box<Fingerprint>,
        expected: Box<Fingerprint>,
    },
    #[error("job microbatch size {job} differs from the profile's {profile}")]
    MicrobatchMismatch { job: u32, profile: u32 },
    #[error(
        "the model does not fit: even one layer per stage needs {needed_bytes} bytes per device, \
         the device has {device_bytes}"
    )]
    ModelTooLarge {
        needed_bytes: u64,
        device_bytes: u64,
    },
    #[error(
        "{nodes} nodes are too few: f+1 pipelines of at least n0 nodes need {min_nodes} nodes"
    )]
    Infeasible { nodes: u32, min_nodes: u32 },
    #[error(
        "global batch of {global_microbatches} microbatches is smaller than the {pipelines} \
         pipelines that need at least one each"
    )]
    BatchTooSmall {
        global_microbatches: u32,
        pipelines: u32,
    },
    #[error("no combination of templates ({sizes:?} nodes) covers exactly {nodes} nodes with at least {min_pipelines} pipelines")]
    NoComposition {
        nodes: u32,
        min_pipelines: u32,
        sizes: Vec<u32>,
    },
    #[error("node {node} is not part of the current plan")]
    UnknownNode { node: u32 },
    #[error("node {node} joined but is already part of the plan")]
    DuplicateNode { node: u32 },
}
