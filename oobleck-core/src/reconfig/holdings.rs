//! What each device holds at the committed step: the input of every decision's copies.

use std::collections::{BTreeMap, BTreeSet};

use crate::planning::{Plan, Stage, Template};

/// Which layers each `(node, device)` holds at the committed step. [`Holdings::of`] a plan
/// is what its devices hold while it runs; the runtime passes its own record when that differs
/// (a worker that died on a surviving node holds nothing, a reconfiguration that failed during
/// its copies leaves the devices with what they held before it).
///
/// Kept per node, and a device's layers as a range when they are contiguous (a stage's always
/// are), so a 10,000-node plan's holdings take one entry per node and no set per device.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Holdings {
    g: u32,
    /// node -> per device: the layers held, `None` for nothing. No node maps to all `None`.
    by_node: BTreeMap<u32, Vec<Option<Held>>>,
}

/// The layers one device holds: contiguous `[start, end)`, or any other non-empty set. A set
/// that is contiguous is always a range, so equal holdings compare equal.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Held {
    Range(usize, usize),
    Set(BTreeSet<usize>),
}

impl Held {
    fn of(layers: BTreeSet<usize>) -> Option<Held> {
        let (first, last) = (*layers.first()?, *layers.last()?);
        if last - first + 1 == layers.len() {
            Some(Held::Range(first, last + 1))
        } else {
            Some(Held::Set(layers))
        }
    }

    pub(super) fn contains(&self, layer: usize) -> bool {
        match self {
            Held::Range(a, b) => (*a..*b).contains(&layer),
            Held::Set(s) => s.contains(&layer),
        }
    }

    fn first(&self) -> usize {
        match self {
            Held::Range(a, _) => *a,
            Held::Set(s) => *s.first().expect("a held set is not empty"),
        }
    }

    pub(super) fn iter(&self) -> Box<dyn Iterator<Item = usize> + '_> {
        match self {
            Held::Range(a, b) => Box::new(*a..*b),
            Held::Set(s) => Box::new(s.iter().copied()),
        }
    }
}

impl Holdings {
    /// What every device of `plan` holds while the plan runs: its stage's layers.
    pub fn of(plan: &Plan) -> Self {
        let mut h = Holdings::empty(plan.devices_per_node);
        let g = plan.devices_per_node as usize;
        for p in &plan.pipelines {
            let t = plan.template_of(p);
            for (j, &node) in p.nodes.iter().enumerate() {
                let mut devices = vec![None; g];
                for s in t.stages.iter().filter(|s| s.node as usize == j) {
                    for d in s.first_device..s.first_device + s.devices {
                        let slot = d as usize;
                        if slot >= devices.len() {
                            devices.resize(slot + 1, None);
                        }
                        devices[slot] = Some(Held::Range(s.layer_start, s.layer_end))
                            .filter(|_| s.layer_start < s.layer_end);
                    }
                }
                h.by_node.insert(node, devices);
            }
        }
        h.by_node.retain(|_, d| d.iter().any(Option::is_some));
        h
    }

    /// Nothing held yet, `devices_per_node` devices per node.
    pub fn empty(devices_per_node: u32) -> Self {
        Holdings {
            g: devices_per_node,
            by_node: BTreeMap::new(),
        }
    }

    /// `(node, device)` holds exactly `layers` (none: it holds nothing).
    pub fn set(&mut self, node: u32, device: u32, layers: BTreeSet<usize>) {
        let held = Held::of(layers);
        let slot = device as usize;
        let devices = self.by_node.entry(node).or_default();
        if slot >= devices.len() {
            devices.resize((self.g as usize).max(slot + 1), None);
        }
        devices[slot] = held;
        if devices.iter().all(Option::is_none) {
            self.by_node.remove(&node);
        }
    }

    /// What `(node, device)` holds.
    pub fn layers(&self, node: u32, device: u32) -> Option<BTreeSet<usize>> {
        self.held(node, device).map(|h| h.iter().collect())
    }

    /// Forgets everything `node` held (it is lost).
    pub fn drop_node(&mut self, node: u32) {
        self.by_node.remove(&node);
    }

    /// The layers no device holds, of `0..num_layers`.
    pub fn missing(&self, num_layers: usize) -> Vec<usize> {
        let mut held = vec![false; num_layers];
        for (_, h) in self.devices() {
            for l in h.iter().filter(|&l| l < num_layers) {
                held[l] = true;
            }
        }
        (0..num_layers).filter(|&l| !held[l]).collect()
    }

    /// Every device that holds something, in `(node, device)` order.
    pub(super) fn devices(&self) -> impl Iterator<Item = ((u32, u32), &Held)> {
        self.by_node.iter().flat_map(|(&node, devices)| {
            devices
                .iter()
                .enumerate()
                .filter_map(move |(d, h)| h.as_ref().map(|h| ((node, d as u32), h)))
        })
    }

    /// Calls `f(stage, device, layer)` for every layer a pipeline of template `t` on `nodes`
    /// (in stage order) needs and its device does not hold. One holdings lookup per node.
    pub(super) fn each_lacking(
        &self,
        t: &Template,
        nodes: &[u32],
        mut f: impl FnMut(&Stage, u32, usize),
    ) {
        let mut at = (u32::MAX, &[][..]);
        for s in &t.stages {
            if at.0 != s.node {
                at = (s.node, self.node(nodes[s.node as usize]));
            }
            for d in s.first_device..s.first_device + s.devices {
                let held = at.1.get(d as usize).and_then(Option::as_ref);
                for l in s.layers().filter(|&l| !held.is_some_and(|h| h.contains(l))) {
                    f(s, d, l);
                }
            }
        }
    }

    pub(super) fn held(&self, node: u32, device: u32) -> Option<&Held> {
        self.by_node.get(&node)?.get(device as usize)?.as_ref()
    }

    /// What each device of `node` holds (one lookup for all of them).
    pub(super) fn node(&self, node: u32) -> &[Option<Held>] {
        self.by_node.get(&node).map_or(&[], Vec::as_slice)
    }

    pub(super) fn first_layer(&self, node: u32) -> usize {
        self.by_node
            .get(&node)
            .into_iter()
            .flatten()
            .flatten()
            .map(Held::first)
            .min()
            .unwrap_or(usize::MAX)
    }
}
