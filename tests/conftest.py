import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from lingbot import load_pack  # noqa: E402

load_pack()  # tests import the pack as `lingbot_world`, as the CLI does


def _find_examples() -> Path | None:
    for cand in (ROOT / "examples", ROOT.parent / "shared" / "fixtures" / "lingbot-examples"):
        if (cand / "00" / "poses.npy").is_file():
            return cand
    return None


@pytest.fixture(scope="session")
def shipped_example() -> Path:
    """examples/00 shipped in the repo (image, prompt, poses, intrinsics, action files)."""
    return ROOT / "examples" / "00"


@pytest.fixture(scope="session")
def all_examples() -> list[Path]:
    """Every upstream example: ../shared/fixtures/lingbot-examples when present, else the shipped one."""
    shared = ROOT.parent / "shared" / "fixtures" / "lingbot-examples"
    if shared.is_dir():
        return sorted(p for p in shared.iterdir() if (p / "poses.npy").is_file())
    return [ROOT / "examples" / "00"]
