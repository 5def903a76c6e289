//! The corpus and tokenizer compiled into the library: the same as the files in `datasets/`,
//! safe to open from several threads or processes at once into an empty cache folder, and
//! usable when no cache folder is writable (tokens in memory).
//!
//! Two cases need processes of their own: two processes racing to build one cache, and the
//! default places all unwritable (reachable only through the environment, since an explicit
//! folder that fails is an error, not a fallback). They run this test binary again as child
//! processes with `OOBLECK_CACHE_DIR` set, so no test changes the environment of this one. The
//! child is `child_opens_the_embedded_dataset`, marked `#[ignore]` only so that a plain
//! `cargo test` does not also run it on its own: it is not a skipped test, and run alone it
//! returns at once. The order of the default places itself is unit-tested without any process
//! (`data/cache_dirs.rs`).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Barrier};

use oobleck_models::data::{
    default_corpus_path, default_tokenizer_dir, open_dataset, open_tokenizer, Dataset,
    Gpt2Tokenizer, EMBEDDED_CORPUS, EMBEDDED_CORPUS_NAME, EMBEDDED_TOKENIZER_NAME,
};

/// SHA-256 of the shipped corpus's 1,562,739 GPT-2 ids as u16 LE (see `datasets/README.md`).
const CORPUS_TOKENS_SHA256: &str =
    "1413959d6fb94ab7d408e11a8cbb5ddc96c609ec5d114b7fac8904efb92f6c9a";
/// The cache file name of the shipped corpus: its name and the first 16 hex digits of its hash.
const CACHE_NAME: &str = "shakespeare.txt-6902f4796b355001.tokens";
/// Set (to a scratch folder) only in the child processes these tests start.
const CHILD_ENV: &str = "OOBLECK_TEST_EMBEDDED_CHILD";

#[derive(serde::Deserialize)]
struct Reference {
    cases: Vec<Case>,
}

#[derive(serde::Deserialize)]
struct Case {
    text: String,
}

#[test]
fn embedded_tokenizer_and_corpus_equal_the_shipped_files() {
    let file = Gpt2Tokenizer::from_path(&default_tokenizer_dir()).unwrap();
    let embedded = Gpt2Tokenizer::embedded();
    assert_eq!(embedded.hash(), file.hash());
    assert_eq!(embedded.vocab_size(), file.vocab_size());
    assert_eq!(embedded.source(), Path::new(EMBEDDED_TOKENIZER_NAME));
    assert_eq!(open_tokenizer(None).unwrap().hash(), file.hash());

    let reference: Reference = serde_json::from_slice(
        &std::fs::read(default_tokenizer_dir().join("reference_ids.json")).unwrap(),
    )
    .unwrap();
    for case in &reference.cases {
        assert_eq!(
            embedded.encode(&case.text).unwrap(),
            file.encode(&case.text).unwrap(),
            "{:?}",
            case.text
        );
    }
    let sample = &EMBEDDED_CORPUS[1_000_000..1_300_000];
    let ids = embedded.encode(sample).unwrap();
    assert_eq!(ids, file.encode(sample).unwrap());
    assert_eq!(embedded.decode(&ids).unwrap(), sample);

    assert_eq!(
        EMBEDDED_CORPUS.as_bytes(),
        std::fs::read(default_corpus_path()).unwrap()
    );
}

#[test]
fn two_threads_open_the_embedded_dataset_at_once_into_an_empty_cache() {
    let cache = tempfile::tempdir().unwrap();
    let tok = Arc::new(Gpt2Tokenizer::embedded());
    let start = Arc::new(Barrier::new(2));
    let opened: Vec<Dataset> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..2)
            .map(|_| {
                let (tok, start, dir) = (tok.clone(), start.clone(), cache.path());
                s.spawn(move || {
                    start.wait();
                    Dataset::open_embedded(tok, Some(dir)).unwrap()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for ds in &opened {
        assert_eq!(ds.tokens_sha256(), CORPUS_TOKENS_SHA256);
        assert_eq!(ds.corpus(), Path::new(EMBEDDED_CORPUS_NAME));
        assert_eq!(
            ds.cache_path(),
            Some(cache.path().join(CACHE_NAME).as_path())
        );
    }
    assert_eq!(files_in(cache.path()), vec![CACHE_NAME.to_owned()]);
}

#[test]
fn two_processes_open_the_embedded_dataset_at_once_with_a_fresh_cache_dir() {
    let tmp = tempfile::tempdir().unwrap();
    let cache = tmp.path().join("fresh-cache");
    let children: Vec<Child> = (0..2)
        .map(|i| spawn_child(&cache, &tmp.path().join(format!("child{i}"))))
        .collect();
    for child in children {
        let report = finish_child(child);
        assert_eq!(report.tokens_sha256, CORPUS_TOKENS_SHA256);
        assert_eq!(report.cache, Some(cache.join(CACHE_NAME)));
    }
    // The children's small corpus has its own cache there too; no temporary file is left.
    let names = files_in(&cache);
    let ours: Vec<&String> = names
        .iter()
        .filter(|n| n.contains("shakespeare") || n.contains(".tmp-"))
        .collect();
    assert_eq!(ours, vec![CACHE_NAME], "{names:?}");

    // A later open finds the published cache and uses it as it is.
    let path = cache.join(CACHE_NAME);
    let written = std::fs::metadata(&path).unwrap().modified().unwrap();
    let ds = Dataset::open_embedded(Arc::new(Gpt2Tokenizer::embedded()), Some(&cache)).unwrap();
    assert_eq!(ds.cache_path(), Some(path.as_path()));
    assert_eq!(
        std::fs::metadata(&path).unwrap().modified().unwrap(),
        written
    );
}

#[test]
fn an_unwritable_cache_dir_keeps_the_tokens_in_memory() {
    let tmp = tempfile::tempdir().unwrap();
    // Under a regular file no folder can be created, whoever runs the test (root included).
    let blocker = tmp.path().join("a-file");
    std::fs::write(&blocker, b"x").unwrap();
    let report = finish_child(spawn_child(
        &blocker.join("cache"),
        &tmp.path().join("child"),
    ));
    assert_eq!(report.tokens_sha256, CORPUS_TOKENS_SHA256);
    assert_eq!(report.cache, None);
    assert_eq!(report.user_corpus_cache, None);
}

/// The child process: opens the built-in dataset, and a small user corpus in the scratch
/// folder `$OOBLECK_TEST_EMBEDDED_CHILD`, both with the default cache places, and prints what
/// it got for the parent to check.
#[test]
#[ignore = "not a skipped test: the child process the two tests above start, with OOBLECK_CACHE_DIR set"]
fn child_opens_the_embedded_dataset() {
    let Some(scratch) = std::env::var_os(CHILD_ENV).map(PathBuf::from) else {
        return;
    };
    let ds = open_dataset(None, None).unwrap();
    // A line of its own: the test harness has printed the test's name without a newline.
    println!();
    println!("tokens_sha256={}", ds.tokens_sha256());
    println!("cache={}", shown(ds.cache_path()));
    std::fs::create_dir_all(&scratch).unwrap();
    let corpus = scratch.join("tiny.txt");
    std::fs::write(&corpus, "Now is the winter of our discontent\n").unwrap();
    let user = open_dataset(Some(&corpus), None).unwrap();
    assert_eq!(user.num_tokens(), 8);
    println!("user_corpus_cache={}", shown(user.cache_path()));
}

fn shown(path: Option<&Path>) -> String {
    path.map_or_else(|| "none".to_owned(), |p| p.display().to_string())
}

/// What a child printed.
struct ChildReport {
    tokens_sha256: String,
    cache: Option<PathBuf>,
    user_corpus_cache: Option<PathBuf>,
}

fn spawn_child(cache_dir: &Path, scratch: &Path) -> Child {
    Command::new(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", "child_opens_the_embedded_dataset"])
        .args(["--nocapture", "--test-threads=1"])
        .env("OOBLECK_CACHE_DIR", cache_dir)
        .env(CHILD_ENV, scratch)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

fn finish_child(child: Child) -> ChildReport {
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "child failed: {}\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let field = |key: &str| {
        stdout
            .lines()
            .find_map(|l| l.strip_prefix(key)?.strip_prefix('='))
            .unwrap_or_else(|| panic!("child printed no {key}: {stdout}"))
            .to_owned()
    };
    let path = |v: String| (v != "none").then(|| PathBuf::from(v));
    ChildReport {
        tokens_sha256: field("tokens_sha256"),
        cache: path(field("cache")),
        user_corpus_cache: path(field("user_corpus_cache")),
    }
}

/// Names of the entries of `dir`, sorted (a leftover temporary file would show here).
fn files_in(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}
