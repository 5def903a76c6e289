//! Our encoder against the `tokenizers` crate's, id for id: on the shipped corpus, on the
//! reference texts, and on seeded random Unicode built to hit every rule of GPT-2's
//! pre-tokenizer and every class boundary.

use super::*;

fn shipped() -> Gpt2Tokenizer {
    let tok = Gpt2Tokenizer::embedded();
    assert!(tok.fast.is_some(), "GPT-2 takes our encoder");
    tok
}

/// Ours and the `tokenizers` crate's ids of `text` are equal (the message shows the text).
fn assert_same(tok: &Gpt2Tokenizer, text: &str) {
    let ours = tok.encode(text).unwrap();
    let theirs = tok.encode_with_tokenizers_crate(text);
    assert_eq!(ours, theirs, "ids of {text:?}");
}

#[test]
fn ids_equal_the_tokenizers_crate_on_the_whole_corpus() {
    let tok = shipped();
    let corpus = crate::data::EMBEDDED_CORPUS;
    assert!(corpus.len() > 1_000_000);
    // Whole (cut into parallel pieces), and paragraph by paragraph as documents.
    assert_same(&tok, corpus);
    for paragraph in corpus.split("\n\n").take(2000) {
        assert_same(&tok, paragraph);
    }
}

#[test]
fn ids_equal_the_reference_ids_and_the_tokenizers_crate() {
    let tok = shipped();
    let path = crate::data::default_tokenizer_dir().join("reference_ids.json");
    let reference: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    let cases = reference["cases"].as_array().unwrap();
    assert!(cases.len() >= 20);
    for case in cases {
        let text = case["text"].as_str().unwrap();
        let ids: Vec<u32> = serde_json::from_value(case["ids"].clone()).unwrap();
        assert_eq!(tok.encode(text).unwrap(), ids, "ids of {text:?}");
        assert_same(&tok, text);
    }
}

/// splitmix64: a seeded generator, so a failure names a reproducible string.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        let out = oobleck_core::runtime::wire::records::splitmix64(self.0);
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        out
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn pick<'a>(&mut self, items: &[&'a str]) -> &'a str {
        items[self.below(items.len())]
    }
}

/// Fragments of text that the pre-tokenizer's rules and classes treat differently.
const ATOMS: &[&str] = &[
    // ASCII words, digits, punctuation, contractions (and near-contractions).
    "the",
    "Hello",
    "x",
    "I",
    "2024",
    "7",
    "3.14",
    ",",
    ".",
    "!?",
    "--",
    "\"",
    "(",
    "@#$",
    "'",
    "'s",
    "'t",
    "'re",
    "'ve",
    "'m",
    "'ll",
    "'d",
    "'S",
    "'LL",
    "'x",
    "''",
    "don't",
    // Whitespace of every kind, alone and in runs.
    " ",
    " ",
    " ",
    "  ",
    "   ",
    "\t",
    "\n",
    "\n\n",
    "\r\n",
    "\r",
    "\u{b}",
    "\u{c}",
    "\u{a0}",
    "\u{85}",
    "\u{1680}",
    "\u{2000}",
    "\u{2009}",
    "\u{200a}",
    "\u{2028}",
    "\u{2029}",
    "\u{202f}",
    "\u{205f}",
    "\u{3000}",
    " \u{a0}",
    "\u{a0} ",
    "\n ",
    " \n",
    // Not whitespace although they look like it: zero-width space and joiner, BOM, NUL.
    "\u{200b}",
    "\u{200d}",
    "\u{feff}",
    "\u{0}",
    "\u{7f}",
    // Letters of other scripts, with combining marks (Mn/Mc, not \p{L}).
    "é",
    "e\u{301}",
    "ñ",
    "Straße",
    "Ωμέγα",
    "ᾳ\u{345}",
    "Привет",
    "日本語",
    "中文",
    "한국어",
    "العربية",
    "हिन्दी",
    "ไทย",
    "עברית",
    "\u{301}",
    "\u{345}",
    "\u{903}",
    // Numbers that are not ASCII digits: letter numbers, other numbers, other scripts.
    "Ⅻ",
    "²",
    "½",
    "١٢٣",
    "४२",
    "１２３",
    "〇",
    "𝟘",
    "𐄇",
    // Astral letters, symbols, emoji and their sequences.
    "𝔸𝔹",
    "𐐀",
    "🎉",
    "👍🏽",
    "👨\u{200d}👩\u{200d}👧",
    "🇫🇷",
    "€",
    "©",
    "\u{fffd}",
    // The special token, whole and in parts.
    "<|endoftext|>",
    "<|endoftext|",
    "<|",
    "|>",
    " <|endoftext|> ",
];

/// A random text of atoms, long runs (merged by the heap path) and arbitrary characters.
fn random_text(rng: &mut Rng) -> String {
    let mut s = String::new();
    for _ in 0..rng.below(24) {
        match rng.below(20) {
            0 => {
                // An arbitrary scalar value: any class boundary of any plane.
                let c = loop {
                    let limit = if rng.below(2) == 0 { 0x3000 } else { 0x11_0000 };
                    if let Some(c) = char::from_u32(rng.below(limit) as u32) {
                        break c;
                    }
                };
                s.push(c);
            }
            1 => {
                let atom = rng.pick(&["a", "ab", "1", " ", "\n", "é", "!", "🎉", "日"]);
                s.push_str(&atom.repeat(30 + rng.below(60)));
            }
            _ => s.push_str(rng.pick(ATOMS)),
        }
    }
    s
}

#[test]
fn ids_equal_the_tokenizers_crate_on_random_unicode() {
    let tok = shipped();
    let mut rng = Rng(42);
    for _ in 0..6000 {
        assert_same(&tok, &random_text(&mut rng));
    }
}

#[test]
fn cut_encoding_equals_one_pass_on_random_unicode() {
    let tok = shipped();
    let fast = tok.fast.as_ref().unwrap();
    let mut rng = Rng(7);
    for _ in 0..300 {
        let text = (0..8)
            .map(|_| random_text(&mut rng))
            .collect::<Vec<_>>()
            .join("x\ny");
        assert!(!cut_points(&text, 16).is_empty());
        assert_eq!(
            fast.encode_in_chunks(&text, 16),
            tok.encode_with_tokenizers_crate(&text),
            "ids of {text:?}"
        );
    }
}

#[test]
fn a_tokenizer_json_keeps_the_tokenizers_crate() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tokenizer.json");
    std::fs::write(&path, shipped().inner.to_string(false).unwrap()).unwrap();
    let tok = Gpt2Tokenizer::from_path(&path).unwrap();
    assert!(tok.fast.is_none());
    assert_eq!(tok.encode("Hello world").unwrap(), vec![15496, 995]);
}

/// GPT-2's merges over GPT-2's tokens numbered backwards (as OPT renumbers them), in a folder.
fn renumbered_gpt2(dir: &Path) -> Gpt2Tokenizer {
    use super::super::embedded::{EMBEDDED_ENCODER_JSON, EMBEDDED_VOCAB_BPE};
    let vocab: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(EMBEDDED_ENCODER_JSON).unwrap();
    let last = vocab.len() as u64 - 1;
    let backwards: serde_json::Map<String, serde_json::Value> = vocab
        .into_iter()
        .map(|(token, id)| (token, (last - id.as_u64().unwrap()).into()))
        .collect();
    std::fs::write(
        dir.join("vocab.json"),
        serde_json::to_vec(&backwards).unwrap(),
    )
    .unwrap();
    std::fs::write(dir.join("merges.txt"), EMBEDDED_VOCAB_BPE).unwrap();
    Gpt2Tokenizer::from_path(dir).unwrap()
}

#[test]
fn another_numbering_takes_our_encoder_and_keeps_its_own_cached_pieces() {
    let dir = tempfile::tempdir().unwrap();
    let (gpt2, renumbered) = (shipped(), renumbered_gpt2(dir.path()));
    assert!(renumbered.fast.is_some());
    let last = GPT2_VOCAB_SIZE as u32 - 1;
    let mut rng = Rng(3);
    // Alternating on one thread: each tokenizer's cached pieces must stay its own.
    for _ in 0..500 {
        let text = random_text(&mut rng);
        let ids = gpt2.encode(&text).unwrap();
        let backwards = renumbered.encode(&text).unwrap();
        assert_same(&renumbered, &text);
        let mapped: Vec<u32> = ids.iter().map(|&id| last - id).collect();
        assert_eq!(backwards, mapped, "ids of {text:?}");
    }
}
