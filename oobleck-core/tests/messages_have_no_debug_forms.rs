//! The messages of the user-facing error types show no Rust `Debug` forms (`Some(2)`,
//! `Stopping { rank: 0 }`, `Protocol("...")`): every `{x:?}` placeholder in an `#[error(...)]`
//! of the workspace's sources must be one of the few whose Debug form is plain data (a list of
//! numbers, a quoted name, a unit variant's name), listed below with the reason. A new one
//! fails here: render it (a `Display`, a `kind()`, a helper) or, if its Debug form is plain,
//! add it with the reason.

use std::path::{Path, PathBuf};

/// `(file, placeholder)`: a Debug placeholder whose output is plain data, and why.
const PLAIN: &[(&str, &str, &str)] = &[
    (
        "oobleck-core/src/error.rs",
        "indices",
        "a list of layer indices: [0, 2]",
    ),
    (
        "oobleck-core/src/error.rs",
        "layers",
        "a list of layer indices",
    ),
    (
        "oobleck-core/src/error.rs",
        "shape",
        "a tensor shape: [4, 64]",
    ),
    (
        "oobleck-core/src/error.rs",
        "found",
        "a shape, or a dtype's name (F32)",
    ),
    (
        "oobleck-core/src/error.rs",
        "expected",
        "a shape, or a dtype's name (F32)",
    ),
    (
        "oobleck-core/src/error.rs",
        "stages",
        "lists of layer indices",
    ),
    (
        "oobleck-core/src/error.rs",
        "runs",
        "lists of microbatch indices",
    ),
    (
        "oobleck-core/src/runtime/wire/error.rs",
        "found",
        "4 magic bytes in hex",
    ),
    (
        "oobleck-core/src/runtime/wire/error.rs",
        "expected",
        "4 magic bytes in hex",
    ),
    (
        "oobleck-core/src/planning/mod.rs",
        "sizes",
        "a list of node counts",
    ),
    ("oobleck-comm/src/error.rs", "name", "a blob's name, quoted"),
    (
        "oobleck-comm/src/tcp/handshake/accept.rs",
        "0",
        "a frame kind's name (Data)",
    ),
];

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the workspace")
        .to_path_buf()
}

/// The non-test Rust sources under `dir`.
fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).expect("a source dir").flatten() {
        let p = e.path();
        let name = e.file_name().to_string_lossy().to_string();
        if p.is_dir() {
            if name != "tests" {
                sources(&p, out);
            }
        } else if name.ends_with(".rs") && name != "tests.rs" && !name.ends_with("_tests.rs") {
            out.push(p);
        }
    }
}

/// The text of every `#[error(...)]` attribute of `text`.
fn error_attributes(text: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find("#[error(") {
        let body = &rest[at + "#[error(".len()..];
        let mut depth = 1;
        let end = body
            .char_indices()
            .find(|&(_, c)| {
                depth += match c {
                    '(' => 1,
                    ')' => -1,
                    _ => 0,
                };
                depth == 0
            })
            .map_or(body.len(), |(i, _)| i);
        out.push(&body[..end]);
        rest = &body[end..];
    }
    out
}

/// The names of the `{name:?}` (or `{name:#x?}`...) placeholders of an attribute.
fn debug_placeholders(attr: &str) -> Vec<String> {
    let mut out = Vec::new();
    for (i, _) in attr.match_indices('{') {
        let Some(len) = attr[i..].find('}') else {
            continue;
        };
        let inner = &attr[i + 1..i + len];
        if let Some((name, spec)) = inner.split_once(':') {
            if spec.ends_with('?') {
                out.push(name.to_string());
            }
        }
    }
    out
}

#[test]
fn error_messages_render_values_instead_of_their_debug_forms() {
    let root = workspace();
    let mut files = Vec::new();
    for krate in [
        "oobleck-core/src",
        "oobleck-comm/src",
        "oobleck-models/src",
        "bin/src",
    ] {
        sources(&root.join(krate), &mut files);
    }
    assert!(files.len() > 50, "found only {} sources", files.len());
    let mut found = Vec::new();
    for f in &files {
        let rel = f.strip_prefix(&root).expect("under the workspace");
        let rel = rel.to_string_lossy().replace('\\', "/");
        let text = std::fs::read_to_string(f).expect("a source");
        for attr in error_attributes(&text) {
            for name in debug_placeholders(attr) {
                let plain = PLAIN.iter().any(|(file, n, _)| *file == rel && *n == name);
                if !plain {
                    found.push(format!("{rel}: {{{name}:?}} in #[error({attr})]"));
                }
            }
        }
    }
    assert!(
        found.is_empty(),
        "Debug forms in error messages (render them for a person):\n{}",
        found.join("\n")
    );
}

#[test]
fn the_scan_sees_debug_placeholders_and_nested_parentheses() {
    let text = r#"#[error("rank {rank:?} sent {r:#?} ({x})", r = f(a))] X, #[error("{y}")] Y"#;
    let attrs = error_attributes(text);
    assert_eq!(attrs.len(), 2);
    assert_eq!(debug_placeholders(attrs[0]), ["rank", "r"]);
    assert!(debug_placeholders(attrs[1]).is_empty());
}
