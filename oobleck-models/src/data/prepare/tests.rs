use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use super::*;
use crate::data::{open_shard, FormatHint, END_OF_TEXT_ID};

pub(super) fn tok() -> Gpt2Tokenizer {
    Gpt2Tokenizer::embedded()
}

pub(super) fn jsonl(texts: &[String]) -> Vec<u8> {
    let mut out = Vec::new();
    for t in texts {
        out.extend_from_slice(
            serde_json::json!({ "id": 1, "text": t })
                .to_string()
                .as_bytes(),
        );
        out.push(b'\n');
    }
    out
}

fn gz(bytes: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    e.write_all(bytes).unwrap();
    e.finish().unwrap()
}

fn zst(bytes: &[u8]) -> Vec<u8> {
    zstd::stream::encode_all(bytes, 3).unwrap()
}

fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, bytes).unwrap();
    path
}

pub(super) fn read_opts(skip: bool) -> ReadOptions {
    ReadOptions {
        text_field: "text".into(),
        skip_bad_records: skip,
    }
}

/// Every document of one file, or the first error.
fn read_all(path: &Path, skip: bool) -> Result<(Vec<String>, u64)> {
    let src = expand_sources(&[path.display().to_string()])?.remove(0);
    let mut r = DocReader::open(&src, &read_opts(skip), Arc::new(AtomicU64::new(0)))?;
    let mut docs = Vec::new();
    while let Some(d) = r.next_doc()? {
        docs.push(d);
    }
    Ok((docs, r.skipped))
}

pub(super) fn texts(n: usize) -> Vec<String> {
    (0..n)
        .map(|i| {
            format!(
                "Document {i}: \"quoted\" text, ünïcödé and\nnew lines. {}",
                "word ".repeat(i % 7)
            )
        })
        .collect()
}

#[test]
fn plain_gzip_and_zstd_jsonl_give_the_same_documents() {
    let dir = tempfile::tempdir().unwrap();
    let docs = texts(50);
    let raw = jsonl(&docs);
    for (name, bytes) in [
        ("a.jsonl", raw.clone()),
        ("b.jsonl.gz", gz(&raw)),
        ("c.json.zst", zst(&raw)),
    ] {
        let (got, skipped) = read_all(&write(dir.path(), name, &bytes), false).unwrap();
        assert_eq!(got, docs, "{name}");
        assert_eq!(skipped, 0);
    }
    let text = write(dir.path(), "d.txt.gz", &gz(b"one whole\n\nfile"));
    assert_eq!(
        read_all(&text, false).unwrap().0,
        vec!["one whole\n\nfile".to_string()]
    );
}

#[test]
fn a_line_that_is_not_json_names_the_file_and_line() {
    let dir = tempfile::tempdir().unwrap();
    let mut raw = jsonl(&texts(3));
    raw.extend_from_slice(b"{\"text\": \"cut off\n");
    let path = write(dir.path(), "bad.jsonl", &raw);
    let err = read_all(&path, false).unwrap_err().to_string();
    assert!(err.contains("bad.jsonl, line 4: not JSON"), "{err}");
    assert!(err.contains("--skip-bad-records"), "{err}");
}

#[test]
fn a_record_without_the_field_lists_the_fields_it_has() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(
        dir.path(),
        "f.jsonl",
        b"{\"text\": \"ok\"}\n\n{\"body\": \"x\", \"id\": 2}\n",
    );
    let err = read_all(&path, false).unwrap_err().to_string();
    assert!(
        err.contains("f.jsonl, line 3: no field \"text\" (fields: body, id"),
        "{err}"
    );
}

#[test]
fn skip_bad_records_counts_and_skips_them() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(
        dir.path(),
        "s.jsonl",
        b"{\"text\": \"a\"}\nnot json\n{\"other\": 1}\n[1]\n{\"text\": 5}\n{\"text\": \"b\"}\n",
    );
    let (docs, skipped) = read_all(&path, true).unwrap();
    assert_eq!(docs, vec!["a".to_string(), "b".to_string()]);
    assert_eq!(skipped, 4);
}

#[test]
fn text_that_is_not_utf8_names_the_byte_offset() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(dir.path(), "x.txt", b"hello \xff world");
    let err = read_all(&path, false).unwrap_err().to_string();
    assert!(
        err.contains("x.txt: not UTF-8 text (invalid byte sequence at byte 6)"),
        "{err}"
    );
    let path = write(
        dir.path(),
        "x.jsonl",
        b"{\"text\": \"a\"}\n{\"text\": \"\xc3\"}\n",
    );
    let err = read_all(&path, false).unwrap_err().to_string();
    assert!(err.contains("at byte 24, line 2"), "{err}");
}

#[test]
fn truncated_gzip_and_zstd_are_errors_not_short_corpora() {
    let dir = tempfile::tempdir().unwrap();
    let raw = jsonl(&texts(400));
    for (name, bytes) in [("t.jsonl.gz", gz(&raw)), ("t.jsonl.zst", zst(&raw))] {
        let cut = &bytes[..bytes.len() * 2 / 3];
        let err = read_all(&write(dir.path(), name, cut), false)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(name) && err.contains("truncated or corrupt"),
            "{err}"
        );
    }
}

#[test]
fn a_missing_source_or_unknown_extension_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nope.jsonl").display().to_string();
    let err = expand_sources(&[missing]).unwrap_err().to_string();
    assert!(err.contains("nope.jsonl does not exist"), "{err}");
    write(dir.path(), "data.csv", b"a,b");
    let err = expand_sources(&[dir.path().display().to_string()])
        .unwrap_err()
        .to_string();
    assert!(err.contains("data.csv: unknown format"), "{err}");
    let glob = dir.path().join("*.parquet").display().to_string();
    let err = expand_sources(&[glob]).unwrap_err().to_string();
    assert!(err.contains("matches no file"), "{err}");
}

fn options(sources: &[&Path], out: &Path, shard_tokens: u64, workers: usize) -> PrepareOptions {
    PrepareOptions {
        sources: sources.iter().map(|p| p.display().to_string()).collect(),
        out: out.to_path_buf(),
        shard_tokens,
        workers,
        read: read_opts(false),
    }
}

/// The corpus of the pipeline tests: a folder of JSONL (plain, gz, zst) and a text file.
fn corpus(dir: &Path) -> (PathBuf, Vec<String>) {
    let src = dir.join("src");
    std::fs::create_dir_all(src.join("sub")).unwrap();
    let all = texts(300);
    write(&src, "a.jsonl", &jsonl(&all[..100]));
    write(&src, "b.jsonl.gz", &gz(&jsonl(&all[100..200])));
    write(&src, "c.txt", all[200].as_bytes());
    write(&src.join("sub"), "d.jsonl.zst", &zst(&jsonl(&all[201..])));
    (src, all)
}

fn shard_docs(dir: &Path, manifest: &Manifest) -> Vec<Vec<u32>> {
    let mut docs = Vec::new();
    for entry in &manifest.shards {
        let shard = open_shard(&dir.join(&entry.name), FormatHint::Detect).unwrap();
        let mut ids = Vec::new();
        shard.copy_range(0, shard.len(), &mut ids).unwrap();
        assert_eq!(ids.len() as u64, entry.tokens);
        assert_eq!(ids[0], END_OF_TEXT_ID, "{} starts a document", entry.name);
        let mut n = 0;
        for id in ids {
            if id == END_OF_TEXT_ID {
                docs.push(Vec::new());
                n += 1;
            } else {
                docs.last_mut().unwrap().push(id);
            }
        }
        assert_eq!(n, entry.documents);
    }
    docs
}

/// The shard files (`.bin`) of a prepared folder with their bytes, by name (not the
/// manifest: it names the sources).
pub(super) fn shards_of(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut shards = files_of(dir);
    shards.retain(|(name, _)| name.ends_with(".bin"));
    shards
}

fn files_of(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut out: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .map(|p| {
            (
                p.file_name().unwrap().to_string_lossy().into_owned(),
                std::fs::read(&p).unwrap(),
            )
        })
        .collect();
    out.sort();
    out
}

#[test]
fn shards_hold_each_document_s_ids_after_an_end_of_text_in_order() {
    let dir = tempfile::tempdir().unwrap();
    let (src, all) = corpus(dir.path());
    let out = dir.path().join("out");
    let s = prepare(
        &options(&[&src], &out, DEFAULT_SHARD_TOKENS, 2),
        &tok(),
        &mut |_| {},
    )
    .unwrap();
    let t = tok();
    let expected: Vec<Vec<u32>> = all.iter().map(|x| t.encode(x).unwrap()).collect();
    assert_eq!(shard_docs(&out, &s.manifest), expected);
    let m = &s.manifest;
    assert!(m.complete);
    assert_eq!((m.totals.shards, m.totals.documents), (1, 300));
    assert_eq!(m.sources.len(), 4);
    assert!(
        m.sources[3].path.ends_with("d.jsonl.zst"),
        "folders are read recursively, sorted"
    );
    assert_eq!(m.dtype, "u16");
}

#[test]
fn one_and_two_workers_write_identical_shards_and_small_shards_split_no_document() {
    let dir = tempfile::tempdir().unwrap();
    let (src, all) = corpus(dir.path());
    let (one, two) = (dir.path().join("one"), dir.path().join("two"));
    let a = prepare(&options(&[&src], &one, 500, 1), &tok(), &mut |_| {}).unwrap();
    prepare(&options(&[&src], &two, 500, 2), &tok(), &mut |_| {}).unwrap();
    assert_eq!(files_of(&one), files_of(&two));
    assert!(
        a.manifest.shards.len() > 5,
        "{} shards",
        a.manifest.shards.len()
    );
    assert!(a.manifest.shards.iter().all(|s| s.tokens <= 500));
    let t = tok();
    let expected: Vec<Vec<u32>> = all.iter().map(|x| t.encode(x).unwrap()).collect();
    assert_eq!(
        shard_docs(&one, &a.manifest),
        expected,
        "no document is split"
    );
    // A document longer than a shard gets a shard of its own, whole.
    let tiny = dir.path().join("tiny");
    let s = prepare(&options(&[&src], &tiny, 5, 1), &t, &mut |_| {}).unwrap();
    assert_eq!(s.manifest.shards.len(), 300);
    assert_eq!(shard_docs(&tiny, &s.manifest), expected);
}

#[test]
fn a_rerun_keeps_the_finished_shards_and_writes_the_same_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let (src, _) = corpus(dir.path());
    let (full, cut) = (dir.path().join("full"), dir.path().join("cut"));
    prepare(&options(&[&src], &full, 700, 2), &tok(), &mut |_| {}).unwrap();
    let first = prepare(&options(&[&src], &cut, 700, 2), &tok(), &mut |_| {}).unwrap();
    // What a kill leaves: the manifest lists the first shards; a half-written shard is a .tmp.
    let mut m = first.manifest.clone();
    for s in &m.shards[3..] {
        std::fs::remove_file(cut.join(&s.name)).unwrap();
    }
    m.shards.truncate(3);
    m.complete = false;
    m.update_totals();
    m.save(&cut).unwrap();
    write(&cut, "shard-000003.bin.tmp", b"half");
    let again = prepare(&options(&[&src], &cut, 700, 1), &tok(), &mut |_| {}).unwrap();
    assert_eq!(again.kept_shards, 3);
    assert_eq!(files_of(&full), files_of(&cut));
    let done = prepare(&options(&[&src], &cut, 700, 1), &tok(), &mut |_| {}).unwrap();
    assert!(done.already_complete);
}

#[test]
fn a_folder_prepared_from_other_sources_or_settings_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (src, _) = corpus(dir.path());
    let out = dir.path().join("out");
    prepare(&options(&[&src], &out, 700, 2), &tok(), &mut |_| {}).unwrap();
    let err = prepare(&options(&[&src], &out, 800, 2), &tok(), &mut |_| {})
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("different --shard-tokens (there: 700; now: 800)"),
        "{err}"
    );
    write(&src, "c.txt", b"changed");
    let err = prepare(&options(&[&src], &out, 700, 2), &tok(), &mut |_| {})
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("different content of source") && err.contains("c.txt"),
        "{err}"
    );
}

#[test]
fn no_documents_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let src = write(dir.path(), "empty.jsonl", b"\n\n");
    let err = prepare(
        &options(&[&src], &dir.path().join("o"), 100, 1),
        &tok(),
        &mut |_| {},
    );
    assert!(
        matches!(err, Err(PrepareError::Empty { skipped_records: 0 })),
        "{err:?}"
    );
    // Every record skipped: the message says so and names the flag that may fix it.
    let src = write(dir.path(), "body.jsonl", b"{\"body\": \"x\"}\n");
    let mut opts = options(&[&src], &dir.path().join("p"), 100, 1);
    opts.read.skip_bad_records = true;
    let err = prepare(&opts, &tok(), &mut |_| {}).unwrap_err().to_string();
    assert!(
        err.contains("all 1 records were bad") && err.contains("--text-field"),
        "{err}"
    );
}

#[test]
fn a_bad_record_stops_the_run_after_writing_what_came_before() {
    let dir = tempfile::tempdir().unwrap();
    let mut raw = jsonl(&texts(200));
    raw.extend_from_slice(b"oops\n");
    let src = write(dir.path(), "b.jsonl", &raw);
    let out = dir.path().join("o");
    let err = prepare(&options(&[&src], &out, 300, 2), &tok(), &mut |_| {}).unwrap_err();
    assert!(err.to_string().contains("b.jsonl, line 201"), "{err}");
    let m = Manifest::load(&out).unwrap().unwrap();
    assert!(!m.complete && !m.shards.is_empty());
    let mut opts = options(&[&src], &out, 300, 2);
    opts.read.skip_bad_records = true;
    let s = prepare(&opts, &tok(), &mut |_| {}).unwrap();
    assert_eq!(
        (
            s.manifest.totals.documents,
            s.manifest.totals.skipped_records
        ),
        (200, 1)
    );
}
