//! The documents of one Parquet file: one string column (`text`, or `--text-field NAME`), read
//! a row group at a time and, inside it, a batch of rows at a time.
//!
//! FineWeb, FineWeb-Edu, DCLM and Dolma copies ship as Parquet with a top-level string column
//! (snappy or zstd pages). The file is read at the Parquet level, not through Arrow: a column
//! Arrow calls `Utf8` or `LargeUtf8` is the same `BYTE_ARRAY` column in the file, so both read
//! the same way, and only that column's pages are decoded. Memory is one page of that column
//! plus [`BATCH_ROWS`] decoded values, whatever the size of the file or its row groups.
//!
//! Rows are numbered from 0 across the whole file, as `pyarrow` and `pandas` number them; a
//! null value is a bad record (skipped and counted with `--skip-bad-records`).

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parquet::basic::Type as PhysicalType;
use parquet::column::reader::{get_typed_column_reader, ColumnReaderImpl};
use parquet::data_type::{ByteArray, ByteArrayType};
use parquet::file::reader::{FileReader, SerializedFileReader};

use super::error::{read_err, PrepareError, Result};

/// Rows decoded at once: small enough that a batch of long documents stays a few MB.
const BATCH_ROWS: usize = 256;

/// A Parquet source's documents, in row order.
pub struct ParquetDocs {
    path: PathBuf,
    file: SerializedFileReader<File>,
    /// Index of the text column among the file's leaf columns.
    column: usize,
    /// Definition level of a present (non-null) value: 0 for a required column.
    max_def: i16,
    /// The row group being read (`next_group` is the one after it) and its column reader.
    current: Option<ColumnReaderImpl<ByteArrayType>>,
    next_group: usize,
    /// Decoded values of the current batch and their definition levels, consumed from `at`.
    values: Vec<ByteArray>,
    defs: Vec<i16>,
    rows_in_batch: usize,
    at: usize,
    value_at: usize,
    /// Rows consumed so far in the file (the next row's number).
    row: u64,
    /// File bytes credited to the progress counter, and rows read when it was last credited.
    file_bytes: u64,
    total_rows: u64,
    counter: Arc<AtomicU64>,
    credited: u64,
}

/// What one row holds.
pub enum Row {
    Text(String),
    /// A null value or bytes that are not UTF-8: the problem, for the error or the count.
    Bad(String),
}

impl ParquetDocs {
    /// Opens `path` and finds the column `field`; `counter` advances by the file's bytes in
    /// proportion to the rows read (the progress's "MB read").
    pub fn open(path: &Path, field: &str, counter: Arc<AtomicU64>) -> Result<Self> {
        let handle = File::open(path).map_err(read_err(path))?;
        let file_bytes = handle.metadata().map_err(read_err(path))?.len();
        let file = SerializedFileReader::new(handle).map_err(parquet_err(path))?;
        let schema = file.metadata().file_metadata().schema_descr_ptr();
        let column = schema
            .columns()
            .iter()
            .position(|c| c.path().parts() == [field])
            .ok_or_else(|| missing_column(path, field, schema.root_schema().get_fields()))?;
        let descr = schema.column(column);
        if descr.physical_type() != PhysicalType::BYTE_ARRAY || descr.max_rep_level() > 0 {
            return Err(PrepareError::Parquet {
                path: path.to_path_buf(),
                problem: format!(
                    "column \"{field}\" is {}{}, not a string column; pass --text-field NAME",
                    descr.physical_type(),
                    if descr.max_rep_level() > 0 {
                        " (a list)"
                    } else {
                        ""
                    }
                ),
            });
        }
        let total_rows = file.metadata().file_metadata().num_rows().max(0) as u64;
        Ok(Self {
            path: path.to_path_buf(),
            file,
            column,
            max_def: descr.max_def_level(),
            current: None,
            next_group: 0,
            values: Vec::new(),
            defs: Vec::new(),
            rows_in_batch: 0,
            at: 0,
            value_at: 0,
            row: 0,
            file_bytes,
            total_rows,
            counter,
            credited: 0,
        })
    }

    /// Number (from 0) of the row [`Self::next_row`] returned last.
    pub fn last_row(&self) -> u64 {
        self.row.saturating_sub(1)
    }

    /// The next row, or `None` after the last row of the last row group.
    pub fn next_row(&mut self) -> Result<Option<Row>> {
        while self.at == self.rows_in_batch {
            if !self.read_batch()? {
                self.credit(self.file_bytes);
                return Ok(None);
            }
        }
        let present = self.max_def == 0 || self.defs[self.at] == self.max_def;
        self.at += 1;
        self.row += 1;
        if !present {
            return Ok(Some(Row::Bad("the text is null".into())));
        }
        let value = std::mem::take(&mut self.values[self.value_at]);
        self.value_at += 1;
        match String::from_utf8(value.data().to_vec()) {
            Ok(text) => Ok(Some(Row::Text(text))),
            Err(e) => Ok(Some(Row::Bad(format!(
                "not UTF-8 text (invalid byte sequence at byte {} of the value)",
                e.utf8_error().valid_up_to()
            )))),
        }
    }

    /// Decodes the next batch of rows, moving to the next row group at the end of one;
    /// `false` when every row group is read.
    fn read_batch(&mut self) -> Result<bool> {
        loop {
            let Some(reader) = self.current.as_mut() else {
                if self.next_group == self.file.num_row_groups() {
                    return Ok(false);
                }
                self.open_group()?;
                continue;
            };
            self.values.clear();
            self.defs.clear();
            let defs = (self.max_def > 0).then_some(&mut self.defs);
            let (rows, _, _) = reader
                .read_records(BATCH_ROWS, defs, None, &mut self.values)
                .map_err(parquet_err(&self.path))?;
            if rows > 0 {
                (self.rows_in_batch, self.at, self.value_at) = (rows, 0, 0);
                return Ok(true);
            }
            self.current = None;
            let total = self.total_rows.max(1);
            self.credit(self.file_bytes * self.row.min(total) / total);
        }
    }

    fn open_group(&mut self) -> Result<()> {
        let group = self
            .file
            .get_row_group(self.next_group)
            .map_err(parquet_err(&self.path))?;
        let reader = group
            .get_column_reader(self.column)
            .map_err(parquet_err(&self.path))?;
        self.current = Some(get_typed_column_reader::<ByteArrayType>(reader));
        self.next_group += 1;
        Ok(())
    }

    /// Advances the progress counter to `upto` of the file's bytes.
    fn credit(&mut self, upto: u64) {
        if upto > self.credited {
            self.counter
                .fetch_add(upto - self.credited, Ordering::Relaxed);
            self.credited = upto;
        }
    }
}

/// The file's top-level columns, for the error that names the ones it has.
fn missing_column(
    path: &Path,
    field: &str,
    fields: &[parquet::schema::types::TypePtr],
) -> PrepareError {
    PrepareError::NoColumn {
        path: path.to_path_buf(),
        column: field.to_string(),
        columns: if fields.is_empty() {
            "none".to_string()
        } else {
            fields
                .iter()
                .map(|f| f.name())
                .collect::<Vec<_>>()
                .join(", ")
        },
    }
}

fn parquet_err(path: &Path) -> impl FnOnce(parquet::errors::ParquetError) -> PrepareError + '_ {
    move |e| PrepareError::Parquet {
        path: path.to_path_buf(),
        problem: e.to_string(),
    }
}
