//! Held-out token streams cut into sequences of growing length.

use serde::Serialize;

/// One evaluation sequence.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Sequence {
    /// The length bucket it belongs to (its length, BOS included).
    pub bucket: usize,
    /// Offset of its first text token in the stream.
    pub offset: usize,
    /// Token ids (BOS first when one is given).
    pub ids: Vec<u32>,
}

/// For each length `L` in `lengths` (ascending or not), up to `per_bucket` consecutive,
/// non-overlapping windows of the stream `tokens`, each `bos` (when given) followed by
/// `L − 1` text tokens (`L` without a BOS). A length the stream cannot fill once is skipped.
pub fn split_sequences(
    tokens: &[u32],
    bos: Option<u32>,
    lengths: &[usize],
    per_bucket: usize,
) -> Vec<Sequence> {
    let mut out = Vec::new();
    for &length in lengths {
        let text_len = length.saturating_sub(usize::from(bos.is_some()));
        if text_len == 0 {
            continue;
        }
        let windows = tokens.chunks_exact(text_len).take(per_bucket);
        for (i, window) in windows.enumerate() {
            out.push(Sequence {
                bucket: length,
                offset: i * text_len,
                ids: bos.into_iter().chain(window.iter().copied()).collect(),
            });
        }
    }
    out
}
