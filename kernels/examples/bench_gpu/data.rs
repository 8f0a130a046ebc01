//! The benchmark's inputs: seeded activations X (bf16), weights W (f32), and the files the
//! PyTorch side reads (safetensors + `manifest.json`, format in `bench/make_test_data.py`).

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use crate::report::Json;

/// SplitMix64: a small, fast, seedable generator (statistical quality is ample for test data).
struct SplitMix64(u64);

impl SplitMix64 {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in (0, 1].
    fn uniform(&mut self) -> f64 {
        ((self.next_u64() >> 11) + 1) as f64 / (1u64 << 53) as f64
    }

    /// Standard normal (Box–Muller, one value per call).
    fn normal(&mut self) -> f32 {
        let (u1, u2) = (self.uniform(), self.uniform());
        ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32
    }
}

/// `len` values `f(rng, index)` generated in parallel chunks, each chunk with its own stream
/// seeded from `(seed, chunk)`: the result does not depend on the thread count.
fn generate<T: Send + Default + Clone>(
    len: usize,
    seed: u64,
    f: impl Fn(&mut SplitMix64, usize) -> T + Sync,
) -> Vec<T> {
    const CHUNK: usize = 1 << 20;
    let mut out = vec![T::default(); len];
    let threads = std::thread::available_parallelism().map_or(4, |n| n.get());
    {
        let chunks: Vec<(usize, &mut [T])> = out.chunks_mut(CHUNK).enumerate().collect();
        let per_thread = chunks.len().div_ceil(threads).max(1);
        let mut chunks = chunks.into_iter();
        let f = &f;
        std::thread::scope(|scope| loop {
            let batch: Vec<(usize, &mut [T])> = chunks.by_ref().take(per_thread).collect();
            if batch.is_empty() {
                break;
            }
            scope.spawn(move || {
                for (c, slice) in batch {
                    let stream = (c as u64 + 1).wrapping_mul(0xD1B5_4A32_D192_ED03);
                    let mut rng = SplitMix64(seed ^ stream);
                    for (i, v) in slice.iter_mut().enumerate() {
                        *v = f(&mut rng, c * CHUNK + i);
                    }
                }
            });
        });
    }
    out
}

/// f32 → bf16 bits, round to nearest even (inputs are finite).
pub fn f32_to_bf16(x: f32) -> u16 {
    let bits = x.to_bits();
    let round = ((bits >> 16) & 1) + 0x7FFF;
    (bits.wrapping_add(round) >> 16) as u16
}

/// bf16 bits → f32 (exact).
pub fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

/// Activations `[tokens, dim]` as bf16 bits: channel `c` has a log-normal scale
/// `exp(0.5·n_c)`, and one channel in 64 is an outlier ×8 (LLM activations have a few
/// large channels, which is what makes H far from a multiple of I).
pub fn activations(tokens: usize, dim: usize, seed: u64) -> Vec<u16> {
    let scales = generate(dim, seed ^ 0xC4A7, |rng, c| {
        let outlier = if c % 64 == 17 { 8.0 } else { 1.0 };
        (0.5 * rng.normal()).exp() * outlier
    });
    generate(tokens * dim, seed, |rng, i| {
        f32_to_bf16(rng.normal() * scales[i % dim])
    })
}

/// Weights `[out, inp]` ~ N(0, 0.02²), one column in 64 scaled ×8 (outlier input channels).
pub fn weights(out: usize, inp: usize, seed: u64) -> Vec<f32> {
    generate(out * inp, seed, |rng, i| {
        let outlier = if (i % inp) % 64 == 5 { 8.0 } else { 1.0 };
        0.02 * rng.normal() * outlier
    })
}

/// One tensor of a safetensors file: name, dtype ("BF16", "F32"), shape, little-endian bytes.
pub struct Tensor<'a> {
    pub name: &'a str,
    pub dtype: &'static str,
    pub shape: Vec<usize>,
    pub data: TensorData<'a>,
}

/// The values of a [`Tensor`].
pub enum TensorData<'a> {
    Bf16(&'a [u16]),
    F32(&'a [f32]),
}

impl TensorData<'_> {
    fn byte_len(&self) -> usize {
        match self {
            TensorData::Bf16(v) => v.len() * 2,
            TensorData::F32(v) => v.len() * 4,
        }
    }

    fn write(&self, out: &mut impl Write) -> std::io::Result<()> {
        // In slices of 1 Mi values so that no second copy of a 1 GiB tensor is built.
        match self {
            TensorData::Bf16(v) => v.chunks(1 << 20).try_for_each(|c| {
                out.write_all(&c.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>())
            }),
            TensorData::F32(v) => v.chunks(1 << 20).try_for_each(|c| {
                out.write_all(&c.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>())
            }),
        }
    }
}

/// Writes `tensors` as one safetensors file (8-byte header length, JSON header padded to a
/// multiple of 8, then the data in order).
pub fn write_safetensors(path: &Path, tensors: &[Tensor<'_>]) -> std::io::Result<()> {
    let mut offset = 0usize;
    let mut header = Vec::new();
    for t in tensors {
        let end = offset + t.data.byte_len();
        header.push((
            t.name.to_string(),
            Json::obj(vec![
                ("dtype", Json::Str(t.dtype.into())),
                (
                    "shape",
                    Json::Arr(t.shape.iter().map(|&d| Json::Num(d as f64)).collect()),
                ),
                (
                    "data_offsets",
                    Json::Arr(vec![Json::Num(offset as f64), Json::Num(end as f64)]),
                ),
            ]),
        ));
        offset = end;
    }
    let mut text = Json::Obj(header).to_string().into_bytes();
    text.resize(text.len().div_ceil(8) * 8, b' ');
    let mut out = BufWriter::with_capacity(1 << 22, File::create(path)?);
    out.write_all(&(text.len() as u64).to_le_bytes())?;
    out.write_all(&text)?;
    for t in tensors {
        t.data.write(&mut out)?;
    }
    out.flush()
}
