//! A folder `oobleck data prepare` wrote, read as a `--data` source: checked against its
//! `manifest.json` before training opens its shards, so a preparation that did not finish,
//! shards of another tokenizer or a file the manifest does not list is an error that says
//! what to do, never a silently different corpus.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use super::prepare::Manifest;
use super::tokenizer::Gpt2Tokenizer;
use super::{DataError, Result};

/// Checks `dir` against its manifest when it is a prepared folder (a folder that holds
/// `manifest.json`); anything else passes. `files` are the shard files `--data dir` found
/// there; `tokenizer` is the run's.
pub(crate) fn check_prepared(
    dir: &Path,
    files: &[PathBuf],
    tokenizer: &Gpt2Tokenizer,
) -> Result<()> {
    if !dir.is_dir() {
        return Ok(());
    }
    let bad = |problem: String| DataError::Prepared {
        dir: dir.to_path_buf(),
        problem,
    };
    let manifest = match Manifest::load(dir) {
        Ok(Some(m)) => m,
        Ok(None) => return Ok(()),
        Err(e) => return Err(bad(format!("{e}; prepare the folder again"))),
    };
    if !manifest.complete {
        return Err(bad(format!(
            "its preparation did not finish ({} shards of {} tokens so far): run the same \
             `oobleck data prepare ... --out {}` again to finish it (the finished shards are kept)",
            manifest.shards.len(),
            manifest.shards.iter().map(|s| s.tokens).sum::<u64>(),
            dir.display()
        )));
    }
    if manifest.tokenizer.sha256 != tokenizer.hash() {
        return Err(bad(format!(
            "prepared with another tokenizer (SHA-256 {}..., {} ids) than this run's ({}..., \
             {} ids), so its ids name other tokens: train with the tokenizer it was prepared \
             with (--tokenizer), or prepare its sources again with this one",
            short(&manifest.tokenizer.sha256),
            manifest.tokenizer.vocab_size,
            short(tokenizer.hash()),
            tokenizer.vocab_size()
        )));
    }
    check_listed(&manifest, files).map_err(bad)
}

/// The folder's shard files are exactly the manifest's shards.
fn check_listed(manifest: &Manifest, files: &[PathBuf]) -> std::result::Result<(), String> {
    let listed: BTreeSet<&str> = manifest.shards.iter().map(|s| s.name.as_str()).collect();
    let present: BTreeSet<String> = files
        .iter()
        .filter_map(|f| f.file_name().map(|n| n.to_string_lossy().into_owned()))
        .collect();
    if let Some(stray) = present.iter().find(|n| !listed.contains(n.as_str())) {
        return Err(format!(
            "{stray} is not one of the shards its manifest.json lists; move it out of the \
             folder (only the prepared shards may be there)"
        ));
    }
    if let Some(missing) = listed.iter().find(|n| !present.contains(**n)) {
        return Err(format!(
            "shard {missing}, which its manifest.json lists, is missing; prepare the folder \
             again (or put the shard back)"
        ));
    }
    Ok(())
}

fn short(sha: &str) -> &str {
    &sha[..sha.len().min(12)]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::prepare::{prepare, PrepareOptions, ReadOptions};
    use crate::data::source::{resolve_source, DataSource};
    use crate::data::FormatHint;

    fn prepared(dir: &Path) -> PathBuf {
        let text = dir.join("a.txt");
        std::fs::write(&text, "To be, or not to be, that is the question.").unwrap();
        let out = dir.join("prepared");
        let options = PrepareOptions {
            sources: vec![text.display().to_string()],
            out: out.clone(),
            shard_tokens: 1000,
            workers: 1,
            read: ReadOptions {
                text_field: "text".into(),
                skip_bad_records: false,
            },
        };
        prepare(&options, &Gpt2Tokenizer::embedded(), &mut |_| {}).unwrap();
        out
    }

    fn check(dir: &Path) -> Result<()> {
        let DataSource::Shards(files) = resolve_source(dir, FormatHint::Detect)? else {
            panic!("a folder is shards");
        };
        check_prepared(dir, &files, &Gpt2Tokenizer::embedded())
    }

    fn edit_manifest(dir: &Path, edit: impl FnOnce(&mut Manifest)) {
        let mut m = Manifest::load(dir).unwrap().unwrap();
        edit(&mut m);
        m.save(dir).unwrap();
    }

    #[test]
    fn a_prepared_folder_passes_and_each_damage_is_named() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = prepared(tmp.path());
        check(&dir).unwrap();

        std::fs::write(dir.join("notes.bin"), b"x").unwrap();
        let msg = check(&dir).unwrap_err().to_string();
        assert!(msg.contains("notes.bin is not one of the shards"), "{msg}");
        std::fs::remove_file(dir.join("notes.bin")).unwrap();

        edit_manifest(&dir, |m| m.tokenizer.sha256 = "ab".repeat(32));
        let msg = check(&dir).unwrap_err().to_string();
        assert!(
            msg.contains("prepared with another tokenizer (SHA-256 abababababab"),
            "{msg}"
        );
        assert!(msg.contains("--tokenizer"), "{msg}");

        let real = Gpt2Tokenizer::embedded().hash().to_string();
        edit_manifest(&dir, |m| {
            m.tokenizer.sha256 = real;
            m.complete = false;
        });
        let msg = check(&dir).unwrap_err().to_string();
        assert!(msg.contains("did not finish (1 shards"), "{msg}");
        assert!(msg.contains("oobleck data prepare"), "{msg}");

        edit_manifest(&dir, |m| {
            m.complete = true;
            let mut later = m.shards[0].clone();
            later.name = "later_000001.bin".into();
            m.shards.push(later);
        });
        let msg = check(&dir).unwrap_err().to_string();
        assert!(
            msg.contains("shard later_000001.bin, which its manifest.json lists, is missing"),
            "{msg}"
        );

        std::fs::write(dir.join("manifest.json"), b"{").unwrap();
        let msg = check(&dir).unwrap_err().to_string();
        assert!(msg.contains("prepare the folder again"), "{msg}");
    }
}
