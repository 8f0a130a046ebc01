//! The long-context drift test: how far each lightning layer's GLA state
//! `S_t = γ·S_{t−1} + k_tᵀ v_t` and output move between the original and the quantized weights as
//! the input grows.
//!
//! A causal model's values at position `t` depend only on tokens `≤ t`, so one pass over `N`
//! tokens gives the state after every prefix: the state is taken at each checkpoint length `n`
//! (recurrence in f64 on the layer's own k/v), the layer output's error over the positions since
//! the previous checkpoint. The growth exponent `p` of `error ∝ n^p` is the least-squares slope
//! of `ln error` against `ln n`: `p ≈ 1` is a systematic bias accumulating linearly, `p ≈ 0.5`
//! independent noise, `p ≈ 0` an error the decay keeps bounded.

use crate::error::EvalError;
use crate::model::{host_values, LoadedModel};
use burn::tensor::backend::Backend;
use burn::tensor::Tensor;
use sala_gptq::model::ops::gla::log_decays;
use sala_gptq::model::{LayerKind, LayerRunner, LayerWeights};
use serde::Serialize;
use std::fmt::Write;

/// What the quantized model's layers read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum DriftInput {
    /// Each model its own hidden states, as served (errors of earlier layers included).
    Propagated,
    /// Each quantized layer the original model's input (its own weights' error only).
    Original,
}

/// Options of [`drift`].
#[derive(Debug, Clone, PartialEq)]
pub struct DriftOptions {
    /// Prefix lengths at which errors are measured, ascending, each `≤` the input length.
    pub checkpoints: Vec<usize>,
    /// What the quantized layers read.
    pub input: DriftInput,
}

/// Errors of one lightning layer after `tokens` tokens.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct DriftPoint {
    /// Prefix length.
    pub tokens: usize,
    /// `‖S_q − S_o‖_F` over all heads.
    pub state_abs: f64,
    /// `‖S_q − S_o‖_F / ‖S_o‖_F`.
    pub state_rel: f64,
    /// Relative Frobenius error of the layer's output rows since the previous checkpoint.
    pub output_rel: f64,
}

/// The drift of one lightning layer.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LayerDrift {
    /// Decoder layer index.
    pub layer: usize,
    /// One point per checkpoint.
    pub points: Vec<DriftPoint>,
    /// Growth exponent of `state_abs` (`None` with fewer than two positive points).
    pub p_state_abs: Option<f64>,
    /// Growth exponent of `state_rel`.
    pub p_state_rel: Option<f64>,
    /// Growth exponent of `output_rel`.
    pub p_output_rel: Option<f64>,
}

/// The GLA state after the first `n` tokens for each `n` in `at` (ascending, `≤ tokens`), in
/// f64, as `[heads, d, d]` row-major, from `k`, `v` `[tokens, heads, d]` row-major.
pub fn gla_states(
    k: &[f32],
    v: &[f32],
    shape: [usize; 3],
    log_decays: &[f64],
    at: &[usize],
) -> Vec<Vec<f64>> {
    let [tokens, heads, d] = shape;
    let mut out = vec![vec![0f64; heads * d * d]; at.len()];
    for (h, &g) in log_decays.iter().enumerate().take(heads) {
        let gamma = g.exp();
        let mut state = vec![0f64; d * d];
        let mut next = 0;
        for t in 0..tokens {
            let row = (t * heads + h) * d;
            for (i, s_row) in state.chunks_mut(d).enumerate() {
                let ki = k[row + i] as f64;
                for (s, &vj) in s_row.iter_mut().zip(&v[row..row + d]) {
                    *s = gamma * *s + ki * vj as f64;
                }
            }
            while next < at.len() && at[next] == t + 1 {
                out[next][h * d * d..(h + 1) * d * d].copy_from_slice(&state);
                next += 1;
            }
        }
    }
    out
}

/// Least-squares slope of `ln err` against `ln n` over the points with `err > 0`.
pub fn growth_exponent(points: &[(usize, f64)]) -> Option<f64> {
    let logs: Vec<(f64, f64)> = points
        .iter()
        .filter(|(n, e)| *n > 0 && *e > 0.0 && e.is_finite())
        .map(|&(n, e)| ((n as f64).ln(), e.ln()))
        .collect();
    if logs.len() < 2 {
        return None;
    }
    let m = logs.len() as f64;
    let (mx, my) = logs
        .iter()
        .fold((0.0, 0.0), |(a, b), (x, y)| (a + x / m, b + y / m));
    let sxx: f64 = logs.iter().map(|(x, _)| (x - mx).powi(2)).sum();
    let sxy: f64 = logs.iter().map(|(x, y)| (x - mx) * (y - my)).sum();
    (sxx > 0.0).then(|| sxy / sxx)
}

fn frobenius_error<T: Copy + Into<f64>>(a: &[T], b: &[T]) -> (f64, f64) {
    let (mut diff, mut norm) = (0f64, 0f64);
    for (&x, &y) in a.iter().zip(b) {
        let (x, y): (f64, f64) = (x.into(), y.into());
        diff += (x - y).powi(2);
        norm += x * x;
    }
    (diff.sqrt(), norm.sqrt())
}

fn relative(abs: f64, norm: f64) -> f64 {
    if norm > 0.0 {
        abs / norm
    } else {
        abs
    }
}

fn check_checkpoints(checkpoints: &[usize], tokens: usize) -> Result<(), EvalError> {
    let ascending = checkpoints.windows(2).all(|w| w[0] < w[1]);
    let valid = !checkpoints.is_empty()
        && ascending
        && checkpoints[0] > 0
        && checkpoints.last().is_some_and(|&n| n <= tokens);
    if valid {
        Ok(())
    } else {
        Err(EvalError::InvalidInput(format!(
            "drift checkpoints {checkpoints:?} must be ascending, positive and at most the input length {tokens}"
        )))
    }
}

/// One lightning layer of both models: state and output errors at each checkpoint.
fn lightning_drift<B: Backend>(
    runner: &LayerRunner<B>,
    (original, quantized): (&LayerWeights, &LayerWeights),
    (h_o, h_q): (&Tensor<B, 2>, &Tensor<B, 2>),
    (out_o, out_q): (&[f32], &[f32]),
    checkpoints: &[usize],
) -> Result<LayerDrift, EvalError> {
    let [_, k_o, v_o] = runner.lightning_gla_inputs(original, h_o.clone())?;
    let [_, k_q, v_q] = runner.lightning_gla_inputs(quantized, h_q.clone())?;
    let shape = k_o.dims();
    let decays = log_decays(shape[1]);
    let s_o = gla_states(
        &host_values(k_o)?,
        &host_values(v_o)?,
        shape,
        &decays,
        checkpoints,
    );
    let s_q = gla_states(
        &host_values(k_q)?,
        &host_values(v_q)?,
        shape,
        &decays,
        checkpoints,
    );
    let width = runner.config().hidden_size();
    let mut points = Vec::with_capacity(checkpoints.len());
    let mut start = 0;
    for (i, &n) in checkpoints.iter().enumerate() {
        let (state_abs, state_norm) = frobenius_error(&s_o[i], &s_q[i]);
        let rows = start * width..n * width;
        let (out_abs, out_norm) = frobenius_error(&out_o[rows.clone()], &out_q[rows]);
        points.push(DriftPoint {
            tokens: n,
            state_abs,
            state_rel: relative(state_abs, state_norm),
            output_rel: relative(out_abs, out_norm),
        });
        start = n;
    }
    let exponent = |f: fn(&DriftPoint) -> f64| {
        growth_exponent(&points.iter().map(|p| (p.tokens, f(p))).collect::<Vec<_>>())
    };
    Ok(LayerDrift {
        layer: original.layer,
        p_state_abs: exponent(|p| p.state_abs),
        p_state_rel: exponent(|p| p.state_rel),
        p_output_rel: exponent(|p| p.output_rel),
        points,
    })
}

/// Runs both models over `ids` and measures every lightning layer's drift.
pub fn drift<B: Backend>(
    runner: &LayerRunner<B>,
    original: &LoadedModel,
    quantized: &LoadedModel,
    ids: &[u32],
    options: &DriftOptions,
) -> Result<Vec<LayerDrift>, EvalError> {
    check_checkpoints(&options.checkpoints, ids.len())?;
    let mut h_o = original.embed(runner, ids)?;
    let mut h_q = quantized.embed(runner, ids)?;
    let mut layers = Vec::new();
    for (w_o, w_q) in original.layers().iter().zip(quantized.layers()) {
        if options.input == DriftInput::Original {
            h_q = h_o.clone();
        }
        let out_o = runner.run_layer(w_o, h_o.clone(), |_, _, _| {})?;
        let out_q = runner.run_layer(w_q, h_q.clone(), |_, _, _| {})?;
        if w_o.kind == LayerKind::Lightning {
            let (host_o, host_q) = (host_values(out_o.clone())?, host_values(out_q.clone())?);
            layers.push(lightning_drift(
                runner,
                (w_o, w_q),
                (&h_o, &h_q),
                (&host_o, &host_q),
                &options.checkpoints,
            )?);
        }
        (h_o, h_q) = (out_o, out_q);
    }
    Ok(layers)
}

/// A Markdown table: one row per layer and checkpoint, then the exponents.
pub fn drift_table(layers: &[LayerDrift]) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "| layer | tokens | state abs err | state rel err | output rel err |"
    );
    let _ = writeln!(s, "|---:|---:|---:|---:|---:|");
    for l in layers {
        for p in &l.points {
            let _ = writeln!(
                s,
                "| {} | {} | {:.4e} | {:.4e} | {:.4e} |",
                l.layer, p.tokens, p.state_abs, p.state_rel, p.output_rel
            );
        }
    }
    let fmt = |p: Option<f64>| p.map_or("n/a".to_owned(), |p| format!("{p:.3}"));
    let _ = writeln!(
        s,
        "\n| layer | p(state abs) | p(state rel) | p(output rel) |"
    );
    let _ = writeln!(s, "|---:|---:|---:|---:|");
    for l in layers {
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} |",
            l.layer,
            fmt(l.p_state_abs),
            fmt(l.p_state_rel),
            fmt(l.p_output_rel)
        );
    }
    s
}
