"""The package's layers (docs/architecture.md): the import graph of `voicechat/` has no circles and
no upward arrows, nothing inside the package imports the package root, and `import voicechat`
stays light. Read from the source with `ast`, so a new import that breaks a rule fails here."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import voicechat

PACKAGE = Path(voicechat.__file__).parent
# Bottom to top; a module may import its own layer and the layers below it.
LAYERS = (
    ("voicechat._version", "voicechat.errors", "voicechat.events", "voicechat.environment", "voicechat.samples"),
    ("voicechat.model",),
    ("voicechat.runtime",),
    ("voicechat.io",),
    ("voicechat.tools",),
    ("voicechat.streaming",),
    ("voicechat.synthetic",),
    ("voicechat.server",),
    ("voicechat.cli",),
)


def _modules() -> dict[str, Path]:
    out = {}
    for p in PACKAGE.rglob("*.py"):
        parts = p.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = p
    return out


def _edges(mods: dict[str, Path]) -> list[tuple[str, str, bool]]:
    """(importer, imported module, at module level) for every import of a package module."""
    edges = []
    for name, path in mods.items():
        tree = ast.parse(path.read_text())
        top = {id(n) for n in tree.body}
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                assert node.level == 0, f"{name}: relative import (the package imports absolutely)"
                targets = [
                    f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods else node.module for a in node.names
                ]
            for t in targets:
                if t == "voicechat" or t.startswith("voicechat."):
                    edges.append((name, t, id(node) in top))
    return edges


def _layer(module: str) -> int:
    for i, prefixes in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return i
    raise AssertionError(f"{module} is in no layer: add it to LAYERS and docs/architecture.md")


def test_every_module_has_a_layer_and_no_arrow_points_up():
    mods = _modules()
    up = [(a, b) for a, b, _ in _edges(mods) if a != "voicechat" and _layer(b) > _layer(a)]
    assert up == []


def test_nothing_inside_the_package_imports_its_root():
    mods = _modules()
    assert [a for a, b, _ in _edges(mods) if b == "voicechat" and a != "voicechat"] == []


def test_the_import_graph_has_no_circles():
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for a, b, _ in _edges(mods):
        if a != b and b in graph:
            graph[a].add(b)
    seen, on_path, cycles = set(), [], []

    def visit(m):
        if m in on_path:
            cycles.append(on_path[on_path.index(m) :] + [m])
            return
        if m in seen:
            return
        seen.add(m)
        on_path.append(m)
        for n in sorted(graph[m]):
            visit(n)
        on_path.pop()

    for m in sorted(graph):
        visit(m)
    assert cycles == []


def test_import_voicechat_is_light_and_the_public_names_resolve():
    code = (
        "import sys, voicechat; assert 'mlx.core' not in sys.modules, 'mlx imported'; "
        "assert 'pandas' not in sys.modules and 'matplotlib' not in sys.modules; "
        "from voicechat.runtime import ExecutionPolicy; assert voicechat.ExecutionPolicy is ExecutionPolicy; "
        "from voicechat.streaming.prompt_state import PromptState; assert voicechat.PromptState is PromptState; "
        "import voicechat.synthetic, voicechat.tools; "
        "assert callable(voicechat.synthetic.write_checkpoint) and callable(voicechat.tools.render_system_prompt)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr


def test_the_top_of_the_package_is_the_api_and_its_folders():
    top = sorted(p.name for p in PACKAGE.iterdir() if p.suffix == ".py")
    assert top == ["__init__.py", "_version.py", "environment.py", "errors.py", "events.py"]
    folders = sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists())
    assert folders == ["cli", "io", "model", "runtime", "samples", "server", "streaming", "synthetic", "tools"]
    for f in folders:  # each says its purpose
        assert ast.get_docstring(ast.parse((PACKAGE / f / "__init__.py").read_text())), f


def test_bench_without_its_extra_says_which_to_install_and_the_rest_runs():
    """pandas and matplotlib are the `bench` extra: without them `voicechat bench` says what to install
    (exit 2), and the speech model's commands build and parse as before."""
    code = (
        "import sys; sys.modules['pandas'] = None; sys.modules['matplotlib'] = None\n"
        "from voicechat.cli.main import build_parser, main\n"
        "build_parser().parse_args(['synth', 'x'])\n"
        "rc = main(['bench', '-m', 'tiny'])\n"
        "assert 'pandas' not in [m for m, v in sys.modules.items() if v is not None]\n"
        "sys.exit(rc)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert r.returncode == 2, r.stderr
    assert "needs pandas and matplotlib (the `bench` extra)" in r.stderr and "voicechat-mlx[bench]" in r.stderr
