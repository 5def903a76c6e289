//! Zero-bubble scheduling (Qi et al., ICLR 2024) at the level of passes, beside 1F1B: a
//! microbatch's backward splits into B (the gradient of its input, which the previous stage
//! waits for) and W (the gradient of its weights, which nothing waits for). 1F1B runs W right
//! after its B; ZB-H1 keeps 1F1B's order of F and B and runs each W later: where the stage
//! would otherwise wait for an input, before a forward that would hold more microbatches than
//! 1F1B's peak (`min(S, m)`, its first stage's; an activation is held from its F to its W),
//! and at the end. Its peak is 1F1B's, but a later stage reaches it too, where under 1F1B it
//! holds `S - i`: a memory model for ZB-H1 must count `min(S, m)` on every stage. With equal
//! pass times its makespan is `m (F + B + W) + (S - 1)(F + B - W)`, against 1F1B's
//! `(m + S - 1)(F + B + W)` ([`closed_form`]); with unequal ones it is never above 1F1B's and
//! never below that form (the tests' grid: at most 1.28 times it, where W > F).
//!
//! [`simulate`] decides each stage's next pass as the clock reaches it and returns the streams
//! it ran, so the ZB-H1 order of a pipeline is the order simulated with its profiled times.
//! Sends are buffered and receives blocking, as in `schedule::simulate`, whose 1F1B makespan
//! this one equals with B + W as the fused backward (a test holds them together).
//! [`stage_stream`] turns the simulated order into the instruction stream a stage runs, whose
//! B and W are `model::weight_grads`' split of the layers' backward.

use serde::{Deserialize, Serialize};

use super::Instruction;
use crate::planning::Nanos;

/// A pipeline schedule.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Schedule {
    /// One forward, one backward (B and W together).
    #[default]
    #[serde(rename = "1f1b")]
    OneFOneB,
    /// Zero-bubble H1: W deferred into the bubbles, at 1F1B's activation memory.
    ZbH1,
}

impl Schedule {
    /// Every schedule, by the name flags and files give it.
    pub const ALL: [(Schedule, &'static str); 2] =
        [(Schedule::OneFOneB, "1f1b"), (Schedule::ZbH1, "zb-h1")];

    pub fn name(self) -> &'static str {
        Self::ALL
            .iter()
            .find(|(s, _)| *s == self)
            .map(|(_, n)| *n)
            .expect("every schedule has a name")
    }
}

impl std::fmt::Display for Schedule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Schedule {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .iter()
            .find(|(_, n)| n.eq_ignore_ascii_case(s))
            .map(|(s, _)| *s)
            .ok_or_else(|| format!("no schedule {s:?}: 1f1b or zb-h1"))
    }
}

/// One pass of a microbatch on a stage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Pass {
    /// Forward.
    F,
    /// Backward to the stage's input (what the previous stage waits for).
    B,
    /// Backward to the stage's weights.
    W,
}

/// A stage's time for each pass of one microbatch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PassTimes {
    pub f: Nanos,
    pub b: Nanos,
    pub w: Nanos,
}

/// What [`simulate`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PassSimulation {
    pub makespan_ns: Nanos,
    /// Each stage's passes in the order it ran them, `(pass, microbatch)`.
    pub streams: Vec<Vec<(Pass, u32)>>,
    /// When each of those passes started.
    pub starts: Vec<Vec<Nanos>>,
    /// Each stage's time waiting for an input.
    pub idle_ns: Vec<Nanos>,
    /// Each stage's most microbatches held at once (forward done, weight gradient not yet).
    pub peak_held: Vec<u32>,
}

/// The makespan of `m` microbatches on `s` stages of equal pass times `t` (Qi et al.'s
/// closed forms; ZB-H1's holds for `W <= F + B` and `m >= s`).
pub fn closed_form(schedule: Schedule, s: u32, m: u32, t: PassTimes) -> Nanos {
    let (s, m) = (u64::from(s), u64::from(m));
    match schedule {
        Schedule::OneFOneB => (m + s - 1) * (t.f + t.b + t.w),
        Schedule::ZbH1 => m * (t.f + t.b + t.w) + (s - 1) * (t.f + t.b).saturating_sub(t.w),
    }
}

/// Stage `stage`'s ZB-H1 instruction stream of `stages` for `m` microbatches: the pass order
/// [`simulate`] runs with equal pass times and free messages (Qi et al.'s ZB-H1), each F with
/// its receive and send, each B a `BackwardInput` with its receive and the send of its
/// gradient, each W a `BackwardWeight`. Any order the simulator ran is deadlock-free on the
/// real data plane: sends are buffered there too, and every receive's send comes earlier in
/// the order of its sender.
pub fn stage_stream(stage: usize, stages: usize, m: u32) -> Vec<Instruction> {
    assert!(stage < stages, "stage {stage} out of {stages}");
    let unit = PassTimes { f: 1, b: 1, w: 1 };
    let sim = simulate(Schedule::ZbH1, &vec![unit; stages], &vec![0; stages - 1], m);
    let ends = (stage == 0, stage + 1 == stages);
    let mut out = Vec::with_capacity(5 * m as usize);
    for &(pass, mb) in &sim.streams[stage] {
        match pass {
            Pass::F => super::push_forward(&mut out, mb, ends),
            Pass::B => super::push_backward(&mut out, Instruction::BackwardInput { mb }, mb, ends),
            Pass::W => out.push(Instruction::BackwardWeight { mb }),
        }
    }
    out
}

/// One stage's progress in [`simulate`].
#[derive(Default)]
struct Stage {
    clock: Nanos,
    idle: Nanos,
    /// Index of the next F or B in its 1F1B order.
    next: usize,
    /// Microbatches whose B ran and whose W has not.
    pending_w: std::collections::VecDeque<u32>,
    held: u32,
    peak_held: u32,
    ran: Vec<(Pass, u32)>,
    starts: Vec<Nanos>,
}

/// Simulates one iteration of `m` microbatches under `schedule`. `p2p_ns[i]` is the cost of one
/// message between stages `i` and `i + 1`.
pub fn simulate(
    schedule: Schedule,
    stages: &[PassTimes],
    p2p_ns: &[Nanos],
    m: u32,
) -> PassSimulation {
    let s = stages.len();
    assert!(s > 0, "a pipeline has at least one stage");
    assert_eq!(p2p_ns.len(), s - 1, "one p2p cost per boundary");
    let mut run = Run::new(schedule, stages, p2p_ns, m);
    // The stage furthest behind whose next pass can be decided now goes next.
    while let Some(i) = (0..s)
        .filter(|&i| run.decidable(i))
        .min_by_key(|&i| run.st[i].clock)
    {
        run.advance(i);
    }
    for (i, stage) in run.st.iter().enumerate() {
        assert_eq!(stage.ran.len(), 3 * m as usize, "stage {i} ran every pass");
    }
    let mut sim = PassSimulation {
        makespan_ns: run.st.iter().map(|x| x.clock).max().unwrap_or(0),
        idle_ns: run.st.iter().map(|x| x.idle).collect(),
        peak_held: run.st.iter().map(|x| x.peak_held).collect(),
        streams: Vec::with_capacity(s),
        starts: Vec::with_capacity(s),
    };
    for stage in run.st {
        sim.streams.push(stage.ran);
        sim.starts.push(stage.starts);
    }
    sim
}

/// The state of one [`simulate`].
struct Run<'a> {
    schedule: Schedule,
    times: &'a [PassTimes],
    p2p_ns: &'a [Nanos],
    /// Each stage's F and B in 1F1B order (the warm-up, steady and drain of `stage_stream`).
    order: Vec<Vec<(Pass, u32)>>,
    /// When each microbatch's activation reaches stage `i`, and its gradient.
    act: Vec<Vec<Option<Nanos>>>,
    grad: Vec<Vec<Option<Nanos>>>,
    st: Vec<Stage>,
    /// 1F1B's peak of microbatches held.
    limit: u32,
}

impl<'a> Run<'a> {
    fn new(schedule: Schedule, times: &'a [PassTimes], p2p_ns: &'a [Nanos], m: u32) -> Self {
        let s = times.len();
        let order = (0..s)
            .map(|i| {
                super::stage_stream(i, s, m)
                    .into_iter()
                    .filter_map(|ins| match ins {
                        Instruction::Forward { mb } => Some((Pass::F, mb)),
                        Instruction::Backward { mb } => Some((Pass::B, mb)),
                        _ => None,
                    })
                    .collect()
            })
            .collect();
        let mut act = vec![vec![None; m as usize]; s];
        act[0].fill(Some(0));
        Run {
            schedule,
            times,
            p2p_ns,
            order,
            act,
            grad: vec![vec![None; m as usize]; s],
            st: (0..s).map(|_| Stage::default()).collect(),
            limit: s.min(m as usize) as u32,
        }
    }

    /// Whether stage `i` can choose its next pass: it has one left, and either holds a W to
    /// run or knows when its next F or B's input arrives.
    fn decidable(&self, i: usize) -> bool {
        let stage = &self.st[i];
        match self.order[i].get(stage.next) {
            None => !stage.pending_w.is_empty(),
            Some(_) if !stage.pending_w.is_empty() => true,
            Some(&(Pass::F, mb)) => self.act[i][mb as usize].is_some(),
            Some(&(_, mb)) => self.grad[i][mb as usize].is_some(),
        }
    }

    /// Runs stage `i`'s next pass: a deferred W, or its next F or B once the input is there.
    fn advance(&mut self, i: usize) {
        let t = self.times[i];
        let next = self.order[i].get(self.st[i].next).copied();
        let ready = next.and_then(|(p, mb)| match p {
            Pass::F => self.act[i][mb as usize],
            _ => self.grad[i][mb as usize],
        });
        let stage = &mut self.st[i];
        let defer_w = self.schedule == Schedule::ZbH1 && !stage.pending_w.is_empty();
        let w_first = match next {
            None => true,
            Some(_) if !defer_w => false,
            // 1F1B's peak: no forward while as many microbatches are held.
            Some((Pass::F, _)) if stage.held >= self.limit => true,
            // A bubble: the input is not there yet.
            Some(_) => ready.is_none_or(|at| at > stage.clock),
        };
        if w_first {
            let mb = stage.pending_w.pop_front().expect("a pending W");
            return run(stage, Pass::W, mb, t.w);
        }
        let (pass, mb) = next.expect("a next F or B");
        let at = ready.expect("decidable: its input's time is known");
        if at > stage.clock {
            stage.idle += at - stage.clock;
            stage.clock = at;
        }
        stage.next += 1;
        let last = i + 1 == self.times.len();
        if pass == Pass::F {
            run(stage, Pass::F, mb, t.f);
            match last {
                false => self.act[i + 1][mb as usize] = Some(stage.clock + self.p2p_ns[i]),
                true => self.grad[i][mb as usize] = Some(stage.clock), // the loss's gradient
            }
            return;
        }
        run(stage, Pass::B, mb, t.b);
        // 1F1B's backward is one pass: its gradient leaves after W too.
        match self.schedule {
            Schedule::OneFOneB => run(stage, Pass::W, mb, t.w),
            Schedule::ZbH1 => stage.pending_w.push_back(mb),
        }
        if i > 0 {
            self.grad[i - 1][mb as usize] = Some(stage.clock + self.p2p_ns[i - 1]);
        }
    }
}

fn run(stage: &mut Stage, pass: Pass, mb: u32, ns: Nanos) {
    stage.starts.push(stage.clock);
    stage.clock += ns;
    match pass {
        Pass::F => {
            stage.held += 1;
            stage.peak_held = stage.peak_held.max(stage.held);
        }
        Pass::W => stage.held -= 1,
        Pass::B => {}
    }
    stage.ran.push((pass, mb));
}

#[cfg(test)]
mod tests;
