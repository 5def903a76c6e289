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
fn a_larger_model_vocabulary_is_padding_and_a_larger_tokenizer_is_refused() {
    let tok = shipped();
    assert_eq!(tok.check_vocab(GPT2_VOCAB_SIZE).unwrap(), 0);
    // OPT's 50272 rows: the 15 the tokenizer never produces are padding.
    assert_eq!(tok.check_vocab(50272).unwrap(), 15);
    // Fewer rows than ids: an id past the embedding, refused with both numbers.
    let err = tok.check_vocab(50000).unwrap_err();
    assert!(matches!(
        err,
        DataError::VocabMismatch {
            tokenizer_vocab: 50257,
            model_vocab: 50000,
            ..
        }
    ));
    let msg = err.to_string();
    assert!(msg.contains("50257") && msg.contains("50000") && msg.contains("gpt2-tokenizer"));
}

#[test]
fn opt_ids_differ_from_gpt2_ids_for_the_same_pieces() {
    // `transformers`' OPTTokenizationTest: facebook/opt-350m encodes "A photo of a cat" to
    // [2, 250, 1345, 9, 10, 4758] (BOS `</s>` = 2, then five pieces). GPT-2 cuts the same five
    // pieces with other ids (datasets/README.md, "OPT and the GPT-2 tokenizer").
    let ids = shipped().encode("A photo of a cat").unwrap();
    assert_eq!(ids, vec![32, 4590, 286, 257, 3797]);
    assert_eq!(ids.len(), [250, 1345, 9, 10, 4758].len());
}

#[test]
fn files_are_the_bytes_it_was_built_from_under_hugging_face_names() {
    let dir = tempfile::tempdir().unwrap();
    let tok = shipped();
    let files = tok.files();
    let names: Vec<&str> = files.iter().map(|f| f.0).collect();
    assert_eq!(names, ["vocab.json", "merges.txt"]);
    assert!(Gpt2Tokenizer::in_model_dir(dir.path()).is_none());
    for (name, bytes) in &files {
        std::fs::write(dir.path().join(name), bytes).unwrap();
    }
    let found = Gpt2Tokenizer::in_model_dir(dir.path()).expect("vocab.json + merges.txt");
    assert_eq!(found, dir.path());
    let back = Gpt2Tokenizer::from_path(&found).unwrap();
    assert_eq!(
        back.hash(),
        tok.hash(),
        "the same ids, the same token cache"
    );
    assert_eq!(Gpt2Tokenizer::embedded().hash(), tok.hash());

    // A tokenizer.json wins over the pair.
    let json = dir.path().join("tokenizer.json");
    std::fs::write(&json, b"{}").unwrap();
    assert_eq!(Gpt2Tokenizer::in_model_dir(dir.path()), Some(json));
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
    // A model with more rows than these 6 ids accepts it (the rest is padding); fewer refuse.
    assert_eq!(
        tok.check_vocab(GPT2_VOCAB_SIZE).unwrap(),
        GPT2_VOCAB_SIZE - 6
    );
    assert!(tok.check_vocab(5).is_err());
    assert_ne!(tok.hash(), shipped().hash());
}
