//! Corpus, tokenizer and batches (in progress).
