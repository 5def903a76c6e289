//! Golden plans for realistic jobs (GPT-3 2.7B and 6.7B on 8-32 nodes), kept as text so
//! reviewers see when plans change. Regenerate with `UPDATE_GOLDEN=1 cargo test -p oobleck-core
//! --test planner_golden` and review the diff.

use oobleck_core::planning::report::{plan_table, templates_table};
use oobleck_core::planning::{
    analytical_profile, generate_templates, gradient_sync_ns, instantiate_with_sizes, DeviceSpec,
    Dtype, JobSpec, TemplateMicrobatches, TransformerShape,
};
use oobleck_core::reconfig::decide;
use oobleck_core::reconfig::report::reconfig_table;

struct Case {
    file: &'static str,
    model: &'static str,
    shape: TransformerShape,
    device: &'static str,
    nodes: u32,
    g: u32,
    f: u32,
    b: u32,
    global: u32,
    lose: &'static [u32],
}

fn render(c: &Case) -> String {
    let dev = DeviceSpec::named(c.device).expect("known device");
    let profile = analytical_profile(c.model, &c.shape, dev, c.b, Dtype::Bf16);
    let cluster = dev.cluster(c.g);
    let job = JobSpec {
        fault_threshold: c.f,
        microbatch_size: c.b,
        global_microbatches: c.global / c.b,
        state_bytes_per_param_byte: 8,
        template_microbatches: TemplateMicrobatches::Auto,
    };
    let set = generate_templates(&profile, &cluster, &job, c.nodes).expect("templates");
    let nodes: Vec<u32> = (0..c.nodes).collect();
    let sync = gradient_sync_ns(&profile, &cluster);
    let plan = instantiate_with_sizes(&set, &job, c.g, sync, &nodes, 0).expect("plan");
    let r = decide(&plan, c.lose, &[]).expect("reconfiguration");
    format!(
        "{} on {} nodes x {} {}, f = {}, b = {}, global batch {} samples\n\n{}\n{}\n{}",
        c.model,
        c.nodes,
        c.g,
        c.device,
        c.f,
        c.b,
        c.global,
        templates_table(&set),
        plan_table(&plan),
        reconfig_table(&r)
    )
}

const GPT3_2_7B: TransformerShape = TransformerShape::gpt(32, 2560, 32, 50257, 2048);
const GPT3_6_7B: TransformerShape = TransformerShape::gpt(32, 4096, 32, 50257, 2048);

#[test]
fn golden_plans_are_unchanged() {
    let cases = [
        Case {
            file: "gpt3-2.7b_8x1_a100-40gb.txt",
            model: "gpt3-2.7b",
            shape: GPT3_2_7B,
            device: "a100-40gb",
            nodes: 8,
            g: 1,
            f: 1,
            b: 1,
            global: 512,
            lose: &[3],
        },
        Case {
            file: "gpt3-2.7b_16x1_v100-32gb.txt",
            model: "gpt3-2.7b",
            shape: GPT3_2_7B,
            device: "v100-32gb",
            nodes: 16,
            g: 1,
            f: 3,
            b: 1,
            global: 512,
            lose: &[0, 5, 6],
        },
        Case {
            file: "gpt3-6.7b_16x8_a100-80gb.txt",
            model: "gpt3-6.7b",
            shape: GPT3_6_7B,
            device: "a100-80gb",
            nodes: 16,
            g: 8,
            f: 3,
            b: 4,
            global: 1024,
            lose: &[2, 9],
        },
        Case {
            file: "gpt3-6.7b_32x1_a100-40gb.txt",
            model: "gpt3-6.7b",
            shape: GPT3_6_7B,
            device: "a100-40gb",
            nodes: 32,
            g: 1,
            f: 3,
            b: 1,
            global: 1024,
            lose: &[1, 2, 3],
        },
    ];
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/testdata");
    let update = std::env::var_os("UPDATE_GOLDEN").is_some();
    for c in &cases {
        let got = render(c);
        let path = dir.join(c.file);
        if update {
            std::fs::write(&path, &got).expect("write golden");
            continue;
        }
        let want = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("{}: {e} (run with UPDATE_GOLDEN=1)", path.display()));
        assert!(got == want, "{} changed:\n{got}", c.file);
    }
}
