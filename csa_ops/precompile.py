"""Ahead-of-time kernels: ``python -m csa_ops.precompile`` (and ``csa_ops.precompile(...)``).

Builds the kernel cache (``csa_ops.kernel_cache``) of chosen configurations, dtypes and archs
(csa::compressor's two directions, csa::compressor_extend's kernels) on any machine, without a
GPU, a line per kernel as it goes (--quiet: none), and the native launch library for this
torch. Ship the directory as CSA_OPS_CACHE_DIR: a GPU machine then loads, never compiles.

    python -m csa_ops.precompile --ratio 4 --coff 2 --head-dim 128 512 \\
        --dtype bfloat16 --arch sm_90a sm_100a --cache-dir ./csa-kernels
"""

from __future__ import annotations

import argparse
import functools
import itertools
import os
import pathlib
import subprocess
import sys
import time
import types

import torch


def kernel_plan(ratios, coffs, head_dims, dtypes, archs) -> list[tuple[object, object, str]]:
    """(direction, key, label) of every kernel the combinations need, in build order: both
    directions of csa::compressor and the serving op's kernels. An unsupported combination
    raises ValueError here, before anything compiles."""
    from . import host
    from .config import Direction
    from .kernels import extend_plan

    plan = []
    for ratio, coff, head_dim, dtype, arch in itertools.product(ratios, coffs, head_dims,
                                                                dtypes, archs):
        keys = host.configuration_keys(ratio, head_dim, coff, dtype, arch)
        forward_key = keys[0][1]
        if extend_plan.supports(forward_key):  # csa::compressor_extend's kernels too
            keys += [(Direction.EXTEND, key) for key in extend_plan.keys(forward_key)]
        where = f"ratio={ratio} coff={coff} head_dim={head_dim}"
        plan += [(direction, key, f"{direction} {where} {key.dtype} {arch}")
                 for direction, key in keys]
    return plan


def build_cache(ratios, coffs, head_dims, dtypes, archs, root: pathlib.Path,
                log=print) -> dict[str, int]:
    """Make sure ``root`` holds every kernel of ``kernel_plan``; counts of kernels compiled
    and already present. ``log`` gets one line per kernel as it is done (its count of the
    total, whether it was compiled, its time and the time since the start): a compile takes
    seconds to a minute, so a long build shows where it stands. log=None: no lines."""
    from . import host

    plan = kernel_plan(ratios, coffs, head_dims, dtypes, archs)
    counts = {"compiled": 0, "present": 0}
    width = len(str(len(plan)))
    start = time.perf_counter()
    for done, (direction, key, label) in enumerate(plan, start=1):
        began = time.perf_counter()
        state = "compiled" if host.KERNELS.export(direction, key, root) else "present"
        counts[state] += 1
        if log is not None:
            now = time.perf_counter()
            log(f"[{done:{width}d}/{len(plan)}] {state:8s} {label} ({now - began:.1f} s, "
                f"{now - start:.1f} s elapsed)")
    return counts


def _parser() -> argparse.ArgumentParser:
    from . import config

    parser = argparse.ArgumentParser(prog="python -m csa_ops.precompile",
                                     description=__doc__.split("\n\n")[1])
    parser.add_argument("--ratio", type=int, nargs="+", required=True)
    parser.add_argument("--coff", type=int, nargs="+", required=True, choices=(1, 2))
    parser.add_argument("--head-dim", type=int, nargs="+", required=True)
    parser.add_argument("--dtype", nargs="+", default=["bfloat16"], choices=config.DTYPES)
    parser.add_argument("--arch", nargs="+", default=list(config.ARCHS), choices=config.ARCHS)
    parser.add_argument("--cache-dir", type=pathlib.Path, default=None,
                        help="default: $CSA_OPS_CACHE_DIR or the user cache directory")
    parser.add_argument("--quiet", action="store_true",
                        help="no line per kernel (the closing summary and errors still print)")
    parser.add_argument("--no-native", action="store_true",
                        help="skip building the native launch library (csa_ops.native) for "
                             "this machine's torch")
    return parser


def main(argv=None) -> int:
    from . import kernel_cache, native

    args = _parser().parse_args(argv)
    root = args.cache_dir or kernel_cache.directory()
    os.makedirs(root, exist_ok=True)
    dtypes = [getattr(torch, name) for name in args.dtype]
    try:
        counts = build_cache(args.ratio, args.coff, args.head_dim, dtypes, args.arch, root,
                             log=None if args.quiet else functools.partial(print, flush=True))
    except ValueError as error:
        print(f"csa_ops.precompile: {error}", file=sys.stderr)
        return 2
    print(f"{root}: {counts['compiled']} kernels compiled, {counts['present']} already present")
    if not args.no_native and native.enabled():
        try:
            print(f"native launch library: {native.build(pathlib.Path(root))}")
        except (OSError, subprocess.CalledProcessError) as error:
            detail = getattr(error, "stderr", None) or error
            print(f"csa_ops.precompile: the native launch library did not build; calls run "
                  f"the Python path ({str(detail).strip().splitlines()[-1:]})", file=sys.stderr)
    return 0


class _CallableModule(types.ModuleType):
    """Importing this module rebinds ``csa_ops.precompile`` to it: it stays callable as the
    function of the same name."""

    def __call__(self, ratio: int, head_dim: int, coff: int, dtype=None, arch=None):
        from . import host

        return host.precompile(ratio, head_dim, coff, dtype, arch)


if __name__ == "__main__":
    sys.exit(main())
else:
    sys.modules[__name__].__class__ = _CallableModule
