"""The pack as a Python distribution: registry metadata that ComfyUI's registry reads, and a wheel that
installs the folder as package `lingbot_world` with the data its CLI needs at run time."""

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from xml.etree import ElementTree

import pytest

ROOT = Path(__file__).resolve().parents[1]
REPOSITORY = "https://github.com/lingbot-world-nf4/ComfyUI-LingBot-World-NF4"
PUBLISHER = "lingbot-world-nf4"
PLACEHOLDERS = {"", "todo", "tbd", "changeme", "example", "your-publisher-id", "none"}


def pyproject() -> dict:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        tomllib = pytest.importorskip("tomli", reason="Python 3.10 needs tomli to read pyproject.toml")
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def test_registry_metadata_is_real():
    meta = pyproject()
    project, comfy = meta["project"], meta["tool"]["comfy"]
    for key in ("PublisherId", "DisplayName", "Icon"):
        assert str(comfy.get(key, "")).strip().lower() not in PLACEHOLDERS, (
            f"[tool.comfy] {key} is a placeholder"
        )
    assert comfy["PublisherId"] == PUBLISHER
    # registry node ids: letters, digits, - _ . with no two special characters in a row, no "ComfyUI"
    assert re.fullmatch(r"[A-Za-z][A-Za-z0-9]*([-_.][A-Za-z0-9]+)*", project["name"]), project["name"]
    assert "comfyui" not in project["name"].lower()
    assert re.fullmatch(r"\d+\.\d+\.\d+", project["version"]), project["version"]
    assert project["urls"]["Repository"] == REPOSITORY
    # the icon is a file of this repository, served raw from its default branch
    owner_repo = REPOSITORY.removeprefix("https://github.com/")
    prefix = f"https://raw.githubusercontent.com/{owner_repo}/main/"
    assert comfy["Icon"].startswith(prefix), comfy["Icon"]
    icon = ROOT / comfy["Icon"].removeprefix(prefix)
    assert icon.is_file(), f"{icon.name} named by [tool.comfy] Icon is not in the repository"
    svg = ElementTree.parse(icon).getroot()
    assert svg.tag == "{http://www.w3.org/2000/svg}svg"
    _, _, width, height = (float(v) for v in svg.get("viewBox").split())
    assert width == height, "the registry shows icons square"
    assert icon.stat().st_size < 20_000


def test_dependencies_leave_torch_to_comfyui():
    """torch is ComfyUI's: neither a dependency nor in requirements.txt, only the `cli` extra. The two
    dependency lists say the same thing (ComfyUI-Manager reads one, pip the other)."""
    project = pyproject()["project"]

    def names(reqs):
        return {re.split(r"[<>=!~;\[ ]", r.strip(), maxsplit=1)[0].lower() for r in reqs if r.strip()}

    lines = (ROOT / "requirements.txt").read_text().splitlines()
    listed = [line for line in lines if line.strip() and not line.lstrip().startswith("#")]
    assert names(project["dependencies"]) == names(listed)
    assert {"safetensors", "bitsandbytes", "tokenizers", "av"} <= names(listed)
    assert not names(project["dependencies"]) & {"torch", "torchvision", "torchaudio"}
    assert names(project["optional-dependencies"]["cli"]) == {"torch"}


def test_console_script_names_the_cli():
    """The script's target imports the CLI inside main(), so Ctrl-C during torch's import is an interrupt."""
    module, _, func = pyproject()["project"]["scripts"]["lingbot-world"].partition(":")
    assert module == "lingbot_world.lingbot"
    import lingbot_world.lingbot as entry

    assert callable(getattr(entry, func))
    assert "import torch" not in (ROOT / "lingbot.py").read_text()


def _source_copy(dest: Path) -> Path:
    """The repository's files without local clutter, so building leaves the checkout untouched."""
    skip = {
        ".git",
        ".venv",
        "venv",
        "build",
        "dist",
        "outputs",
        "out",
        "bench_out",
        ".whl",
        ".gl",
        "__pycache__",
        ".pytest_cache",
        ".ruff_cache",
    }
    shutil.copytree(
        ROOT, dest, ignore=lambda d, names: [n for n in names if n in skip or n.endswith(".egg-info")]
    )
    return dest


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    setuptools = pytest.importorskip("setuptools", reason="building the wheel needs setuptools>=77")
    if int(setuptools.__version__.split(".")[0]) < 77:
        pytest.skip(f"building the wheel needs setuptools>=77 (found {setuptools.__version__})")
    tmp = tmp_path_factory.mktemp("wheel")
    src = _source_copy(tmp / "src")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp),
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    (path,) = tmp.glob("*.whl")
    return path


def test_wheel_holds_the_package_and_its_data(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for name in (
        "lingbot_world/__init__.py",
        "lingbot_world/cli.py",
        "lingbot_world/lingbot.py",  # the text encoder's child process boots through it
        "lingbot_world/wan/dit.py",
        "lingbot_world/loaders/stream.py",
        "lingbot_world/nodes/sampler.py",
        "lingbot_world/example_workflows/lingbot_world_nf4_i2v.json",
        "lingbot_world/workflows/api/lingbot_world_nf4_i2v_api.json",
        "lingbot_world/examples/LICENSE.txt",
    ):
        assert name in names, name
    shipped = {p.name for p in (ROOT / "examples" / "00").iterdir()}
    assert {n.rsplit("/", 1)[1] for n in names if n.startswith("lingbot_world/examples/00/")} == shipped
    templates = {p.name for p in (ROOT / "example_workflows").iterdir()}  # workflows and their thumbnails
    assert {
        n.rsplit("/", 1)[1] for n in names if n.startswith("lingbot_world/example_workflows/")
    } == templates
    assert not [n for n in names if n.startswith(("lingbot_world/tests/", "lingbot_world/benchmarks/"))]
    assert not [n for n in names if "__pycache__" in n]
    (dist_info,) = {n.split("/")[0] for n in names} - {"lingbot_world"}  # nothing else at the top
    assert dist_info.endswith(".dist-info"), dist_info
    meta = zipfile.ZipFile(wheel).read(f"{dist_info}/METADATA").decode()
    torch_reqs = [line for line in meta.splitlines() if line.startswith("Requires-Dist: torch")]
    assert torch_reqs and all('extra == "cli"' in line for line in torch_reqs), torch_reqs
    entry = zipfile.ZipFile(wheel).read(f"{dist_info}/entry_points.txt").decode()
    assert "lingbot-world = lingbot_world.lingbot:main" in entry


def test_unpacked_wheel_runs_outside_the_checkout(wheel, tmp_path):
    """The console script's target, imported from the wheel's files alone (not this folder), from an
    unrelated working directory: the parser builds, and the demo's shipped example is found."""
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    code = (
        "import sys, lingbot_world.cli as c; from pathlib import Path; "
        "assert Path(c.__file__).is_relative_to(sys.argv[1]), c.__file__; "
        "assert (c.ROOT / 'examples' / '00' / 'poses.npy').is_file(); "
        "sys.exit(c.main(['--help']))"
    )
    env = {**os.environ, "PYTHONPATH": str(site)}
    out = subprocess.run(
        [sys.executable, "-c", code, str(site)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "generate" in out.stdout and "demo" in out.stdout
