//! `oobleck plan`: templates and the chosen plan for a model preset (or a profile file) on a
//! cluster shape, and the reconfiguration that would follow losing or gaining nodes.

use std::path::PathBuf;

use anyhow::{bail, Context};
use oobleck_core::planning::report::{plan_table, templates_table};
use oobleck_core::planning::{
    analytical_profile, gradient_sync_ns, instantiate_with_sizes, template::generate_templates,
    DeviceSpec, Dtype, JobSpec, ModelProfile, TemplateMicrobatches, TransformerShape,
};
use oobleck_core::reconfig::decide;
use oobleck_core::reconfig::report::reconfig_table;
use oobleck_core::simulate::policies::SimWorkload;
use oobleck_models::ModelConfig;

/// The planner's shape of a preset of `oobleck-models` (the presets `train` runs), at the
/// model's full context.
pub fn preset_shape(name: &str) -> anyhow::Result<TransformerShape> {
    let cfg = ModelConfig::preset(name)?;
    Ok(cfg.planner_shape(cfg.max_seq_len())?)
}

/// The model, the machines and the job: the flags `oobleck plan` and `oobleck simulate`
/// share.
#[derive(Debug, Clone, clap::Args)]
pub struct WorkloadArgs {
    /// Model preset (gpt2, gpt3-2.7b, opt-1.3b, gpt-tiny, ...); ignored with --profile.
    #[arg(long, default_value = "gpt3-2.7b")]
    pub model: String,
    /// A profile JSON (per-layer times and sizes) instead of an analytical one.
    #[arg(long)]
    pub profile: Option<PathBuf>,
    /// Microbatches the templates are optimised for: N, Ns (N per stage, e.g. 4s) or auto
    /// (each pipeline's share of the global batch).
    #[arg(long, default_value = "auto")]
    pub template_microbatches: TemplateMicrobatches,
    /// Devices per node (G).
    #[arg(long, default_value_t = 1)]
    pub devices_per_node: u32,
    /// Device kind: a100-40gb, a100-80gb, h100-80gb, h200-141gb, v100-32gb, cpu.
    #[arg(long, default_value = "a100-80gb")]
    pub device: String,
    /// Fault threshold f: at least f + 1 pipelines.
    #[arg(long, default_value_t = 1)]
    pub fault_threshold: u32,
    /// Samples per microbatch.
    #[arg(long, default_value_t = 1)]
    pub microbatch_size: u32,
    /// Global batch in samples (a multiple of --microbatch-size).
    #[arg(long, default_value_t = 512)]
    pub global_batch_size: u32,
    /// Training dtype of the analytical profile (f32 or bf16 with fp32 master state).
    #[arg(long, value_enum, default_value = "bf16")]
    pub dtype: crate::config::Precision,
    /// Plan for activation recomputation (`train --recompute`): each layer keeps only its
    /// input per microbatch in flight, and its backward runs its forward again.
    #[arg(long)]
    pub recompute: bool,
}

/// Plan a job: print the pipeline templates and the chosen plan.
#[derive(Debug, Clone, clap::Args)]
pub struct PlanArgs {
    #[command(flatten)]
    pub work: WorkloadArgs,
    /// Nodes in the cluster.
    #[arg(long, default_value_t = 8)]
    pub nodes: u32,
    /// Print JSON instead of tables.
    #[arg(long)]
    pub json: bool,
    /// Node ids to lose, e.g. 3,7: print the reconfiguration that follows.
    #[arg(long, value_delimiter = ',')]
    pub lose: Vec<u32>,
    /// Number of nodes joining (ids continue after the existing ones).
    #[arg(long, default_value_t = 0)]
    pub join: u32,
}

/// Everything `oobleck plan` computes; the JSON output.
#[derive(Debug, serde::Serialize)]
pub struct PlanOutput {
    pub profile_fingerprint: oobleck_core::planning::Fingerprint,
    /// Planned with activation recomputation (`--recompute`).
    pub recompute: bool,
    pub templates: oobleck_core::planning::TemplateSet,
    pub plan: oobleck_core::planning::Plan,
    pub reconfiguration: Option<oobleck_core::reconfig::ReconfigPlan>,
}

/// The planner's inputs the flags describe: the profile (analytical for a preset, or a
/// profile file), the cluster and the job.
pub fn workload(args: &WorkloadArgs) -> anyhow::Result<SimWorkload> {
    let Some(device) = DeviceSpec::named(&args.device) else {
        bail!(
            "unknown device `{}`; known: {}",
            args.device,
            DeviceSpec::names().join(", ")
        );
    };
    if args.global_batch_size.checked_rem(args.microbatch_size) != Some(0)
        || args.global_batch_size == 0
    {
        bail!(
            "--global-batch-size {} must be a positive multiple of --microbatch-size {}",
            args.global_batch_size,
            args.microbatch_size
        );
    }
    let dtype = args.dtype.dtype();
    // The bytes of a microbatch's token ids (u32), what layer 0 keeps under recomputation;
    // unknown for a profile file, where layer 0 is then charged what it keeps without.
    let (profile, ids_bytes) = match &args.profile {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading profile {}", path.display()))?;
            let p = ModelProfile::from_json(&text)
                .with_context(|| format!("validating profile {}", path.display()))?;
            check_file_fingerprint(&p, args, device.name, dtype)
                .with_context(|| format!("profile {}", path.display()))?;
            (p, u64::MAX)
        }
        None => {
            let shape = preset_shape(&args.model)?;
            let ids = 4 * u64::from(args.microbatch_size) * u64::from(shape.seq_len);
            let p = analytical_profile(&args.model, &shape, device, args.microbatch_size, dtype);
            (p, ids)
        }
    };
    let profile = if args.recompute {
        profile.with_recompute(ids_bytes)
    } else {
        profile
    };
    if device_base(&profile.fingerprint.device_kind) != device.name {
        bail!(
            "the profile was made for device `{}`, not `{}`: re-profile or pass --device {}",
            profile.fingerprint.device_kind,
            device.name,
            profile.fingerprint.device_kind
        );
    }
    let cluster = device.cluster(args.devices_per_node);
    // As `train` plans (TrainingSpec::job_spec): fp32 weights, grads, Adam m and v; bf16
    // adds the working copy the layers cast to.
    let precision = if profile.fingerprint.dtype == "bf16" {
        Dtype::Bf16
    } else {
        Dtype::F32
    };
    let job = JobSpec {
        template_microbatches: args.template_microbatches,
        ..JobSpec::training(
            args.fault_threshold,
            args.microbatch_size,
            args.global_batch_size / args.microbatch_size,
            precision,
        )
    };
    Ok(SimWorkload {
        profile,
        cluster,
        job,
    })
}

/// `cpu` of a measured `cpu:<model>x<threads>`: the planner's device the profile is for.
fn device_base(kind: &str) -> &str {
    kind.split_once(':').map_or(kind, |(base, _)| base)
}

/// A profile file must be for the microbatch, dtype and device the plan is asked for (its
/// model is whatever it measured): otherwise an error naming both fingerprints.
fn check_file_fingerprint(
    p: &ModelProfile,
    args: &WorkloadArgs,
    device: &str,
    dtype: Dtype,
) -> anyhow::Result<()> {
    let found = &p.fingerprint;
    let expected = oobleck_core::planning::Fingerprint {
        model: found.model.clone(),
        microbatch_size: args.microbatch_size,
        dtype: match dtype {
            Dtype::Bf16 => "bf16".into(),
            _ => "f32".into(),
        },
        device_kind: if device_base(&found.device_kind) == device {
            found.device_kind.clone()
        } else {
            device.to_string()
        },
    };
    p.check_fingerprint(&expected).map_err(|e| {
        anyhow::anyhow!(
            "{e}: pass the profile's --microbatch-size {} --dtype {} --device {}, or measure \
             one for this plan with `oobleck profile`",
            found.microbatch_size,
            found.dtype,
            device_base(&found.device_kind)
        )
    })
}

/// Computes the plan (no printing).
pub fn compute(args: &PlanArgs) -> anyhow::Result<PlanOutput> {
    let SimWorkload {
        profile,
        cluster,
        job,
    } = workload(&args.work)?;
    let set = generate_templates(&profile, &cluster, &job, args.nodes)?;
    let nodes: Vec<u32> = (0..args.nodes).collect();
    let sync = gradient_sync_ns(&profile, &cluster);
    let plan = instantiate_with_sizes(&set, &job, cluster.devices_per_node, sync, &nodes, 0)?;
    let reconfiguration = if args.lose.is_empty() && args.join == 0 {
        None
    } else {
        let joined: Vec<u32> = (args.nodes..args.nodes + args.join).collect();
        Some(decide(&plan, &args.lose, &joined)?)
    };
    Ok(PlanOutput {
        profile_fingerprint: profile.fingerprint,
        recompute: args.work.recompute,
        templates: set,
        plan,
        reconfiguration,
    })
}

/// Renders the output as tables.
pub fn render(out: &PlanOutput) -> String {
    let mut s = String::new();
    s.push_str(&format!("profile: {}\n", out.profile_fingerprint));
    if out.recompute {
        s.push_str("activation recomputation: each layer keeps its input, backward reruns it\n");
    }
    s.push('\n');
    s.push_str(&templates_table(&out.templates));
    s.push('\n');
    s.push_str(&plan_table(&out.plan));
    if let Some(r) = &out.reconfiguration {
        s.push('\n');
        s.push_str(&reconfig_table(r));
    }
    s
}

/// Runs `oobleck plan`.
pub fn run(args: &PlanArgs) -> anyhow::Result<()> {
    let out = compute(args)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        print!("{}", render(&out));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        plan: PlanArgs,
    }

    fn args(v: &[&str]) -> PlanArgs {
        Cli::parse_from(std::iter::once("plan").chain(v.iter().copied())).plan
    }

    #[test]
    fn plans_a_preset_and_a_loss() {
        let a = args(&["--model", "gpt3-2.7b", "--nodes", "8", "--lose", "3"]);
        let out = compute(&a).expect("plan");
        assert_eq!(out.plan.num_nodes(), 8);
        let r = out.reconfiguration.as_ref().expect("loss");
        assert_eq!(r.plan.num_nodes(), 7);
        let text = render(&out);
        assert!(text.contains("predicted iteration"));
        assert!(text.contains("lost [3]"));
    }

    /// The presets `train` runs are the presets `oobleck plan` plans, on 16 nodes of 8 H200s.
    /// The 175B models fit no device without `--recompute`: one block's activations for every
    /// microbatch in flight exceed its memory; with it, every preset plans.
    #[test]
    fn every_preset_of_the_model_library_plans() {
        let mut too_big = Vec::new();
        for name in oobleck_models::preset_names() {
            let cfg = ModelConfig::preset(name).expect(name);
            let flags = [
                "--model",
                name,
                "--nodes",
                "16",
                "--devices-per-node",
                "8",
                "--device",
                "h200-141gb",
            ];
            let recomputed = compute(&args(&[&flags[..], &["--recompute"]].concat()));
            assert_eq!(
                recomputed.map(|o| o.plan.num_nodes()).ok(),
                Some(16),
                "{name}"
            );
            match compute(&args(&flags)) {
                Ok(out) => {
                    assert_eq!(out.plan.num_nodes(), 16, "{name}");
                    assert_eq!(out.templates.layer_state_bytes.len(), cfg.num_layers());
                }
                Err(e) if e.to_string().contains("does not fit") => {
                    assert!(e.to_string().contains("--recompute"), "{e}");
                    too_big.push(name)
                }
                Err(e) => panic!("{name}: {e:#}"),
            }
        }
        assert_eq!(too_big, ["gpt3-175b", "opt-175b"]);
    }

    #[test]
    fn tiny_plans_on_cpu() {
        let a = args(&[
            "--model",
            "gpt-tiny",
            "--device",
            "cpu",
            "--nodes",
            "4",
            "--devices-per-node",
            "2",
            "--template-microbatches",
            "4s",
            "--json",
            "--join",
            "1",
        ]);
        let out = compute(&a).expect("plan");
        assert_eq!(out.reconfiguration.expect("join").plan.num_nodes(), 5);
    }

    #[test]
    fn bad_flags_are_clear_errors() {
        let e = compute(&args(&["--device", "tpu"]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("unknown device"), "{e}");
        let e = compute(&args(&["--model", "gpt5"]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("unknown model"), "{e}");
        let e = compute(&args(&["--nodes", "1", "--fault-threshold", "3"]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("nodes are too few"), "{e}");
        let e = compute(&args(&[
            "--global-batch-size",
            "7",
            "--microbatch-size",
            "2",
        ]))
        .unwrap_err()
        .to_string();
        assert!(e.contains("multiple"), "{e}");
    }
}
