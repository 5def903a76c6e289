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
        if num_layers == 0 || pipelines.is_empty() {
            return Err(Error::EmptyLayout {
                num_layers,
                pipelines: pipelines.len(),
            });
        }
        let mut ranks = BTreeSet::new();
        for (p, pipe) in pipelines.iter().enumerate() {
            let end = pipe.stages.iter().try_fold(0, |next, st| {
                (st.layers.start == next && !st.layers.is_empty()).then_some(st.layers.end)
            });
            if end != Some(num_layers) {
                return Err(Error::PipelineLayers {
                    pipeline: p,
                    stages: pipe.stages.iter().map(|s| s.layers.clone()).collect(),
                    num_layers,
                });
            }
            for (s, st) in pipe.stages.iter().enumerate() {
                if st.ranks.is_empty() {
                    return Err(Error::NoDevices {
                        pipeline: p,
                        stage: s,
                    });
                }
                if let Some(&rank) = st.ranks.iter().find(|&&r| !ranks.insert(r)) {
                    return Err(Error::DuplicateRank { rank });
                }
            }
        }
        let runs: Vec<Range<u64>> = pipelines
            .iter()
            .map(|p| u64::from(p.microbatches.start)..u64::from(p.microbatches.end))
            .collect();
        check_microbatch_runs(runs, total_microbatches)?;
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
        // Checked in u64 first, so counts that overflow u32 are reported, not wrapped.
        let mut runs = Vec::with_capacity(plan.pipelines.len());
        let mut next_mb = 0u64;
        for p in &plan.pipelines {
            runs.push(next_mb..next_mb + u64::from(p.microbatches));
            next_mb += u64::from(p.microbatches);
        }
        check_microbatch_runs(runs.clone(), plan.global_microbatches)?;
        let mut pipelines = Vec::with_capacity(plan.pipelines.len());
        for (p, run) in plan.pipelines.iter().zip(runs) {
            let t = plan
                .templates
                .iter()
                .find(|t| t.nodes == p.template_nodes)
                .ok_or_else(|| Error::PlanPipeline {
                    pipeline: p.id,
                    reason: format!(
                        "uses a template of {} nodes the plan does not have",
                        p.template_nodes
                    ),
                })?;
            let stages = t
                .stages
                .iter()
                .map(|s| {
                    let base =
                        p.first_rank as usize + s.node as usize * g + s.first_device as usize;
                    if s.first_device + s.devices > plan.devices_per_node {
                        return Err(Error::PlanPipeline {
                            pipeline: p.id,
                            reason: format!(
                                "has a stage on devices {}..{} of a {}-device node",
                                s.first_device,
                                s.first_device + s.devices,
                                plan.devices_per_node
                            ),
                        });
                    }
                    Ok(StageSpec {
                        layers: s.layer_start..s.layer_end,
                        ranks: (base..base + s.devices as usize).collect(),
                    })
                })
                .collect::<Result<Vec<_>>>()?;
            // check_microbatch_runs bounded every run by the u32 total.
            pipelines.push(PipelineSpec {
                stages,
                microbatches: run.start as u32..run.end as u32,
            });
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
        let bad = || Error::TiedLayers {
            layers: layers.to_vec(),
            num_layers: self.num_layers,
        };
        let &first = layers.first().ok_or_else(bad)?;
        if layers.iter().any(|&l| l >= self.num_layers) {
            return Err(bad());
        }
        let set: BTreeSet<Rank> = layers.iter().flat_map(|&l| self.holders(l)).collect();
        Ok((set.into_iter().collect(), self.holders(first)[0]))
    }
}

/// Checks that `runs` partition `0..total` in order with at least one microbatch each.
fn check_microbatch_runs(runs: Vec<Range<u64>>, total: u32) -> Result<()> {
    let end = runs.iter().try_fold(0, |next, r| {
        (r.start == next && !r.is_empty()).then_some(r.end)
    });
    if end != Some(u64::from(total)) {
        return Err(Error::PipelineMicrobatches { runs, total });
    }
    Ok(())
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
        // A gap between stages: the error lists the pipeline's stages.
        let err = Layout::new(4, 1, vec![p(vec![st(0..1, 0), st(2..4, 1)], 0..1)]).unwrap_err();
        assert!(
            matches!(&err, Error::PipelineLayers { pipeline: 0, stages, num_layers: 4 }
                if *stages == [0..1, 2..4]),
            "{err}"
        );
        // Short of the last layer, an empty stage, no stages at all.
        assert!(Layout::new(4, 1, vec![p(vec![st(0..3, 0)], 0..1)]).is_err());
        assert!(Layout::new(2, 1, vec![p(vec![st(0..2, 0), st(2..2, 1)], 0..1)]).is_err());
        assert!(Layout::new(2, 1, vec![p(vec![], 0..1)]).is_err());
        assert!(matches!(
            Layout::new(0, 1, vec![p(vec![], 0..1)]),
            Err(Error::EmptyLayout { num_layers: 0, .. })
        ));
        // A rank twice.
        let err = Layout::new(
            2,
            2,
            vec![p(vec![st(0..2, 0)], 0..1), p(vec![st(0..2, 0)], 1..2)],
        )
        .unwrap_err();
        assert!(matches!(err, Error::DuplicateRank { rank: 0 }), "{err}");
        // Microbatch runs that overlap, miss some, or are empty.
        let two = |a: Range<u32>, b: Range<u32>, total| {
            Layout::new(
                2,
                total,
                vec![p(vec![st(0..2, 0)], a), p(vec![st(0..2, 1)], b)],
            )
        };
        let err = two(0..2, 1..3, 3).unwrap_err();
        assert!(
            matches!(&err, Error::PipelineMicrobatches { runs, total: 3 } if *runs == [0..2, 1..3]),
            "{err}"
        );
        assert!(two(0..1, 1..2, 3).is_err());
        assert!(two(0..0, 0..2, 2).is_err());
        assert!(two(0..1, 1..3, 3).is_ok());
    }

    /// The ranks `planning::stage_leads` names are device 0 of their stage in the layout.
    mod stage_leads {
        use crate::execution::Layout;
        use crate::planning::ranks::test_plans::plan_with_stages;
        use crate::planning::{stage_leads, world_size};

        #[test]
        fn stage_leads_are_device_0_of_each_stage_even_with_two_stages_on_a_node() {
            let plan = plan_with_stages();
            assert_eq!(stage_leads(&plan, 0), vec![0, 1]);
            assert_eq!(stage_leads(&plan, 1), vec![2, 4]);
            assert!(stage_leads(&plan, 2).is_empty());
            // The same ranks the execution layout puts at device 0 of a stage.
            let layout = Layout::from_plan(&plan, 4).expect("layout");
            for rank in 0..world_size(&plan) {
                let pos = layout
                    .position(rank as usize)
                    .expect("every rank has a place");
                let lead = stage_leads(&plan, pos.pipeline).contains(&rank);
                assert_eq!(lead, pos.device == 0, "rank {rank} at {pos:?}");
            }
        }
    }
}
