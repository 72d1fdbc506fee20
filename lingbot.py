"""Headless entry: `python lingbot.py demo` / `python lingbot.py generate ...`.

The pack is a ComfyUI custom-node folder whose name is the user's choice, and ComfyUI loads it by
path, so its modules import each other relatively. This file loads the folder as the package
`lingbot_world` (tests and child processes use the same function) and hands over to its CLI.
Installed with pip (`pip install ".[cli]"`), the same CLI is the `lingbot-world` command; this file
ships inside that package too, because the text encoder's child process boots through it.
"""

import importlib.util
import sys
from pathlib import Path

PACKAGE = "lingbot_world"
ROOT = Path(__file__).resolve().parent


def load_pack(name: str = PACKAGE):
    """Import this folder as package `name` (once per process) and return it."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(
        name, ROOT / "__init__.py", submodule_search_locations=[str(ROOT)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def main(argv=None) -> int:
    """Also the `lingbot-world` console script. The CLI imports torch once the arguments parse (so --help
    is instant), and ends Ctrl-C while it loads as an interrupt (exit 130), not a traceback. SIGTERM is
    handled like Ctrl-C (exit 143) here, in the command's own process only, not where `cli.main` runs
    as a library (tests)."""
    try:
        load_pack()
        from lingbot_world.cli import main as cli_main
        from lingbot_world.cli import sigterm_as_interrupt
    except KeyboardInterrupt:
        print("interrupted while starting", file=sys.stderr)
        return 130
    with sigterm_as_interrupt():
        return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
