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


# The pack's layers, lowest first; a module may import its own layer and those below it.
LAYERS = {"wan": 0, "loaders": 1, "session": 2, "nodes": 3, "cli": 3}


def _module(path: Path) -> str:
    """'session.request' for session/request.py, 'cli' for cli.py (relative to the pack's root)."""
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def _imports(path: Path) -> set:
    """The pack's modules `path` imports with relative imports, wherever in the file (lazy ones included):
    `from ..loaders import stream` -> loaders.stream, `from .wan.config import X` -> wan.config."""
    import ast

    package = _module(path).split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.ImportFrom) or not node.level:
            continue
        base = package[: len(package) - node.level + 1] + (node.module.split(".") if node.module else [])
        for alias in node.names:  # a name that is a module of its own is the edge, else the module named
            sub = [*base, alias.name]
            out.add(".".join(sub if (ROOT.joinpath(*sub).with_suffix(".py")).is_file() else base))
    return out


def _layer(module: str):
    return LAYERS.get(module.split(".")[0])


def test_layers_import_one_way():
    """wan/ <- loaders/ <- session/ <- nodes/ and cli.py: no module imports a layer above its own (lazy
    imports included), nothing below the front ends imports ComfyUI, and no import circle joins modules of
    one layer."""
    for layer, banned in (
        ("wan", ("comfy", "folder_paths")),
        ("loaders", ("comfy", "folder_paths")),
        ("session", ("comfy", "folder_paths")),
    ):
        for path in (ROOT / layer).glob("*.py"):
            text = path.read_text()
            for name in banned:
                assert f"from {name}" not in text and f"import {name}" not in text, (path, name)
    paths = [ROOT / "cli.py", *(p for layer in LAYERS if layer != "cli" for p in (ROOT / layer).glob("*.py"))]
    graph = {_module(p): _imports(p) for p in paths}
    assert graph["session.request"] and graph["cli"]  # the parse finds imports
    for module, targets in graph.items():
        for target in targets:
            assert _layer(target) is not None and _layer(target) <= _layer(module), (module, target)
    same = {m: {t for t in ts if _layer(t) == _layer(m) and t in graph} for m, ts in graph.items()}

    def circle(start, module, seen):
        for nxt in same[module]:
            if nxt == start:
                return [*seen, nxt]
            if nxt not in seen:
                found = circle(start, nxt, [*seen, nxt])
                if found:
                    return found
        return None

    for module in same:
        assert circle(module, module, [module]) is None, circle(module, module, [module])


def test_import_graph_check_sees_upward_imports_and_circles(tmp_path, monkeypatch):
    """The layering test's parse finds a lazy upward import and resolves module and package imports."""
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "loaders").mkdir()
    (tmp_path / "session").mkdir()
    (tmp_path / "session" / "planner.py").write_text("")
    source = tmp_path / "loaders" / "a.py"
    source.write_text("def f():\n    from ..session import planner, errors\n    from . import b\n")
    assert _imports(source) == {"session.planner", "session", "loaders"}
    assert _layer("session.planner") > _layer("loaders.a")


def test_tests_share_helpers_through_helpers_py():
    """A test file imports shared helpers from tests/helpers.py (or gets them as conftest fixtures), never
    from another test file: importing one runs its module-level set-up and ties the files together."""
    for path in (ROOT / "tests").glob("*.py"):
        found = re.findall(r"^\s*(?:from|import)\s+(test_\w+)", path.read_text(encoding="utf-8"), re.M)
        assert not found, (path.name, found)
