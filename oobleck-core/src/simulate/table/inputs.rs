//! The numbers of one model and one system, read from the authors' `sim_inputs.json`
//! (`datasets/simulator/sim_inputs.json`; its README documents every field).

use serde_json::Value;

use super::System;
use crate::simulate::SimError;

/// Node counts the throughput tables cover; fewer nodes use the 15 entry, more the 30 entry.
pub const MIN_NODES: usize = 15;
pub const MAX_NODES: usize = 30;
const ROWS: usize = MAX_NODES - MIN_NODES + 1;

/// One model on one system: step times by node count and the simulator's constants.
#[derive(Debug, Clone, PartialEq)]
pub struct TableInputs {
    pub model: String,
    pub system: System,
    /// Samples per step (global batch). A float: GPT-3-2_7b's is `1024 / 2` in Python.
    pub samples_per_step: f64,
    /// The model's own step budget, used when an experiment does not set one (Bamboo, spot).
    pub default_steps_per_run: i64,
    /// Oobleck: reconfiguration cost per removal; Varuna: restart cost before the
    /// per-node-count table applies; Bamboo: in-place reconfiguration cost. Milliseconds.
    pub local_rendezvous_timeout_ms: i64,
    /// Oobleck 0; Bamboo's restart cost; Varuna's is defined but unused. Milliseconds.
    pub global_rendezvous_timeout_ms: i64,
    /// From `add` until a node is usable (45 s). Milliseconds.
    pub spot_instance_creation_ms: i64,
    /// Oobleck/Varuna/Bamboo need this many ready nodes; pipelines = nodes / this.
    pub num_stages_target: usize,
    /// Varuna: milliseconds added to a step that checkpoints; 0 elsewhere.
    pub checkpointing_overhead_ms: i64,
    /// Varuna: checkpoint every this many steps (10; the no-ckpt experiment uses 2).
    pub checkpoint_per_iter: i64,
    /// Bamboo: step-time factor while a node covers for a lost peer (1.5); 1 elsewhere.
    pub fallback_slowdown: f64,
    /// Bamboo: the share of each step that is redundant work (1 - 0.1971); 0 elsewhere.
    pub redundant_ratio: f64,
    /// `int(samples_per_step / tput * 1000)` for 15..=30 nodes, as the simulator uses it.
    pub step_delta_ms: [i64; ROWS],
    /// Varuna: restart cost by node count (only BERT-large's varies).
    pub local_rendezvous_timeout_by_nodes: Option<[i64; ROWS]>,
    /// Varuna: idle GPUs at that node count (feeds only the idle-GPU accumulator).
    pub idle_gpus_by_nodes: Option<[f64; ROWS]>,
}

impl TableInputs {
    /// Reads `json_text` (the whole `sim_inputs.json`) for `model` on `system`.
    pub fn parse(json_text: &str, model: &str, system: System) -> Result<TableInputs, SimError> {
        let root: Value = serde_json::from_str(json_text).map_err(|e| SimError::Inputs {
            field: "(file)".into(),
            message: format!("not a JSON document: {e}"),
        })?;
        let sys = system.inputs_key();
        let known = known_models(&root, sys);
        let constants = get(&root, &["constants", sys])?;
        let Some(c) = constants.get(model) else {
            return Err(SimError::Inputs {
                field: "model".into(),
                message: format!(
                    "unknown model `{model}` for {sys}; known models: {}",
                    known.join(", ")
                ),
            });
        };
        let cpath = format!("constants.{sys}.{model}");
        let tpath = format!("throughput_tables.{sys}.{model}");
        let table = get(&root, &["throughput_tables", sys, model])?;
        let is_varuna = sys == "varuna";
        Ok(TableInputs {
            model: model.to_string(),
            system,
            samples_per_step: number(c, &cpath, "samples_per_step")?,
            default_steps_per_run: integer(c, &cpath, "steps_per_run")?,
            local_rendezvous_timeout_ms: integer(c, &cpath, "local_rendezvous_timeout_delta")?,
            global_rendezvous_timeout_ms: integer(c, &cpath, "global_rendezvous_timeout_delta")?,
            spot_instance_creation_ms: integer(c, &cpath, "spot_instance_creation_time")?,
            num_stages_target: positive(c, &cpath, "num_stages_target")?,
            checkpointing_overhead_ms: if is_varuna {
                integer(c, &cpath, "checkpointing_overhead")?
            } else {
                0
            },
            checkpoint_per_iter: if is_varuna {
                integer(c, &cpath, "checkpoint_per_iter")?.max(1)
            } else {
                1
            },
            fallback_slowdown: number(c, &cpath, "fallback_slowdown")?,
            redundant_ratio: if sys == "bamboo" {
                number(c, &cpath, "redundant_ratio")?
            } else {
                0.0
            },
            step_delta_ms: by_nodes(table, &tpath, "step_delta_ms_by_nodes", as_i64)?,
            local_rendezvous_timeout_by_nodes: optional_by_nodes(
                table,
                &tpath,
                "local_rendezvous_timeout_ms_by_nodes",
                as_i64,
            )?,
            idle_gpus_by_nodes: optional_by_nodes(
                table,
                &tpath,
                "idle_gpu_overhead_by_nodes",
                |v| v.as_f64(),
            )?,
        })
    }

    /// The table row for `nodes` (clamped to 15..=30, as the simulators do).
    pub fn row(nodes: usize) -> usize {
        nodes.clamp(MIN_NODES, MAX_NODES) - MIN_NODES
    }
}

fn known_models(root: &Value, sys: &str) -> Vec<String> {
    let from_list = root.get("models").and_then(Value::as_array).map(|a| {
        a.iter()
            .filter_map(|m| m.as_str().map(str::to_string))
            .collect::<Vec<_>>()
    });
    from_list
        .or_else(|| {
            root.pointer(&format!("/constants/{sys}"))
                .and_then(Value::as_object)
                .map(|o| o.keys().cloned().collect())
        })
        .unwrap_or_default()
}

fn get<'a>(root: &'a Value, path: &[&str]) -> Result<&'a Value, SimError> {
    let mut v = root;
    for (i, key) in path.iter().enumerate() {
        v = v.get(*key).ok_or_else(|| SimError::Inputs {
            field: path[..=i].join("."),
            message: "missing".into(),
        })?;
    }
    Ok(v)
}

fn field<'a>(obj: &'a Value, path: &str, name: &str) -> Result<&'a Value, SimError> {
    obj.get(name).ok_or_else(|| SimError::Inputs {
        field: format!("{path}.{name}"),
        message: "missing".into(),
    })
}

fn wrong(path: &str, name: &str, want: &str, got: &Value) -> SimError {
    SimError::Inputs {
        field: format!("{path}.{name}"),
        message: format!("expected {want}, found `{got}`"),
    }
}

fn number(obj: &Value, path: &str, name: &str) -> Result<f64, SimError> {
    let v = field(obj, path, name)?;
    v.as_f64()
        .filter(|x| x.is_finite())
        .ok_or_else(|| wrong(path, name, "a number", v))
}

fn as_i64(v: &Value) -> Option<i64> {
    v.as_i64().or_else(|| {
        v.as_f64()
            .filter(|x| x.fract() == 0.0 && x.abs() < 9e15)
            .map(|x| x as i64)
    })
}

fn integer(obj: &Value, path: &str, name: &str) -> Result<i64, SimError> {
    let v = field(obj, path, name)?;
    as_i64(v).ok_or_else(|| wrong(path, name, "a whole number", v))
}

fn positive(obj: &Value, path: &str, name: &str) -> Result<usize, SimError> {
    let v = field(obj, path, name)?;
    as_i64(v)
        .filter(|&x| x > 0)
        .map(|x| x as usize)
        .ok_or_else(|| wrong(path, name, "a whole number above 0", v))
}

/// A `{"15": .., ..., "30": ..}` object as an array indexed by `nodes - 15`.
fn by_nodes<T: Copy + Default>(
    table: &Value,
    path: &str,
    name: &str,
    read: impl Fn(&Value) -> Option<T>,
) -> Result<[T; ROWS], SimError> {
    let obj = field(table, path, name)?;
    if !obj.is_object() {
        return Err(wrong(path, name, "an object keyed by node count", obj));
    }
    let mut out = [T::default(); ROWS];
    for (i, slot) in out.iter_mut().enumerate() {
        let key = (MIN_NODES + i).to_string();
        let entry = format!("{name}.{key}");
        let v = field(obj, &format!("{path}.{name}"), &key)?;
        *slot = read(v).ok_or_else(|| wrong(path, &entry, "a number", v))?;
    }
    Ok(out)
}

fn optional_by_nodes<T: Copy + Default>(
    table: &Value,
    path: &str,
    name: &str,
    read: impl Fn(&Value) -> Option<T>,
) -> Result<Option<[T; ROWS]>, SimError> {
    match table.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(_) => by_nodes(table, path, name, read).map(Some),
    }
}
