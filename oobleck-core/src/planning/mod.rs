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
pub(crate) mod compose;
pub mod instantiate;
pub mod profile;
pub mod ranks;
pub mod report;
pub mod template;

pub use analytical::{analytical_profile, DeviceSpec, Dtype, TransformerShape};
pub use instantiate::{
    gradient_sync_ns, instantiate, instantiate_degraded, instantiate_with_sizes,
    plan_with_pipelines, split_batch, Pipeline, Plan,
};
pub use profile::{
    ClusterSpec, Fingerprint, JobSpec, LayerProfile, LinkModel, ModelProfile, Nanos,
    TemplateMicrobatches,
};
pub use ranks::{ranks_of_node, stage_leads, world_size};
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
    #[error("profile was made for {found}, but this job needs {expected}; re-profile")]
    StaleProfile {
        found: Box<Fingerprint>,
        expected: Box<Fingerprint>,
    },
    #[error("job microbatch size {job} differs from the profile's {profile}")]
    MicrobatchMismatch { job: u32, profile: u32 },
    /// Even the finest split (one layer per stage, every device of a node on each stage) needs
    /// more than a device holds. The numbers are those of its worst stage, per device, and
    /// `needed_bytes = state_bytes + activation_bytes`.
    #[error("{}", model_too_large_text(self))]
    ModelTooLarge {
        needed_bytes: u64,
        device_bytes: u64,
        /// The layer of that stage (its index in the profile).
        layer: usize,
        /// Parameters, gradients and optimizer state of the layer.
        state_bytes: u64,
        /// Activations of every microbatch the stage holds in flight.
        activation_bytes: u64,
        /// Microbatches in flight on the stage under 1F1B (stage `k` of `S` holds `S - k`).
        in_flight: u64,
        /// Samples of each microbatch a device holds (the microbatch split over the stage's
        /// devices along the batch, rounded up).
        samples_per_device: u64,
    },
    /// Fewer nodes than `f + 1` pipelines of the smallest template need.
    #[error("{}", too_few_nodes_text(self))]
    Infeasible {
        nodes: u32,
        min_nodes: u32,
        /// `n0`: nodes of the smallest pipeline that fits.
        pipeline_nodes: u32,
        /// `f + 1`.
        pipelines: u32,
        /// Parameters, gradients and optimizer state of the whole model.
        state_bytes: u64,
        /// Memory of one node's devices; 0 when not known.
        node_bytes: u64,
    },
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

/// The text of [`PlanError::Infeasible`]: how many nodes, why a pipeline needs `n0` of them
/// (the model's state against a node's memory), and what changes it.
fn too_few_nodes_text(e: &PlanError) -> String {
    let PlanError::Infeasible {
        nodes,
        min_nodes,
        pipeline_nodes,
        pipelines,
        state_bytes,
        node_bytes,
    } = *e
    else {
        unreachable!("the Display of Infeasible alone calls this");
    };
    let gib = |bytes: u64| bytes as f64 / (1u64 << 30) as f64;
    let mut text = format!(
        "{nodes} nodes are too few: {pipelines} pipelines (f + 1) of at least {pipeline_nodes} \
         nodes need {min_nodes} nodes. "
    );
    if node_bytes > 0 {
        text.push_str(&format!(
            "The model's parameters, gradients and optimizer state take {:.1} GiB, activations \
             come on top, and a node's devices have {:.1} GiB: the smallest pipeline that fits \
             takes {pipeline_nodes} nodes. ",
            gib(state_bytes),
            gib(node_bytes)
        ));
    }
    text.push_str(&format!(
        "Ways out: at least {min_nodes} nodes, a smaller --fault-threshold, or pipelines that \
         fit on fewer nodes (--recompute keeps one tensor per layer of each microbatch in \
         flight; --precision bf16 halves the activations)"
    ));
    text
}

/// The text of [`PlanError::ModelTooLarge`]: what does not fit, then the ways out that would
/// help this case (a smaller microbatch only helps while a device holds several samples of it;
/// nothing but a larger device helps when the layer's state alone is too large).
fn model_too_large_text(e: &PlanError) -> String {
    let PlanError::ModelTooLarge {
        needed_bytes,
        device_bytes,
        layer,
        state_bytes,
        activation_bytes,
        in_flight,
        samples_per_device,
    } = *e
    else {
        unreachable!("the Display of ModelTooLarge alone calls this");
    };
    let gib = |bytes: u64| bytes as f64 / (1u64 << 30) as f64;
    let samples = match samples_per_device {
        1 => "1 sample".to_string(),
        n => format!("{n} samples"),
    };
    let mut text = format!(
        "the model does not fit: even one layer per stage needs {:.1} GiB per device, the device \
         has {:.1} GiB. Layer {layer}'s stage holds {:.1} GiB of parameters, gradients and \
         optimizer state and {:.1} GiB of activations ({in_flight} microbatches in flight: under \
         1F1B stage k of S holds S - k; {:.2} GiB each at {samples} per device). ",
        gib(needed_bytes),
        gib(device_bytes),
        gib(state_bytes),
        gib(activation_bytes),
        gib(activation_bytes / in_flight.max(1)),
    );
    if state_bytes > device_bytes {
        text.push_str(
            "The layer's state alone exceeds the device: a larger device, or fewer bytes of \
             optimizer state per parameter",
        );
        return text;
    }
    text.push_str(
        "Ways out: activation recomputation if it is off (`--recompute`: each layer keeps only \
         its input per microbatch in flight, for one more forward in its backward), bf16 \
         activations if they are fp32 (`--precision bf16`), a shorter context",
    );
    if samples_per_device > 1 {
        text.push_str(", a smaller microbatch or more devices per node, or a larger device");
    } else {
        text.push_str(
            ", or a larger device; more devices per stage do not help, each already holds 1 \
             sample of every microbatch",
        );
    }
    text
}
