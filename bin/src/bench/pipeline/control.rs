//! The control-plane cost of committing a step with the real `runtime::master::Master` and `runtime::node::Agent`.

use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use oobleck_core::runtime::master::{Master, MasterConfig, MasterEvent};
use oobleck_core::runtime::node::Agent;
use oobleck_core::runtime::wire::{Message, Token};
use oobleck_core::runtime::WorkerReport;

use super::table::{ms, percentile};
use super::ControlPlane;
use crate::bench::median;

/// The commit round trip with the real control plane: `agents` agents register with a master on
/// 127.0.0.1; per step every agent sends a `Ready` report, the driver waits for all of their
/// `MasterEvent::Worker`s, calls `commit_step`, and every agent receives `StepCommitted`.
/// Timed from the first send to the last `StepCommitted` received.
pub fn control_plane(agents: usize, steps: usize, timeout: Duration) -> Result<ControlPlane> {
    if agents == 0 || steps == 0 {
        bail!("the control-plane measurement needs at least one agent and one step");
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("tokio runtime")?;
    rt.block_on(async move {
        let token = Token::random();
        let mut master = Master::bind_with(
            "127.0.0.1:0".parse().expect("address"),
            MasterConfig::new(token.clone(), agents as u32),
        )
        .await?;
        let mut ags = Vec::with_capacity(agents);
        for _ in 0..agents {
            ags.push(Agent::connect(master.local_addr(), &token, timeout).await?);
        }
        master.wait_for_nodes(timeout).await?;
        let mut samples = Vec::with_capacity(steps);
        for step in 0..steps as u64 + 1 {
            let t0 = Instant::now();
            commit_one_step(&mut master, &mut ags, step, timeout).await?;
            if step > 0 {
                samples.push(ms(t0.elapsed()));
            }
        }
        drop(ags);
        master.shutdown("benchmark done", timeout).await;
        Ok(ControlPlane {
            agents,
            steps,
            ready_leg: "Worker(Ready) -> MasterEvent::Worker -> commit_step -> StepCommitted"
                .into(),
            round_trip_ms: median(&samples),
            p90_ms: percentile(&samples, 0.9),
        })
    })
}

/// One timed round: every agent reports `step` ready, the master commits it, and every agent
/// holds its `StepCommitted`.
async fn commit_one_step(
    master: &mut Master,
    ags: &mut [Agent],
    step: u64,
    timeout: Duration,
) -> Result<()> {
    let agents = ags.len();
    // Ready leg: every agent relays a `Ready` report (as the cluster's agents do for
    // their workers); the master's connection tasks turn each into a
    // `MasterEvent::Worker` for the driver, which commits once it has heard from all.
    for (rank, a) in ags.iter().enumerate() {
        let msg = Message::Worker {
            node: a.node(),
            generation: 0,
            report: WorkerReport::Ready {
                rank: rank as u32,
                step,
                loss: 0.0,
                grad_norm: 0.0,
                microbatches: vec![0, 1],
                samples: None,
                times: None,
            },
        };
        a.send(msg, timeout).await?;
    }
    let mut ready = 0;
    while ready < agents {
        match master.next_event(timeout).await? {
            MasterEvent::Worker {
                report: WorkerReport::Ready { step: s, .. },
                ..
            } if s == step => ready += 1,
            MasterEvent::Joined { .. } => {}
            other => bail!("expected StepReady({step}) events, got {other:?}"),
        }
    }
    let failed = master.commit_step(step, 0.0, false).await;
    if let Some((node, e)) = failed.into_iter().next() {
        bail!("commit_step could not reach node {node}: {e}");
    }
    for a in ags.iter_mut() {
        match a.recv(timeout).await? {
            Message::StepCommitted { step: s, .. } if s == step => {}
            other => bail!("expected StepCommitted({step}), got {other:?}"),
        }
    }
    Ok(())
}
