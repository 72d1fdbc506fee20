"""The pack loads from any folder name, the way ComfyUI imports custom nodes (by path, no sys.path)."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_imports_under_any_folder_name(tmp_path):
    folder = tmp_path / "My LingBot-World pack (v2)"
    folder.symlink_to(ROOT, target_is_directory=True)
    # A fresh interpreter, as ComfyUI's loader does it: module name = folder name, nothing on sys.path.
    code = f"""
import importlib.util, sys
name = {folder.name!r}
spec = importlib.util.spec_from_file_location(name, {str(folder / "__init__.py")!r},
                                              submodule_search_locations=[{str(folder)!r}])
mod = importlib.util.module_from_spec(spec); sys.modules[name] = mod; spec.loader.exec_module(mod)
assert mod.NODE_CLASS_MAPPINGS == {{}}  # no ComfyUI here: nothing to register, and no error
dit = importlib.import_module(name + ".wan.dit")
stream = importlib.import_module(name + ".loaders.stream")
assert "lingbot_world" not in sys.modules
print("ok", dit.WanModel.__name__, stream.load_expert.__name__)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok WanModel load_expert"


def test_layers_import_one_way():
    """wan/ <- loaders/ <- session/ <- nodes/ and cli.py: no layer imports one above it or ComfyUI."""
    for layer, banned in (
        ("wan", ("..loaders", "..session", "..nodes", "comfy", "folder_paths")),
        ("loaders", ("..session", "..nodes", "comfy", "folder_paths")),
        ("session", ("..nodes", "..cli", "comfy", "folder_paths")),
    ):
        for path in (ROOT / layer).glob("*.py"):
            text = path.read_text()
            for name in banned:
                assert f"from {name}" not in text and f"import {name}" not in text, (path, name)


def test_tests_share_helpers_through_helpers_py():
    """A test file imports shared helpers from tests/helpers.py (or gets them as conftest fixtures), never
    from another test file: importing one runs its module-level set-up and ties the files together."""
    for path in (ROOT / "tests").glob("*.py"):
        found = re.findall(r"^\s*(?:from|import)\s+(test_\w+)", path.read_text(encoding="utf-8"), re.M)
        assert not found, (path.name, found)
