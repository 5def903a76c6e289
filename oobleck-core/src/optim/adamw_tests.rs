use super::*;
use candle_core::Device;

fn var(name: &str, data: &[f32], shape: &[usize]) -> (String, Var) {
    let t = Tensor::from_slice(data, shape, &Device::Cpu).unwrap();
    (name.to_string(), Var::from_tensor(&t).unwrap())
}

fn grads(entries: &[(&str, &[f32], &[usize])]) -> HashMap<String, Tensor> {
    entries
        .iter()
        .map(|(n, d, s)| {
            (
                n.to_string(),
                Tensor::from_slice(d, *s, &Device::Cpu).unwrap(),
            )
        })
        .collect()
}

fn values(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
}

fn max_abs_diff(got: &[f32], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    got.iter()
        .zip(want)
        .map(|(x, y)| (*x as f64 - y).abs())
        .fold(0.0, f64::max)
}

fn torch_like_config() -> AdamWConfig {
    AdamWConfig {
        lr: 1e-2,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
    }
}

/// Three steps on a 2x3 weight (decays) and a bias (does not) with changing gradients and
/// learning rates.
fn run_reference_steps(opt: &mut AdamW) -> (Var, Var) {
    let params = vec![
        var("w", &[0.5, -1.0, 0.25, 2.0, 0.0, -0.75], &[2, 3]),
        var("b", &[0.1, -0.2, 0.3], &[3]),
    ];
    for (t, lr) in [1e-2, 5e-3, 2e-2].into_iter().enumerate() {
        let s = (t + 1) as f32;
        let g = grads(&[
            ("w", &[0.1 * s, -0.2, 0.3 / s, -0.4, 0.5 * s, 0.0], &[2, 3]),
            ("b", &[1.0 / s, -0.5, 0.25 * s], &[3]),
        ]);
        opt.step(&params, &g, lr).unwrap();
    }
    (params[0].1.clone(), params[1].1.clone())
}

/// Expected values: PyTorch 2.15.0 `torch.optim.AdamW` (CPU, float32, default single-tensor
/// path) on the same parameters, gradients and rates, with param groups
/// `[{params: [w], weight_decay: 0.1}, {params: [b], weight_decay: 0.0}]`,
/// betas (0.9, 0.95), eps 1e-8, printed with `repr(float(x))`. Script (run once, by hand):
/// ```text
/// w = torch.tensor([[0.5,-1.0,0.25],[2.0,0.0,-0.75]], requires_grad=True)
/// b = torch.tensor([0.1,-0.2,0.3], requires_grad=True)
/// opt = torch.optim.AdamW([{"params":[w],"weight_decay":0.1},
///                          {"params":[b],"weight_decay":0.0}], betas=(0.9,0.95), eps=1e-8)
/// for t, lr in enumerate([1e-2, 5e-3, 2e-2]):
///     for g in opt.param_groups: g["lr"] = lr
///     s = t + 1
///     w.grad = torch.tensor([[0.1*s,-0.2,0.3/s],[-0.4,0.5*s,0.0]])
///     b.grad = torch.tensor([1.0/s,-0.5,0.25*s])
///     opt.step()
/// ```
#[test]
fn matches_torch_adamw_over_three_steps_with_decay_groups() {
    let mut opt = AdamW::new(torch_like_config()).unwrap();
    let (w, b) = run_reference_steps(&mut opt);
    let want_w: &[f64] = &[
        0.464_606_225_490_570_07,
        -0.961_538_493_633_270_3,
        0.216_708_317_399_024_96,
        2.027_972_221_374_511_7,
        -0.033_645_555_377_006_53,
        -0.747_377_634_048_461_9,
    ];
    let want_b: &[f64] = &[
        0.067_548_066_377_639_77,
        -0.165_000_006_556_510_93,
        0.266_319_900_751_113_9,
    ];
    let want_m: &[f64] = &[
        0.056_099_999_696_016_31,
        -0.054_200_001_060_962_68,
        0.047_800_004_482_269_29,
        -0.108_400_002_121_925_35,
        0.280_499_994_754_791_26,
        0.0,
    ];
    let want_v: &[f64] = &[
        0.006_851_250_771_433_115,
        0.005_705_000_367_015_6,
        0.005_630_000_028_759_241,
        0.022_820_001_468_062_4,
        0.171_281_248_331_069_95,
        0.0,
    ];
    let state: HashMap<String, Tensor> = opt.export_state().unwrap().into_iter().collect();
    let diffs = [
        max_abs_diff(&values(w.as_tensor()), want_w),
        max_abs_diff(&values(b.as_tensor()), want_b),
        max_abs_diff(&values(&state["w.exp_avg"]), want_m),
        max_abs_diff(&values(&state["w.exp_avg_sq"]), want_v),
    ];
    for d in diffs {
        assert!(d <= 1e-6, "max abs diff vs PyTorch {diffs:?}");
    }
    assert_eq!(state["w.step"].to_scalar::<i64>().unwrap(), 3);
    assert_eq!(opt.step_count("b"), Some(3));
}

#[test]
fn decay_predicate_selects_which_parameters_decay() {
    // A predicate that decays nothing must equal weight_decay = 0 for every parameter.
    let never: DecayPredicate = Arc::new(|_, _| false);
    let mut a = AdamW::with_decay(torch_like_config(), never).unwrap();
    let mut b = AdamW::new(AdamWConfig {
        weight_decay: 0.0,
        ..torch_like_config()
    })
    .unwrap();
    let mut c = AdamW::new(torch_like_config()).unwrap();
    let (wa, ba) = run_reference_steps(&mut a);
    let (wb, bb) = run_reference_steps(&mut b);
    let (wc, bc) = run_reference_steps(&mut c);
    assert_eq!(values(wa.as_tensor()), values(wb.as_tensor()));
    assert_eq!(values(ba.as_tensor()), values(bb.as_tensor()));
    // With the default predicate only the rank-2 weight differs.
    assert_ne!(values(wa.as_tensor()), values(wc.as_tensor()));
    assert_eq!(values(ba.as_tensor()), values(bc.as_tensor()));
    assert!(c.applies_weight_decay("h.0.attn.c_attn.weight", 2));
    assert!(!c.applies_weight_decay("h.0.ln_1.weight", 1));
}

#[test]
fn rejects_missing_extra_duplicate_and_misshapen_gradients_without_changing_anything() {
    let mut opt = AdamW::new(AdamWConfig::default()).unwrap();
    let params = vec![var("a", &[1.0, 2.0], &[2]), var("b", &[3.0], &[1])];
    let only_a = grads(&[("a", &[0.1, 0.1], &[2])]);
    let err = opt.step(&params, &only_a, 1e-3).unwrap_err().to_string();
    assert!(err.contains("`b`") && err.contains("no gradient"), "{err}");

    let extra = grads(&[
        ("a", &[0.1, 0.1], &[2]),
        ("b", &[0.1], &[1]),
        ("c", &[0.1], &[1]),
    ]);
    let err = opt.step(&params, &extra, 1e-3).unwrap_err().to_string();
    assert!(err.contains("`c`") && err.contains("not among"), "{err}");

    let bad_shape = grads(&[("a", &[0.1, 0.1], &[2]), ("b", &[0.1, 0.2], &[2])]);
    let err = opt.step(&params, &bad_shape, 1e-3).unwrap_err().to_string();
    assert!(err.contains("`b`") && err.contains("[2]"), "{err}");

    let twice = vec![params[0].clone(), params[0].clone()];
    let err = opt.step(&twice, &only_a, 1e-3).unwrap_err().to_string();
    assert!(err.contains("listed twice"), "{err}");

    assert!(opt.step(&params, &extra, f64::NAN).is_err());
    assert_eq!(values(params[0].1.as_tensor()), vec![1.0, 2.0]);
    assert!(opt.state_names().is_empty());
}

#[test]
fn exported_state_imported_elsewhere_gives_identical_later_steps() {
    let cfg = torch_like_config();
    let mut a = AdamW::new(cfg).unwrap();
    let (w, b) = run_reference_steps(&mut a);
    let clone = |v: &Var| Var::from_tensor(&v.as_tensor().copy().unwrap()).unwrap();

    // Full import.
    let mut full = AdamW::new(cfg).unwrap();
    full.import_state(&a.export_state().unwrap()).unwrap();
    // Subset import: only `w`, as a layer copy would carry it.
    let mut part = AdamW::new(cfg).unwrap();
    part.import_state(&a.export_state_for(&["w"]).unwrap())
        .unwrap();
    assert_eq!(part.state_names(), vec!["w".to_string()]);
    // The same subset taken from the whole state (a stage resuming from a full checkpoint).
    let mut picked = AdamW::new(cfg).unwrap();
    let names: std::collections::BTreeSet<String> = ["w".to_string()].into();
    picked
        .import_state_of(&a.export_state().unwrap(), &names)
        .unwrap();
    assert_eq!(picked.state_names(), vec!["w".to_string()]);
    let absent: std::collections::BTreeSet<String> = ["w".to_string(), "z".to_string()].into();
    let err = AdamW::new(cfg)
        .unwrap()
        .import_state_of(&a.export_state().unwrap(), &absent)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("`z`: the imported state has no entries"),
        "{err}"
    );

    let g = grads(&[
        ("w", &[0.3, -0.1, 0.2, 0.05, -0.6, 0.9], &[2, 3]),
        ("b", &[0.2, 0.2, -0.2], &[3]),
    ]);
    let p_a = vec![("w".to_string(), w.clone()), ("b".to_string(), b.clone())];
    let p_full = vec![("w".to_string(), clone(&w)), ("b".to_string(), clone(&b))];
    let p_part = vec![("w".to_string(), clone(&w))];
    let g_part: HashMap<String, Tensor> = g
        .iter()
        .filter(|(k, _)| *k == "w")
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    a.step(&p_a, &g, 7e-3).unwrap();
    full.step(&p_full, &g, 7e-3).unwrap();
    part.step(&p_part, &g_part, 7e-3).unwrap();
    for i in 0..2 {
        assert_eq!(
            values(p_a[i].1.as_tensor()),
            values(p_full[i].1.as_tensor())
        );
    }
    assert_eq!(
        values(p_a[0].1.as_tensor()),
        values(p_part[0].1.as_tensor())
    );
    assert_eq!(part.step_count("w"), Some(4));
}

#[test]
fn import_rejects_incomplete_or_inconsistent_state_and_keeps_the_old() {
    let mut opt = AdamW::new(AdamWConfig::default()).unwrap();
    let params = vec![var("w", &[1.0, 2.0], &[2])];
    opt.ensure_state(&params).unwrap();
    let dev = Device::Cpu;
    let zeros = |n: usize| Tensor::zeros(n, DType::F32, &dev).unwrap();
    let step = Tensor::new(5i64, &dev).unwrap();

    let lacks_sq = vec![
        ("w.exp_avg".to_string(), zeros(2)),
        ("w.step".to_string(), step.clone()),
    ];
    let err = opt.import_state(&lacks_sq).unwrap_err().to_string();
    assert!(err.contains("w.exp_avg_sq"), "{err}");

    let wrong_shape = vec![
        ("w.exp_avg".to_string(), zeros(3)),
        ("w.exp_avg_sq".to_string(), zeros(3)),
        ("w.step".to_string(), step.clone()),
    ];
    let err = opt.import_state(&wrong_shape).unwrap_err().to_string();
    assert!(err.contains("existing state"), "{err}");

    let negative = vec![
        ("w.exp_avg".to_string(), zeros(2)),
        ("w.exp_avg_sq".to_string(), zeros(2)),
        ("w.step".to_string(), Tensor::new(-1i64, &dev).unwrap()),
    ];
    assert!(opt.import_state(&negative).is_err());

    let unknown = vec![("w.momentum".to_string(), zeros(2))];
    assert!(opt.import_state(&unknown).is_err());
    assert_eq!(opt.step_count("w"), Some(0));
    assert!(opt.export_state_for(&["nope"]).is_err());
}

#[test]
fn config_validation_rejects_out_of_range_values() {
    assert!(AdamWConfig::default().validate().is_ok());
    for bad in [
        AdamWConfig {
            beta1: 1.0,
            ..Default::default()
        },
        AdamWConfig {
            beta2: -0.1,
            ..Default::default()
        },
        AdamWConfig {
            eps: 0.0,
            ..Default::default()
        },
        AdamWConfig {
            lr: f64::INFINITY,
            ..Default::default()
        },
        AdamWConfig {
            weight_decay: -1.0,
            ..Default::default()
        },
    ] {
        assert!(AdamW::new(bad).is_err(), "{bad:?} accepted");
    }
    let parsed: AdamWConfig = serde_json::from_str(r#"{"lr": 6e-4, "beta2": 0.95}"#).unwrap();
    assert_eq!(parsed.beta2, 0.95);
    assert_eq!(parsed.eps, 1e-8);
    assert!(serde_json::from_str::<AdamWConfig>(r#"{"learning_rate": 1}"#).is_err());
}

/// Seeded values in [-scale, scale).
fn seeded(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    use rand::{Rng, SeedableRng};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    (0..n).map(|_| rng.random_range(-scale..scale)).collect()
}

/// The fused in-place update (CPU f32) gives the tensor path's bits exactly: on a parameter
/// of several parallel chunks plus a ragged tail, with and without decay, through both lerp
/// branches (β1 = 0.9 and 0.3), over several steps.
#[test]
fn fused_update_is_bit_identical_to_the_tensor_path() {
    let n = 3 * (1 << 15) + 77;
    for (beta1, weight_decay) in [(0.9, 0.1), (0.9, 0.0), (0.3, 0.1)] {
        let cfg = AdamWConfig {
            beta1,
            weight_decay,
            ..torch_like_config()
        };
        let (name, p) = var("w", &seeded(n, 1, 1.0), &[n]);
        let mut opt = AdamW::with_decay(cfg, Arc::new(|_, _| true)).unwrap();
        let mut theta = p.as_tensor().copy().unwrap();
        let mut m = theta.zeros_like().unwrap();
        let mut v = theta.zeros_like().unwrap();
        let params = vec![(name, p.clone())];
        for step in 1..=4u64 {
            let lr = 1e-2 / step as f64;
            let g = Tensor::from_vec(seeded(n, 10 + step, 0.5), n, &Device::Cpu).unwrap();
            let grads = HashMap::from([("w".to_string(), g.clone())]);
            opt.step(&params, &grads, lr).unwrap();
            (theta, m, v) = update(&theta, &g, &m, &v, step, lr, weight_decay, &cfg).unwrap();
            let state = opt.export_state().unwrap();
            let bits = |t: &Tensor| values(t).iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                bits(p.as_tensor()),
                bits(&theta),
                "θ at step {step}, β1 {beta1}"
            );
            assert_eq!(bits(&state[0].1), bits(&m), "exp_avg at step {step}");
            assert_eq!(bits(&state[1].1), bits(&v), "exp_avg_sq at step {step}");
        }
    }
}

/// Exported state is a snapshot and imported tensors stay the caller's: the in-place update
/// changes neither.
#[test]
fn exported_and_imported_state_are_not_changed_by_later_steps() {
    let mut opt = AdamW::new(torch_like_config()).unwrap();
    let params = vec![var("w", &[0.5, -1.0, 0.25, 2.0], &[2, 2])];
    let g = grads(&[("w", &[0.1, -0.2, 0.3, -0.4], &[2, 2])]);
    opt.step(&params, &g, 1e-2).unwrap();
    let exported = opt.export_state().unwrap();
    let before: Vec<Vec<f32>> = exported[..2].iter().map(|(_, t)| values(t)).collect();
    let mut other = AdamW::new(torch_like_config()).unwrap();
    other.import_state(&exported).unwrap();
    opt.step(&params, &g, 1e-2).unwrap();
    other.step(&params, &g, 1e-2).unwrap();
    let after: Vec<Vec<f32>> = exported[..2].iter().map(|(_, t)| values(t)).collect();
    assert_eq!(before, after);
    assert_ne!(values(&opt.export_state().unwrap()[0].1), before[0]);
}
