//! The pipe between a node's agent and each of its workers.
//!
//! ```text
//!  agent ──stdin──► worker     1 line: WorkerAssignment (JSON)
//!                              then ToWorker lines: Rendezvous, then Commit per step;
//!                              after a failure, Reassign: the next generation's assignment
//!                              (the same process goes on, with the state it holds)
//!  agent ◄─stdout── worker     WorkerReport lines, after records::REPORT_PREFIX and the
//!                              generation they belong to; progress beats (an
//!                              execution::Snapshot after PROGRESS_PREFIX, every 50 ms while
//!                              it moves, every 500 ms while it does not), which the agent's
//!                              watchdog reads and keeps to itself; any other line is the
//!                              worker's own output, passed on to the agent's stderr
//! ```
//!
//! The worker exits when its stdin closes: the agent that started it is gone, so nobody would
//! commit a step or collect its results. The agent wraps each report of the running
//! generation, as it is, in a [`crate::elastic::Message::Worker`] with its node and the
//! generation, and drops those of earlier generations.

use std::net::{SocketAddr, ToSocketAddrs};
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use oobleck_comm::SecretKey;

use super::error::{Context, Result};
use super::spec::JobConfig;
use crate::elastic::protocol::Rendezvous;
use crate::execution::Snapshot;
use crate::planning::Plan;
use crate::reconfig::{Donor, LayerCopy};

/// What an agent gives each of its workers (the first JSON line on the worker's stdin).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerAssignment {
    pub generation: u64,
    pub rank: u32,
    pub node: u32,
    pub plan: Plan,
    /// The IP the worker binds its data-plane port on.
    pub host: String,
    /// The job's run directory (outputs).
    pub run_dir: PathBuf,
    /// The job, as the master resolved it.
    pub job: JobConfig,
    /// The NCCL unique id of this generation (`DataPlane::Nccl`), 128 bytes.
    pub nccl_id: Option<Vec<u8>>,
    /// The generation's data-plane key: the worker proves it to every peer and refuses a peer
    /// that cannot.
    pub key: SecretKey,
    /// Where this generation's parameters and optimizer state come from.
    pub source: StateSource,
    /// Where the worker uploads its state (`HOST:PORT` on the master's machine) and the key
    /// the uploads prove; files land under the run directory there.
    pub state_sink: String,
    pub state_key: SecretKey,
}

/// Where a generation's workers get their parameters, optimizer state and step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "from", rename_all = "snake_case", deny_unknown_fields)]
pub enum StateSource {
    /// Fresh, deterministic initialisation: step 0.
    Init,
    /// A checkpoint directory (a resumed job, or a recovery beyond what replicas cover).
    Checkpoint { path: PathBuf },
    /// In place, after a failure: every worker keeps what it holds of committed `step` and
    /// receives the layers its new stage lacks from their holders, as `copies` say (ranks of
    /// the new generation, in an order every rank follows).
    Peers {
        step: u64,
        copies: Vec<LayerCopy>,
        /// Devices of drained nodes that send the layers only they hold, as ranks after the
        /// plan's own (`reconfig::Donor`); every rank's data plane includes them.
        #[serde(default)]
        donors: Vec<Donor>,
    },
}

/// What an agent tells a worker after its assignment, one JSON object per stdin line.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "to_worker", rename_all = "snake_case", deny_unknown_fields)]
pub enum ToWorker {
    /// Where every rank of the generation listens.
    Rendezvous { rendezvous: Vec<Rendezvous> },
    /// Every holder has its reduced gradient for `step` (1-based): apply it.
    Commit { step: u64 },
    /// Generation `generation` failed: stop the step under way (its update is never applied)
    /// instead of finishing it. Read by the worker's stdin thread as soon as it arrives.
    Abort { generation: u64 },
    /// The next generation, for a worker that keeps running: leave the current one (its open
    /// step is not applied) and take this assignment with the state it holds.
    Reassign { assignment: Box<WorkerAssignment> },
}

/// Lines of a worker's stdout that carry a progress beat start with this.
pub const PROGRESS_PREFIX: &str = "oobleck-progress ";

/// The line a worker prints for a progress beat.
pub fn progress_line(s: &Snapshot) -> String {
    let body = serde_json::to_string(s).expect("a snapshot always serialises");
    format!("{PROGRESS_PREFIX}{body}")
}

/// Parses a worker's line into a progress beat; `None` for lines that are not beats.
pub fn parse_progress(line: &str) -> Option<std::result::Result<Snapshot, String>> {
    let body = line.strip_prefix(PROGRESS_PREFIX)?;
    Some(serde_json::from_str(body).map_err(|e| format!("malformed progress beat {body:?}: {e}")))
}

/// Resolves `HOST:PORT` (a name or an IP) to its first address.
pub fn resolve(addr: &str) -> Result<SocketAddr> {
    addr.to_socket_addrs()
        .with_ctx(|| format!("resolving {addr:?} (expected HOST:PORT)"))?
        .next()
        .with_ctx(|| format!("{addr:?} resolves to no address"))
}

/// The ranks a node runs under `plan`: device `d` of node `j` of a pipeline is rank
/// `first_rank + j * G + d` (the numbering of `planning::Pipeline`).
pub fn ranks_of_node(plan: &Plan, node: u32) -> Vec<u32> {
    let g = plan.devices_per_node;
    plan.pipelines
        .iter()
        .flat_map(|p| {
            p.nodes
                .iter()
                .enumerate()
                .filter(move |(_, &n)| n == node)
                .flat_map(move |(j, _)| (0..g).map(move |d| p.first_rank + j as u32 * g + d))
        })
        .collect()
}

/// The lead (device 0) of each stage of pipeline `pipeline`, in stage order: the stage of
/// node `j` of the template that starts on device `d` is led by rank `first_rank + j * G + d`.
/// The leads of pipeline 0, which holds every layer once, keep the state the master assembles.
/// A node runs several stages when its template's stages use fewer than `G` devices, so this
/// is not one rank per node. Empty when the plan has no such pipeline; panics, as
/// [`Plan::template_of`] does, when the pipeline's template is not in the plan (a plan
/// `execution::Layout::from_plan` refuses).
pub fn stage_leads(plan: &Plan, pipeline: usize) -> Vec<u32> {
    let Some(p) = plan.pipelines.get(pipeline) else {
        return Vec::new();
    };
    let g = plan.devices_per_node;
    plan.template_of(p)
        .stages
        .iter()
        .map(|s| p.first_rank + s.node * g + s.first_device)
        .collect()
}

/// Number of ranks (devices) the plan uses.
pub fn world_size(plan: &Plan) -> u32 {
    plan.pipelines
        .iter()
        .map(|p| p.nodes.len() as u32 * plan.devices_per_node)
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::execution::Layout;
    use crate::planning::{Pipeline, Stage, Template};

    /// Two pipelines over nodes `[3, 5]` and `[4]`, two devices per node.
    fn plan() -> Plan {
        let pipeline = |id, nodes: Vec<u32>, first_rank| Pipeline {
            id,
            template_nodes: nodes.len() as u32,
            nodes,
            first_rank,
            microbatches: 2,
            predicted_ns: 1_000,
        };
        Plan {
            generation: 2,
            devices_per_node: 2,
            fault_threshold: 1,
            global_microbatches: 4,
            min_nodes: 1,
            templates: Vec::new(),
            pipelines: vec![pipeline(0, vec![3, 5], 0), pipeline(1, vec![4], 4)],
            compute_ns: 1_000,
            sync_ns: 0,
            sync_model_ns: 0,
            layer_state_bytes: vec![64],
            iteration_ns: 1_000,
        }
    }

    #[test]
    fn a_node_runs_the_devices_of_its_place_in_each_pipeline() {
        let plan = plan();
        assert_eq!(ranks_of_node(&plan, 3), vec![0, 1]);
        assert_eq!(ranks_of_node(&plan, 5), vec![2, 3]);
        assert_eq!(ranks_of_node(&plan, 4), vec![4, 5]);
        assert!(ranks_of_node(&plan, 9).is_empty());
        assert_eq!(world_size(&plan), 6);
    }

    /// Two devices per node. Pipeline 0: one node (3) whose two stages use one device each;
    /// pipeline 1: two nodes (4, 5) with one two-device stage each.
    fn plan_with_stages() -> Plan {
        let stage = |layers: std::ops::Range<usize>, node, first_device, devices| Stage {
            layer_start: layers.start,
            layer_end: layers.end,
            node,
            first_device,
            devices,
            forward_ns: 1,
            backward_ns: 1,
            p2p_ns: 0,
            memory_bytes: 1,
        };
        let template = |nodes, stages| Template {
            nodes,
            devices_per_node: 2,
            stages,
            microbatches: 2,
            t1_ns: 2,
            t3_ns: 2,
            bottleneck_stage: 0,
            bottleneck_ns: 2,
            iteration_ns: 4,
            peak_memory_bytes: 1,
        };
        let mut p = plan();
        p.templates = vec![
            template(1, vec![stage(0..2, 0, 0, 1), stage(2..4, 0, 1, 1)]),
            template(2, vec![stage(0..2, 0, 0, 2), stage(2..4, 1, 0, 2)]),
        ];
        p.pipelines[0].nodes = vec![3];
        p.pipelines[0].template_nodes = 1;
        p.pipelines[1].nodes = vec![4, 5];
        p.pipelines[1].template_nodes = 2;
        p.pipelines[1].first_rank = 2;
        p
    }

    #[test]
    fn stage_leads_are_device_0_of_each_stage_even_with_two_stages_on_a_node() {
        let plan = plan_with_stages();
        assert_eq!(stage_leads(&plan, 0), vec![0, 1]);
        assert_eq!(stage_leads(&plan, 1), vec![2, 4]);
        assert!(stage_leads(&plan, 2).is_empty());
        // The same ranks the execution layout puts at device 0 of a stage.
        let layout = Layout::from_plan(&plan, 4).expect("layout");
        for rank in 0..world_size(&plan) {
            let pos = layout
                .position(rank as usize)
                .expect("every rank has a place");
            let lead = stage_leads(&plan, pos.pipeline).contains(&rank);
            assert_eq!(lead, pos.device == 0, "rank {rank} at {pos:?}");
        }
    }

    #[test]
    fn addresses_resolve_and_bad_ones_say_what_was_expected() {
        let a = resolve("127.0.0.1:7000").expect("an IP resolves");
        assert_eq!(a, "127.0.0.1:7000".parse::<SocketAddr>().expect("literal"));
        let e = resolve("no-port-here").expect_err("no port").to_string();
        assert!(e.contains("expected HOST:PORT"), "{e}");
    }

    #[test]
    fn pipe_messages_round_trip_as_json_lines() {
        for msg in [
            ToWorker::Rendezvous {
                rendezvous: vec![Rendezvous {
                    rank: 0,
                    addr: "127.0.0.1:9".into(),
                }],
            },
            ToWorker::Commit { step: 3 },
        ] {
            let line = serde_json::to_string(&msg).expect("json");
            assert!(!line.contains('\n'));
            assert_eq!(serde_json::from_str::<ToWorker>(&line).expect("back"), msg);
        }
        assert!(serde_json::from_str::<ToWorker>(r#"{"to_worker":"explode"}"#).is_err());
    }

    #[test]
    fn progress_beats_round_trip_and_a_bad_one_says_what_it_was() {
        let s = Snapshot {
            seq: 9,
            step: 4,
            in_step: true,
            doing: vec![crate::execution::Doing::Backward { mb: 1 }],
        };
        let line = progress_line(&s);
        assert_eq!(parse_progress(&line), Some(Ok(s)));
        assert_eq!(parse_progress("loss 3.2"), None);
        let e = parse_progress("oobleck-progress {\"seq\":1}").expect("a beat line");
        assert!(e.expect_err("bad").contains("malformed progress beat"));
    }
}
