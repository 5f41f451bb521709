"""The persistent kernel cache (csa_ops.kernel_cache) and the deployable cache command.

No GPU needed: entries are cross-compiled for sm_90a / sm_100a, exported, linked and loaded
(loading a TVM-FFI library needs no device); only calling a kernel would.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch

from csa_ops import compile_cache, host, kernel_cache
from csa_ops.config import Direction
from csa_ops.kernels import extend_plan
from csa_ops.state import STATE

SMALL = (2, 16, 1)  # ratio, head_dim, coff: the quickest configuration to compile


def _key(arch="sm_90a", backward=False):
    ratio, head_dim, coff = SMALL
    return host.select_key(ratio, coff, head_dim, "bfloat16", arch, Direction.of(backward))


def _identity(key, direction="fwd"):
    return kernel_cache.identity(f"{direction} {key!r}", host.launch_signature(direction, key))


@pytest.fixture(scope="module")
def compiled():
    """One real compiled kernel, reused as the `build` result of every test here."""
    return compile_cache.compile_kernel(Direction.FORWARD, _key())


class _Builds:
    def __init__(self, compiled):
        self.compiled, self.count = compiled, 0

    def __call__(self):
        self.count += 1
        return self.compiled


def _entry_files(root: pathlib.Path, ident):
    manifest = root / f"{kernel_cache.entry_name(ident)}.json"
    return manifest, root / json.loads(manifest.read_text())["library"]


def _replace(path: pathlib.Path, data: bytes):
    # Damage arrives as a new file, as from another process or a copy: rewriting the
    # inode in place would also rewrite the pages this process mapped when it loaded it.
    tmp = path.with_suffix(".damaged")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def test_store_then_load_without_rebuilding(tmp_path, compiled):
    ident, build = _identity(_key()), _Builds(compiled)
    kernel, built = kernel_cache.get_or_build(ident, build, root=tmp_path)
    assert built and build.count == 1 and callable(kernel)
    manifest, library = _entry_files(tmp_path, ident)
    meta = json.loads(manifest.read_text())
    assert meta["identity"] == ident and library.exists()
    assert not list(tmp_path.glob(".*tmp"))  # no temporary file left behind
    kernel, built = kernel_cache.get_or_build(ident, build, root=tmp_path)
    assert not built and build.count == 1 and callable(kernel)


def _corrupt(library: pathlib.Path, manifest: pathlib.Path):
    data = bytearray(library.read_bytes())
    data[len(data) // 2] ^= 0xFF
    _replace(library, bytes(data))


def _truncate(library: pathlib.Path, manifest: pathlib.Path):
    _replace(library, library.read_bytes()[:1000])


def _foreign(library: pathlib.Path, manifest: pathlib.Path):
    meta = json.loads(manifest.read_text())
    meta["identity"]["dsl"] = "0.0.1"  # written by another DSL version
    _replace(manifest, json.dumps(meta).encode())


def _garbled_manifest(library: pathlib.Path, manifest: pathlib.Path):
    _replace(manifest, b'{"identity": ')


@pytest.mark.parametrize("damage", (_corrupt, _truncate, _foreign, _garbled_manifest),
                         ids=("corrupt", "truncated", "foreign-version", "garbled-manifest"))
def test_bad_entries_are_discarded_with_a_warning_and_rebuilt(tmp_path, compiled, damage):
    ident, build = _identity(_key()), _Builds(compiled)
    kernel_cache.get_or_build(ident, build, root=tmp_path)
    manifest, library = _entry_files(tmp_path, ident)
    damage(library, manifest)
    manifest = tmp_path / manifest.name
    with pytest.warns(RuntimeWarning, match="discarding kernel cache entry"):
        kernel, built = kernel_cache.get_or_build(ident, build, root=tmp_path)
    assert built and build.count == 2 and callable(kernel)
    manifest, library = _entry_files(tmp_path, ident)  # rebuilt: a whole, valid entry again
    assert json.loads(manifest.read_text())["identity"] == ident
    assert json.loads(manifest.read_text())["sha256"] == kernel_cache._file_digest(library)
    assert len(list(tmp_path.glob("*.so"))) == 1  # the discarded library is gone


def test_identity_names_everything_that_changes_the_binary():
    fwd, bwd = _key(), _key(backward=True)
    base = _identity(fwd)
    assert set(base) >= {"package", "dsl", "tvm_ffi", "sources", "kernel", "signature"}
    assert "arch='sm_90a'" in base["kernel"]
    others = [_identity(_key("sm_100a")), _identity(bwd, "bwd")]
    names = {kernel_cache.entry_name(i) for i in [base, *others]}
    assert len(names) == 3


def test_a_kernel_source_change_invalidates_its_entries(tmp_path, monkeypatch, compiled):
    # A copy of the package's kernel sources with one edited line: another digest, so
    # another entry name, so the kernel is built again.
    package = pathlib.Path(kernel_cache.__file__).parent
    copy = tmp_path / "pkg"
    (copy / "kernels").mkdir(parents=True)
    for path in [package / "config.py", *(package / "kernels").rglob("*.py")]:
        target = copy / path.relative_to(package)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(path.read_bytes())
    before = kernel_cache.source_digest()
    assert kernel_cache.source_digest(copy) == before
    edited = copy / "kernels" / "window" / "forward.py"
    edited.write_text(edited.read_text() + "\n# a changed line\n")
    assert kernel_cache.source_digest(copy) != before
    ident, build = _identity(_key()), _Builds(compiled)
    root = tmp_path / "cache"
    kernel_cache.get_or_build(ident, build, root=root)
    monkeypatch.setattr(STATE, "source_digest", kernel_cache.source_digest(copy))
    kernel_cache.get_or_build(_identity(_key()), build, root=root)
    assert build.count == 2
    assert len(list(root.glob("*.json"))) == 2


_RANK = textwrap.dedent("""
    import sys, torch
    from csa_ops import host
    ratio, head_dim, coff = {small}
    host.precompile(ratio, head_dim, coff, torch.bfloat16, arch="sm_90a")
    info = host.cache_info()
    print(info["misses"], info["disk_loads"])
""")


def _python(code, env, timeout=300):
    return subprocess.run([sys.executable, "-c", code], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=timeout, check=True)


def test_concurrent_processes_compile_each_kernel_once(tmp_path):
    # Four "ranks" start at once on an empty cache: every kernel is compiled by one of them
    # and loaded by the others, and nobody reads a half-written entry.
    env = {"CSA_OPS_CACHE_DIR": str(tmp_path)}
    code = _RANK.format(small=SMALL)
    ranks = [subprocess.Popen([sys.executable, "-c", code], env={**os.environ, **env},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(4)]
    results = []
    for rank in ranks:
        out, err = rank.communicate(timeout=600)
        assert rank.returncode == 0, err
        assert "discarding" not in err
        results.append([int(x) for x in out.split()[-2:]])
    assert sum(misses for misses, _ in results) == 2  # forward and backward, once each
    assert all(misses + loads == 2 for misses, loads in results)
    assert len(list(tmp_path.glob("*.json"))) == 2


_WARM = textwrap.dedent("""
    import sys, torch
    from csa_ops import host
    from csa_ops.kernels import extend_plan
    ratio, head_dim, coff = {small}
    for arch in ("sm_90a", "sm_100a"):
        keys = host.configuration_keys(ratio, head_dim, coff, torch.bfloat16, arch)
        serving = [("ext", key) for key in extend_plan.keys(keys[0][1])]
        for direction, key in [*keys, *serving]:  # the serving op's kernels too
            assert callable(host.KERNELS.get(direction, key))
    info = host.cache_info()
    print(info["misses"], info["disk_loads"], int("cutlass" in sys.modules))
""")


def test_deployable_cache_for_both_archs_loads_without_the_dsl(tmp_path):
    ratio, head_dim, coff = SMALL
    command = [sys.executable, "-m", "csa_ops.precompile", "--ratio", str(ratio), "--coff",
               str(coff), "--head-dim", str(head_dim), "--arch", "sm_90a", "sm_100a",
               "--cache-dir", str(tmp_path)]
    # Per arch: forward, backward and the serving op's kernel of each call size class.
    forward_key = host.configuration_keys(ratio, head_dim, coff, torch.bfloat16, "sm_90a")[0][1]
    kernels = 2 * (2 + len(extend_plan.keys(forward_key)))
    built = subprocess.run(command, capture_output=True, text=True, timeout=600, check=True)
    assert f"{kernels} kernels compiled" in built.stdout
    again = subprocess.run(command, capture_output=True, text=True, timeout=600, check=True)
    assert f"0 kernels compiled, {kernels} already present" in again.stdout
    out = _python(_WARM.format(small=SMALL), {"CSA_OPS_CACHE_DIR": str(tmp_path)}).stdout
    misses, loads, dsl_imported = (int(x) for x in out.split()[-3:])
    assert (misses, loads) == (0, kernels)
    assert dsl_imported == 0  # a warm cache never imports the DSL


def test_precompile_command_rejects_unsupported_configurations(tmp_path):
    # No family runs fp32 at ratio 128 (the streaming kernels take bf16 and fp16).
    done = subprocess.run([sys.executable, "-m", "csa_ops.precompile", "--ratio", "128",
                           "--coff", "1", "--head-dim", "128", "--dtype", "float32", "--arch",
                           "sm_90a", "--cache-dir", str(tmp_path)], capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 2
    assert "csa_ops.precompile: precompile: no kernel family supports ratio=128" in done.stderr
    assert not list(tmp_path.glob("*.json"))


def test_cache_switch_and_location(monkeypatch, tmp_path):
    monkeypatch.setenv("CSA_OPS_CACHE_DIR", str(tmp_path))
    assert kernel_cache.directory() == tmp_path
    monkeypatch.delenv("CSA_OPS_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert kernel_cache.directory() == tmp_path / "xdg" / "csa-ops"
    assert kernel_cache.enabled()
    monkeypatch.setenv("CSA_OPS_CACHE", "0")
    assert not kernel_cache.enabled()


def test_cache_off_compiles_in_memory_only(tmp_path):
    code = _RANK.format(small=SMALL)
    env = {"CSA_OPS_CACHE_DIR": str(tmp_path), "CSA_OPS_CACHE": "0"}
    out = _python(code, env).stdout
    assert [int(x) for x in out.split()[-2:]] == [2, 0]
    assert not list(tmp_path.glob("*"))


def test_precompile_errors_name_the_argument():
    with pytest.raises(ValueError, match="dtype"):
        host.configuration_keys(4, 128, 2, torch.int8, "sm_90a")
    with pytest.raises(ValueError, match="arch"):
        host.configuration_keys(4, 128, 2, torch.bfloat16, "sm_75")
