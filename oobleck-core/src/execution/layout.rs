//! Who holds what: pipelines of stages bound to ranks, and the microbatches each pipeline runs.
//!
//! A [`Layout`] is the execution-side view of a plan for one iteration. It is pure data, checked
//! once ([`Layout::new`]), and everything the runtime derives from it (neighbours, the holder
//! set of every layer, gradient buckets, which rank counts which parameter in the global norm)
//! is a function of it, the same on every rank.

use std::collections::BTreeSet;
use std::ops::Range;

use oobleck_comm::Rank;

use crate::planning::Plan;
use crate::{Error, Result};

/// One stage of a pipeline: a contiguous range of layers on `g = ranks.len()` devices, which
/// split every microbatch along the batch dimension (`schedule::rows`; device `d` is
/// `ranks[d]`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StageSpec {
    pub layers: Range<usize>,
    pub ranks: Vec<Rank>,
}

impl StageSpec {
    /// A stage on one device.
    pub fn single(layers: Range<usize>, rank: Rank) -> Self {
        Self {
            layers,
            ranks: vec![rank],
        }
    }
}

/// One pipeline: its stages in order and the global microbatch ids it runs each iteration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PipelineSpec {
    pub stages: Vec<StageSpec>,
    /// A contiguous run of `0..B` (DESIGN.md section 4: pipeline `p` takes a contiguous run).
    pub microbatches: Range<u32>,
}

/// All pipelines of one iteration. Every pipeline is a full replica of the model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    num_layers: usize,
    total_microbatches: u32,
    pipelines: Vec<PipelineSpec>,
}

/// Consecutive layers that have the same holder set: their gradients travel as one buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bucket {
    pub layers: Range<usize>,
    /// Holders in pipeline order, then device order (every device of the holding stage of
    /// each pipeline). `holders[0]` counts these layers' parameters in the global norm.
    pub holders: Vec<Rank>,
}

/// Where one rank sits in a layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Position {
    pub pipeline: usize,
    pub stage: usize,
    /// Device index inside the stage.
    pub device: usize,
}

impl Layout {
    /// Checks that every pipeline covers `0..num_layers` with consecutive non-empty stages,
    /// that no rank appears twice, and that the microbatch runs partition `0..total` in
    /// pipeline order with at least one microbatch each.
    pub fn new(
        num_layers: usize,
        total_microbatches: u32,
        pipelines: Vec<PipelineSpec>,
    ) -> Result<Self> {
        let bad = |m: String| Err(Error::Msg(format!("execution layout: {m}")));
        if num_layers == 0 {
            return bad("a model needs at least one layer".into());
        }
        if pipelines.is_empty() {
            return bad("no pipelines".into());
        }
        let mut ranks = BTreeSet::new();
        let mut next_mb = 0u32;
        for (p, pipe) in pipelines.iter().enumerate() {
            if pipe.stages.is_empty() {
                return bad(format!("pipeline {p} has no stages"));
            }
            let mut next_layer = 0;
            for (s, st) in pipe.stages.iter().enumerate() {
                if st.layers.start != next_layer || st.layers.is_empty() {
                    return bad(format!(
                        "pipeline {p} stage {s} holds layers {:?}; expected a non-empty range starting at {next_layer}",
                        st.layers
                    ));
                }
                next_layer = st.layers.end;
                if st.ranks.is_empty() {
                    return bad(format!("pipeline {p} stage {s} has no devices"));
                }
                for &r in &st.ranks {
                    if !ranks.insert(r) {
                        return bad(format!("rank {r} holds more than one stage"));
                    }
                }
            }
            if next_layer != num_layers {
                return bad(format!(
                    "pipeline {p} ends at layer {next_layer}, the model has {num_layers}"
                ));
            }
            if pipe.microbatches.start != next_mb || pipe.microbatches.is_empty() {
                return bad(format!(
                    "pipeline {p} runs microbatches {:?}; expected a non-empty run starting at {next_mb}",
                    pipe.microbatches
                ));
            }
            next_mb = pipe.microbatches.end;
        }
        if next_mb != total_microbatches {
            return bad(format!(
                "pipelines run {next_mb} microbatches, the global batch has {total_microbatches}"
            ));
        }
        Ok(Self {
            num_layers,
            total_microbatches,
            pipelines,
        })
    }

    /// The layout of a plan for a model of `num_layers` layers: pipeline `p` runs the stages
    /// of its template, stage `i` on ranks `first_rank + node * G + first_device + d` for
    /// `d < devices` (the rank numbering of `planning::Pipeline`), and takes the next
    /// `microbatches` microbatches of the global batch.
    pub fn from_plan(plan: &Plan, num_layers: usize) -> Result<Self> {
        let g = plan.devices_per_node as usize;
        let mut pipelines = Vec::with_capacity(plan.pipelines.len());
        let mut next_mb = 0u32;
        for p in &plan.pipelines {
            let t = plan
                .templates
                .iter()
                .find(|t| t.nodes == p.template_nodes)
                .ok_or_else(|| {
                    Error::Msg(format!(
                        "plan: pipeline {} uses a template of {} nodes the plan does not have",
                        p.id, p.template_nodes
                    ))
                })?;
            let stages = t
                .stages
                .iter()
                .map(|s| {
                    let base =
                        p.first_rank as usize + s.node as usize * g + s.first_device as usize;
                    if s.first_device + s.devices > plan.devices_per_node {
                        return Err(Error::Msg(format!(
                            "plan: a stage of pipeline {} uses devices {}..{} of a {}-device node",
                            p.id,
                            s.first_device,
                            s.first_device + s.devices,
                            plan.devices_per_node
                        )));
                    }
                    Ok(StageSpec {
                        layers: s.layer_start..s.layer_end,
                        ranks: (base..base + s.devices as usize).collect(),
                    })
                })
                .collect::<Result<Vec<_>>>()?;
            let end = next_mb
                .checked_add(p.microbatches)
                .ok_or_else(|| Error::Msg("plan: microbatch counts overflow".into()))?;
            pipelines.push(PipelineSpec {
                stages,
                microbatches: next_mb..end,
            });
            next_mb = end;
        }
        Self::new(num_layers, plan.global_microbatches, pipelines)
    }

    pub fn num_layers(&self) -> usize {
        self.num_layers
    }

    /// `B`: microbatches of the global batch.
    pub fn total_microbatches(&self) -> u32 {
        self.total_microbatches
    }

    pub fn pipelines(&self) -> &[PipelineSpec] {
        &self.pipelines
    }

    /// Every rank of the layout, ascending.
    pub fn ranks(&self) -> Vec<Rank> {
        let mut r: Vec<Rank> = self
            .pipelines
            .iter()
            .flat_map(|p| p.stages.iter().flat_map(|s| s.ranks.iter().copied()))
            .collect();
        r.sort_unstable();
        r
    }

    /// The pipeline and stage of `rank`, if it has one.
    pub fn position(&self, rank: Rank) -> Option<Position> {
        self.pipelines.iter().enumerate().find_map(|(p, pipe)| {
            pipe.stages.iter().enumerate().find_map(|(stage, s)| {
                s.ranks
                    .iter()
                    .position(|&r| r == rank)
                    .map(|device| Position {
                        pipeline: p,
                        stage,
                        device,
                    })
            })
        })
    }

    pub fn stage(&self, pos: Position) -> &StageSpec {
        &self.pipelines[pos.pipeline].stages[pos.stage]
    }

    /// The holders of `layer`: every device of its stage in each pipeline, in pipeline order.
    pub fn holders(&self, layer: usize) -> Vec<Rank> {
        self.pipelines
            .iter()
            .flat_map(|p| {
                p.stages
                    .iter()
                    .find(|s| s.layers.contains(&layer))
                    .map(|s| s.ranks.iter().copied())
                    .expect("Layout::new checked that every pipeline covers every layer")
            })
            .collect()
    }

    /// All buckets of the model, by ascending layer. Computed globally (not per rank) so the
    /// members of a bucket agree on its boundaries.
    pub fn buckets(&self) -> Vec<Bucket> {
        let mut out: Vec<Bucket> = Vec::new();
        for l in 0..self.num_layers {
            let h = self.holders(l);
            match out.last_mut() {
                Some(b) if b.holders == h => b.layers.end = l + 1,
                _ => out.push(Bucket {
                    layers: l..l + 1,
                    holders: h,
                }),
            }
        }
        out
    }

    /// The buckets `rank` is a member of, by ascending layer: the order it reduces them in.
    pub fn buckets_of(&self, rank: Rank) -> Vec<Bucket> {
        self.buckets()
            .into_iter()
            .filter(|b| b.holders.contains(&rank))
            .collect()
    }

    /// The group that sums a parameter used by `layers` (a tied embedding): every holder of
    /// any of them, ascending, and the rank that counts it in the global norm (the holder of
    /// its first layer in pipeline 0).
    pub fn tied_group(&self, layers: &[usize]) -> Result<(Vec<Rank>, Rank)> {
        let Some(&first) = layers.first() else {
            return Err(Error::Msg("a tied parameter lists no layers".into()));
        };
        if let Some(&l) = layers.iter().find(|&&l| l >= self.num_layers) {
            return Err(Error::Msg(format!(
                "a tied parameter names layer {l}; the model has {}",
                self.num_layers
            )));
        }
        let set: BTreeSet<Rank> = layers.iter().flat_map(|&l| self.holders(l)).collect();
        Ok((set.into_iter().collect(), self.holders(first)[0]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn st(layers: Range<usize>, rank: Rank) -> StageSpec {
        StageSpec::single(layers, rank)
    }

    /// Pipelines of 2 and 3 stages over 6 layers, 5 microbatches split 2 + 3.
    fn hetero() -> Layout {
        Layout::new(
            6,
            5,
            vec![
                PipelineSpec {
                    stages: vec![st(0..3, 0), st(3..6, 1)],
                    microbatches: 0..2,
                },
                PipelineSpec {
                    stages: vec![st(0..2, 2), st(2..3, 3), st(3..6, 4)],
                    microbatches: 2..5,
                },
            ],
        )
        .unwrap()
    }

    #[test]
    fn buckets_merge_consecutive_layers_with_the_same_holders() {
        let l = hetero();
        let b = l.buckets();
        assert_eq!(
            b,
            vec![
                Bucket {
                    layers: 0..2,
                    holders: vec![0, 2]
                },
                Bucket {
                    layers: 2..3,
                    holders: vec![0, 3]
                },
                Bucket {
                    layers: 3..6,
                    holders: vec![1, 4]
                },
            ]
        );
        assert_eq!(l.buckets_of(0).len(), 2);
        assert_eq!(l.buckets_of(3), vec![b[1].clone()]);
        assert_eq!(l.tied_group(&[0, 5]).unwrap(), (vec![0, 1, 2, 4], 0));
        assert_eq!(
            l.position(3),
            Some(Position {
                pipeline: 1,
                stage: 1,
                device: 0
            })
        );
        assert_eq!(l.ranks(), vec![0, 1, 2, 3, 4]);
    }

    #[test]
    fn rejects_gaps_duplicate_ranks_and_bad_microbatch_runs() {
        let p = |stages, microbatches| PipelineSpec {
            stages,
            microbatches,
        };
        // A gap between stages.
        assert!(Layout::new(4, 1, vec![p(vec![st(0..1, 0), st(2..4, 1)], 0..1)]).is_err());
        // Short of the last layer.
        assert!(Layout::new(4, 1, vec![p(vec![st(0..3, 0)], 0..1)]).is_err());
        // A rank twice.
        assert!(Layout::new(
            2,
            2,
            vec![p(vec![st(0..2, 0)], 0..1), p(vec![st(0..2, 0)], 1..2)]
        )
        .is_err());
        // Microbatch runs that overlap, miss some, or are empty.
        let two = |a: Range<u32>, b: Range<u32>, total| {
            Layout::new(
                2,
                total,
                vec![p(vec![st(0..2, 0)], a), p(vec![st(0..2, 1)], b)],
            )
        };
        assert!(two(0..2, 1..3, 3).is_err());
        assert!(two(0..1, 1..2, 3).is_err());
        assert!(two(0..0, 0..2, 2).is_err());
        assert!(two(0..1, 1..3, 3).is_ok());
    }
}
