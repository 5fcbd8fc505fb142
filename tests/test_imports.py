"""The import graph of `zerojax/`, read with `ast` (nothing is imported): no cycles, and
the library does not import its test tooling (`zerojax.testing`)."""

import ast
import os

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
  assert {"zerojax.memory", "zerojax.memory_report", "zerojax.build"} <= graph.keys()
  assert cycles(graph) == []


def test_the_library_does_not_import_the_test_tooling():
  graph = import_graph(ROOT, "zerojax")
  library = {m for m in graph if m != TOOLING and not m.startswith(TOOLING + ".")}
  wrong = {m: sorted(t for t in graph[m] if t == TOOLING or t.startswith(TOOLING + "."))
           for m in library}
  assert {m: t for m, t in wrong.items() if t} == {}
  assert "zerojax.testing.hlo" in graph  # The tooling is where this test looks for it.
