"""Which launch configuration torch's CUDA kernels use for the eager region's softmax and sum.

For (rows, W, d) fp32 windows, compares `torch.softmax(sg, dim=1)` with
`csa_ops.kernels.torch_order.softmax` at every chain count, and `terms.sum(dim=1)` with
`torch_order.window_sum` at every split, bit for bit, and prints which ones match beside
what torch_order predicts. A mismatch of the prediction means torch_order's derivation of
torch's launch configuration is wrong for that shape (or torch changed). --json writes it.
"""

from __future__ import annotations

import argparse
import json

import torch

from csa_ops.kernels.shared import torch_order

WINDOWS = (32, 64, 100, 128, 256)
HEAD_DIMS = (512, 130, 128, 96, 66, 65, 64, 33, 32, 16, 7)
ROWS = (1, 3, 4, 16, 700)
POWERS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def probe(window: int, head_dim: int, rows: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(window * 7919 + head_dim * 31 + rows)
    sg = 2 * torch.randn(rows, window, head_dim, device="cuda", generator=gen)
    terms = torch.randn(rows, window, head_dim, device="cuda", generator=gen)
    p = torch.softmax(sg, dim=1)
    soft = [c for c in POWERS if c <= window and torch.equal(torch_order.softmax(sg, c), p)]
    total = terms.sum(dim=1)
    split = [h for h in POWERS
             if h <= window and torch.equal(torch_order.window_sum(terms, h), total)]
    model = (torch_order.softmax_chains(window, head_dim),
             torch_order.sum_split(window, head_dim, rows))
    return {"window": window, "head_dim": head_dim, "rows": rows, "model": model,
            "softmax_chains_matching": soft, "sum_split_matching": split,
            "model_holds": model[0] in soft and model[1] in split}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    print(f"device {torch.cuda.get_device_name()}  torch {torch.__version__}")
    results = []
    for window in WINDOWS:
        for head_dim in HEAD_DIMS:
            for rows in ROWS:
                r = probe(window, head_dim, rows)
                results.append(r)
                print(f"W {window:4d} d {head_dim:4d} rows {rows:4d}  model {r['model']}  "
                      f"softmax {r['softmax_chains_matching']}  sum {r['sum_split_matching']}"
                      f"{'' if r['model_holds'] else '  MISMATCH'}")
    print(f"model holds on {sum(r['model_holds'] for r in results)} of {len(results)}")
    if args.json:  # the format of bench/results/h200/torch_order_probe.json
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "script": "bench/probe_torch_order.py", "cases": results}, f, indent=0)


if __name__ == "__main__":
    main()
