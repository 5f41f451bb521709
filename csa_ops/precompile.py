"""Ahead-of-time kernels: ``python -m csa_ops.precompile`` (and ``csa_ops.precompile(...)``,
``csa_ops.precompile_extend(...)``).

The command builds the persistent kernel cache (``csa_ops.kernel_cache``) for chosen
configurations, dtypes and archs (csa::compressor's two directions and
csa::compressor_extend's kernels, those its call size classes launch: extend_plan.keys), on
any machine, without a GPU (cross-compiling). Ship the directory and point
``CSA_OPS_CACHE_DIR`` at it: a GPU machine then loads every kernel of those configurations
and never compiles. It also builds the native launch library
(``csa_ops.native``) for this machine's torch into the same directory; a machine with another
torch builds its own on first use.

    python -m csa_ops.precompile --ratio 4 --coff 2 --head-dim 128 512 \\
        --dtype bfloat16 --arch sm_90a sm_100a --cache-dir ./csa-kernels
"""

from __future__ import annotations

import argparse
import itertools
import os
import pathlib
import subprocess
import sys
import time
import types

import torch


def build_cache(ratios, coffs, head_dims, dtypes, archs, root: pathlib.Path,
                log=print) -> dict[str, int]:
    """Make sure ``root`` holds both directions of every combination and the serving op's
    kernels; counts of kernels compiled and already present."""
    from . import host
    from .config import Direction
    from .kernels import extend_plan

    counts = {"compiled": 0, "present": 0}
    for ratio, coff, head_dim, dtype, arch in itertools.product(ratios, coffs, head_dims,
                                                                dtypes, archs):
        keys = host.configuration_keys(ratio, head_dim, coff, dtype, arch)
        forward_key = keys[0][1]
        if extend_plan.supports(forward_key):  # csa::compressor_extend's kernels too
            keys += [(Direction.EXTEND, key) for key in extend_plan.keys(forward_key)]
        for direction, key in keys:
            start = time.perf_counter()
            built = host.KERNELS.export(direction, key, root)
            state = "compiled" if built else "present"
            counts[state] += 1
            log(f"{state:8s} {direction} ratio={ratio} coff={coff} head_dim={head_dim} "
                f"{key.dtype} {arch} ({time.perf_counter() - start:.2f} s)")
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
        counts = build_cache(args.ratio, args.coff, args.head_dim, dtypes, args.arch, root)
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
