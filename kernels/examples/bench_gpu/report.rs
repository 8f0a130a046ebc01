//! Results: one row type for every measurement, one timing helper, one table printer and a
//! minimal JSON writer (the example has no serde).

use std::fmt::{self, Write as _};
use std::time::Instant;

/// A JSON value.
#[derive(Debug, Clone)]
pub enum Json {
    Null,
    Bool(bool),
    Num(f64),
    Str(String),
    Arr(Vec<Json>),
    Obj(Vec<(String, Json)>),
}

impl Json {
    /// An object from `(key, value)` pairs.
    pub fn obj(fields: Vec<(&str, Json)>) -> Json {
        Json::Obj(
            fields
                .into_iter()
                .map(|(k, v)| (k.to_string(), v))
                .collect(),
        )
    }

    /// `Num` or `Null`.
    pub fn opt(v: Option<f64>) -> Json {
        v.map_or(Json::Null, Json::Num)
    }
}

fn write_str(f: &mut fmt::Formatter<'_>, s: &str) -> fmt::Result {
    f.write_char('"')?;
    for c in s.chars() {
        match c {
            '"' => f.write_str("\\\"")?,
            '\\' => f.write_str("\\\\")?,
            '\n' => f.write_str("\\n")?,
            c if (c as u32) < 0x20 => write!(f, "\\u{:04x}", c as u32)?,
            c => f.write_char(c)?,
        }
    }
    f.write_char('"')
}

impl fmt::Display for Json {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Json::Null => f.write_str("null"),
            Json::Bool(b) => write!(f, "{b}"),
            // Rust's `{}` of a float is the shortest text that reads back to the same value.
            Json::Num(x) if x.is_finite() => write!(f, "{x}"),
            Json::Num(_) => f.write_str("null"),
            Json::Str(s) => write_str(f, s),
            Json::Arr(items) => {
                f.write_char('[')?;
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        f.write_str(", ")?;
                    }
                    write!(f, "{item}")?;
                }
                f.write_char(']')
            }
            Json::Obj(fields) => {
                f.write_str("{\n")?;
                for (i, (k, v)) in fields.iter().enumerate() {
                    write_str(f, k)?;
                    write!(f, ": {v}")?;
                    f.write_str(if i + 1 < fields.len() { ",\n" } else { "\n" })?;
                }
                f.write_char('}')
            }
        }
    }
}

/// One measurement (the record `bench/common.py::record` writes too): `time_s` is the median
/// in seconds, `flops`/`bytes` the work of one run, `loss` the algorithm's objective,
/// `error` the failure, `extra` the checks.
#[derive(Debug, Clone, Default)]
pub struct Row {
    pub kernel: &'static str,
    pub time_s: Option<f64>,
    pub times_s: Vec<f64>,
    pub flops: Option<f64>,
    pub bytes: Option<f64>,
    pub loss: Option<f64>,
    pub error: Option<String>,
    pub extra: Vec<(&'static str, Json)>,
}

impl Row {
    /// A row with a timing.
    pub fn timed(kernel: &'static str, timing: &Timing) -> Self {
        Self {
            kernel,
            time_s: Some(timing.median),
            times_s: timing.times.clone(),
            ..Default::default()
        }
    }

    /// A failed measurement.
    pub fn failed(kernel: &'static str, error: String) -> Self {
        Self {
            kernel,
            error: Some(error),
            ..Default::default()
        }
    }

    pub fn flops(mut self, flops: f64) -> Self {
        self.flops = Some(flops);
        self
    }

    pub fn bytes(mut self, bytes: f64) -> Self {
        self.bytes = Some(bytes);
        self
    }

    pub fn loss(mut self, loss: f64) -> Self {
        self.loss = Some(loss);
        self
    }

    pub fn extra(mut self, key: &'static str, value: Json) -> Self {
        self.extra.push((key, value));
        self
    }

    /// TFLOP/s of the median run.
    pub fn tflops(&self) -> Option<f64> {
        Some(self.flops? / self.time_s? / 1e12)
    }

    pub fn to_json(&self) -> Json {
        let mut fields = vec![
            ("kernel", Json::Str(self.kernel.into())),
            ("time_s", Json::opt(self.time_s)),
            (
                "times_s",
                Json::Arr(self.times_s.iter().map(|&t| Json::Num(t)).collect()),
            ),
            ("flops", Json::opt(self.flops)),
            ("bytes", Json::opt(self.bytes)),
            ("loss", Json::opt(self.loss)),
            ("error", self.error.clone().map_or(Json::Null, Json::Str)),
        ];
        fields.extend(self.extra.iter().cloned());
        Json::obj(fields)
    }

    /// The checks, as `key=value` text for the table.
    pub fn checks(&self) -> String {
        self.extra
            .iter()
            .map(|(k, v)| match v {
                Json::Num(x) if x.fract() == 0.0 && x.abs() < 1e15 => format!("{k}={x}"),
                Json::Num(x) => format!("{k}={}", cell(Some(*x))),
                other => format!("{k}={other}"),
            })
            .collect::<Vec<_>>()
            .join(" ")
    }
}

/// Median and individual times of a measurement, in seconds.
#[derive(Debug, Clone)]
pub struct Timing {
    pub median: f64,
    pub times: Vec<f64>,
}

/// Runs `setup` then `run` `warmup` times untimed, then `reps` times timed (median
/// reported); `setup` (fresh inputs for a run that consumes them) is never timed. `run` must
/// return only once its device work is complete (it synchronizes); `sync` is called before
/// each timed run so that nothing queued earlier is counted. Returns the last run's value.
pub fn time_it<S, T, E>(
    warmup: usize,
    reps: usize,
    sync: &dyn Fn() -> Result<(), E>,
    mut setup: impl FnMut() -> Result<S, E>,
    mut run: impl FnMut(S) -> Result<T, E>,
) -> Result<(Timing, T), E> {
    let mut last = None;
    for _ in 0..warmup {
        let input = setup()?;
        last = Some(run(input)?);
    }
    let mut times = Vec::new();
    for _ in 0..reps.max(1) {
        drop(last.take());
        let input = setup()?;
        sync()?;
        let start = Instant::now();
        let value = run(input)?;
        times.push(start.elapsed().as_secs_f64());
        last = Some(value);
    }
    let mut sorted = times.clone();
    sorted.sort_by(f64::total_cmp);
    let median = sorted[sorted.len() / 2];
    match last {
        Some(value) => Ok((Timing { median, times }, value)),
        None => unreachable!("reps.max(1) runs at least once"),
    }
}

/// A table cell: 4 significant digits, `-` when unknown.
pub fn cell(v: Option<f64>) -> String {
    match v {
        None => "-".into(),
        Some(x) if x != 0.0 && (x.abs() >= 1e5 || x.abs() < 1e-3) => format!("{x:.3e}"),
        Some(x) => {
            let digits = (3 - x.abs().log10().floor() as i32).clamp(0, 6) as usize;
            format!("{x:.digits$}")
        }
    }
}

/// Prints an aligned table.
pub fn print_table(headers: &[&str], rows: &[Vec<String>]) {
    let mut widths: Vec<usize> = headers.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (w, c) in widths.iter_mut().zip(row) {
            *w = (*w).max(c.chars().count());
        }
    }
    let line = |cells: Vec<String>| {
        cells
            .iter()
            .zip(&widths)
            .map(|(c, &w)| format!("{c:<w$}"))
            .collect::<Vec<_>>()
            .join("  ")
    };
    let header = line(headers.iter().map(|h| h.to_string()).collect());
    println!("{header}");
    println!("{}", "-".repeat(header.chars().count()));
    for row in rows {
        println!("{}", line(row.clone()));
    }
}
