//! The launch recipes under `deploy/` are checked, not just shipped: the Kubernetes manifests
//! against the Kubernetes schemas offline (`kubernetes-validate --strict`, from PyPI), the
//! SkyPilot task parsed as YAML and naming only variables SkyPilot sets.
//!
//! The tools come from a Python virtual environment named by `OOBLECK_DEPLOY_VENV` (`.ci/run`
//! makes one with `pip install kubernetes-validate`, which brings PyYAML). Without it these
//! tests fail under `OOBLECK_REQUIRE_DEPLOY_CHECKS=1` (as on CI) and otherwise say they
//! checked nothing.

use std::path::{Path, PathBuf};
use std::process::Command;

/// What SkyPilot sets in a task's `run` and `setup` (its docs, "Environment variables").
const SKYPILOT_SETS: &[&str] = &[
    "SKYPILOT_NODE_RANK",
    "SKYPILOT_NODE_IPS",
    "SKYPILOT_NUM_NODES",
    "SKYPILOT_NUM_GPUS_PER_NODE",
    "SKYPILOT_TASK_ID",
    "SKYPILOT_CLUSTER_INFO",
    "SKYPILOT_SERVE_REPLICA_ID",
    "SKYPILOT_SETUP_NODE_RANK",
    "SKYPILOT_SETUP_NODE_IPS",
];

/// What a checking tool printed, stdout then stderr.
fn printed(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned() + &String::from_utf8_lossy(&o.stderr)
}

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The checking virtual environment, or `None` (and why) when there is none.
fn venv() -> Option<PathBuf> {
    let found = std::env::var_os("OOBLECK_DEPLOY_VENV")
        .map(PathBuf::from)
        .filter(|v| v.join("bin/kubernetes-validate").exists());
    if found.is_none() {
        let why = "no OOBLECK_DEPLOY_VENV with kubernetes-validate (python3 -m venv V && \
                   V/bin/pip install kubernetes-validate)";
        assert!(
            std::env::var("OOBLECK_REQUIRE_DEPLOY_CHECKS").as_deref() != Ok("1"),
            "{why}"
        );
        eprintln!("NOT CHECKED: {why}");
    }
    found
}

#[test]
fn the_kubernetes_manifests_validate_against_the_schemas() {
    let Some(venv) = venv() else { return };
    let dir = repo().join("deploy/k8s");
    let files = ["master.yaml", "nodes.yaml"].map(|f| dir.join(f));
    let o = Command::new(venv.join("bin/kubernetes-validate"))
        .arg("--strict")
        .args(&files)
        .output()
        .expect("run kubernetes-validate");
    let said = printed(&o);
    assert!(o.status.success(), "{said}");
    // Every resource of both files was checked, none skipped for an unknown kind.
    assert_eq!(said.matches(" passed for resource ").count(), 4, "{said}");
}

#[test]
fn the_skypilot_task_parses_and_names_only_variables_skypilot_sets() {
    let path = repo().join("deploy/skypilot/train.yaml");
    let text = std::fs::read_to_string(&path).unwrap();
    let mut named: Vec<&str> = text
        .match_indices("SKYPILOT_")
        .map(|(at, _)| {
            let rest = &text[at..];
            let end = rest
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(rest.len());
            &rest[..end]
        })
        .collect();
    named.sort_unstable();
    named.dedup();
    assert!(named.contains(&"SKYPILOT_NUM_GPUS_PER_NODE"), "{named:?}");
    for name in &named {
        assert!(
            SKYPILOT_SETS.contains(name),
            "{name} is not a SkyPilot variable"
        );
    }
    let Some(venv) = venv() else { return };
    let keys = "import sys, yaml; t = yaml.safe_load(open(sys.argv[1])); \
                print(sorted(t)); assert isinstance(t['num_nodes'], int); \
                assert 'train' in t['run'] and t['resources']['use_spot'] is True";
    let o = Command::new(venv.join("bin/python"))
        .args(["-c", keys])
        .arg(&path)
        .output()
        .expect("run python");
    let said = printed(&o);
    assert!(o.status.success(), "{said}");
    assert!(
        said.contains("'envs'") && said.contains("'setup'"),
        "{said}"
    );
}
