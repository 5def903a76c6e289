//! Typed records: what workers report ([`WorkerReport`], carried unchanged by the agent's pipe
//! and by the control protocol), what a run writes to `events.jsonl` ([`Event`]) and
//! `metrics.jsonl` ([`StepMetrics`]). The report reads them back with the same types.

mod event;
mod metrics;
mod report;

pub use event::{
    Event, EventLine, EventLineError, PipelineLayout, StartInfo, STANDBY_COST_COMMITS,
};
pub use metrics::{ranges, splitmix64, SampleHash, StepData, StepMetrics};
pub use report::{CorruptCopy, WorkerReport, REPORT_PREFIX};
