//! The Oobleck-rs engine.
//!
//! (Tour and data-flow diagram: see the end of issue work; filled in as modules land.)

pub mod checkpoint;
pub mod error;
pub mod model;
pub mod optim;
pub mod planning;
pub mod reconfig;
pub mod schedule;

pub use error::{Error, Result};
