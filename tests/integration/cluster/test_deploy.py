"""The image and the Kubernetes manifests (issue 31, items 3 and 4), checked as far as this
machine can without a container runtime or a cluster:

The integration half: these tests start processes or measure time; the unit tests
are in tests/unit/cli/test_deploy.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.deploy_manifests import (
    ROOT,
)


@pytest.mark.integration
def test_the_build_context_builds_a_wheel_with_the_gateways_files(tmp_path: Path) -> None:
    """What the build stage copies is enough for pip: a wheel of it holds the package
    data the gateway needs (its .proto) and the `batcher` entry point."""
    import shutil

    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, tmp_path / name)
    for name in ("batcher", "workers"):
        shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path / "w"),
            ".",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    import zipfile

    (wheel,) = (tmp_path / "w").glob("batcher-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "batcher/gateway/inference.proto" in names
    assert "workers/worker.py" in names
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "batcher = batcher.cli:main" in zipfile.ZipFile(wheel).read(entry).decode()
