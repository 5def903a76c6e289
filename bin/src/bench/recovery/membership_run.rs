//! The drain + join run, acting: one `train` with no failure, which the bench drains a node of
//! and adds a node to from outside, with the `oobleck` tools (`oobleck drain NODE --run DIR`,
//! `oobleck add-node --run DIR`), once the committed step in its `metrics.jsonl` reaches the
//! plan's ([`MembershipPlan::due`]).
//!
//! The added agent is no child of `train` nor of the bench: `oobleck add-node` starts it and
//! exits. It stays in the process group the bench gave `oobleck add-node`, so that group is
//! kept registered with the reaper (killed on Ctrl-C or an error) until the agent is seen to
//! exit by itself after the job, which the run requires.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use super::membership::{Act, MembershipPlan, Outcome, Sent};
use super::records::parse_metrics;
use super::summary::{RunInput, RunKind};
use super::{Bench, FailurePlan, Out};
use crate::bench::child::{tail, Group, TrainProcess};

/// How often the run's `metrics.jsonl` is looked at.
const LOOK: Duration = Duration::from_millis(100);
/// Bound of one `oobleck drain` or `oobleck add-node` (each asks the master once).
const TOOL_TIMEOUT: Duration = Duration::from_secs(30);
/// How long the added agent may take to exit after `train` did.
const AGENT_EXIT: Duration = Duration::from_secs(30);

impl Bench<'_> {
    /// The drain + join run: the job of the other runs, `--join-after 0` so that the join is
    /// taken at the next boundary whether or not it adds a pipeline (unless `--train-arg`
    /// sets it).
    pub(super) fn membership(&self, plan: &FailurePlan, m: &MembershipPlan) -> (RunInput, Outcome) {
        let slug = "drain-join";
        let dir = self.scratch.root.join(slug);
        let f = self.a.fault_threshold;
        let mut args = self.train_args(Out::Fresh(&dir), f, &plan.pins, &[]);
        if !self
            .a
            .train_arg
            .iter()
            .any(|x| x.starts_with("--join-after"))
        {
            args.extend(["--join-after".into(), "0".into()]);
        }
        let mut driver = Driver {
            bench: self,
            plan: m,
            dir: dir.clone(),
            next_look: Instant::now(),
            outcome: Outcome::default(),
            agent: None,
            problems: vec![],
        };
        let result = self.segment(&dir, &args, slug, 0.0, &mut || driver.tick());
        let (outcome, problems) = driver.finish();
        let (segments, train_error) = match result {
            Ok((seg, error)) => (vec![seg], error),
            Err(e) => (vec![], Some(format!("{e:#}"))),
        };
        let errors: Vec<String> = train_error.into_iter().chain(problems).collect();
        let input = RunInput {
            kind: RunKind::Membership,
            segments,
            error: (!errors.is_empty()).then(|| format!("{slug}: {}", errors.join("; "))),
        };
        (input, outcome)
    }
}

/// Sends the plan's acts as the job commits steps; owns the added agent's group.
struct Driver<'a> {
    bench: &'a Bench<'a>,
    plan: &'a MembershipPlan,
    dir: PathBuf,
    next_look: Instant,
    outcome: Outcome,
    agent: Option<Group>,
    problems: Vec<String>,
}

impl Driver<'_> {
    /// Called between looks at the running `train`: sends the act that is due, if one is.
    fn tick(&mut self) {
        if Instant::now() < self.next_look {
            return;
        }
        self.next_look = Instant::now() + LOOK;
        let committed = committed_step(&self.dir);
        let Some(act) = self.plan.due(committed, self.outcome.sent.len()) else {
            return;
        };
        self.outcome.sent.push(Sent {
            act,
            after_step: committed,
        });
        let result = match act {
            Act::Drain => self.drain(),
            Act::Join => self.join(),
        };
        if let Err(e) = result {
            self.problems.push(format!("{e:#}"));
        }
    }

    /// `oobleck ARGS` to its exit (bounded), logged to `drain-join-LOG.std{out,err}`.
    fn tool(&self, args: &[String], log: &str) -> Result<(TrainProcess, PathBuf)> {
        let b = self.bench;
        let cmd = format!("{} {}", b.oobleck.display(), args.join(" "));
        eprintln!("bench recovery: {cmd}");
        b.commands.borrow_mut().push(cmd);
        let log = b.scratch.root.join(format!("drain-join-{log}"));
        let p = TrainProcess::spawn(&b.reaper, &b.oobleck, args, &log)?;
        Ok((p, log))
    }

    fn drain(&mut self) -> Result<()> {
        let node = self.plan.drain_node.to_string();
        let args = ["drain", &node, "--run", &self.dir.display().to_string()].map(String::from);
        let (p, log) = self.tool(&args, "drain")?;
        let exit = p.wait(TOOL_TIMEOUT)?;
        if !exit.status.success() {
            bail!(
                "oobleck drain {node} exited with {}: {}",
                exit.status,
                tail(&log.with_extension("stderr"), 3).replace('\n', " / ")
            );
        }
        Ok(())
    }

    fn join(&mut self) -> Result<()> {
        let args = ["add-node", "--run", &self.dir.display().to_string()].map(String::from);
        let (p, log) = self.tool(&args, "add-node")?;
        let (exit, group) = p.wait_leaving(TOOL_TIMEOUT)?;
        // Whatever happened, what it left in its group is killed at the latest on drop.
        self.agent = Some(group);
        if !exit.status.success() {
            bail!(
                "oobleck add-node exited with {}: {}",
                exit.status,
                tail(&log.with_extension("stderr"), 3).replace('\n', " / ")
            );
        }
        let said = std::fs::read_to_string(log.with_extension("stdout")).unwrap_or_default();
        let pid = agent_pid(&said)
            .with_context(|| format!("no agent pid in oobleck add-node's output {said:?}"))?;
        self.outcome.agent_pid = Some(pid);
        Ok(())
    }

    /// After `train` exited: the added agent must exit too; and every act must have been sent.
    fn finish(mut self) -> (Outcome, Vec<String>) {
        if let (Some(group), Some(pid)) = (self.agent.as_mut(), self.outcome.agent_pid) {
            self.outcome.agent_exit_s = group.wait_gone(&[pid], AGENT_EXIT);
            if self.outcome.agent_exit_s.is_none() {
                self.problems.push(format!(
                    "the agent oobleck add-node started (pid {pid}) was still running {} s \
                     after train exited; killed",
                    AGENT_EXIT.as_secs()
                ));
            }
        }
        let sent = self.outcome.sent.len();
        let planned = self.plan.acts().len();
        if sent < planned {
            self.problems.push(format!(
                "train exited at step {} with {sent} of the {planned} acts sent",
                committed_step(&self.dir)
            ));
        }
        (self.outcome, self.problems)
    }
}

/// The newest committed step of the run in `dir` (0 before the first, or unreadable).
pub(super) fn committed_step(dir: &Path) -> u64 {
    let text = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap_or_default();
    parse_metrics(&text)
        .ok()
        .and_then(|m| m.iter().map(|m| m.step).max())
        .unwrap_or(0)
}

/// The pid in `started a node agent (pid N) ...`.
fn agent_pid(said: &str) -> Option<u32> {
    said.split("(pid ").nth(1)?.split(')').next()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_agent_pid_is_read_from_add_nodes_line() {
        let said = "started a node agent (pid 31760) for the job at 127.0.0.1:44761; it is \
                    admitted at a step boundary. Its log: run1/logs/added-agent-1.log\n";
        assert_eq!(agent_pid(said), Some(31760));
        assert_eq!(agent_pid("started a node agent"), None);
    }
}
