//! The parallel part: one reader, `workers` tokenizers, one writer, a fixed number of batches
//! in flight.
//!
//! ```text
//!  reader thread ── (seq, batch of documents, ~1 MB) ──> workers (a rayon pool of N threads)
//!    │ takes a permit per batch                              │ encode every document
//!    │                                                       v
//!  permits (M = 2N + 2) <── returned per written batch ── writer (this thread): reorders by
//!                                                          seq, appends documents in order
//! ```
//!
//! The reader takes a permit before it reads a batch and the writer gives it back once the
//! batch is written, so at most M batches exist at once, whatever the corpus size. The writer
//! writes batches in sequence order, so the shards do not depend on N or on timing. An error
//! travels down the same path in its place: everything read before it is written first.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{channel, sync_channel, Receiver, Sender, SyncSender};
use std::sync::{Arc, Mutex};

use super::error::{PrepareError, Result};
use super::manifest::Position;
use super::readers::{DocReader, ReadOptions};
use super::sources::SourceFile;
use super::writer::ShardWriter;
use super::Progress;
use crate::data::Gpt2Tokenizer;

/// Text read into one batch before it is handed to a worker. Small enough that a 20 MB
/// corpus is 20 batches (with 4 MB, its 5 batches left one of two workers idle for the last
/// one: 1.1x on 2 cores), large enough that handing a batch over costs nothing.
const BATCH_BYTES: usize = 1 << 20;

struct Doc {
    text: String,
    /// The position after this document.
    end: Position,
}

type BatchMsg = (u64, Result<Batch>);
type DoneMsg = (u64, Result<Tokenized>);

struct Batch {
    docs: Vec<Doc>,
    /// Bad records skipped so far, trailing ones (after the last document) included.
    skipped: u64,
}

struct Tokenized {
    docs: Vec<(Vec<u32>, Position)>,
    skipped: u64,
}

/// What the pipeline reads and with how many workers.
pub struct Plan<'a> {
    pub sources: &'a [SourceFile],
    pub read: &'a ReadOptions,
    pub start: Position,
    pub workers: usize,
}

/// Reads from `plan.start` to the end of the sources into `writer`.
pub fn run(
    plan: &Plan<'_>,
    tokenizer: &Gpt2Tokenizer,
    writer: &mut ShardWriter,
    progress: &mut dyn FnMut(&Progress),
) -> Result<()> {
    let permits_n = 2 * plan.workers + 2;
    let (permit_tx, permit_rx) = sync_channel::<()>(permits_n);
    for _ in 0..permits_n {
        permit_tx
            .send(())
            .expect("the channel holds exactly permits_n");
    }
    let (batch_tx, batch_rx) = sync_channel::<BatchMsg>(permits_n);
    let batch_rx = Arc::new(Mutex::new(batch_rx));
    let (done_tx, done_rx) = channel::<DoneMsg>();
    let bytes_read = Arc::new(AtomicU64::new(0));
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(plan.workers)
        .thread_name(|i| format!("tokenize-{i}"))
        .build()
        .map_err(|e| PrepareError::Read {
            path: "worker threads".into(),
            source: std::io::Error::other(e.to_string()),
        })?;
    std::thread::scope(|s| {
        let counter = bytes_read.clone();
        s.spawn(move || read_batches(plan, counter, batch_tx, permit_rx));
        s.spawn(move || {
            pool.scope(|ps| {
                for _ in 0..plan.workers {
                    let (rx, tx) = (batch_rx.clone(), done_tx.clone());
                    ps.spawn(move |_| tokenize_batches(tokenizer, &rx, &tx));
                }
            });
            drop(done_tx);
        });
        let total = plan.sources.iter().map(|s| s.bytes).sum();
        write_in_order(done_rx, permit_tx, writer, &bytes_read, total, progress)
    })
}

fn read_batches(
    plan: &Plan<'_>,
    counter: Arc<AtomicU64>,
    out: SyncSender<BatchMsg>,
    permits: Receiver<()>,
) {
    let mut docs = DocStream::new(plan, counter);
    for seq in 0.. {
        if permits.recv().is_err() {
            return; // the writer stopped
        }
        let mut batch = Vec::new();
        let mut bytes = 0;
        let result = loop {
            match docs.next() {
                Ok(Some(doc)) => {
                    bytes += doc.text.len();
                    batch.push(doc);
                    if bytes >= BATCH_BYTES {
                        break Ok(false);
                    }
                }
                Ok(None) => break Ok(true),
                Err(e) => break Err(e),
            }
        };
        let skipped = docs.skipped();
        let batch = Batch {
            docs: batch,
            skipped,
        };
        match result {
            Ok(last) => {
                if out.send((seq, Ok(batch))).is_err() || last {
                    return;
                }
            }
            Err(e) => {
                // What was read before the error is written first: nothing is lost.
                let _ = out.send((seq, Ok(batch)));
                let _ = out.send((seq + 1, Err(e)));
                return;
            }
        }
    }
}

/// Documents of all sources from a position on, each with the position after it.
struct DocStream<'a> {
    plan: &'a Plan<'a>,
    counter: Arc<AtomicU64>,
    source: usize,
    reader: Option<DocReader>,
    document: u64,
    /// Bad records skipped in the sources before `source`.
    skipped_before: u64,
}

impl<'a> DocStream<'a> {
    fn new(plan: &'a Plan<'a>, counter: Arc<AtomicU64>) -> Self {
        let before: u64 = plan
            .sources
            .iter()
            .take(plan.start.source)
            .map(|s| s.bytes)
            .sum();
        counter.fetch_add(before, Ordering::Relaxed);
        Self {
            plan,
            counter,
            source: plan.start.source,
            reader: None,
            document: 0,
            skipped_before: plan.start.skipped_records,
        }
    }

    fn next(&mut self) -> Result<Option<Doc>> {
        loop {
            let Some(src) = self.plan.sources.get(self.source) else {
                return Ok(None);
            };
            if self.reader.is_none() {
                self.reader = Some(self.open(src)?);
            }
            let reader = self.reader.as_mut().expect("opened just above");
            if let Some(text) = reader.next_doc()? {
                self.document += 1;
                let end = Position {
                    source: self.source,
                    document: self.document,
                    skipped_records: self.skipped_before + reader.skipped,
                };
                return Ok(Some(Doc { text, end }));
            }
            self.skipped_before += reader.skipped;
            self.reader = None;
            self.source += 1;
            self.document = 0;
        }
    }

    fn skipped(&self) -> u64 {
        self.skipped_before + self.reader.as_ref().map_or(0, |r| r.skipped)
    }

    /// Opens `src`; at the resume point, skips the documents the kept shards hold.
    fn open(&mut self, src: &SourceFile) -> Result<DocReader> {
        let mut reader = DocReader::open(src, self.plan.read, self.counter.clone())?;
        let start = self.plan.start;
        if self.source == start.source && start.document > 0 {
            for _ in 0..start.document {
                if reader.next_doc()?.is_none() {
                    break;
                }
            }
            self.document = start.document;
            // The skipped records counted in `start` include those just read past again.
            self.skipped_before = start.skipped_records.saturating_sub(reader.skipped);
        }
        Ok(reader)
    }
}

fn tokenize_batches(tok: &Gpt2Tokenizer, rx: &Mutex<Receiver<BatchMsg>>, tx: &Sender<DoneMsg>) {
    loop {
        let msg = rx.lock().expect("no worker panics holding the lock").recv();
        let Ok((seq, batch)) = msg else {
            return; // the reader finished
        };
        let out = batch.and_then(|batch| {
            let docs = batch
                .docs
                .into_iter()
                .map(|d| Ok((tok.encode(&d.text)?, d.end)))
                .collect::<Result<Vec<_>>>()?;
            Ok(Tokenized {
                docs,
                skipped: batch.skipped,
            })
        });
        if tx.send((seq, out)).is_err() {
            return; // the writer stopped
        }
    }
}

fn write_in_order(
    done: Receiver<DoneMsg>,
    permits: SyncSender<()>,
    writer: &mut ShardWriter,
    bytes_read: &AtomicU64,
    bytes_total: u64,
    progress: &mut dyn FnMut(&Progress),
) -> Result<()> {
    let mut pending = BTreeMap::new();
    let mut next = 0u64;
    let mut p = Progress {
        bytes_total,
        ..Progress::default()
    };
    for (seq, result) in done {
        pending.insert(seq, result);
        while let Some(result) = pending.remove(&next) {
            let batch = result?;
            for (ids, end) in batch.docs {
                p.tokens += ids.len() as u64 + 1;
                p.documents += 1;
                writer.add_document(&ids, end)?;
            }
            p.skipped_records = batch.skipped;
            writer.set_skipped_records(batch.skipped);
            next += 1;
            let _ = permits.send(()); // the reader may have finished: then nobody needs it
            p.bytes_read = bytes_read.load(Ordering::Relaxed);
            p.shards = writer.manifest().shards.len() as u64;
            progress(&p);
        }
    }
    Ok(())
}
