"""Serving with csa::compressor_extend: chunked prefill and decode for several requests.

Run with ``python -m csa_ops.demo_serving``. Uses CUDA when present (bf16), else the CPU
(fp32). Requests arrive at different steps; each step batches every active request (a
prefill chunk or one decode token), so prefill and decode mix. The rows are checked against
one ``csa::compressor`` call over the whole sequences.
"""

from __future__ import annotations

import argparse
import time

import torch

from .demo import add_block_options, demo_device
from .module import Compressor, offsets_for
from .serving import CompressorState


def _schedule(prompts, decode: int, chunk: int, arrive_every: int):
    """Steps of (request, new tokens): request i arrives at step i*arrive_every, prefills in
    chunks, then decodes one token per step."""
    total = [p + decode for p in prompts]
    consumed, steps, step = [0] * len(prompts), [], 0
    while any(c < t for c, t in zip(consumed, total)):
        batch = []
        for i, (p, t) in enumerate(zip(prompts, total)):
            if step >= i * arrive_every and consumed[i] < t:
                n = min(chunk, p - consumed[i]) if consumed[i] < p else 1
                batch.append((i, n))
                consumed[i] += n
        steps.append(batch)
        step += 1
    return steps


def serve(extend, sequences, schedule, slots, ratio: int):
    """Run ``schedule`` through ``extend(pieces, cu, start_pos, slots, total_comp)``; return
    the rows of each request and the seconds per step."""
    device = sequences[0].device
    consumed, rows = [0] * len(sequences), [[] for _ in sequences]
    seconds = []
    for step in schedule:
        pieces = [sequences[i][consumed[i]:consumed[i] + n] for i, n in step]
        cu, _ = offsets_for([n for _, n in step], ratio, device)
        start = torch.tensor([consumed[i] for i, _ in step], dtype=torch.int32, device=device)
        slot = torch.tensor([slots[i] for i, _ in step], dtype=torch.int32, device=device)
        # A static row capacity: every request completes at most n // ratio + 1 blocks.
        capacity = sum(n // ratio + 1 for _, n in step)
        began = time.perf_counter()
        out, cuc = extend(torch.cat(pieces), cu, start, slot, capacity)
        bounds = cuc.tolist()
        seconds.append(time.perf_counter() - began)
        for j, (i, n) in enumerate(step):
            rows[i].append(out[bounds[j]:bounds[j + 1]])
            consumed[i] += n
    return [torch.cat(r) for r in rows], seconds


def _mismatches(got, want) -> tuple[int, float]:
    diff = (got.float() - want.float()).abs()
    return int((got != want).sum()), float(diff.max()) if diff.numel() else 0.0


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", default="300,37,129,5,1000", help="prompt lengths")
    parser.add_argument("--decode", type=int, default=24, help="decode steps per request")
    parser.add_argument("--chunk", type=int, default=128, help="prefill chunk length")
    add_block_options(parser, dim=256)
    args = parser.parse_args(argv)
    device, dtype = demo_device()
    prompts = [int(v) for v in args.prompts.split(",")]
    lengths = [p + args.decode for p in prompts]
    block = Compressor(args.dim, args.head_dim, args.ratio, args.coff, device=device, dtype=dtype)
    x = [torch.randn(n, args.dim, device=device, dtype=dtype) for n in lengths]
    schedule = _schedule(prompts, args.decode, args.chunk, arrive_every=3)
    slots = torch.randperm(2 * len(prompts))[:len(prompts)].tolist()  # any free slots

    with torch.no_grad():
        # The op on the requests' projections: rows must be bit-identical to the one-shot op.
        kv = [block.wkv(t) for t in x]
        score = [block.wgate(t) for t in x]
        both = [torch.cat([k, s], dim=1) for k, s in zip(kv, score)]
        state = CompressorState(2 * len(prompts), args.ratio, args.coff, args.head_dim, dtype,
                                device)
        width = args.coff * args.head_dim

        def op_extend(pieces, cu, start, slot, capacity):
            return state.extend(pieces[:, :width], pieces[:, width:], block.ape, cu, start, slot,
                                capacity)

        rows, seconds = serve(op_extend, both, schedule, slots, args.ratio)
        cu, cuc = offsets_for(lengths, args.ratio, device)
        one_shot = torch.ops.csa.compressor(torch.cat(kv), torch.cat(score), block.ape, cu, cuc,
                                            args.ratio, args.coff, None)
        differ, max_diff = _mismatches(torch.cat(rows), one_shot)

        # The module's inference method, checked against its training forward (the linears
        # see different token counts, so this one is compared with a tolerance).
        state.reset()
        normed, _ = serve(lambda *a: block.extend(*a[:4], state, a[4]), x, schedule, slots,
                          args.ratio)
        forward = block(torch.cat(x), cu, cuc)
        module_err = float((torch.cat(normed).float() - forward.float()).abs().max())

    decode_steps = sum(all(n <= 1 for _, n in step) for step in schedule)
    print(f"device {device}, dtype {dtype}, ratio {args.ratio}, coff {args.coff}, head_dim "
          f"{args.head_dim}: {len(prompts)} requests (prompts {prompts}, then {args.decode} "
          f"decode tokens each) in {len(schedule)} steps ({decode_steps} decode-only, the rest "
          f"mixing prefill chunks of <= {args.chunk} with decode)")
    print(f"rows: {sum(r.shape[0] for r in rows)} emitted, one-shot csa::compressor has "
          f"{one_shot.shape[0]}; {differ} elements differ (max |diff| {max_diff:.3g})")
    print(f"Compressor.extend vs Compressor.forward after RMSNorm: max |diff| {module_err:.3g}")
    print(f"median step {sorted(seconds)[len(seconds) // 2] * 1e3:.3f} ms (eager, host timed)")
    if differ:
        raise SystemExit("rows are not bit-identical to the one-shot csa::compressor")
    tol = 5e-2 if dtype == torch.bfloat16 else 1e-4
    if not module_err <= tol:
        raise SystemExit(f"Compressor.extend differs from Compressor.forward by {module_err}")
    print("OK: rows bit-identical to one-shot csa::compressor")


if __name__ == "__main__":
    main()
