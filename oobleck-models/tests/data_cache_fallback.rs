//! Where the token cache goes when the caller names no folder. One test in its own binary
//! because it sets environment variables (no other thread reads them meanwhile).

use std::sync::Arc;

use oobleck_models::data::{default_tokenizer_dir, Dataset, Gpt2Tokenizer};

#[test]
fn cache_falls_back_to_the_user_cache_when_the_corpus_folder_is_unusable() {
    let tmp = tempfile::tempdir().unwrap();
    let xdg = tmp.path().join("xdg");
    let corpus_dir = tmp.path().join("corpus");
    std::fs::create_dir(&corpus_dir).unwrap();
    let corpus = corpus_dir.join("tiny.txt");
    std::fs::write(&corpus, "Now is the winter of our discontent\n").unwrap();
    // A folder where the cache file would go: neither readable as a cache nor replaceable by
    // rename, which stands in for a read-only checkout (root ignores permission bits).
    std::fs::create_dir(corpus_dir.join("tiny.txt.tokens")).unwrap();
    std::env::remove_var("OOBLECK_CACHE_DIR");
    std::env::set_var("XDG_CACHE_HOME", &xdg);

    let tok = Arc::new(Gpt2Tokenizer::from_path(&default_tokenizer_dir()).unwrap());
    let ds = Dataset::open_with(&corpus, tok.clone(), None).unwrap();
    let path = ds.cache_path().unwrap().to_path_buf();
    assert!(
        path.starts_with(xdg.join("oobleck-rs")),
        "{}",
        path.display()
    );
    let name = path.file_name().unwrap().to_string_lossy().into_owned();
    assert!(
        name.starts_with("tiny.txt-") && name.ends_with(".tokens"),
        "{name}"
    );
    assert_eq!(ds.num_tokens(), 8);
    drop(ds);
    // Found again on the next open (no rebuild into another place).
    let ds = Dataset::open_with(&corpus, tok.clone(), None).unwrap();
    assert_eq!(ds.cache_path(), Some(path.as_path()));
    drop(ds);

    // OOBLECK_CACHE_DIR, when set, is the only default location.
    let own = tmp.path().join("own-cache");
    std::env::set_var("OOBLECK_CACHE_DIR", &own);
    let ds = Dataset::open_with(&corpus, tok, None).unwrap();
    let path = ds.cache_path().unwrap();
    assert!(path.starts_with(&own), "{}", path.display());
    std::env::remove_var("OOBLECK_CACHE_DIR");
}
