//! 1F1B instruction streams and an exact event simulator of one pipeline iteration; the
//! zero-bubble schedule ZB-H1 beside 1F1B at the level of passes, and its streams
//! ([`zero_bubble`]); [`schedule_stream`] gives a stage its stream under either.
//!
//! Stage `i` of `S` runs `min(S - i - 1, m)` warm-up forwards, then alternates one forward and
//! one backward, then drains the remaining backwards (the DeepSpeed `TrainSchedule` order).
//! Each forward is `RecvActivation` (not on stage 0), `Forward`, `SendActivation` (not on the
//! last stage); each backward is `RecvGradient` (not on the last stage), `Backward`,
//! `SendGradient` (not on stage 0). A stage of `g` devices splits each microbatch of `b`
//! samples into `g` contiguous row slices; when neighbouring stages have different `g`, each
//! device sends/receives exactly the overlapping rows ([`device_stream`]).
//!
//! The simulator treats sends as buffered (the sender does not wait) and receives as blocking:
//! a message sent at `t` over a link of cost `c` is available at `t + c`. Every instruction
//! starts when its stage is free and its input has arrived; the makespan is the longest path
//! through this DAG, computed exactly in integer nanoseconds.

use serde::{Deserialize, Serialize};

use crate::planning::Nanos;

pub mod zero_bubble;

pub use zero_bubble::Schedule;

/// One step of a stage's program. `mb` is the microbatch index in `0..m`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "op")]
pub enum Instruction {
    RecvActivation {
        mb: u32,
    },
    Forward {
        mb: u32,
    },
    SendActivation {
        mb: u32,
    },
    RecvGradient {
        mb: u32,
    },
    Backward {
        mb: u32,
    },
    SendGradient {
        mb: u32,
    },
    /// ZB-H1's B: the backward to the stage's input only; its `SendGradient` follows.
    BackwardInput {
        mb: u32,
    },
    /// ZB-H1's W: the weight gradients its `BackwardInput` left.
    BackwardWeight {
        mb: u32,
    },
}

/// The instruction stream of stage `stage` of `stages` under `schedule`, for `m` microbatches:
/// 1F1B's ([`stage_stream`]) or ZB-H1's ([`zero_bubble::stage_stream`]).
pub fn schedule_stream(
    schedule: Schedule,
    stage: usize,
    stages: usize,
    m: u32,
) -> Vec<Instruction> {
    match schedule {
        Schedule::OneFOneB => stage_stream(stage, stages, m),
        Schedule::ZbH1 => zero_bubble::stage_stream(stage, stages, m),
    }
}

/// The 1F1B instruction stream of stage `stage` of `stages`, for `m` microbatches.
pub fn stage_stream(stage: usize, stages: usize, m: u32) -> Vec<Instruction> {
    assert!(stage < stages, "stage {stage} out of {stages}");
    let first = stage == 0;
    let last = stage + 1 == stages;
    let warmup = ((stages - stage - 1) as u32).min(m);
    let mut out = Vec::with_capacity(6 * m as usize);
    let ends = (first, last);
    let bwd = |out: &mut Vec<Instruction>, mb| {
        push_backward(out, Instruction::Backward { mb }, mb, ends);
    };
    for mb in 0..warmup {
        push_forward(&mut out, mb, ends);
    }
    for j in 0..(m - warmup) {
        push_forward(&mut out, warmup + j, ends);
        bwd(&mut out, j);
    }
    for mb in (m - warmup)..m {
        bwd(&mut out, mb);
    }
    out
}

/// Microbatch `mb`'s forward with its receive (not on the first stage) and send (not on the
/// last); `(first, last)` says which ends the stage is.
pub(crate) fn push_forward(out: &mut Vec<Instruction>, mb: u32, (first, last): (bool, bool)) {
    if !first {
        out.push(Instruction::RecvActivation { mb });
    }
    out.push(Instruction::Forward { mb });
    if !last {
        out.push(Instruction::SendActivation { mb });
    }
}

/// Microbatch `mb`'s backward pass `pass` (1F1B's `Backward`, ZB-H1's `BackwardInput`) with
/// the receive of its output's gradient (not on the last stage) and the send of its input's
/// (not on the first).
pub(crate) fn push_backward(
    out: &mut Vec<Instruction>,
    pass: Instruction,
    mb: u32,
    (first, last): (bool, bool),
) {
    if !last {
        out.push(Instruction::RecvGradient { mb });
    }
    out.push(pass);
    if !first {
        out.push(Instruction::SendGradient { mb });
    }
}

/// Rows `[start, end)` of a microbatch of `b` samples that device `d` of `g` handles (the
/// first `b % g` devices get one more row).
pub fn rows(b: u32, g: u32, d: u32) -> (u32, u32) {
    let base = b / g;
    let extra = b % g;
    let start = d * base + d.min(extra);
    let len = base + u32::from(d < extra);
    (start, start + len)
}

/// A peer of a send/receive and the rows exchanged with it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeerRows {
    /// Device index inside the neighbouring stage.
    pub device: u32,
    pub start: u32,
    pub end: u32,
}

/// A device-level instruction: the stage instruction plus, for communication, the peers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceInstruction {
    pub instruction: Instruction,
    /// Rows of the microbatch this device computes on.
    pub rows: (u32, u32),
    /// For sends/receives: the neighbour devices and overlapping rows (empty otherwise).
    pub peers: Vec<PeerRows>,
}

/// The stream of device `device` of stage `stage` under `schedule`, with device counts
/// `devices[i]` per stage and `b` samples per microbatch.
pub fn device_stream(
    schedule: Schedule,
    stage: usize,
    devices: &[u32],
    device: u32,
    b: u32,
    m: u32,
) -> Vec<DeviceInstruction> {
    let g = devices[stage];
    let own = rows(b, g, device);
    let overlap = |other: usize| -> Vec<PeerRows> {
        let og = devices[other];
        (0..og)
            .filter_map(|d| {
                let (s, e) = rows(b, og, d);
                let (s, e) = (s.max(own.0), e.min(own.1));
                (s < e).then_some(PeerRows {
                    device: d,
                    start: s,
                    end: e,
                })
            })
            .collect()
    };
    schedule_stream(schedule, stage, devices.len(), m)
        .into_iter()
        .map(|ins| {
            let peers = match ins {
                Instruction::RecvActivation { .. } | Instruction::SendGradient { .. } => {
                    overlap(stage - 1)
                }
                Instruction::SendActivation { .. } | Instruction::RecvGradient { .. } => {
                    overlap(stage + 1)
                }
                _ => Vec::new(),
            };
            DeviceInstruction {
                instruction: ins,
                rows: own,
                peers,
            }
        })
        .collect()
}

/// Times of one stage for the simulator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct StageTimes {
    pub forward_ns: Nanos,
    pub backward_ns: Nanos,
}

/// Result of a simulation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Simulation {
    /// Time the last instruction of any stage ends.
    pub makespan_ns: Nanos,
    /// When each stage finishes.
    pub stage_end_ns: Vec<Nanos>,
    /// Time each stage spends waiting for input.
    pub stage_idle_ns: Vec<Nanos>,
}

/// Simulates one iteration of `m` microbatches. `p2p_ns[i]` is the cost of one message over
/// the boundary between stages `i` and `i + 1` (activation forward or gradient backward).
pub fn simulate(stages: &[StageTimes], p2p_ns: &[Nanos], m: u32) -> Simulation {
    let s = stages.len();
    assert!(s > 0, "a pipeline has at least one stage");
    assert_eq!(p2p_ns.len(), s - 1, "one p2p cost per boundary");
    let streams: Vec<Vec<Instruction>> = (0..s).map(|i| stage_stream(i, s, m)).collect();
    // Arrival times of messages: act[i][mb] arrives at stage i (from i-1); grad[i][mb] at
    // stage i (from i+1).
    let mut act = vec![vec![None::<Nanos>; m as usize]; s];
    let mut grad = vec![vec![None::<Nanos>; m as usize]; s];
    let mut pc = vec![0usize; s];
    let mut clock = vec![0 as Nanos; s];
    let mut idle = vec![0 as Nanos; s];
    let mut progressed = true;
    while progressed {
        progressed = false;
        for i in 0..s {
            while let Some(&ins) = streams[i].get(pc[i]) {
                match ins {
                    Instruction::RecvActivation { mb } => {
                        let Some(t) = act[i][mb as usize] else { break };
                        if t > clock[i] {
                            idle[i] += t - clock[i];
                            clock[i] = t;
                        }
                    }
                    Instruction::RecvGradient { mb } => {
                        let Some(t) = grad[i][mb as usize] else { break };
                        if t > clock[i] {
                            idle[i] += t - clock[i];
                            clock[i] = t;
                        }
                    }
                    Instruction::Forward { .. } => clock[i] += stages[i].forward_ns,
                    Instruction::Backward { .. } => clock[i] += stages[i].backward_ns,
                    Instruction::BackwardInput { .. } | Instruction::BackwardWeight { .. } => {
                        unreachable!("1F1B streams only: ZB-H1 is zero_bubble::simulate's")
                    }
                    Instruction::SendActivation { mb } => {
                        act[i + 1][mb as usize] = Some(clock[i] + p2p_ns[i]);
                    }
                    Instruction::SendGradient { mb } => {
                        grad[i - 1][mb as usize] = Some(clock[i] + p2p_ns[i - 1]);
                    }
                }
                pc[i] += 1;
                progressed = true;
            }
        }
    }
    for (i, st) in streams.iter().enumerate() {
        assert_eq!(pc[i], st.len(), "1F1B streams never deadlock");
    }
    Simulation {
        makespan_ns: clock.iter().copied().max().unwrap_or(0),
        stage_end_ns: clock,
        stage_idle_ns: idle,
    }
}

/// Provable bounds of the simulated makespan with zero p2p: `lower` = the path through the
/// slowest stage's `m` forwards and backwards, `upper` = the makespan with every stage as slow
/// as the slowest, `(m + S - 1) * w_max` (the makespan is monotone in every stage time).
pub fn makespan_bounds(stages: &[StageTimes], m: u32) -> (Nanos, Nanos) {
    let w: Vec<Nanos> = stages
        .iter()
        .map(|s| s.forward_ns + s.backward_ns)
        .collect();
    let wmax = *w.iter().max().expect("stages");
    let lower = (0..w.len())
        .map(|k| w[..k].iter().sum::<Nanos>() + u64::from(m) * w[k])
        .max()
        .expect("stages");
    let upper = (u64::from(m) + w.len() as u64 - 1) * wmax;
    (lower, upper)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stream_has_one_forward_and_backward_per_microbatch_in_1f1b_order() {
        let s = stage_stream(1, 4, 6);
        let fw: Vec<u32> = s
            .iter()
            .filter_map(|i| match i {
                Instruction::Forward { mb } => Some(*mb),
                _ => None,
            })
            .collect();
        assert_eq!(fw, vec![0, 1, 2, 3, 4, 5]);
        // Warm-up of stage 1 of 4 is 2 forwards, then the first backward follows forward 2.
        let pos_b0 = s
            .iter()
            .position(|i| *i == Instruction::Backward { mb: 0 })
            .unwrap();
        let pos_f2 = s
            .iter()
            .position(|i| *i == Instruction::Forward { mb: 2 })
            .unwrap();
        assert!(pos_f2 < pos_b0);
    }

    #[test]
    fn rows_recut_between_stages_of_different_width() {
        let ds = device_stream(Schedule::OneFOneB, 0, &[2, 4], 1, 8, 1);
        let send = ds
            .iter()
            .find(|d| matches!(d.instruction, Instruction::SendActivation { .. }))
            .unwrap();
        assert_eq!(send.rows, (4, 8));
        assert_eq!(
            send.peers,
            vec![
                PeerRows {
                    device: 2,
                    start: 4,
                    end: 6
                },
                PeerRows {
                    device: 3,
                    start: 6,
                    end: 8
                }
            ]
        );
    }
}
