//! The shipped GPT-2 tokenizer gives OpenAI's ids and round-trips; bad tokenizers fail clearly.

use oobleck_models::data::{
    default_tokenizer_dir, DataError, Gpt2Tokenizer, END_OF_TEXT, END_OF_TEXT_ID, GPT2_VOCAB_SIZE,
};

fn shipped() -> Gpt2Tokenizer {
    Gpt2Tokenizer::from_path(&default_tokenizer_dir()).expect("shipped tokenizer loads")
}

#[derive(serde::Deserialize)]
struct Reference {
    vocab_size: usize,
    cases: Vec<Case>,
}

#[derive(serde::Deserialize)]
struct Case {
    text: String,
    ids: Vec<u32>,
}

#[test]
fn encodes_like_openai_gpt2_and_round_trips() {
    let tok = shipped();
    assert_eq!(tok.vocab_size(), GPT2_VOCAB_SIZE);
    assert_eq!(tok.encode("Hello world").unwrap(), vec![15496, 995]);

    let path = default_tokenizer_dir().join("reference_ids.json");
    let reference: Reference =
        serde_json::from_slice(&std::fs::read(&path).unwrap()).expect("reference_ids.json parses");
    assert_eq!(reference.vocab_size, GPT2_VOCAB_SIZE);
    assert!(reference.cases.len() >= 20);
    for case in &reference.cases {
        let ids = tok.encode(&case.text).unwrap();
        assert_eq!(ids, case.ids, "ids of {:?}", &case.text);
        assert_eq!(
            tok.decode(&ids).unwrap(),
            case.text,
            "round trip of {:?}",
            &case.text
        );
    }
}

#[test]
fn end_of_text_is_one_special_token() {
    let tok = shipped();
    let ids = tok.encode(&format!("The end.{END_OF_TEXT}Once")).unwrap();
    assert_eq!(ids, vec![464, 886, 13, END_OF_TEXT_ID, 7454]);
    assert_eq!(
        tok.decode(&ids).unwrap(),
        format!("The end.{END_OF_TEXT}Once")
    );
}

#[test]
fn vocab_mismatch_names_both_sizes_and_the_tokenizer() {
    let tok = shipped();
    tok.check_vocab(GPT2_VOCAB_SIZE).unwrap();
    let err = tok.check_vocab(50272).unwrap_err();
    assert!(matches!(
        err,
        DataError::VocabMismatch {
            tokenizer_vocab: 50257,
            model_vocab: 50272,
            ..
        }
    ));
    let msg = err.to_string();
    assert!(msg.contains("50257") && msg.contains("50272") && msg.contains("gpt2-tokenizer"));
}

#[test]
fn decode_rejects_ids_outside_the_vocabulary() {
    let err = shipped().decode(&[15496, 50257]).unwrap_err();
    assert!(err.to_string().contains("id 50257"), "{err}");
}

#[test]
fn missing_or_malformed_tokenizer_files_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("no-such-tokenizer");
    let err = Gpt2Tokenizer::from_path(&missing).unwrap_err();
    assert!(matches!(err, DataError::NotFound { .. }));
    assert!(err.to_string().contains("no-such-tokenizer"), "{err}");

    let err = Gpt2Tokenizer::from_path(dir.path()).unwrap_err();
    assert!(err.to_string().contains("encoder.json"), "{err}");

    let merges = default_tokenizer_dir().join("vocab.bpe");
    std::fs::write(dir.path().join("encoder.json"), br#"{"a": 0, "b": 0}"#).unwrap();
    std::fs::copy(&merges, dir.path().join("vocab.bpe")).unwrap();
    let err = Gpt2Tokenizer::from_path(dir.path()).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("encoder.json") && msg.contains("used twice"),
        "{msg}"
    );

    std::fs::write(dir.path().join("encoder.json"), b"[1, 2").unwrap();
    let err = Gpt2Tokenizer::from_path(dir.path()).unwrap_err();
    assert!(err.to_string().contains("not a JSON object"), "{err}");

    std::fs::write(
        dir.path().join("encoder.json"),
        br#"{"a": 0, "b": 1, "ab": 2}"#,
    )
    .unwrap();
    std::fs::write(
        dir.path().join("vocab.bpe"),
        "#version: 0.2\na b\nthree symbols here\n",
    )
    .unwrap();
    let err = Gpt2Tokenizer::from_path(dir.path()).unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("vocab.bpe") && msg.contains("line 3"), "{msg}");

    let json = dir.path().join("tokenizer.json");
    std::fs::write(&json, b"{}").unwrap();
    let err = Gpt2Tokenizer::from_path(&json).unwrap_err();
    assert!(err.to_string().contains("tokenizer.json"), "{err}");
}

#[test]
fn a_small_custom_vocabulary_is_usable_and_reports_its_size() {
    let dir = tempfile::tempdir().unwrap();
    // Byte-level symbols: "Ġ" is the space byte.
    std::fs::write(
        dir.path().join("vocab.json"),
        r#"{"a": 0, "b": 1, "Ġ": 2, "ab": 3, "Ġab": 4}"#,
    )
    .unwrap();
    std::fs::write(dir.path().join("merges.txt"), "#version: 0.2\na b\nĠ ab\n").unwrap();
    let tok = Gpt2Tokenizer::from_path(dir.path()).unwrap();
    // 5 entries plus <|endoftext|>, which this vocabulary lacks and gets appended.
    assert_eq!(tok.vocab_size(), 6);
    assert_eq!(tok.encode("ab ab").unwrap(), vec![3, 4]);
    assert!(tok.check_vocab(GPT2_VOCAB_SIZE).is_err());
    assert_ne!(tok.hash(), shipped().hash());
}
