"""Verify every GEMM of an inference pass and report what it cost.

    python examples/inference.py --batches 20

Under ``torch.inference_mode()`` nn.Linear reaches the guard as ``linear``; the
weight-side encodings are cached after the first batch, so steady-state verification
reads each weight zero extra times.
"""

import argparse
import time

import torch

import sdc_guard
from sdc_guard.toy_gpt import GPT, CharData, GPTConfig, make_corpus


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--d-model", type=int, default=256)
    args = parser.parse_args()
    torch.manual_seed(0)
    data = CharData(make_corpus())
    model = GPT(GPTConfig(vocab=data.vocab, ctx=128, d_model=args.d_model, heads=8, layers=4)).eval()

    with torch.inference_mode():
        bare = []
        for i in range(args.batches):
            t0 = time.perf_counter()
            model(data.batch(i, 8, 128)[0])
            bare.append(time.perf_counter() - t0)
        with sdc_guard.protect(model) as guard:
            for i in range(args.batches):
                model(data.batch(i, 8, 128)[0])
                guard.step()
    reports = [r for r in guard.reports if r.seen]
    warm = reports[len(reports) // 2:]
    verified = sum(r.verified for r in reports)
    flagged = sum(r.flagged for r in reports)
    overhead = sum(r.verify_seconds for r in warm) / sum(r.step_seconds - r.verify_seconds for r in warm)
    bare_ms = 1e3 * sorted(bare)[len(bare) // 2]
    print(f"batches {len(reports)}  GEMMs verified {verified}  flagged {flagged}")
    print(f"weight cache: {guard.cache.stats.hits} hits, {guard.cache.stats.misses} misses")
    print(f"bare forward (median) {bare_ms:.1f} ms; verification overhead (warm) {100 * overhead:.1f} %")


if __name__ == "__main__":
    main()
