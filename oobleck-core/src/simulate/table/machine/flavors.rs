//! What Varuna and Bamboo do differently from Oobleck: Varuna's checkpoints and roll-backs,
//! Bamboo's redundant stages, slowdown and in-place reconfiguration.

use super::{Instance, Kind, Machine, NodeStatus, Status, MS_PER_HOUR};

impl Machine<'_> {
    /// Roll back to the last checkpoint: every step after it is zeroed in the series.
    pub(super) fn varuna_remove(&mut self, d: i64) {
        self.node_will_be_removed = true;
        if !self.p.no_fallback {
            match self.prev_checkpoint {
                None => {
                    self.ys.iter_mut().for_each(|y| *y = 0.0);
                    self.acc.fallback_loss += d as f64;
                }
                Some(ckpt) => {
                    let n = self.xs.len().min(self.ys.len());
                    // The first point at the checkpoint's time, else the last point.
                    let idx = (0..n).find(|&i| self.xs[i] == ckpt).or(n.checked_sub(1));
                    if let Some(idx) = idx {
                        let from = (idx + 1).min(self.ys.len());
                        self.ys[from..].iter_mut().for_each(|y| *y = 0.0);
                        let zeroed = (self.ys.len() - from) as f64;
                        self.acc.fallback_loss += self.step_delta_or_note() as f64 * zeroed;
                    }
                }
            }
        }
        self.fatal_failure(d);
    }

    /// A lost node's stage is taken over by its predecessor in the pipeline unless that one
    /// already covers for another; the job then runs 1.5x slower until the next rendezvous.
    pub(super) fn bamboo_remove(&mut self, d: i64, inst: Instance) {
        self.acc.fallback_loss += self.step_delta.unwrap_or(0) as f64;
        if inst.status == NodeStatus::Running {
            if inst.coords.len() > 1 {
                return self.fatal_failure(d);
            }
            let (pipe, stage) = inst.coords[0];
            let prev = if stage == 0 {
                self.num_stages.wrapping_sub(1)
            } else {
                stage - 1
            };
            let holder = self
                .instances
                .iter()
                .position(|i| i.coords.contains(&(pipe, prev)));
            if let Some(h) = holder {
                if self.instances[h].coords.len() > 1 {
                    return self.fatal_failure(d);
                }
                self.instances[h].coords.push((pipe, stage));
            }
        }
        if self.status == Status::Running && self.fallback_event.is_none() {
            self.fallback_event = Some((self.steps, d));
            self.fallback_handled = false;
            if let Some(s) = self.step_delta {
                self.step_delta = Some((s as f64 * self.inp.fallback_slowdown) as i64);
            }
        }
    }

    /// Bamboo's first step after losing redundancy is stretched by the slowdown once.
    pub(super) fn bamboo_slow_step(&mut self, d: i64, version: u64) -> bool {
        match self.fallback_event {
            Some((at_steps, at)) if !self.fallback_handled && at_steps == self.steps => {
                let extra = ((d - at) as f64 * (self.inp.fallback_slowdown - 1.0)) as i64;
                self.push(d + extra, Kind::StepComplete, String::new(), version);
                self.fallback_handled = true;
                true
            }
            _ => false,
        }
    }

    pub(super) fn bamboo_should_reconfigure(&self) -> bool {
        let overloaded = self
            .instances
            .iter()
            .filter(|i| i.status == NodeStatus::Running && i.coords.len() > 1)
            .count();
        if overloaded > 0 && self.num_workers_waiting >= overloaded {
            return true;
        }
        let active = (self.num_pipelines * self.num_stages) as f64 - overloaded as f64;
        // Python divides by zero here when every worker is overloaded; inf > 0.05 is true.
        if overloaded > 0 && 2.0 * overloaded as f64 / active > 0.05 {
            return true;
        }
        let potential =
            (active + self.num_workers_waiting as f64) / self.inp.num_stages_target as f64;
        potential.floor() as usize > self.num_pipelines
    }

    /// Varuna's idle-GPU counter and checkpoint; returns the step's end after checkpointing.
    pub(super) fn varuna_after_step(&mut self, mut d: i64, dur: i64) -> i64 {
        let active = self.num_active();
        if active == 0 {
            self.step_with_no_active_node = true; // Python: ZeroDivisionError
        } else {
            self.acc.idle_gpu += dur as f64 * self.curr_gpu_overhead / active as f64;
        }
        let cpi = self.p.checkpoint_per_iter;
        if self.steps % cpi != 0 && !self.node_will_be_removed {
            return d;
        }
        self.node_will_be_removed = false;
        if !self.p.no_ckpt_overhead {
            d += self.inp.checkpointing_overhead_ms;
            self.acc.checkpoint += self.inp.checkpointing_overhead_ms as f64;
            let at = d + self.inp.checkpointing_overhead_ms;
            self.push(at, Kind::CheckpointComplete, String::new(), 0);
        }
        self.heap.heapify();
        if self.checkpointing_will_fail() && !self.p.no_fallback {
            self.acc.fallback_loss += (cpi * self.step_delta.unwrap_or(0)) as f64;
            self.steps = (self.steps - cpi).max(0);
            // `ys[-2*cpi:] = [0.0] * (2*cpi)`: may lengthen ys past xs.
            let k = 2 * cpi as usize;
            self.ys.truncate(self.ys.len().saturating_sub(k));
            self.ys.extend(std::iter::repeat_n(0.0, k));
        } else {
            self.prev_checkpoint = Some(d as f64 / MS_PER_HOUR);
        }
        d
    }

    /// True when, walking the heap *array*, a removal comes before a checkpoint completion.
    pub(super) fn checkpointing_will_fail(&self) -> bool {
        let mut removal_seen = false;
        for e in self.heap.as_slice() {
            match e.kind {
                Kind::Remove => removal_seen = true,
                Kind::CheckpointComplete => return removal_seen,
                _ => {}
            }
        }
        false
    }
}
