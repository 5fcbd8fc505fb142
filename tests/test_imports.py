"""The import graph of `zerojax/`, read with `ast` (nothing is imported): no cycles, and
the library does not import its test tooling (`zerojax.testing`); and, in a fresh
interpreter, the launcher imports no JAX."""

import ast
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLING = "zerojax.testing"


def _modules(root: str, package: str) -> dict[str, str]:
  """{dotted module name: file} of every .py file of `package` under `root`."""
  out = {}
  for folder, _, files in os.walk(os.path.join(root, *package.split("."))):
    dotted = os.path.relpath(folder, root).replace(os.sep, ".")
    for name in files:
      if name.endswith(".py"):
        out[dotted if name == "__init__.py" else f"{dotted}.{name[:-3]}"] = os.path.join(folder,
                                                                                         name)
  return out


def import_graph(root: str, package: str) -> dict[str, set[str]]:
  """{module: the modules of `package` it imports}, at module level or in any function.

  `from a import b` imports the module `a.b` where there is one, else the module `a`.
  """
  modules = _modules(root, package)
  graph = {}
  for module, path in modules.items():
    with open(path) as f:
      tree = ast.parse(f.read(), path)
    is_package = path.endswith("__init__.py")
    targets = set()
    for node in ast.walk(tree):
      if isinstance(node, ast.Import):
        targets |= {a.name for a in node.names}
      elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:  # Relative: from the module's package, up `level - 1` packages.
          parts = module.split(".")[:len(module.split(".")) - node.level + is_package]
          base = ".".join(parts + ([base] if base else []))
        targets |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                    for a in node.names}
    graph[module] = {t for t in targets if t in modules and t != module}
  return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """Each import cycle once, as a path that starts and ends at the same module."""
  found, done = [], set()

  def visit(node, path):
    for nxt in sorted(graph[node]):
      if nxt in path:
        found.append(path[path.index(nxt):] + [nxt])
      elif nxt not in done:
        visit(nxt, path + [nxt])
    done.add(node)

  for node in sorted(graph):
    if node not in done:
      visit(node, [node])
  return found


def test_the_walker_sees_function_level_imports_and_cycles(tmp_path):
  pkg = tmp_path / "pkg"
  (pkg / "sub").mkdir(parents=True)
  (pkg / "__init__.py").write_text("")
  (pkg / "sub" / "__init__.py").write_text("")
  (pkg / "a.py").write_text("from pkg import b\n")
  (pkg / "b.py").write_text("def f():\n  from pkg.sub import c\n")
  (pkg / "sub" / "c.py").write_text("if __name__ == '__main__':\n  from .. import a\n")
  (pkg / "d.py").write_text("import pkg.a\nfrom pkg.a import f\n")
  graph = import_graph(str(tmp_path), "pkg")
  assert graph["pkg.b"] == {"pkg.sub.c"} and graph["pkg.sub.c"] == {"pkg.a"}
  assert graph["pkg.d"] == {"pkg.a"}
  assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.sub.c", "pkg.a"]]


def test_zerojax_has_no_import_cycles():
  graph = import_graph(ROOT, "zerojax")
  assert {"zerojax.memory", "zerojax.memory.report", "zerojax.build"} <= graph.keys()
  assert cycles(graph) == []


def test_the_library_does_not_import_the_test_tooling():
  graph = import_graph(ROOT, "zerojax")
  library = {m for m in graph if m != TOOLING and not m.startswith(TOOLING + ".")}
  wrong = {m: sorted(t for t in graph[m] if t == TOOLING or t.startswith(TOOLING + "."))
           for m in library}
  assert {m: t for m, t in wrong.items() if t} == {}
  assert "zerojax.testing.hlo" in graph  # The tooling is where this test looks for it.


# The rooms of `zerojax/`, lowest first: a module imports only from rooms below its own
# (and its own room). WORKSPACE.md draws the same layers.
LAYERS = (
  ("zerojax.runtime",),  # backend switch, fake devices, JAX internals, XLA dumps, exits, units
  ("zerojax.mesh",),
  ("zerojax.config", "zerojax.optim", "zerojax.data", "zerojax.sequence"),
  ("zerojax.zero", "zerojax.run"),
  ("zerojax.streaming",),
  ("zerojax.stage3", "zerojax.vocab", "zerojax.layered", "zerojax.updates",
   "zerojax.testing"),
  ("zerojax.step", "zerojax.models"),
  ("zerojax",),  # The package's own names: make_plan, init_state, make_train_step, ...
  ("zerojax.release", "zerojax.checkpoint", "zerojax.gpu"),
  ("zerojax.build",),
  ("zerojax.hf",),
  ("zerojax.generate",),
  ("zerojax.memory",),
  ("zerojax.train",),
)
RANK = {room: rank for rank, rooms in enumerate(LAYERS) for room in rooms}


def room_of(module: str) -> str:
  """'zerojax.run.peers' -> 'zerojax.run'; 'zerojax' (the package's `__init__`) itself."""
  return ".".join(module.split(".")[:2])


def upward_imports(graph: dict[str, set[str]]) -> dict[str, list[str]]:
  """{module: the modules it imports from its own layer or above, outside its own room}."""
  wrong = {}
  for module, targets in graph.items():
    if module == "zerojax":  # The package's names re-export the rooms below it.
      continue
    here = room_of(module)
    up = sorted(t for t in targets if room_of(t) != here and RANK[room_of(t)] >= RANK[here])
    if up:
      wrong[module] = up
  return wrong


def local_imports(root: str, package: str) -> list[tuple[str, int, str]]:
  """(file, line, source line) of each function-local import of a `package` module."""
  out = []
  for module, path in _modules(root, package).items():
    with open(path) as f:
      source = f.read()
    lines = source.splitlines()
    for node in ast.walk(ast.parse(source, path)):
      if isinstance(node, (ast.Import, ast.ImportFrom)) and node.col_offset > 0:
        names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [
            a.name for a in node.names]
        if any(n == package or n.startswith(package + ".") for n in names):
          out.append((os.path.relpath(path, root), node.lineno, lines[node.lineno - 1]))
  return out


def test_the_layer_check_sees_an_upward_import():
  graph = {"zerojax.models.llama": {"zerojax.release", "zerojax.stage3"},
           "zerojax.release": {"zerojax.models.llama"}, "zerojax.run.peers": {"zerojax.run"}}
  assert upward_imports(graph) == {"zerojax.models.llama": ["zerojax.release"]}


def test_every_module_is_in_a_room_and_imports_follow_the_layers():
  graph = import_graph(ROOT, "zerojax")
  assert sorted({room_of(m) for m in graph} - RANK.keys()) == []
  assert upward_imports(graph) == {}


def test_the_package_top_holds_the_zero_core_only():
  top = sorted(f for f in os.listdir(os.path.join(ROOT, "zerojax")) if f.endswith(".py"))
  assert len(top) <= 12, top
  for room in sorted(r for r in RANK if r.count(".") == 1):
    init = os.path.join(ROOT, *room.split("."), "__init__.py")
    if os.path.exists(init):  # A room that is a package says what it owns.
      with open(init) as f:
        assert ast.get_docstring(ast.parse(f.read())), init


def test_function_local_imports_are_few_and_say_why():
  found = local_imports(ROOT, "zerojax")
  assert len(found) <= 15, found
  # Each keeps an optional dependency optional (or its cost off the common path): the
  # linter's suppression (PLC0415, pyproject.toml) followed by the reason.
  assert [f for f in found if "noqa: PLC0415" not in f[2].split("#", 1)[-1]
          or not f[2].split("PLC0415", 1)[-1].strip(" )(")] == []


def test_the_launcher_imports_no_jax():
  """`zerojax-launch` only starts processes: importing it (and through it the package's
  names, lazy, and `runtime.device_env`) loads no JAX (1.1 s of CPU a launcher start), while
  a package name still brings its module."""
  code = ("import sys, zerojax.run.launch; assert 'jax' not in sys.modules, 'jax'; "
          "import zerojax; zerojax.make_plan; assert 'jax' in sys.modules")
  result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
  assert result.returncode == 0, result.stderr[-2000:]
