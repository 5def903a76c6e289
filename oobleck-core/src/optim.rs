//! AdamW with exportable state (in progress).
