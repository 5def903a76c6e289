//! Turns the states pipeline 0's ranks leave into checkpoints and validation losses. Owns what
//! it needs, so it runs on a blocking thread while the job goes on.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use candle_core::{Device, Tensor};

use crate::checkpoint::{self, TrainerState};
use crate::model::{ParamSource, Stage};
use crate::runtime::error::{Context, Result, RuntimeError};
use crate::runtime::workload::Workload;

#[derive(Clone)]
pub(super) struct Assembler {
    pub workload: Arc<dyn Workload>,
    pub out: PathBuf,
    pub seed: u64,
    /// The run's configuration, echoed in every checkpoint's `trainer.json`.
    pub echo: serde_json::Value,
}

/// What a periodic assembly produced.
pub(super) struct Assembled {
    pub checkpoint: Option<PathBuf>,
    pub val_loss: Option<f64>,
    pub duration_s: f64,
}

/// Parameters and optimizer state by name.
type State = (BTreeMap<String, Tensor>, BTreeMap<String, Tensor>);

impl Assembler {
    /// Reads every saver's state (rank -> file): parameters and optimizer state, by name.
    fn merge(&self, states: &BTreeMap<u32, String>) -> Result<State> {
        let mut params = BTreeMap::new();
        let mut opt = BTreeMap::new();
        for (rank, path) in states {
            let tensors = candle_core::safetensors::load(path, &Device::Cpu)
                .with_ctx(|| format!("reading the state of rank {rank} from {path}"))?;
            for (k, t) in tensors {
                if let Some(name) = k.strip_prefix("param/") {
                    params.insert(name.to_string(), t);
                } else if let Some(name) = k.strip_prefix("opt/") {
                    opt.insert(name.to_string(), t);
                } else {
                    return Err(RuntimeError::Invalid(format!(
                        "{path}: unexpected entry {k}"
                    )));
                }
            }
        }
        Ok((params, opt))
    }

    /// Writes `checkpoints/step-NNNNNN`, laid out as the single-process trainer's, with the
    /// workload's own files beside the tensors.
    fn save(
        &self,
        params: &BTreeMap<String, Tensor>,
        opt: BTreeMap<String, Tensor>,
        step: u64,
    ) -> Result<PathBuf> {
        let state = TrainerState {
            step,
            seed: self.seed,
            data_cursor: self.workload.data_cursor(step),
            config: Some(self.echo.clone()),
        };
        let opt: Vec<(String, Tensor)> = opt.into_iter().collect();
        let files = self.workload.checkpoint_files();
        let extra: Vec<(&str, Vec<u8>)> = files
            .iter()
            .map(|(name, bytes)| (name.as_str(), bytes.clone()))
            .collect();
        Ok(checkpoint::save_checkpoint_with(
            &self.out, params, &opt, &state, &extra,
        )?)
    }

    /// The workload's evaluation of the whole model with `params`.
    fn evaluate(&self, params: &BTreeMap<String, Tensor>) -> Result<Option<f64>> {
        let model = self.workload.model();
        let params: HashMap<String, Tensor> =
            params.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        let layers = model.build_layers(
            0..model.num_layers(),
            &Device::Cpu,
            ParamSource::Tensors(&params),
        )?;
        let stage = Stage::new(layers)?;
        self.workload
            .evaluate(&stage)
            .map_err(RuntimeError::Workload)
    }

    /// Pipeline 0's states after `step` (rank -> file) as a checkpoint and/or an evaluation;
    /// removes the states it read. The one path of periodic checkpoints, rescues and the end.
    pub fn assemble(
        &self,
        step: u64,
        states: &BTreeMap<u32, String>,
        checkpoint: bool,
        eval: bool,
    ) -> Result<Assembled> {
        let started = Instant::now();
        let (params, opt) = self.merge(states)?;
        let checkpoint = match checkpoint {
            true => Some(self.save(&params, opt, step)?),
            false => None,
        };
        let val_loss = match eval {
            true => self.evaluate(&params)?,
            false => None,
        };
        if let Some(dir) = states.values().next().and_then(|p| Path::new(p).parent()) {
            let _ = std::fs::remove_dir_all(dir);
        }
        Ok(Assembled {
            checkpoint,
            val_loss,
            duration_s: started.elapsed().as_secs_f64(),
        })
    }
}
