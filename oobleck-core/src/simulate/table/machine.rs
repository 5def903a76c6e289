//! The authors' event loop, one state machine for the three simulators. Each handler mirrors
//! the Python method of the same name (`simulate_spot_instance_remove`, ...); where the three
//! files differ, the handler branches on [`Flavor`]. Behaviour the Python gets wrong on
//! purpose or by accident is kept (see the README's "Quirks"); only its crashes are not: where
//! Python would raise (a removal before the first step, no step at all), we go on and say so
//! in a note.

mod flavors;

use super::inputs::TableInputs;
use super::pyheap::{HeapKey, PyHeap};
use crate::simulate::trace::{Change, Trace};

/// Which of the three simulator files the run follows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Flavor {
    Oobleck,
    Varuna,
    Bamboo,
}

/// The driver parameters one eval script passes to the simulator's constructor.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Params {
    pub steps_per_run: i64,
    pub hard_stop: bool,
    /// Varuna: losing a node does not roll back to the last checkpoint.
    pub no_fallback: bool,
    /// Varuna: checkpoints cost nothing.
    pub no_ckpt_overhead: bool,
    pub checkpoint_per_iter: i64,
}

/// `EventKind` values; the heap orders by (time, kind).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Add = 1,
    Remove = 2,
    Ready = 4,
    GlobalTimeout = 5,
    LocalTimeout = 6,
    StepComplete = 7,
    CheckpointComplete = 8,
}

#[derive(Debug, Clone)]
struct Event {
    delta: i64,
    kind: Kind,
    /// The node of an add, remove or ready event.
    node: String,
    /// The rendezvous version a step belongs to.
    version: u64,
}

impl HeapKey for Event {
    fn key(&self) -> (i64, u8) {
        (self.delta, self.kind as u8)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum NodeStatus {
    Creating,
    Ready,
    Running,
}

#[derive(Debug, Clone)]
struct Instance {
    name: String,
    status: NodeStatus,
    coords: Vec<(usize, usize)>,
}

impl Instance {
    fn active(&self) -> bool {
        self.status != NodeStatus::Creating
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Status {
    Stopped,
    Rendezvous,
    Running,
}

/// Why the loop ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Ending {
    HardStop,
    StepsPerRun,
    EventsExhausted,
}

/// The time counters the simulators print, in milliseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct Accumulators {
    pub effective: f64,
    pub rebalance: f64,
    pub restart: f64,
    pub checkpoint: f64,
    pub redundant: f64,
    pub fallback_loss: f64,
    pub idle_gpu: f64,
}

impl Accumulators {
    pub fn sum(&self) -> f64 {
        self.effective
            + self.rebalance
            + self.restart
            + self.checkpoint
            + self.redundant
            + self.fallback_loss
            + self.idle_gpu
    }
}

/// What one run leaves behind, in the simulator's own terms.
#[derive(Debug, Clone)]
pub(crate) struct Run {
    pub average: f64,
    pub acc: Accumulators,
    pub start_delta: Option<i64>,
    /// `performance_xs[-1]` in milliseconds (the last step completion).
    pub last_step_ms: f64,
    pub span_ms: f64,
    pub ending_delta: i64,
    pub stop: Ending,
    pub steps: i64,
    pub fatal_failures: u64,
    pub removals: u64,
    pub local_reconfigurations: u64,
    /// The performance series as the simulator leaves it (hours, samples/s).
    pub xs: Vec<f64>,
    pub ys: Vec<f64>,
    /// Trace events the loop handled.
    pub handled: Vec<(i64, Change, String)>,
    pub removal_before_first_step: bool,
    pub step_with_no_active_node: bool,
}

const MS_PER_HOUR: f64 = 3_600_000.0;

pub(crate) struct Machine<'a> {
    inp: &'a TableInputs,
    flavor: Flavor,
    p: Params,
    heap: PyHeap<Event>,
    instances: Vec<Instance>,
    status: Status,
    rendezvous: Vec<String>,
    version: u64,
    num_workers_waiting: usize,
    num_pipelines: usize,
    num_stages: usize,
    steps: i64,
    fatal: u64,
    removals: u64,
    local_reconfigs: u64,
    fallback_event: Option<(i64, i64)>,
    fallback_handled: bool,
    start_delta: Option<i64>,
    prev_step_complete: i64,
    step_delta: Option<i64>,
    curr_gpu_overhead: f64,
    local_timeout: i64,
    prev_checkpoint: Option<f64>,
    node_will_be_removed: bool,
    xs: Vec<f64>,
    ys: Vec<f64>,
    acc: Accumulators,
    handled: Vec<(i64, Change, String)>,
    removal_before_first_step: bool,
    step_with_no_active_node: bool,
}

impl<'a> Machine<'a> {
    pub fn new(inp: &'a TableInputs, flavor: Flavor, p: Params) -> Machine<'a> {
        Machine {
            inp,
            flavor,
            p,
            heap: PyHeap::new(),
            instances: Vec::new(),
            status: Status::Stopped,
            rendezvous: Vec::new(),
            version: 0,
            num_workers_waiting: 0,
            num_pipelines: 0,
            num_stages: 0,
            steps: 0,
            fatal: 0,
            removals: 0,
            local_reconfigs: 0,
            fallback_event: None,
            fallback_handled: false,
            start_delta: None,
            prev_step_complete: 0,
            step_delta: None,
            curr_gpu_overhead: 0.0,
            local_timeout: inp.local_rendezvous_timeout_ms,
            prev_checkpoint: None,
            node_will_be_removed: false,
            xs: Vec::new(),
            ys: Vec::new(),
            acc: Accumulators::default(),
            handled: Vec::new(),
            removal_before_first_step: false,
            step_with_no_active_node: false,
        }
    }

    /// `Simulator.simulate()` with a trace.
    pub fn run(mut self, trace: &Trace) -> Run {
        for e in trace.events() {
            let kind = match e.change {
                Change::Add => Kind::Add,
                Change::Remove => Kind::Remove,
            };
            self.push(e.at_ms as i64, kind, e.node.clone(), 0);
        }
        self.heap.heapify();
        // The hard stop is the last *array element*, not the latest event.
        let last = self.heap.as_slice().last().map_or(0, |e| e.delta);
        let mut stop = Ending::EventsExhausted;
        let mut delta = 0;
        while let Some(ev) = self.heap.pop() {
            delta = ev.delta;
            if self.p.hard_stop && delta >= last {
                stop = Ending::HardStop;
                break;
            }
            self.handle(ev);
            if self.steps == self.p.steps_per_run {
                stop = Ending::StepsPerRun;
                break;
            }
        }
        self.finish(delta, stop)
    }

    fn handle(&mut self, ev: Event) {
        let d = ev.delta;
        match ev.kind {
            Kind::Add => {
                self.handled.push((d, Change::Add, ev.node.clone()));
                self.add(d, ev.node);
            }
            Kind::Remove => {
                self.handled.push((d, Change::Remove, ev.node.clone()));
                self.remove(d, &ev.node);
            }
            Kind::Ready => self.ready(d, &ev.node),
            Kind::GlobalTimeout => self.rendezvous_timeout(d, true),
            Kind::LocalTimeout => self.rendezvous_timeout(d, false),
            Kind::StepComplete => self.step_complete(d, ev.version),
            Kind::CheckpointComplete => {}
        }
    }

    fn finish(self, ending_delta: i64, stop: Ending) -> Run {
        let last_h = self.xs.last().copied().unwrap_or(0.0);
        let span_h = match self.start_delta {
            Some(s) if !self.xs.is_empty() => last_h - s as f64 / MS_PER_HOUR,
            _ => 0.0,
        };
        Run {
            average: calculate_average(&self.xs, &self.ys, span_h),
            acc: self.acc,
            start_delta: self.start_delta,
            last_step_ms: last_h * MS_PER_HOUR,
            span_ms: span_h * MS_PER_HOUR,
            ending_delta,
            stop,
            steps: self.steps,
            fatal_failures: self.fatal,
            removals: self.removals,
            local_reconfigurations: self.local_reconfigs,
            xs: self.xs,
            ys: self.ys,
            handled: self.handled,
            removal_before_first_step: self.removal_before_first_step,
            step_with_no_active_node: self.step_with_no_active_node,
        }
    }

    fn push(&mut self, delta: i64, kind: Kind, node: String, version: u64) {
        self.heap.push(Event {
            delta,
            kind,
            node,
            version,
        });
    }

    fn num_active(&self) -> usize {
        self.instances.iter().filter(|i| i.active()).count()
    }

    fn find(&self, name: &str) -> Option<usize> {
        self.instances.iter().position(|i| i.name == name)
    }

    /// The per-model `*_simulate_step_delta`: step time (and Varuna's restart cost and idle
    /// GPUs) from the number of ready or running nodes.
    fn simulate_step_delta(&mut self) {
        let n = self.num_active();
        let row = TableInputs::row(n);
        self.step_delta = Some(self.inp.step_delta_ms[row]);
        let exact = (super::inputs::MIN_NODES..=super::inputs::MAX_NODES).contains(&n);
        self.curr_gpu_overhead = match &self.inp.idle_gpus_by_nodes {
            Some(t) if exact => t[row],
            _ => 0.0,
        };
        if let Some(t) = &self.inp.local_rendezvous_timeout_by_nodes {
            self.local_timeout = t[row];
        }
    }

    fn add(&mut self, d: i64, name: String) {
        let inst = Instance {
            name: name.clone(),
            status: NodeStatus::Creating,
            coords: Vec::new(),
        };
        match self.find(&name) {
            Some(i) => self.instances[i] = inst,
            None => self.instances.push(inst),
        }
        self.push(d + self.inp.spot_instance_creation_ms, Kind::Ready, name, 0);
    }

    fn ready(&mut self, d: i64, name: &str) {
        let Some(i) = self.find(name) else {
            return; // removed while it was being created
        };
        self.instances[i].status = NodeStatus::Ready;
        match self.status {
            Status::Stopped => self.rendezvous_start(d, true),
            Status::Rendezvous => self.rendezvous.push(name.to_string()),
            Status::Running => self.num_workers_waiting += 1,
        }
    }

    fn remove(&mut self, d: i64, name: &str) {
        let Some(i) = self.find(name) else {
            return; // Trace::parse guarantees the node is present
        };
        let inst = self.instances.remove(i);
        self.removals += 1;
        match self.flavor {
            Flavor::Oobleck => {
                // The Python heapifies here (to look for an in-flight step); heapify can
                // reorder equal events, so it is kept.
                self.heap.heapify();
                self.acc.fallback_loss += self.step_delta_or_note() as f64;
                self.fatal_failure(d);
            }
            Flavor::Varuna => self.varuna_remove(d),
            Flavor::Bamboo => self.bamboo_remove(d, inst),
        }
    }

    fn step_delta_or_note(&mut self) -> i64 {
        self.step_delta.unwrap_or_else(|| {
            self.removal_before_first_step = true;
            0
        })
    }

    fn fatal_failure(&mut self, d: i64) {
        self.fatal += 1;
        self.rendezvous_start(d, true);
    }

    fn rendezvous_start(&mut self, d: i64, global: bool) {
        self.status = Status::Rendezvous;
        self.rendezvous_restart();
        self.timeout_event(d, global);
    }

    fn rendezvous_restart(&mut self) {
        self.rendezvous = self
            .instances
            .iter()
            .filter(|i| i.active())
            .map(|i| i.name.clone())
            .collect();
    }

    /// `create_global_rendezvous_timeout_event` / `create_local_...`: each system charges a
    /// different counter and waits a different time.
    fn timeout_event(&mut self, d: i64, global: bool) {
        let inp = self.inp;
        let (wait, kind) = match (self.flavor, global) {
            (Flavor::Oobleck, true) => {
                let w = inp.global_rendezvous_timeout_ms + self.local_timeout;
                self.acc.rebalance += w as f64;
                (w, Kind::GlobalTimeout)
            }
            (Flavor::Varuna, true) => {
                let w = self.local_timeout - inp.checkpointing_overhead_ms;
                self.acc.restart += w as f64;
                (w, Kind::GlobalTimeout)
            }
            (Flavor::Bamboo, true) => {
                let w = inp.global_rendezvous_timeout_ms;
                self.acc.restart += w as f64;
                (w, Kind::GlobalTimeout)
            }
            (Flavor::Bamboo, false) => {
                self.acc.rebalance += self.local_timeout as f64;
                (self.local_timeout, Kind::LocalTimeout)
            }
            (_, false) => (self.local_timeout, Kind::LocalTimeout),
        };
        self.push(d + wait, kind, String::new(), 0);
    }

    fn rendezvous_timeout(&mut self, d: i64, global: bool) {
        if self.rendezvous.iter().any(|n| self.find(n).is_none()) {
            // A member left during the rendezvous: start over (charged again).
            self.rendezvous_restart();
            return self.timeout_event(d, global);
        }
        self.assign_coordinates();
        self.fallback_event = None;
        self.fallback_handled = false;
        self.version += 1;
        self.rendezvous.clear();
        if self.num_pipelines == 0 {
            self.status = Status::Stopped;
            return;
        }
        self.status = Status::Running;
        self.simulate_step_delta();
        self.step_event(d);
        if self.start_delta.is_none() {
            self.start_delta = Some(d);
            self.prev_step_complete = d;
        }
    }

    /// Pipelines of `num_stages_target` stages from the rendezvous members, in order; the rest
    /// wait. (An empty member list, e.g. a second timeout at the same time, stops the job.)
    fn assign_coordinates(&mut self) {
        let target = self.inp.num_stages_target;
        let (pipes, stages) = if self.rendezvous.len() < target {
            (0, 0)
        } else {
            (self.rendezvous.len() / target, target)
        };
        let mut next = 0usize;
        let mut waiting = 0;
        for name in self.rendezvous.clone() {
            let Some(i) = self.find(&name) else { continue };
            let inst = &mut self.instances[i];
            if next < pipes * stages {
                inst.coords = vec![(next / stages, next % stages)];
                inst.status = NodeStatus::Running;
                next += 1;
            } else {
                inst.coords.clear();
                inst.status = NodeStatus::Ready;
                waiting += 1;
            }
        }
        self.num_pipelines = pipes;
        self.num_stages = stages;
        self.num_workers_waiting = waiting;
    }

    /// `create_training_step_complete_event`: the step is charged when it is scheduled.
    fn step_event(&mut self, d: i64) {
        let s = self.step_delta.unwrap_or(0);
        if self.flavor == Flavor::Bamboo {
            self.acc.effective += s as f64 * (1.0 - self.inp.redundant_ratio);
            self.acc.redundant += s as f64 * self.inp.redundant_ratio;
        } else {
            self.acc.effective += s as f64;
        }
        self.push(d + s, Kind::StepComplete, String::new(), self.version);
    }

    fn step_complete(&mut self, d: i64, version: u64) {
        if version != self.version {
            return; // a step of an earlier configuration
        }
        if self.flavor == Flavor::Bamboo && self.bamboo_slow_step(d, version) {
            return;
        }
        self.steps += 1;
        let dur = d - self.prev_step_complete;
        let tput = if dur == 0 {
            0.0 // only Bamboo guards this in Python; elsewhere a step always lasts > 0 ms
        } else {
            self.inp.samples_per_step / (dur as f64 / 1000.0)
        };
        self.xs.push(self.prev_step_complete as f64 / MS_PER_HOUR);
        self.ys.push(tput);
        self.xs.push(d as f64 / MS_PER_HOUR);
        self.ys.push(tput);
        let d = match self.flavor {
            Flavor::Varuna => self.varuna_after_step(d, dur),
            _ => d,
        };
        self.prev_step_complete = d;
        if self.flavor == Flavor::Bamboo && self.bamboo_should_reconfigure() {
            self.local_reconfigs += 1;
            self.rendezvous_start(d, false);
        } else {
            self.step_event(d);
        }
    }
}

/// `calculate_average`: pairs of points (start, end) weighted by their span, using the end
/// point's value, over `duration` (0 when the span is empty).
pub(crate) fn calculate_average(xs: &[f64], ys: &[f64], duration: f64) -> f64 {
    if duration == 0.0 {
        return 0.0;
    }
    let n = xs.len().min(ys.len());
    let total: f64 = (1..n).step_by(2).map(|i| (xs[i] - xs[i - 1]) * ys[i]).sum();
    total / duration
}
