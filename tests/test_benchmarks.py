"""Every benchmark script runs at --scale tiny on the CPU and ends with its JSON summary line, so the
scripts that produce BENCHMARKS.md cannot rot unnoticed."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "script, keys",
    [
        ("bench_load.py", {"io_floor", "ours", "baseline", "targets"}),
        ("bench_vae.py", {"cases", "weights"}),
        ("bench_pipeline.py", {"phases", "rc"}),
        ("bench_t5.py", {"pth", "safetensors"}),
    ],
)
def test_benchmark_runs_tiny(script, keys, tmp_path):
    env = {"LINGBOT_WORLD_CACHE": str(tmp_path / "cache"), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), "--scale", "tiny", "--workdir", str(tmp_path / "w")],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert keys <= summary.keys()
    if script == "bench_pipeline.py":
        assert summary["rc"] == 0 and [p["phase"] for p in summary["phases"]][-1] == "write_mp4"
    if script == "bench_load.py":
        assert summary["targets"]["rss_growth_le_1.5GB"]
