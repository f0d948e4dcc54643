"""The Triton peer (benchmarks/triton_peer.py) on the CPU: packing, the loader's errors, and the call wiring.

The wiring test runs vLLM's kernel in Triton's interpreter (`triton_peer check`: fp32, small steps),
so the arguments `build` passes (cumulative query lengths, used key lengths, block table, the
2D / 3D launch) are checked against the reference without a GPU. Timings come from the device."""
from __future__ import annotations

import importlib.util
import io
import os
import subprocess
import sys
import tarfile

import pytest

from benchmarks import triton_peer as tp

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
HAVE_TRITON = importlib.util.find_spec("triton") is not None
needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="no installed vLLM to pack the kernel from")


def test_missing_archive_names_the_path_and_the_pack_command(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match=r"nope\.tar\.gz not found: make it with .*triton_peer pack"):
        tp.load(tmp_path / "nope.tar.gz")
    monkeypatch.setattr(tp, "ARCHIVE_DIR", tmp_path)
    with pytest.raises(FileNotFoundError, match=r"no vllm-triton-\*\.tar\.gz in .*triton_peer pack.*--archive"):
        tp.load()


def test_pack_without_a_vllm_asks_for_a_source_tree(tmp_path, monkeypatch):
    monkeypatch.setattr(tp.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="no installed vLLM.*--source"):
        tp.pack(out_dir=tmp_path)
    with pytest.raises(ValueError, match="--version"):
        tp.pack(source=tmp_path, out_dir=tmp_path)
    with pytest.raises(FileNotFoundError, match="triton_unified_attention.py not found under"):
        tp.pack(source=tmp_path, version="v0", out_dir=tmp_path)


def test_an_archive_not_made_by_pack_or_changed_since_is_refused(tmp_path):
    bare = tmp_path / "vllm-triton-x.tar.gz"
    with tarfile.open(bare, "w:gz") as tf:
        info = tarfile.TarInfo(tp.KERNEL)
        tf.addfile(info, io.BytesIO(b""))
    with pytest.raises(ValueError, match="no PEER.json"):
        tp.load(bare)
    src = tmp_path / "tree"
    for rel in tp.SOURCES:
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text("x = 1\n")
    packed = tp.pack(source=src, version="v0", out_dir=tmp_path / "out")
    assert packed.name == "vllm-triton-v0.tar.gz"
    members = {}
    with tarfile.open(packed) as tf:
        for m in tf.getmembers():
            members[m.name] = tf.extractfile(m).read()
    members[tp.HELPERS] = b"x = 2\n"
    with tarfile.open(packed, "w:gz") as tf:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    with pytest.raises(ValueError, match="triton_attention_helpers.py differs from the sha256"):
        tp.load(packed)


@needs_vllm
def test_the_kernel_is_loaded_unchanged_and_the_vllm_modules_are_put_back(tmp_path):
    archive = tp.pack(out_dir=tmp_path)
    root, _, version = tp.installed_vllm()
    assert archive.name == f"vllm-triton-{version}.tar.gz"
    before = {n: m for n, m in sys.modules.items() if n == "vllm" or n.startswith("vllm.")}
    peer = tp.load(archive)
    assert {n: m for n, m in sys.modules.items() if n == "vllm" or n.startswith("vllm.")} == before
    assert open(peer.module.__file__, "rb").read() == (root / tp.KERNEL).read_bytes()
    assert peer.manifest["version"] == version and peer.unified_attention.__name__ == "unified_attention"


@needs_vllm
@pytest.mark.skipif(not HAVE_TRITON, reason="no Triton")
def test_vllm_kernel_called_as_the_backend_does_matches_the_reference_in_the_interpreter(tmp_path):
    """`check` in a fresh process (the interpreter must be on before triton is imported): both launches."""
    archive = tp.pack(out_dir=tmp_path)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(tp.ROOT)] + sys.path))
    done = subprocess.run([sys.executable, "-m", "benchmarks.triton_peer", "check", "--archive", str(archive)],
                          capture_output=True, text=True, env=env, cwd=tp.ROOT, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == len(tp.WIRING) and {ln.split()[2] for ln in lines} == {"2d", "3d"}, done.stdout


def test_check_refuses_to_run_without_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1 before triton is first imported"):
        tp.check()
