//! GPT/OPT models for Oobleck-rs.

pub mod data;
