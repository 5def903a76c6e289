//! Parquet sources, written here with the `parquet` crate's own writer: the same documents as
//! Parquet and as JSONL prepare into the same shard bytes; a null row is a bad record; a file
//! without the column names its columns.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use parquet::basic::{Compression, ZstdLevel};
use parquet::data_type::{ByteArray, ByteArrayType, Int64Type};
use parquet::file::properties::WriterProperties;
use parquet::file::writer::SerializedFileWriter;
use parquet::schema::parser::parse_message_type;

use super::tests::{jsonl, read_opts, shards_of, texts};
use super::*;

/// Writes `groups` (one row group each; `None` is a null text) to `path` with an `id` column
/// before the text column `field` (OPTIONAL, or REQUIRED when no value is null).
fn write_parquet(path: &Path, field: &str, codec: Compression, groups: &[Vec<Option<String>>]) {
    let nullable = groups.iter().flatten().any(Option::is_none);
    let rep = if nullable { "OPTIONAL" } else { "REQUIRED" };
    let schema = format!("message doc {{ REQUIRED INT64 id; {rep} BYTE_ARRAY {field} (UTF8); }}");
    let schema = Arc::new(parse_message_type(&schema).unwrap());
    let props = Arc::new(WriterProperties::builder().set_compression(codec).build());
    let file = std::fs::File::create(path).unwrap();
    let mut w = SerializedFileWriter::new(file, schema, props).unwrap();
    let mut id = 0i64;
    for rows in groups {
        let mut g = w.next_row_group().unwrap();
        let mut ids = g.next_column().unwrap().unwrap();
        let n = rows.len() as i64;
        let values: Vec<i64> = (id..id + n).collect();
        ids.typed::<Int64Type>()
            .write_batch(&values, None, None)
            .unwrap();
        ids.close().unwrap();
        id += n;
        let mut text = g.next_column().unwrap().unwrap();
        let values: Vec<ByteArray> = rows.iter().flatten().map(|t| t.as_str().into()).collect();
        let defs: Vec<i16> = rows.iter().map(|t| t.is_some() as i16).collect();
        text.typed::<ByteArrayType>()
            .write_batch(&values, nullable.then_some(&defs[..]), None)
            .unwrap();
        text.close().unwrap();
        g.close().unwrap();
    }
    w.close().unwrap();
}

fn opts(sources: &[&Path], out: &Path, skip: bool) -> PrepareOptions {
    PrepareOptions {
        sources: sources.iter().map(|p| p.display().to_string()).collect(),
        out: out.to_path_buf(),
        shard_tokens: 500,
        workers: 2,
        read: read_opts(skip),
    }
}

/// 150 documents in two row groups of 100 and 51 rows (snappy), row 120 (the second group's
/// 21st) null; and the 150 as JSONL.
fn fixture(dir: &Path) -> (PathBuf, PathBuf) {
    let docs = texts(150);
    let first = docs[..100].iter().cloned().map(Some).collect();
    let mut second: Vec<Option<String>> = docs[100..].iter().cloned().map(Some).collect();
    second.insert(20, None);
    let pq = dir.join("docs.parquet");
    write_parquet(&pq, "text", Compression::SNAPPY, &[first, second]);
    let js = dir.join("docs.jsonl");
    std::fs::write(&js, jsonl(&docs)).unwrap();
    (pq, js)
}

#[test]
fn parquet_and_jsonl_of_the_same_documents_prepare_into_identical_shards() {
    let dir = tempfile::tempdir().unwrap();
    let (pq, js) = fixture(dir.path());
    let (a, b) = (dir.path().join("pq"), dir.path().join("js"));
    let tok = Gpt2Tokenizer::embedded();
    let s = prepare(&opts(&[&pq], &a, true), &tok, &mut |_| {}).unwrap();
    prepare(&opts(&[&js], &b, false), &tok, &mut |_| {}).unwrap();
    assert_eq!(
        (
            s.manifest.totals.documents,
            s.manifest.totals.skipped_records
        ),
        (150, 1)
    );
    assert!(s.manifest.shards.len() > 3, "several shards: {s:?}");
    assert_eq!(shards_of(&a), shards_of(&b));
}

#[test]
fn a_null_row_names_the_file_and_row_unless_skipped() {
    let dir = tempfile::tempdir().unwrap();
    let (pq, _) = fixture(dir.path());
    let tok = Gpt2Tokenizer::embedded();
    let err = prepare(
        &opts(&[&pq], &dir.path().join("o"), false),
        &tok,
        &mut |_| {},
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("docs.parquet, row 120 (counting from 0): the text is null"),
        "{err}"
    );
    assert!(err.contains("--skip-bad-records"), "{err}");
}

#[test]
fn a_file_without_the_column_lists_its_columns_and_text_field_picks_one() {
    let dir = tempfile::tempdir().unwrap();
    let pq = dir.path().join("body.parquet");
    let rows: Vec<Option<String>> = texts(5).into_iter().map(Some).collect();
    write_parquet(
        &pq,
        "body",
        Compression::ZSTD(ZstdLevel::default()),
        &[rows],
    );
    let tok = Gpt2Tokenizer::embedded();
    let err = prepare(
        &opts(&[&pq], &dir.path().join("o"), true),
        &tok,
        &mut |_| {},
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("body.parquet: no column \"text\" (columns: id, body)"),
        "{err}"
    );
    let mut by_field = opts(&[&pq], &dir.path().join("p"), false);
    by_field.read.text_field = "body".into();
    let s = prepare(&by_field, &tok, &mut |_| {}).unwrap();
    assert_eq!(s.manifest.totals.documents, 5);
    by_field.read.text_field = "id".into();
    by_field.out = dir.path().join("q");
    let err = prepare(&by_field, &tok, &mut |_| {})
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("column \"id\" is INT64, not a string column"),
        "{err}"
    );
}
