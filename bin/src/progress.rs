//! Progress for humans: a bar on a terminal, plain log lines otherwise (CI logs, pipes).

use std::io::IsTerminal;

use indicatif::{ProgressBar, ProgressStyle};

use crate::run_dir::StepMetrics;

/// Shows training progress on stderr (stdout stays free for `--json`).
pub struct Progress {
    bar: Option<ProgressBar>,
    /// Plain mode prints every `every`-th step (and every evaluation).
    every: u64,
    started: std::time::Instant,
}

impl Progress {
    pub fn new(total_steps: u64, start_step: u64) -> Self {
        let bar = std::io::stderr().is_terminal().then(|| {
            let b = ProgressBar::new(total_steps);
            b.set_style(
                ProgressStyle::with_template(
                    "{spinner} step {pos}/{len} [{bar:30}] {msg} eta {eta}",
                )
                .expect("static template is valid")
                .progress_chars("=> "),
            );
            b.set_position(start_step);
            b
        });
        Self {
            bar,
            every: (total_steps / 20).max(1),
            started: std::time::Instant::now(),
        }
    }

    pub fn step(&mut self, m: &StepMetrics, total: u64) {
        let val = m
            .val_loss
            .map(|v| format!(" val {v:.4}"))
            .unwrap_or_default();
        // A cluster's shape: generation, pipelines and nodes.
        let shape = if m.nodes > 1 {
            format!(
                " | gen {}, {} pipelines on {} nodes",
                m.generation, m.pipelines, m.nodes
            )
        } else {
            String::new()
        };
        match &self.bar {
            Some(b) => {
                b.set_position(m.step);
                b.set_message(format!(
                    "loss {:.4}{val}{shape} | {:.0} tok/s",
                    m.loss, m.tokens_per_s
                ));
                if m.val_loss.is_some() {
                    b.println(format!("step {}: loss {:.4}{val}", m.step, m.loss));
                }
            }
            None => {
                if m.step % self.every == 0 || m.val_loss.is_some() || m.step == total {
                    let elapsed = self.started.elapsed().as_secs_f64();
                    eprintln!(
                        "step {}/{total} loss {:.4}{val} lr {:.2e}{shape} | {:.0} tok/s | {:.0}s \
                         elapsed",
                        m.step, m.loss, m.lr, m.tokens_per_s, elapsed
                    );
                }
            }
        }
    }

    pub fn note(&self, msg: &str) {
        match &self.bar {
            Some(b) => b.println(msg),
            None => eprintln!("{msg}"),
        }
    }

    pub fn finish(&self) {
        if let Some(b) = &self.bar {
            b.finish_and_clear();
        }
    }
}
