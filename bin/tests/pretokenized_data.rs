//! `train --data` on pre-tokenized files, on a 2-node local cluster: the shipped corpus's ids
//! as an llm.c shard and as a Megatron pair train with exactly the losses of the text corpus
//! (same ids, same order), the path goes into the run's config, and bad data is refused before
//! any process starts with a message naming the file and what to do.

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::{losses, run, train_cmd};
use oobleck_core::checkpoint::{latest_checkpoint, load_checkpoint};

/// All ids of the shipped corpus (the built-in one `train` uses without `--data`).
fn corpus_ids() -> Vec<u32> {
    let ds = oobleck_models::data::open_dataset(None, None).unwrap();
    let mut ids = Vec::new();
    ds.copy_tokens(0..ds.num_tokens(), &mut ids).unwrap();
    ids
}

fn u16_bytes(ids: &[u32]) -> Vec<u8> {
    ids.iter()
        .flat_map(|&t| u16::try_from(t).unwrap().to_le_bytes())
        .collect()
}

/// llm.c's layout (`write_datafile`): 256 int32 (magic 20240520, version 1, count), u16 ids.
fn write_llmc(path: &Path, ids: &[u32]) {
    let mut bytes = vec![0u8; 1024];
    bytes[0..4].copy_from_slice(&20240520i32.to_le_bytes());
    bytes[4..8].copy_from_slice(&1i32.to_le_bytes());
    bytes[8..12].copy_from_slice(&(ids.len() as i32).to_le_bytes());
    bytes.extend(u16_bytes(ids));
    std::fs::write(path, bytes).unwrap();
}

/// Megatron's layout (`_IndexWriter`): `prefix.bin` of uint16 ids, `prefix.idx` with one
/// sequence and one document per `doc` ids.
fn write_megatron(prefix: &Path, ids: &[u32], doc: usize) {
    let lengths: Vec<i32> = ids.chunks(doc).map(|c| c.len() as i32).collect();
    let mut idx = b"MMIDIDX\x00\x00".to_vec();
    idx.extend(1u64.to_le_bytes());
    idx.push(8);
    idx.extend((lengths.len() as u64).to_le_bytes());
    idx.extend((lengths.len() as u64 + 1).to_le_bytes());
    lengths.iter().for_each(|l| idx.extend(l.to_le_bytes()));
    (0..lengths.len()).for_each(|i| idx.extend(((i * doc * 2) as i64).to_le_bytes()));
    (0..=lengths.len() as i64).for_each(|d| idx.extend(d.to_le_bytes()));
    std::fs::write(prefix.with_extension("bin"), u16_bytes(ids)).unwrap();
    std::fs::write(prefix.with_extension("idx"), idx).unwrap();
}

/// Trains 2 steps on 2 nodes with `data` flags; returns the per-step losses.
fn two_steps_on_two_nodes(out: &Path, data: &[&str]) -> Vec<(u64, f64)> {
    let mut flags = vec!["--nodes", "2"];
    flags.extend(data);
    let o = run(train_cmd(out, 2, &flags), Duration::from_secs(300));
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{data:?}: {stderr}");
    let got = losses(out);
    assert_eq!(got.len(), 2, "{data:?}: {got:?}");
    got
}

#[test]
fn shards_of_the_corpus_ids_train_with_the_text_corpus_s_losses_on_two_nodes() {
    let dir = tempfile::tempdir().unwrap();
    let ids = corpus_ids();
    let llmc = dir.path().join("shakespeare_train_000000.bin");
    write_llmc(&llmc, &ids);
    // One document, as the text file is: validation holds out whole documents, so the same
    // ids give the same training only when they are the same documents.
    let mega = dir.path().join("shakespeare_text_document");
    write_megatron(&mega, &ids, ids.len());

    let text = two_steps_on_two_nodes(&dir.path().join("text"), &[]);
    let glob = dir.path().join("shakespeare_train_*.bin");
    let from_llmc = two_steps_on_two_nodes(
        &dir.path().join("llmc"),
        &["--data", glob.to_str().unwrap()],
    );
    let from_mega = two_steps_on_two_nodes(
        &dir.path().join("megatron"),
        &["--data", mega.to_str().unwrap()],
    );
    eprintln!("text {text:?}\nllm.c {from_llmc:?}\nMegatron {from_mega:?}");
    assert_eq!(from_llmc, text, "llm.c shard vs text corpus");
    assert_eq!(from_mega, text, "Megatron pair vs text corpus");

    // The run's config, which every worker and every checkpoint gets, holds the path as given.
    let ckpt = latest_checkpoint(&dir.path().join("llmc"))
        .unwrap()
        .unwrap();
    let state = load_checkpoint(&ckpt, &candle_core::Device::Cpu)
        .unwrap()
        .trainer;
    let config = state.config.expect("trainer.json echoes the config");
    assert_eq!(config["data"][0].as_str(), glob.to_str(), "{config}");
}

/// `train` with `flags` must fail before any process starts, its message holding `needles`.
fn refused(out: PathBuf, flags: &[&str], needles: &[&str]) {
    let o = run(train_cmd(&out, 2, flags), Duration::from_secs(120));
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{flags:?} should fail");
    for needle in needles {
        assert!(
            stderr.contains(needle),
            "{flags:?}: want {needle:?} in {stderr}"
        );
    }
    assert!(!stderr.contains("panicked"), "{stderr}");
}

#[test]
fn bad_token_data_is_refused_naming_the_file_and_what_to_do() {
    let dir = tempfile::tempdir().unwrap();
    let mut ids: Vec<u32> = (0..20_000).map(|i| i % 1000).collect();
    ids[777] = 60_000;
    let bad = dir.path().join("bad_ids.bin");
    write_llmc(&bad, &ids);
    refused(
        dir.path().join("r0"),
        &["--data", bad.to_str().unwrap()],
        &[
            "bad_ids.bin",
            "token id 60000 at token 777",
            "vocabulary of 50257",
        ],
    );

    let nothing = dir.path().join("fineweb_train_*.bin");
    refused(
        dir.path().join("r1"),
        &["--data", nothing.to_str().unwrap()],
        &["fineweb_train_*.bin: no file matches"],
    );

    let raw = dir.path().join("train.bin");
    std::fs::write(&raw, u16_bytes(&ids[..1000])).unwrap();
    refused(
        dir.path().join("r2"),
        &["--data", raw.to_str().unwrap()],
        &["train.bin", "--data-format u16"],
    );
}

/// A checkpoint records the identity of the tokens it was trained on; `--resume` on data whose
/// tokens changed (one id of the shard) is refused, naming the checkpoint and the data, and
/// the same data resumes.
#[test]
fn resume_refuses_data_that_changed_since_the_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let shard = dir.path().join("corpus.bin");
    let mut ids = corpus_ids();
    write_llmc(&shard, &ids);
    let data = shard.to_str().unwrap();
    let out = dir.path().join("run");
    let o = run(
        train_cmd(&out, 2, &["--nodes", "1", "--data", data]),
        Duration::from_secs(120),
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let saved = load_checkpoint(
        &latest_checkpoint(&out).unwrap().unwrap(),
        &candle_core::Device::Cpu,
    )
    .unwrap();
    assert!(saved.trainer.data_cursor["tokens_sha256"].is_string());
    let resume = [
        "--nodes",
        "1",
        "--data",
        data,
        "--resume",
        out.to_str().unwrap(),
    ];
    ids[1000] = (ids[1000] + 1) % 50000;
    write_llmc(&shard, &ids);
    let o = run(train_cmd(&out, 3, &resume), Duration::from_secs(120));
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{stderr}");
    assert!(
        stderr.contains("the data changed since") && stderr.contains(data),
        "{stderr}"
    );
    ids[1000] = (ids[1000] + 49999) % 50000;
    write_llmc(&shard, &ids);
    let o = run(train_cmd(&out, 3, &resume), Duration::from_secs(120));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

/// Two sources blended 0.7 : 0.3 with validation from a third (`--val-data`) train 2 steps on a
/// 2-node cluster; the checkpoint records every source with its identity, and a `--resume`
/// after one of them changed is refused naming that one. Weights on only some sources, or a
/// weight that is not above zero, are refused before any process starts.
#[test]
fn a_weighted_blend_trains_on_two_nodes_and_resume_names_the_source_that_changed() {
    let dir = tempfile::tempdir().unwrap();
    let ids = corpus_ids();
    let (web, code, val) = (
        dir.path().join("web.bin"),
        dir.path().join("code.bin"),
        dir.path().join("val.bin"),
    );
    write_llmc(&web, &ids[..900_000]);
    let mut code_ids = ids[900_000..1_500_000].to_vec();
    write_llmc(&code, &code_ids);
    write_llmc(&val, &ids[1_500_000..]);
    let (w, c) = (
        format!("0.7:{}", web.display()),
        format!("0.3:{}", code.display()),
    );
    let flags = [
        "--data",
        &w,
        "--data",
        &c,
        "--val-data",
        val.to_str().unwrap(),
    ];
    let out = dir.path().join("run");
    let got = two_steps_on_two_nodes(&out, &flags);
    assert!(got.iter().all(|(_, l)| l.is_finite()), "{got:?}");

    let ckpt = latest_checkpoint(&out).unwrap().unwrap();
    let trainer = load_checkpoint(&ckpt, &candle_core::Device::Cpu)
        .unwrap()
        .trainer;
    let config = trainer.config.expect("trainer.json echoes the config");
    assert_eq!(config["data"], serde_json::json!([w, c]), "{config}");
    assert_eq!(config["val_data"].as_str(), val.to_str(), "{config}");
    let sources = trainer.data_cursor["sources"].as_array().unwrap();
    let recorded: Vec<&str> = sources
        .iter()
        .map(|s| s["data"].as_str().unwrap())
        .collect();
    assert_eq!(recorded, [web.to_str().unwrap(), code.to_str().unwrap()]);

    code_ids[10] = (code_ids[10] + 1) % 50000;
    write_llmc(&code, &code_ids);
    let mut resume = vec!["--nodes", "2", "--resume", out.to_str().unwrap()];
    resume.extend(flags);
    let o = run(train_cmd(&out, 3, &resume), Duration::from_secs(120));
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{stderr}");
    assert!(stderr.contains("the data changed since"), "{stderr}");
    assert!(
        stderr.contains(&format!("source {}", code.display())),
        "{stderr}"
    );

    let unweighted = code.to_str().unwrap();
    refused(
        dir.path().join("r0"),
        &["--data", &w, "--data", unweighted],
        &["code.bin has no weight", "give every source a weight"],
    );
    let zero = format!("0:{unweighted}");
    refused(
        dir.path().join("r1"),
        &["--data", &w, "--data", &zero],
        &["--data weight 0", "above zero"],
    );
}
