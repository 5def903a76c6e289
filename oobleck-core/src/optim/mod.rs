//! Optimizer pieces with state we own: AdamW, global-norm gradient clipping and the learning
//! rate schedule.
//!
//! `candle_nn::AdamW` keeps its moments private, so its state can be neither checkpointed nor
//! copied to a replica that lost a layer. Everything here is keyed by parameter **name** (the
//! names of the HF reference layout, or whatever the caller uses consistently), never by a
//! `Var`'s identity or a `VarMap`'s iteration order, which differ between processes.
//!
//! ```text
//! grads (name -> Tensor) --clip_grad_norm--> clipped grads --AdamW::step(params, grads, lr)--> params
//!                                                 lr = LrSchedule::lr_at(step) --^
//! AdamW::export_state[_for](names) -> [(name.exp_avg | name.exp_avg_sq | name.step, Tensor)]
//!                                  -> optimizer.safetensors or a layer copy -> import_state
//! ```
//!
//! Semantics follow PyTorch (`torch.optim.AdamW`, `torch.nn.utils.clip_grad_norm_`) and nanoGPT
//! (`train.py::get_lr`); each item says where it deviates. Nothing here does I/O or keeps a clock;
//! iteration over several parameters is always in name order so results do not depend on the
//! order a caller's map happens to yield.

mod adamw;
mod clip;
mod fused;
mod schedule;

pub use adamw::{decays, AdamW, AdamWConfig, DecayPredicate, EXP_AVG, EXP_AVG_SQ, STEP};
pub use clip::{clip_grad_norm, global_grad_norm};
pub use schedule::LrSchedule;
