"""Calibration and held-out token windows for the real-model benchmark, from the repository's
public-domain texts, tokenized with the model's tokenizer.json (the `tokenizers` package, the
library our Rust calibration reader uses too).

    python make_data.py --model HF_DIR --out DATA_DIR [--calib-windows 32] [--heldout-windows 16]
                        [--window 512] [--calib-phase 0]

Writes to DATA_DIR:

- calib.jsonl: one `{"text": ...}` record per calibration window, the window's tokens decoded
  (what `quantize_sala --calib-data` reads);
- calib_tokens.json: the token ids our reader gets for each record, i.e. the decoded text
  encoded again with tokenizer.json and the policy of `sala-calib` for plain-text records
  (`add_special_tokens=True`; the head kept when longer than the window, as `--max-len`
  does): what GPTQModel is given, so that both quantizers see the same tokens;
- heldout.json: per held-out text, its non-overlapping windows of token ids (scored as they
  are, nothing decoded);
- data.json: the choices, and how many calibration windows re-encode to exactly their tokens.

Calibration: `fixtures/text/calib-source/kjv-genesis-exodus.txt` (King James Bible, Genesis and
Exodus), 32 windows of 512 tokens spread evenly over the text (non-overlapping). `--calib-phase
P` (0, 1 or 2) shifts every window by P thirds of the stride: three disjoint calibration subsets
of the same text, for the noise band of a quality table (phase 0 is the default set). Held-out: the
first 16 consecutive windows of 512 tokens of `fixtures/text/heldout.txt` (Botchan, in
English) and of `fixtures/text/calib-source/devil-a-d.txt` (The Devil's Dictionary, A to D).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CALIB_TEXT = REPO / "fixtures/text/calib-source/kjv-genesis-exodus.txt"
HELDOUT_TEXTS = {
    "botchan": REPO / "fixtures/text/heldout.txt",
    "devils-dictionary": REPO / "fixtures/text/calib-source/devil-a-d.txt",
}


PHASES = 3


def spread_windows(n_tokens: int, window: int, count: int, phase: int = 0) -> list[int]:
    """Start offsets of `count` non-overlapping windows spread evenly over `n_tokens`.

    Phase 0 is the default set. Phase P shifts every window by P thirds of the stride; a window
    that would then run past the text's end takes the free slot at the end of stride P − 1 instead
    (the stride holds three shifted windows and one more). The phases are disjoint: checked."""
    if count * window > n_tokens:
        sys.exit(f"error: {count} windows of {window} tokens need {count * window} tokens, the text has {n_tokens}")
    if count == 1:
        return [0]
    stride = (n_tokens - window) // (count - 1)
    if phase == 0:
        return phase_starts(n_tokens, window, count, 0, stride)
    phases = [phase_starts(n_tokens, window, count, p, stride) for p in range(PHASES)]
    every = sorted(s for starts in phases for s in starts)
    if any(b - a < window for a, b in zip(every, every[1:])):
        sys.exit(f"error: --calib-phase {phase}: a stride of {stride} tokens is too short for {PHASES} disjoint phases of {window}-token windows")
    return phases[phase]


def phase_starts(n_tokens: int, window: int, count: int, phase: int, stride: int) -> list[int]:
    """The starts of `spread_windows` for one phase, unchecked."""
    shifted = (i * stride + phase * (stride // PHASES) for i in range(count))
    return [s if s + window <= n_tokens else (phase - 1) * stride + stride - window for s in shifted]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, type=Path, help="HF model directory (tokenizer.json)")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--calib-windows", type=int, default=32)
    ap.add_argument("--heldout-windows", type=int, default=16)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--calib-phase", type=int, default=0, choices=range(PHASES),
                    help="which of three disjoint calibration subsets (0: the default windows)")
    args = ap.parse_args()

    from tokenizers import Tokenizer

    tj = args.model / "tokenizer.json"
    if not tj.is_file():
        sys.exit(f"error: {tj}: not found (run convert.py first)")
    tok = Tokenizer.from_file(str(tj))
    w = args.window

    def encode(text: str) -> list[int]:
        # sala-calib's policy for a plain-text record: special tokens as the tokenizer adds them.
        return tok.encode(text, add_special_tokens=True).ids

    specials_added = encode("a") != tok.encode("a", add_special_tokens=False).ids

    # Calibration windows, decoded, re-encoded.
    ids = encode(CALIB_TEXT.read_text(encoding="utf-8"))
    starts = spread_windows(len(ids), w, args.calib_windows, args.calib_phase)
    windows = [ids[s : s + w] for s in starts]
    texts = [tok.decode(win, skip_special_tokens=False) for win in windows]
    reencoded = [encode(t) for t in texts]
    truncated = sum(len(r) > w for r in reencoded)
    ours = [r[:w] for r in reencoded]  # --max-len keeps the head
    exact = sum(o == win for o, win in zip(ours, windows))
    same_len = sum(len(o) == w for o in ours)
    diff_tokens = sum(
        sum(a != b for a, b in zip(o, win)) + abs(len(o) - len(win)) for o, win in zip(ours, windows)
    )

    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "calib.jsonl", "w", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({"text": t}, ensure_ascii=False) + "\n")
    (args.out / "calib_tokens.json").write_text(json.dumps(ours) + "\n")

    heldout = {}
    for name, path in HELDOUT_TEXTS.items():
        hid = encode(path.read_text(encoding="utf-8"))
        n = min(args.heldout_windows, len(hid) // w)
        if n < args.heldout_windows:
            print(f"note: {path.name} gives only {n} windows of {w} tokens", file=sys.stderr)
        heldout[name] = {
            "source": str(path.relative_to(REPO)),
            "text_tokens": len(hid),
            "windows": [hid[i * w : (i + 1) * w] for i in range(n)],
        }
    (args.out / "heldout.json").write_text(json.dumps(heldout) + "\n")

    summary = {
        "tokenizer": "tokenizer.json of the converted model (tokenizers " + __import__("tokenizers").__version__ + ")",
        "tokenizer_adds_special_tokens": specials_added,
        "window": w,
        "calibration": {
            "source": str(CALIB_TEXT.relative_to(REPO)),
            "text_tokens": len(ids),
            "windows": len(windows),
            "phase": args.calib_phase,
            "starts": starts,
            "reencoded_exactly": exact,
            "reencoded_full_length": same_len,
            "reencoded_longer_than_window": truncated,
            "token_positions_differing": diff_tokens,
            "calib_tokens_total": sum(len(o) for o in ours),
        },
        "heldout": {k: {kk: vv for kk, vv in v.items() if kk != "windows"} | {"windows": len(v["windows"])} for k, v in heldout.items()},
    }
    (args.out / "data.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(
        f"calibration: {len(windows)} windows of {w} tokens from {CALIB_TEXT.name} ({len(ids)} tokens); "
        f"{exact}/{len(windows)} re-encode exactly to the window's tokens "
        f"({diff_tokens} token positions differ in all; {truncated} longer than {w}, truncated as --max-len does)"
    )
    for k, v in heldout.items():
        print(f"held-out {k}: {len(v['windows'])} windows of {w} tokens from {v['source']} ({v['text_tokens']} tokens)")
    print(f"tokenizer adds special tokens to plain text: {specials_added}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
