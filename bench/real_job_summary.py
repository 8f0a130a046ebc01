#!/usr/bin/env python3
"""The real job's figures from one `quantize_sala --device cuda` run (bench/run_real_job.sh):

    python3 bench/real_job_summary.py OUT_DIR/quantization_report.json \
        bench/results/forward-h200.json --wall-s 459 --verified > bench/results/real-job-h200.json

Per layer it splits the run into the fixed part (finalize + smooth + solve + write: the
Hessians' sizes do not depend on the tokens) and the forward part (capture + accumulate +
propagate). The projection of the production calibration set (96 samples, 1.83M tokens, up to
131072 tokens each) adds this run's fixed part per layer (and its time outside the layers:
embedding, global tensors, verifier) to the forward projection that
bench_forward measured for that length mix (`projection.total_s` of forward-h200.json: weight
uploads, capture and propagate of every layer, attention cost growing with sample length).
"""
import argparse
import json


def main():
    p = argparse.ArgumentParser()
    p.add_argument("report", help="quantization_report.json of the run")
    p.add_argument("forward", help="bench_forward's JSON (forward-h200.json)")
    p.add_argument("--wall-s", type=float, required=True, help="wall time of the command")
    p.add_argument("--verified", action="store_true", help="verify_checkpoint said ok")
    args = p.parse_args()
    report = json.load(open(args.report))["report"]
    forward = json.load(open(args.forward))["projection"]
    layers = report["layers"]
    n = len(layers)

    def mean(*keys):
        return sum(sum(layer[k] for k in keys) for layer in layers) / n

    fixed = mean("finalize", "smooth", "solve")
    write = mean("write")
    forward_per_layer = mean("capture", "accumulate", "propagate")
    # Embedding, globals, the verifier: what the run spent outside the layers (kept as is).
    outside = report["seconds"] - n * (fixed + write + forward_per_layer)
    projection = forward["total_s"] + n * (fixed + write) + outside
    out = {
        "command": "bash bench/run_real_job.sh BIN_DIR calib-96x16k.jsonl OUT (make_calib --windows 96)",
        "layers": n,
        "samples": report["samples"],
        "tokens": report["tokens"],
        "wall_s": args.wall_s,
        "pipeline_s": report["seconds"],
        "per_layer_fixed_s": fixed,
        "per_layer_stage_means_s": {
            k: mean(k)
            for k in ("capture", "accumulate", "finalize", "smooth", "solve", "write", "propagate")
        },
        "per_layer_forward_s": forward_per_layer,
        "peak_rss_bytes": report["peak_rss_bytes"],
        "peak_device_bytes": report["peak_device_memory"]["in_use"],
        "peak_device_reserved_bytes": report["peak_device_memory"]["reserved"],
        "hidden_state_bytes": report["hidden_state_bytes"],
        "output_bytes": report["output_bytes"],
        "verify_summary": report["verify_summary"],
        "verified": bool(args.verified and report["verify_summary"].startswith("verified ok")),
        "projection_real_job": {
            "tokens": forward["tokens"],
            "samples": forward["samples"],
            "forward_s": forward["total_s"],
            "fixed_s": n * (fixed + write),
            "outside_layers_s": outside,
        },
        "projection_real_job_s": projection,
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
