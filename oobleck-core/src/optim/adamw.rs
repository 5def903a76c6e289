//! AdamW with decoupled weight decay and state that can be exported and imported by name.
//!
//! The update is the single-tensor path of `torch.optim.AdamW` (PyTorch 2.x, `amsgrad=False`,
//! `maximize=False`), including the order of its floating-point operations, with a step counter
//! per parameter as PyTorch keeps one:
//!
//! ```text
//! t      += 1
//! θ      *= 1 - lr·λ                       (λ = weight_decay if the parameter decays, else 0)
//! m       = lerp(m, g, 1 - β1)
//! v       = v·β2 + (1 - β2)·g·g
//! denom   = sqrt(v) / sqrt(1 - β2^t) + ε
//! θ      += (-lr / (1 - β1^t))·m / denom
//! ```
//!
//! Contract of [`AdamW::step`]:
//! - Parameter names are unique within one call. A tied weight (GPT's token embedding and LM
//!   head) held by one process must be one `Var` listed once, with the two uses' gradients
//!   summed into its one gradient by the caller; a repeated name is an error rather than two
//!   silent updates.
//! - Every listed parameter must have a gradient of its shape and dtype, and every gradient must
//!   belong to a listed parameter; otherwise the step fails naming the parameter. All of this is
//!   checked before any parameter changes, so a rejected step leaves parameters and state as
//!   they were.
//! - State for a parameter seen for the first time is zero with step 0 (PyTorch's lazy init).
//!
//! State export: for each parameter `<name>.exp_avg`, `<name>.exp_avg_sq` (the parameter's dtype
//! and shape) and `<name>.step` (a rank-0 `i64`), in name order. That list is what goes into
//! `optimizer.safetensors` and what a layer copy between replicas carries.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor, Var};
use serde::{Deserialize, Serialize};

use super::fused;
use crate::{Error, Result};

/// Suffix of a first-moment entry in exported state (`<name>.exp_avg`).
pub const EXP_AVG: &str = "exp_avg";
/// Suffix of a second-moment entry in exported state (`<name>.exp_avg_sq`).
pub const EXP_AVG_SQ: &str = "exp_avg_sq";
/// Suffix of a step-count entry in exported state (`<name>.step`, rank-0 `i64`).
pub const STEP: &str = "step";

/// Hyper-parameters of AdamW. Defaults are PyTorch's `torch.optim.AdamW` defaults.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AdamWConfig {
    /// Peak learning rate (unitless step size): what an [`super::LrSchedule`] is built from.
    /// [`AdamW::step`] takes the rate to apply explicitly, so a schedule stays outside the
    /// optimizer. Default 1e-3 (PyTorch).
    pub lr: f64,
    /// Decay of the first-moment average. Default 0.9 (PyTorch).
    pub beta1: f64,
    /// Decay of the second-moment average. Default 0.999 (PyTorch; GPT training often uses 0.95).
    pub beta2: f64,
    /// Added to the bias-corrected RMS for numerical safety. Default 1e-8 (PyTorch).
    pub eps: f64,
    /// Decoupled weight decay λ (θ *= 1 - lr·λ) for parameters the decay predicate selects.
    /// Default 0.01 (PyTorch).
    pub weight_decay: f64,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        Self {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
        }
    }
}

impl AdamWConfig {
    /// Rejects values PyTorch would reject (negative rates, betas outside `[0, 1)`, ...).
    pub fn validate(&self) -> Result<()> {
        let bad = |name, value, want| {
            Err(Error::InvalidArgument {
                op: "AdamW config",
                name,
                value,
                want,
            })
        };
        if !(self.lr.is_finite() && self.lr >= 0.0) {
            return bad("lr", self.lr, "finite and >= 0");
        }
        if !(0.0..1.0).contains(&self.beta1) {
            return bad("beta1", self.beta1, "in [0, 1)");
        }
        if !(0.0..1.0).contains(&self.beta2) {
            return bad("beta2", self.beta2, "in [0, 1)");
        }
        if !(self.eps.is_finite() && self.eps > 0.0) {
            return bad("eps", self.eps, "finite and > 0");
        }
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            return bad("weight_decay", self.weight_decay, "finite and >= 0");
        }
        Ok(())
    }
}

/// Decides from a parameter's name and rank whether weight decay applies to it.
pub type DecayPredicate = Arc<dyn Fn(&str, usize) -> bool + Send + Sync>;

/// The default parameter grouping (nanoGPT's): tensors of rank >= 2 (matmul weights and
/// embeddings) decay; biases and LayerNorm gains/biases (rank 1) do not.
pub fn decays(_name: &str, rank: usize) -> bool {
    rank >= 2
}

/// Moments and step count of one parameter.
#[derive(Debug, Clone)]
struct ParamState {
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    step: u64,
}

impl ParamState {
    fn zeros(param: &Tensor) -> Result<Self> {
        Ok(Self {
            exp_avg: param.zeros_like()?,
            exp_avg_sq: param.zeros_like()?,
            step: 0,
        })
    }
}

/// AdamW keyed by parameter name. See the module docs for the exact update and contract.
///
/// Not `Clone`: on the CPU the moments are updated in place, so a shallow copy would share
/// them; [`AdamW::export_state`] gives an independent copy.
pub struct AdamW {
    config: AdamWConfig,
    decay: DecayPredicate,
    state: BTreeMap<String, ParamState>,
}

impl fmt::Debug for AdamW {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AdamW")
            .field("config", &self.config)
            .field("params_with_state", &self.state.len())
            .finish()
    }
}

impl AdamW {
    /// AdamW with the default decay grouping [`decays`].
    pub fn new(config: AdamWConfig) -> Result<Self> {
        Self::with_decay(config, Arc::new(decays))
    }

    /// AdamW whose weight decay applies only to parameters `decay(name, rank)` selects.
    pub fn with_decay(config: AdamWConfig, decay: DecayPredicate) -> Result<Self> {
        config.validate()?;
        Ok(Self {
            config,
            decay,
            state: BTreeMap::new(),
        })
    }

    pub fn config(&self) -> &AdamWConfig {
        &self.config
    }

    /// Whether weight decay applies to a parameter of this name and rank.
    pub fn applies_weight_decay(&self, name: &str, rank: usize) -> bool {
        (self.decay)(name, rank)
    }

    /// How many updates the named parameter has received (`None`: no state yet).
    pub fn step_count(&self, name: &str) -> Option<u64> {
        self.state.get(name).map(|s| s.step)
    }

    /// Names of the parameters that have state, sorted.
    pub fn state_names(&self) -> Vec<String> {
        self.state.keys().cloned().collect()
    }

    /// Creates zero state (step 0) for parameters that have none, and checks that existing
    /// state matches each parameter's shape and dtype. A runtime calls this after building its
    /// layers so that state can be exported (say, for a layer copy) before the first step.
    pub fn ensure_state(&mut self, params: &[(String, Var)]) -> Result<()> {
        let params = unique_params(params)?;
        for (name, var) in &params {
            check_float_param(name, var.as_tensor())?;
            if let Some(st) = self.state.get(*name) {
                check_state_matches(name, st, var.as_tensor())?;
            }
        }
        for (name, var) in params {
            if !self.state.contains_key(name) {
                self.state
                    .insert(name.to_string(), ParamState::zeros(var.as_tensor())?);
            }
        }
        Ok(())
    }

    /// Drops the state of the named parameters (a stage that no longer holds some layers).
    pub fn forget<S: AsRef<str>>(&mut self, names: &[S]) {
        for name in names {
            self.state.remove(name.as_ref());
        }
    }

    /// One AdamW update of every listed parameter with its gradient, at learning rate `lr`.
    pub fn step(
        &mut self,
        params: &[(String, Var)],
        grads: &HashMap<String, Tensor>,
        lr: f64,
    ) -> Result<()> {
        if !(lr.is_finite() && lr >= 0.0) {
            return Err(Error::InvalidArgument {
                op: "AdamW step",
                name: "learning rate",
                value: lr,
                want: "finite and >= 0",
            });
        }
        let params = unique_params(params)?;
        // Validate everything before touching anything, so a rejected step changes nothing.
        let mut extra: Vec<&String> = grads
            .keys()
            .filter(|n| !params.contains_key(n.as_str()))
            .collect();
        extra.sort();
        if let Some(name) = extra.first() {
            return Err(opt_err(
                name,
                "has a gradient but is not among the parameters being stepped",
            ));
        }
        for (name, var) in &params {
            let theta = var.as_tensor();
            check_float_param(name, theta)?;
            let grad = grads
                .get(*name)
                .ok_or_else(|| opt_err(name, "has no gradient"))?;
            if grad.dims() != theta.dims() || grad.dtype() != theta.dtype() {
                return Err(opt_err(
                    name,
                    format!(
                        "gradient is {:?} {:?} but the parameter is {:?} {:?}",
                        grad.dtype(),
                        grad.dims(),
                        theta.dtype(),
                        theta.dims()
                    ),
                ));
            }
            if let Some(st) = self.state.get(*name) {
                check_state_matches(name, st, theta)?;
            }
        }

        let cfg = self.config;
        for (name, var) in params {
            let theta = var.as_tensor();
            let grad = grads[name].to_device(theta.device())?;
            let weight_decay = if (self.decay)(name, theta.rank()) {
                cfg.weight_decay
            } else {
                0.0
            };
            // A clone shares the moments' storage, which the fused path updates in place.
            let st = match self.state.get(name) {
                Some(st) => st.clone(),
                None => ParamState::zeros(theta)?,
            };
            let st = step_one(theta, &grad, st, lr, weight_decay, &cfg)
                .and_then(|st| var_set_unless_in_place(var, st))?;
            self.state.insert(name.to_string(), st);
        }
        Ok(())
    }

    /// All state, sorted by entry name: `<name>.exp_avg`, `<name>.exp_avg_sq`, `<name>.step`.
    pub fn export_state(&self) -> Result<Vec<(String, Tensor)>> {
        let mut out = Vec::with_capacity(self.state.len() * 3);
        for (name, st) in &self.state {
            push_entries(&mut out, name, st)?;
        }
        out.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(out)
    }

    /// The state of the named parameters only (a layer copy), sorted by entry name. A name with
    /// no state is an error: call [`AdamW::ensure_state`] first if the layer may not have
    /// stepped yet.
    pub fn export_state_for<S: AsRef<str>>(&self, names: &[S]) -> Result<Vec<(String, Tensor)>> {
        let mut out = Vec::with_capacity(names.len() * 3);
        let wanted: BTreeSet<&str> = names.iter().map(|n| n.as_ref()).collect();
        for name in wanted {
            let st = self
                .state
                .get(name)
                .ok_or_else(|| opt_err(name, "has no optimizer state to export"))?;
            push_entries(&mut out, name, st)?;
        }
        out.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(out)
    }

    /// Replaces the state of every parameter named in `entries` (the format of
    /// [`AdamW::export_state`]) and leaves other parameters' state alone, so a subset exported
    /// from a replica can be imported. Each parameter needs all three entries, moments of one
    /// float dtype and shape, and, where this optimizer already has state for it, the same shape
    /// and dtype as that state. Nothing is imported unless everything is valid.
    pub fn import_state(&mut self, entries: &[(String, Tensor)]) -> Result<()> {
        type Parts<'a> = (Option<&'a Tensor>, Option<&'a Tensor>, Option<&'a Tensor>);
        let mut parts: BTreeMap<&str, Parts<'_>> = BTreeMap::new();
        for (key, tensor) in entries {
            let (name, slot) = split_entry(key)?;
            let e = parts.entry(name).or_default();
            let cell = match slot {
                Slot::ExpAvg => &mut e.0,
                Slot::ExpAvgSq => &mut e.1,
                Slot::Step => &mut e.2,
            };
            if cell.replace(tensor).is_some() {
                return Err(opt_err(key, "appears twice in the imported state"));
            }
        }
        let mut parsed = Vec::with_capacity(parts.len());
        for (name, (m, v, s)) in parts {
            let missing =
                |what: &str| opt_err(name, format!("imported state lacks `{name}.{what}`"));
            let m = m.ok_or_else(|| missing(EXP_AVG))?;
            let v = v.ok_or_else(|| missing(EXP_AVG_SQ))?;
            let s = s.ok_or_else(|| missing(STEP))?;
            if !m.dtype().is_float() || m.dtype() != v.dtype() || m.dims() != v.dims() {
                return Err(opt_err(
                    name,
                    format!(
                        "imported moments disagree: exp_avg {:?} {:?}, exp_avg_sq {:?} {:?}",
                        m.dtype(),
                        m.dims(),
                        v.dtype(),
                        v.dims()
                    ),
                ));
            }
            if s.dtype() != DType::I64 || s.elem_count() != 1 {
                return Err(opt_err(
                    name,
                    format!(
                        "imported step must be one i64, found {:?} {:?}",
                        s.dtype(),
                        s.dims()
                    ),
                ));
            }
            let step = s.flatten_all()?.to_vec1::<i64>()?[0];
            let step = u64::try_from(step)
                .map_err(|_| opt_err(name, format!("imported step {step} is negative")))?;
            if let Some(old) = self.state.get(name) {
                if old.exp_avg.dims() != m.dims() || old.exp_avg.dtype() != m.dtype() {
                    return Err(opt_err(
                        name,
                        format!(
                            "imported state is {:?} {:?} but existing state is {:?} {:?}",
                            m.dtype(),
                            m.dims(),
                            old.exp_avg.dtype(),
                            old.exp_avg.dims()
                        ),
                    ));
                }
            }
            // Copies: later steps update the moments in place, never the caller's tensors.
            let st = ParamState {
                exp_avg: m.copy()?,
                exp_avg_sq: v.copy()?,
                step,
            };
            parsed.push((name.to_string(), st));
        }
        self.state.extend(parsed);
        Ok(())
    }

    /// [`import_state`](Self::import_state) of the entries of the parameters in `names` only
    /// (a pipeline stage taking its layers' state from a whole-model checkpoint). Every name
    /// must have its entries.
    pub fn import_state_of(
        &mut self,
        entries: &[(String, Tensor)],
        names: &BTreeSet<String>,
    ) -> Result<()> {
        let mut mine = Vec::with_capacity(3 * names.len());
        let mut found = BTreeSet::new();
        for (key, t) in entries {
            let (name, _) = split_entry(key)?;
            if names.contains(name) {
                found.insert(name);
                mine.push((key.clone(), t.clone()));
            }
        }
        if let Some(lost) = names.iter().find(|n| !found.contains(n.as_str())) {
            return Err(opt_err(lost, "the imported state has no entries for it"));
        }
        self.import_state(&mine)
    }
}

/// One parameter's update in the operation order of `torch.optim.adamw._single_tensor_adamw`.
#[allow(clippy::too_many_arguments)]
fn update(
    theta: &Tensor,
    grad: &Tensor,
    exp_avg: &Tensor,
    exp_avg_sq: &Tensor,
    step: u64,
    lr: f64,
    weight_decay: f64,
    cfg: &AdamWConfig,
) -> Result<(Tensor, Tensor, Tensor)> {
    // param.mul_(1 - lr * weight_decay); skipped when it is a multiplication by exactly 1.
    let theta = if weight_decay != 0.0 {
        theta.affine(1.0 - lr * weight_decay, 0.0)?
    } else {
        theta.clone()
    };
    // exp_avg.lerp_(grad, 1 - beta1): ATen's lerp picks its formula by the weight's size, and
    // computes it in the tensor's opmath (f32 for f32/f16/bf16), so mirror both.
    let w = (1.0 - cfg.beta1) as f32;
    let diff = (grad - exp_avg)?;
    let exp_avg = if w.abs() < 0.5 {
        (exp_avg + diff.affine(w as f64, 0.0)?)?
    } else {
        (grad - diff.affine((1.0f32 - w) as f64, 0.0)?)?
    };
    // exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    let exp_avg_sq =
        (exp_avg_sq.affine(cfg.beta2, 0.0)? + (grad.affine(1.0 - cfg.beta2, 0.0)? * grad)?)?;
    let t = step as f64;
    let bias_correction1 = 1.0 - cfg.beta1.powf(t);
    let bias_correction2 = 1.0 - cfg.beta2.powf(t);
    let step_size = lr / bias_correction1;
    // (exp_avg_sq.sqrt() / sqrt(bc2)).add_(eps): a true division, not a multiplication by the
    // reciprocal, to round like PyTorch.
    let bc2_sqrt = Tensor::new(bias_correction2.sqrt(), theta.device())?.to_dtype(theta.dtype())?;
    let denom = (exp_avg_sq.sqrt()?.broadcast_div(&bc2_sqrt)? + cfg.eps)?;
    // param.addcdiv_(exp_avg, denom, value=-step_size): param + (value * exp_avg) / denom
    let next = (&theta + (exp_avg.affine(-step_size, 0.0)? / &denom)?)?;
    Ok((next, exp_avg, exp_avg_sq))
}

/// A parameter's state after one update. On the CPU in `f32` this is [`fused::step_in_place`]
/// on the parameter and the moments themselves (`next_theta` is `None`); elsewhere the tensor
/// path [`update`], whose new parameter value the caller sets.
struct Stepped {
    state: ParamState,
    next_theta: Option<Tensor>,
}

fn step_one(
    theta: &Tensor,
    grad: &Tensor,
    st: ParamState,
    lr: f64,
    weight_decay: f64,
    cfg: &AdamWConfig,
) -> Result<Stepped> {
    let step = st.step + 1;
    if fused::applies([theta, grad, &st.exp_avg, &st.exp_avg_sq]) {
        let s = fused::Scalars::new(cfg.beta1, cfg.beta2, cfg.eps, lr, weight_decay, step);
        fused::step_in_place(theta, grad, &st.exp_avg, &st.exp_avg_sq, s)?;
        return Ok(Stepped {
            state: ParamState { step, ..st },
            next_theta: None,
        });
    }
    let (next_theta, exp_avg, exp_avg_sq) = update(
        &theta.detach(),
        &grad.detach(),
        &st.exp_avg.to_device(theta.device())?,
        &st.exp_avg_sq.to_device(theta.device())?,
        step,
        lr,
        weight_decay,
        cfg,
    )?;
    Ok(Stepped {
        state: ParamState {
            exp_avg,
            exp_avg_sq,
            step,
        },
        next_theta: Some(next_theta),
    })
}

fn var_set_unless_in_place(var: &Var, stepped: Stepped) -> Result<ParamState> {
    if let Some(next) = &stepped.next_theta {
        var.set(next)?;
    }
    Ok(stepped.state)
}

enum Slot {
    ExpAvg,
    ExpAvgSq,
    Step,
}

fn split_entry(key: &str) -> Result<(&str, Slot)> {
    // Check `.exp_avg_sq` before `.exp_avg`; a parameter name may itself contain dots.
    let tries = [
        (EXP_AVG_SQ, Slot::ExpAvgSq),
        (EXP_AVG, Slot::ExpAvg),
        (STEP, Slot::Step),
    ];
    for (suffix, slot) in tries {
        if let Some(name) = key
            .strip_suffix(suffix)
            .and_then(|rest| rest.strip_suffix('.'))
        {
            if !name.is_empty() {
                return Ok((name, slot));
            }
        }
    }
    Err(opt_err(
        key,
        format!(
            "unrecognised optimizer-state entry (expected `<param>.{EXP_AVG}`, \
             `<param>.{EXP_AVG_SQ}` or `<param>.{STEP}`)"
        ),
    ))
}

fn push_entries(out: &mut Vec<(String, Tensor)>, name: &str, st: &ParamState) -> Result<()> {
    let step = i64::try_from(st.step)
        .map_err(|_| opt_err(name, format!("step {} does not fit an i64", st.step)))?;
    let device: &Device = st.exp_avg.device();
    // Copies: the moments are updated in place by later steps.
    out.push((format!("{name}.{EXP_AVG}"), st.exp_avg.copy()?));
    out.push((format!("{name}.{EXP_AVG_SQ}"), st.exp_avg_sq.copy()?));
    out.push((format!("{name}.{STEP}"), Tensor::new(step, device)?));
    Ok(())
}

fn unique_params(params: &[(String, Var)]) -> Result<BTreeMap<&str, &Var>> {
    let mut out = BTreeMap::new();
    for (name, var) in params {
        if out.insert(name.as_str(), var).is_some() {
            return Err(opt_err(
                name,
                "is listed twice; list a tied weight once and sum its gradients",
            ));
        }
    }
    Ok(out)
}

fn check_float_param(name: &str, theta: &Tensor) -> Result<()> {
    if theta.dtype().is_float() {
        Ok(())
    } else {
        Err(opt_err(
            name,
            format!("has dtype {:?}; AdamW needs a float", theta.dtype()),
        ))
    }
}

fn check_state_matches(name: &str, st: &ParamState, theta: &Tensor) -> Result<()> {
    if st.exp_avg.dims() != theta.dims() || st.exp_avg.dtype() != theta.dtype() {
        return Err(opt_err(
            name,
            format!(
                "optimizer state is {:?} {:?} but the parameter is {:?} {:?}",
                st.exp_avg.dtype(),
                st.exp_avg.dims(),
                theta.dtype(),
                theta.dims()
            ),
        ));
    }
    Ok(())
}

fn opt_err(name: &str, reason: impl Into<String>) -> Error {
    Error::Optimizer {
        name: name.to_string(),
        reason: reason.into(),
    }
}

#[cfg(test)]
#[path = "adamw_tests.rs"]
mod tests;
