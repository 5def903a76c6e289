//! Control-plane cost: framing a message, and a committed step's round trip over loopback.
//!
//! `cargo bench -p oobleck-core --bench control_plane`
//! What it answers: how much of a training step the control plane costs. One committed step is
//! one `StepCommitted` per agent (`commit_step_to_4_agents` measures master send -> every agent
//! has it); a plan (`plan_assignment_*`) moves once per generation. Target: the per-step cost
//! under 2% of the default run's step.

use std::net::SocketAddr;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion};
use oobleck_core::planning::{
    analytical_profile, generate_templates, gradient_sync_ns, instantiate_with_sizes, DeviceSpec,
    Dtype, JobSpec, TemplateMicrobatches, TransformerShape,
};
use oobleck_core::runtime::master::Master;
use oobleck_core::runtime::node::Agent;
use oobleck_core::runtime::wire::protocol::{self, GenerationStart, Message, Rendezvous};
use oobleck_core::runtime::wire::Token;
use oobleck_core::runtime::StateSource;

const T: Duration = Duration::from_secs(5);

/// The plan of a GPT-3 6.7B job on 32 nodes with f = 3: a realistic PlanAssignment payload.
fn plan_assignment() -> Message {
    let dev = DeviceSpec::named("a100-80gb").expect("a known device");
    let shape = TransformerShape::gpt(32, 4096, 32, 50257, 2048);
    let profile = analytical_profile("gpt3-6.7b", &shape, dev, 1, Dtype::Bf16);
    let cluster = dev.cluster(1);
    let job = JobSpec {
        fault_threshold: 3,
        microbatch_size: 1,
        global_microbatches: 128,
        state_bytes_per_param_byte: 8,
        template_microbatches: TemplateMicrobatches::Auto,
    };
    let n = 32;
    let set = generate_templates(&profile, &cluster, &job, n).expect("templates");
    let nodes: Vec<u32> = (0..n).collect();
    let sync = gradient_sync_ns(&profile, &cluster);
    let plan = instantiate_with_sizes(&set, &job, 1, sync, &nodes, 0).expect("a plan");
    Message::PlanAssignment {
        generation: plan.generation,
        plan: Box::new(plan),
        start: GenerationStart {
            rendezvous: (0..n)
                .map(|rank| Rendezvous {
                    rank,
                    addr: format!("10.0.0.{rank}:29500"),
                })
                .collect(),
            nccl_unique_id: Some(vec![0xab; 128]),
            key: oobleck_comm::SecretKey::random(),
            source: StateSource::Init,
            state_port: 7100,
            state_key: oobleck_comm::SecretKey::random(),
        },
    }
}

fn decode(frame: &[u8]) -> Message {
    let header: &[u8; protocol::HEADER_BYTES] = frame[..protocol::HEADER_BYTES]
        .try_into()
        .expect("a frame has a header");
    let len = protocol::decode_header(header).expect("a valid header");
    protocol::decode_body(&frame[protocol::HEADER_BYTES..][..len]).expect("a valid body")
}

fn framing(c: &mut Criterion) {
    let commit = Message::StepCommitted {
        step: 1234,
        generation: 2,
        last: false,
    };
    let plan = plan_assignment();
    let plan_bytes = protocol::encode_frame(&plan).expect("encodes").len();
    eprintln!("plan_assignment frame: {plan_bytes} bytes");
    let mut group = c.benchmark_group("frame_encode_decode");
    group.bench_function("step_committed", |b| {
        b.iter(|| decode(&protocol::encode_frame(&commit).expect("encodes")))
    });
    group.sample_size(20);
    group.bench_function("plan_assignment_gpt3_6.7b_32_nodes", |b| {
        b.iter(|| decode(&protocol::encode_frame(&plan).expect("encodes")))
    });
    group.finish();
}

fn commit_round_trip(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a runtime");
    let token = Token::random();
    let (master, mut agents) = rt.block_on(async {
        let addr: SocketAddr = "127.0.0.1:0".parse().expect("a literal address");
        let master = Master::bind(addr, token.clone(), 4).await.expect("bind");
        let mut agents = Vec::new();
        for _ in 0..4 {
            agents.push(
                Agent::connect(master.local_addr(), &token, T)
                    .await
                    .expect("connect"),
            );
        }
        master.wait_for_nodes(T).await.expect("nodes");
        (master, agents)
    });
    let mut step = 0u64;
    c.bench_function("commit_step_to_4_agents", |b| {
        b.iter(|| {
            rt.block_on(async {
                step += 1;
                assert!(master.commit_step(step, 0.0, false).await.is_empty());
                for agent in &mut agents {
                    match agent.recv(T).await.expect("a commit") {
                        Message::StepCommitted { step: s, .. } if s == step => {}
                        other => panic!("expected commit {step}, got {other:?}"),
                    }
                }
            })
        })
    });
}

criterion_group!(benches, framing, commit_round_trip);
criterion_main!(benches);
