"""The product's structure (DESIGN.md, Architecture): layers that import only downward, no import
circles, files and functions sized by concept (the product's and the measuring tools'), no
module-level mutable state, no undeclared attributes.

Each check walks the source with `ast` (no imports executed) and names every violation.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
PRODUCT = ("lazy_facade", "attention", "producers", "pipelines")
# Layer ranks: a module may import its own package and packages of a lower rank only.
LAYERS = {"end_to_end": 9, "pipelines": 8, "pipelines.serve": 7, "pipelines.cli": 6, "pipelines.commands": 5,
          "pipelines.pipeline": 4, "pipelines.wan": 3, "pipelines.parallel": 2, "pipelines.storage": 1, "attention": 1,
          "producers": 1, "lazy_facade": 0}
# Size alarms, not goals (STYLE.md): a module or a function past them is split, unless its concept is
# whole; then WHOLE names it, (file, function) or (file, None) for the whole module, with the reason.
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 60
SIZED = (*PRODUCT, "end_to_end")  # where the alarms apply: the product and its measuring tools
WHOLE = {
    ("attention/blockwise.py", "attend"): "one linear schedule (checks, block splits, the scan over key blocks) "
                                          "over the same local shapes; its docstring says so",
    ("attention/usp.py", "_usp_body"): "one linear schedule of numbered stages (reductions, all-to-all, ring loop, "
                                       "all-to-all back) over the same collectives; its docstring says so",
    ("pipelines/pipeline/checked/request.py", "build"): "one linear sequence of checks over a call's arguments, "
                                                         "one line per argument group, each check in its helper",
}
MUTATORS = {"append", "extend", "update", "clear", "pop", "popitem", "setdefault", "add", "remove",
            "insert", "discard"}


def _modules(*tops: str) -> dict[str, pathlib.Path]:
  """Dotted module name -> path, for every .py file under the given top folders (or the top-level
  module `top`.py)."""
  out = {}
  for top in tops:
    single = ROOT / f"{top}.py"
    for path in [single] if single.is_file() else sorted((ROOT / top).rglob("*.py")):
      parts = list(path.relative_to(ROOT).with_suffix("").parts)
      if parts[-1] == "__init__":
        parts = parts[:-1]
      out[".".join(parts)] = path
  return out


def _layer(module: str) -> str | None:
  """The layer a dotted module belongs to (the longest matching prefix in LAYERS)."""
  matches = [name for name in LAYERS if module == name or module.startswith(name + ".")]
  return max(matches, key=len) if matches else None


def _facade_homes(tree: ast.Module) -> list[tuple[int, str, list[str]]]:
  """(line, home module, names) of each entry of a facade's `_HOMES` table (lazy_facade.py): the
  facade imports a home when one of its names is first asked for."""
  found = []
  for node in tree.body:
    if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["_HOMES"]:
      for entry in node.value.elts:
        module, names = entry.elts
        found.append((entry.lineno, module.value, [name.value for name in names.elts]))
  return found


def _imports(path: pathlib.Path, known: dict[str, pathlib.Path]) -> list[tuple[int, str, list[str]]]:
  """(line, imported module, names) of every import in the file, at any depth, and of every home of
  a facade's `_HOMES`; `from a import b` where a.b is a module counts as importing a.b."""
  tree = ast.parse(path.read_text())
  found = _facade_homes(tree)
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      found += [(node.lineno, alias.name, []) for alias in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      names = [alias.name for alias in node.names]
      subs = [f"{node.module}.{n}" for n in names if f"{node.module}.{n}" in known]
      found += [(node.lineno, sub, []) for sub in subs] or [(node.lineno, node.module, names)]
  return found


def _where(path: pathlib.Path) -> str:
  return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def _upward_imports(known: dict[str, pathlib.Path]) -> list[str]:
  """Every import of a module in `known` that goes to its own layer's rank or above (another
  package), named with its file and line."""
  bad = []
  for module, path in known.items():
    own = _layer(module)
    for line, target, _ in _imports(path, known):
      theirs = _layer(target)
      if theirs is None or theirs == own or (own == "pipelines" and module == "pipelines"):
        continue
      if LAYERS[theirs] >= LAYERS[own]:
        bad.append(f"{_where(path)}:{line} ({own}) imports {target} ({theirs})")
  return bad


def test_layers_import_only_downward():
  bad = _upward_imports(_modules(*PRODUCT, "end_to_end"))
  assert not bad, "imports that go up or sideways:\n" + "\n".join(bad)


def test_measuring_tools_import_nothing_private():
  known = _modules(*PRODUCT, "end_to_end")
  bad = [f"{path.relative_to(ROOT)}:{line} imports {name} from {target}"
         for module, path in known.items() if module.startswith("end_to_end")
         for line, target, names in _imports(path, known) if _layer(target) not in (None, "end_to_end")
         for name in names if name.startswith("_")]
  assert not bad, "\n".join(bad)


def test_positive_control_facade_homes_are_imports(tmp_path):
  """A facade's `_HOMES` entries count as its imports: a home in a higher layer is reported."""
  facade = tmp_path / "__init__.py"
  facade.write_text('from lazy_facade import lazy_facade\n\n_HOMES = (\n    ("pipelines.storage.weights", ("load",)),\n'
                    '    ("pipelines.cli.generate", ("cli",)),\n)\n')
  assert _upward_imports({"pipelines.storage": facade}) == [
      f"{facade}:5 (pipelines.storage) imports pipelines.cli.generate (pipelines.cli)"]


def _imports_between(known: dict[str, pathlib.Path], importer: str, imported: str) -> list[str]:
  """Every import, in a module of package `importer`, of package `imported` (at any depth, lazy ones
  too), named with its file and line."""
  inside = lambda module, package: module == package or module.startswith(package + ".")  # noqa: E731
  return [f"{_where(path)}:{line} imports {target}" for module, path in known.items() if inside(module, importer)
          for line, target, _ in _imports(path, known) if inside(target, imported)]


def test_serve_imports_nothing_from_the_command():
  """`serve` and `generate` share only what lies below both (`pipelines.commands`: presets, flag
  pieces, versions; `pipelines.pipeline` and down), so either changes without the other."""
  bad = _imports_between(_modules("pipelines"), "pipelines.serve", "pipelines.cli")
  assert not bad, "serve imports the generate command (move what both need to pipelines/commands):\n" + "\n".join(bad)


def test_positive_control_serve_imports_from_the_command(tmp_path):
  """Each way of reaching the command from serve is reported; what lies below both is not."""
  api, main, worker = (tmp_path / f"{name}.py" for name in ("api", "main", "worker"))
  api.write_text("from pipelines.cli.presets import PRESETS\nfrom pipelines.commands.presets import TINY_MODELS\n")
  main.write_text("import pipelines.cli.flags\n\n\ndef f():\n  from pipelines.cli import output\n")
  worker.write_text("from pipelines.pipeline.checked.seed import random_seed\nfrom pipelines.commands import versions\n")
  known = {"pipelines.serve.api": api, "pipelines.serve.main": main, "pipelines.serve.worker": worker,
           "pipelines.cli.output": tmp_path / "output.py"}
  assert _imports_between(known, "pipelines.serve", "pipelines.cli") == [
      f"{api}:1 imports pipelines.cli.presets", f"{main}:1 imports pipelines.cli.flags",
      f"{main}:5 imports pipelines.cli.output"]


def _circles(known: dict[str, pathlib.Path]) -> list[str]:
  """The import circles among `known` (each as "a -> b -> a")."""
  graph = {m: {t for _, t, _ in _imports(p, known) if t in known and t != m} for m, p in known.items()}
  # A facade (a package's __init__) that lazily re-exports its own modules is not a circle of concerns.
  graph = {m: {t for t in ts if not (known[m].name == "__init__.py" and t.startswith(m + "."))}
           for m, ts in graph.items()}
  state: dict[str, int] = {}
  circles = []

  def visit(m: str, stack: list[str]) -> None:
    state[m] = 1
    for t in sorted(graph[m]):
      if state.get(t) == 1:
        circles.append(" -> ".join(stack[stack.index(t):] + [t]))
      elif t not in state:
        visit(t, stack + [t])
    state[m] = 2

  for m in sorted(graph):
    if m not in state:
      visit(m, [m])
  return circles


def test_no_import_circles():
  circles = _circles(_modules(*PRODUCT, "end_to_end"))
  assert not circles, "import circles:\n" + "\n".join(circles)


def _oversized(paths: dict[str, pathlib.Path], whole=WHOLE) -> tuple[list[str], list[str]]:
  """(modules over MAX_FILE_LINES, functions over MAX_FUNCTION_LINES), each named with its size,
  less those `whole` names."""
  files, functions = [], []
  for path in paths.values():
    relative = _where(path)
    lines = len(path.read_text().splitlines())
    if lines > MAX_FILE_LINES and (relative, None) not in whole:
      files.append(f"{relative} ({lines} lines)")
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        length = node.end_lineno - node.lineno + 1
        if length > MAX_FUNCTION_LINES and (relative, node.name) not in whole:
          functions.append(f"{relative}:{node.lineno} {node.name} ({length} lines)")
  return files, functions


def test_no_file_over_500_lines():
  files, _ = _oversized(_modules(*SIZED))
  assert not files, (f"files over {MAX_FILE_LINES} lines (split by concept, or name the whole concept in WHOLE "
                     "with its reason):\n" + "\n".join(files))


def test_no_function_over_60_lines():
  _, functions = _oversized(_modules(*SIZED))
  assert not functions, (f"functions over {MAX_FUNCTION_LINES} lines (split by concept, or name the whole "
                         "concept in WHOLE with its reason):\n" + "\n".join(functions))


def test_whole_concepts_are_still_whole_and_say_why():
  """Every WHOLE entry names a module or function that exists and is still past its alarm (else the
  allowance is stale), with a reason; a whole function's docstring says it stays one piece."""
  known = {_where(p): p for p in _modules(*SIZED).values()}
  for (relative, function), reason in WHOLE.items():
    assert relative in known and reason.strip(), (relative, function)
    tree = ast.parse(known[relative].read_text())
    if function is None:
      assert len(known[relative].read_text().splitlines()) > MAX_FILE_LINES, f"{relative} is no longer over: unlist it"
      continue
    [node] = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == function]
    assert node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES, f"{relative}:{function} is no longer over: unlist it"
    assert "one piece" in (ast.get_docstring(node) or ""), f"{relative}:{function}: say why it stays whole"


def test_positive_control_sizes(tmp_path):
  """A long module and a long function are reported, each unless WHOLE names it."""
  long = tmp_path / "long.py"
  long.write_text("def f():\n" + "  x = 1\n" * MAX_FUNCTION_LINES + "\n\n" + "y = 2\n" * MAX_FILE_LINES)
  files, functions = _oversized({"long": long})
  assert files == [f"{long} ({2 * 1 + MAX_FUNCTION_LINES + 1 + MAX_FILE_LINES} lines)"], files
  assert functions == [f"{long}:1 f ({MAX_FUNCTION_LINES + 1} lines)"], functions
  assert _oversized({"long": long}, whole={(str(long), None): "a module", (str(long), "f"): "a function"}) == ([], [])


def _module_names(tree: ast.Module) -> set[str]:
  names = set()
  for node in tree.body:
    targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
        node, (ast.AnnAssign, ast.AugAssign)) else []
    names |= {t.id for t in targets if isinstance(t, ast.Name)}
  return names


def _mutations(path: pathlib.Path) -> list[str]:
  """`global` statements and writes into module-level names (item assignment, mutating methods)."""
  tree = ast.parse(path.read_text())
  names = _module_names(tree)
  bad = []
  for node in ast.walk(tree):
    where = f"{_where(path)}:{getattr(node, 'lineno', 0)}"
    if isinstance(node, ast.Global):
      bad.append(f"{where} global {', '.join(node.names)}")
    elif isinstance(node, (ast.Assign, ast.AugAssign)):
      targets = node.targets if isinstance(node, ast.Assign) else [node.target]
      bad += [f"{where} writes into module-level {t.value.id}" for t in targets
              if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name) and t.value.id in names]
    elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS
          and isinstance(node.func.value, ast.Name) and node.func.value.id in names):
      bad.append(f"{where} {node.func.value.id}.{node.func.attr}(...) mutates module-level state")
  return bad


def test_no_module_level_mutable_state():
  bad = [line for path in _modules(*PRODUCT).values() for line in _mutations(path)]
  assert not bad, "\n".join(bad)


# Calls that draw a random seed; only `pipelines.pipeline.checked.seed` makes them (`random_seed`).
SEED_DRAWS = {"randbelow", "getrandbits", "SeedSequence", "randint", "randrange", "urandom"}
SEED_OWNER = "pipelines.pipeline.checked.seed"


def _seed_draws(path: pathlib.Path) -> list[str]:
  """Every call in the file to a function of `SEED_DRAWS` (`secrets.randbelow`, numpy's
  `SeedSequence`, ...), named with its line."""
  bad = []
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Call):
      name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
      if name in SEED_DRAWS:
        bad.append(f"{_where(path)}:{node.lineno} {name}(...)")
  return bad


def test_one_module_draws_random_seeds():
  """The command, the Python call and the server draw a seed with `seed.random_seed` only."""
  bad = [line for module, path in _modules("pipelines").items() if module != SEED_OWNER
         for line in _seed_draws(path)]
  assert not bad, "draw seeds with pipelines.pipeline.checked.seed.random_seed:\n" + "\n".join(bad)


def test_positive_control_seed_draws(tmp_path):
  drawn = tmp_path / "api.py"
  drawn.write_text("import secrets\nimport numpy as np\nseed = secrets.randbelow(2 ** 31)\n"
                   "other = int(np.random.SeedSequence().entropy % 2 ** 31)\nname = secrets.token_hex(8)\n")
  assert _seed_draws(drawn) == [f"{drawn}:3 randbelow(...)", f"{drawn}:4 SeedSequence(...)"]
  assert _seed_draws(_modules("pipelines")[SEED_OWNER])  # the owner itself is seen drawing


# Where json.dump may write a file itself: the atomic writer, a temporary file, a model folder saved
# whole into a temporary directory first, and `plan`, which opens its --json before the search so a
# bad path fails at once.
JSON_WRITERS = {"pipelines/storage/video_io.py", "end_to_end/quality/step_cache.py",
                "pipelines/wan/pretrained/saving.py", "end_to_end/plan.py"}


def _json_dumps(path: pathlib.Path) -> list[str]:
  """`json.dump(...)` calls (a file written in place) in `path`."""
  return [f"{_where(path)}:{node.lineno} json.dump(...)" for node in ast.walk(ast.parse(path.read_text()))
          if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "dump"
          and isinstance(node.func.value, ast.Name) and node.func.value.id == "json"]


def test_reports_are_written_atomically():
  """JSON reports and records go through `video_io.write_json` (temp file, then rename): a run
  stopped mid-write leaves the old file or none, never half of one."""
  bad = [line for path in _modules(*SIZED).values() if _where(path) not in JSON_WRITERS for line in _json_dumps(path)]
  assert not bad, "write JSON with pipelines.storage.video_io.write_json:\n" + "\n".join(bad)


def test_positive_control_json_dumps(tmp_path):
  written = tmp_path / "bench.py"
  written.write_text("import json\nwith open('r.json', 'w') as f:\n  json.dump({}, f)\ntext = json.dumps({})\n")
  assert _json_dumps(written) == [f"{written}:3 json.dump(...)"]


def _reexports(path: pathlib.Path) -> list[str]:
  """`from a import b  # noqa: F401` in a module that is not a package's `__init__`: names kept for
  others to import from here (a facade in disguise; STYLE.md, one address per name). A side-effect
  `import x  # noqa: F401` is not one."""
  if path.name == "__init__.py":
    return []
  lines = path.read_text().splitlines()
  return [f"{_where(path)}:{node.lineno} re-exports {', '.join(a.name for a in node.names)} from {node.module}"
          for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ImportFrom)
          and any("noqa: F401" in line for line in lines[node.lineno - 1:node.end_lineno])]


def test_names_have_one_address():
  """A name is imported from its home (or its package's lazy facade), not from a module that passes it on."""
  bad = [line for path in _modules(*PRODUCT, "end_to_end").values() for line in _reexports(path)]
  assert not bad, "import these from their homes (or list them in the package's __init__ facade):\n" + "\n".join(bad)


def test_positive_control_reexports(tmp_path):
  module = tmp_path / "wan_pipeline.py"
  module.write_text("from a.hooks import Error  # noqa: F401 (re-exported)\nfrom a.inputs import (f,  # noqa: F401\n"
                    "  g)\nfrom a.inputs import h\n\n\ndef k():\n  import PIL.Image  # noqa: F401\n")
  (tmp_path / "pkg").mkdir()
  facade = tmp_path / "pkg" / "__init__.py"
  facade.write_text(module.read_text())
  assert _reexports(module) == [f"{module}:1 re-exports Error from a.hooks",
                                f"{module}:2 re-exports f, g from a.inputs"]
  assert _reexports(facade) == []


def test_no_undeclared_private_attributes():
  """Attributes are declared in __init__, not looked up with a default (`getattr(self, "_x", d)`)."""
  bad = []
  for path in _modules(*PRODUCT).values():
    for node in ast.walk(ast.parse(path.read_text())):
      if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
          and len(node.args) == 3 and isinstance(node.args[0], ast.Name) and node.args[0].id == "self"
          and isinstance(node.args[1], ast.Constant) and str(node.args[1].value).startswith("_")):
        bad.append(f"{path.relative_to(ROOT)}:{node.lineno} getattr(self, {node.args[1].value!r}, ...)")
  assert not bad, "\n".join(bad)


def test_positive_control_the_checks_can_fail(tmp_path):
  """The walkers catch real violations: a model-layer module importing the command, a function
  writing into a module-level dict, a `global`, and an import circle."""
  bad = tmp_path / "bad.py"
  bad.write_text("import os\nfrom pipelines.cli import generate\n_SEEN = {}\n\n\ndef f():\n  _SEEN['a'] = 1\n"
                 "  _SEEN.update(b=2)\n\n\ndef g():\n  global _SEEN\n")
  cli = tmp_path / "generate.py"
  cli.write_text("from pipelines.wan import bad\n")
  known = {"pipelines.wan.bad": bad, "pipelines.cli.generate": cli}
  assert _upward_imports(known) == [f"{bad}:2 (pipelines.wan) imports pipelines.cli.generate (pipelines.cli)"]
  found = _mutations(bad)
  assert len(found) == 3, found
  for kind in ("writes into module-level _SEEN", "_SEEN.update(...) mutates", "global _SEEN"):
    assert any(kind in line for line in found), (kind, found)
  assert _circles(known) == ["pipelines.cli.generate -> pipelines.wan.bad -> pipelines.cli.generate"]


# --- the Wan model's components (pipelines/wan/__init__.py) -------------------------------------------
GROUND_FLOOR = ("transformer", "vae", "encoders", "schedulers")  # import no other component
UPPER_FLOOR = ("conditioning", "step_cache", "lora", "pretrained", "causal")  # import only the ground floor
# Modules that load without JAX (the command line checks its flags with them before JAX starts).
JAX_FREE = ("pipelines.wan.pretrained.folder", "pipelines.wan.pretrained.hub", "pipelines.wan.lora.convert", "pipelines.wan.lora.format",
            "pipelines.wan.step_cache.calibration", "pipelines.wan.step_cache.spec",
            "pipelines.wan.encoders.tokenizer", "pipelines.wan.transformer.config", "pipelines.wan.transformer.original_names",
            "pipelines.wan.vae.config", "pipelines.wan.vae.original_names", "pipelines.wan.pretrained.layouts",
            "pipelines.wan.pretrained.inference",
            "pipelines.wan.vae.effort", "pipelines.wan.vae.topology")


def _component(module: str) -> str | None:
  parts = module.split(".")
  return parts[2] if len(parts) > 2 and parts[:2] == ["pipelines", "wan"] else None


def _floor_violations(known: dict[str, pathlib.Path]) -> list[str]:
  """Imports between wan components that break the floors: a ground component importing another
  component, an upper one importing anything but the ground floor."""
  bad = []
  for module, path in known.items():
    own = _component(module)
    if own is None:
      continue
    for line, target, _ in _imports(path, known):
      theirs = _component(target)
      if theirs is None or theirs == own:
        continue
      if own in GROUND_FLOOR or theirs not in GROUND_FLOOR:
        bad.append(f"{_where(path)}:{line} ({own}) imports {target} ({theirs})")
  return bad


def test_wan_components_import_in_two_floors():
  top = sorted(p.name for p in (ROOT / "pipelines/wan").iterdir() if p.name != "__pycache__")
  assert top == sorted(["__init__.py", *GROUND_FLOOR, *UPPER_FLOOR]), top
  bad = _floor_violations(_modules("pipelines"))
  assert not bad, "imports across the wan floors:\n" + "\n".join(bad)


def _deep_wan_imports(paths: dict[str, pathlib.Path]) -> list[str]:
  """Imports, outside pipelines/wan, of a component's module rather than of the component's names:
  by its dotted path (`from pipelines.wan.vae.model import decode`), by name through the component
  (`from pipelines.wan.encoders import umt5`) or as a facade's home. A component's modules are the
  .py files in its folder."""
  inner = {m: p for m, p in _modules("pipelines/wan").items() if len(m.split(".")) > 3}
  bad = []
  for module, path in paths.items():
    if _component(module) is not None:
      continue
    bad += [f"{_where(path)}:{line} imports {target}" for line, target, _ in _imports(path, inner)
            if _component(target) is not None and len(target.split(".")) > 3]
  return bad


def test_product_reaches_wan_through_its_components():
  """Product code and the measuring tools import a component's names from the component
  (`from pipelines.wan.encoders import UMT5Config`), so that its modules can move inside it."""
  bad = _deep_wan_imports(_modules(*PRODUCT, "end_to_end"))
  assert not bad, ("import the names from the component (pipelines.wan.<component>; list them in its _HOMES), "
                   "not its module:\n" + "\n".join(bad))


def test_product_imports_no_private_name():
  known = _modules(*PRODUCT)
  bad = [f"{_where(path)}:{line} imports {name} from {target}" for path in known.values()
         for line, target, names in _imports(path, known) if _layer(target) is not None
         for name in names if name.startswith("_") and not name.startswith("__")]
  assert not bad, "\n".join(bad)


def _import_without_jax(modules: tuple[str, ...]) -> subprocess.CompletedProcess:
  """A fresh interpreter, JAX, jaxlib, flax and qwix blocked, importing `modules`."""
  code = ("import sys\nfor name in ('jax', 'jaxlib', 'flax', 'qwix'):\n  sys.modules[name] = None\n"
          + "".join(f"import {m}\n" for m in modules))
  return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)


def test_jax_free_wan_modules_import_without_jax():
  done = _import_without_jax(JAX_FREE)
  assert done.returncode == 0, done.stderr[-2000:]


def test_facades_import_without_jax():
  """Importing a facade imports none of its homes (lazy_facade.py), so every facade loads without JAX."""
  facades = tuple(module for module, path in _modules(*PRODUCT).items()
                  if path.name == "__init__.py" and _facade_homes(ast.parse(path.read_text())))
  assert {"attention", "producers", "pipelines", "pipelines.pipeline", "pipelines.wan.vae"} <= set(facades), facades
  done = _import_without_jax(facades)
  assert done.returncode == 0, done.stderr[-2000:]


def test_shared_command_pieces_import_without_jax():
  """Both commands check their flags with `pipelines.commands` before JAX starts."""
  done = _import_without_jax(tuple(m for m in _modules("pipelines") if m.startswith("pipelines.commands")))
  assert done.returncode == 0, done.stderr[-2000:]


def test_positive_control_wan_floors(tmp_path):
  """A ground component importing another, an upper one importing an upper one, and a product module
  or facade importing a component's inner module (by its path, or by name through the component) are
  each reported; the component's names and the component itself are not."""
  sideways = tmp_path / "model.py"
  sideways.write_text("from pipelines.wan.vae import decode\n")
  upper = tmp_path / "fuse.py"
  upper.write_text("from pipelines.wan import step_cache\nfrom pipelines.wan.transformer import forward\n")
  deep = tmp_path / "runner.py"
  deep.write_text("from pipelines.wan.vae.model import decode\nfrom pipelines.wan import vae\n"
                  "from pipelines.wan.encoders import UMT5Config, umt5\n\n\ndef f():\n"
                  "  from pipelines.wan.step_cache import calibration as mag_calibration\n"
                  "  import pipelines.wan.transformer.quantization\n")
  facade = tmp_path / "__init__.py"
  facade.write_text('_HOMES = (\n    ("pipelines.pipeline.run.hooks", ("Error",)),\n'
                    '    ("pipelines.wan.pretrained", ("TINY_SEED",)),\n    ("pipelines.wan.pretrained.tiny", ("TINY",)),\n)\n')
  for name in ("vae.py", "sc.py", "t.py"):
    (tmp_path / name).write_text("")
  known = {"pipelines.wan.transformer.model": sideways, "pipelines.wan.lora.fuse": upper,
           "pipelines.wan.vae": tmp_path / "vae.py", "pipelines.wan.step_cache": tmp_path / "sc.py",
           "pipelines.wan.transformer": tmp_path / "t.py", "pipelines.pipeline.run.runner": deep}
  assert _floor_violations(known) == [
      f"{sideways}:1 (transformer) imports pipelines.wan.vae (vae)",
      f"{upper}:1 (lora) imports pipelines.wan.step_cache (step_cache)"]
  assert _deep_wan_imports({"pipelines.pipeline.run.runner": deep, "pipelines.pipeline": facade}) == [
      f"{deep}:1 imports pipelines.wan.vae.model", f"{deep}:3 imports pipelines.wan.encoders.umt5",
      f"{deep}:7 imports pipelines.wan.step_cache.calibration", f"{deep}:8 imports pipelines.wan.transformer.quantization",
      f"{facade}:4 imports pipelines.wan.pretrained.tiny"]
  # The JAX-free check's blocker bites: a module that imports JAX fails under it.
  done = subprocess.run([sys.executable, "-c", "import sys\nsys.modules['jax'] = None\nimport pipelines.wan.vae.model"],
                        cwd=ROOT, capture_output=True, text=True)
  assert done.returncode != 0 and "ModuleNotFoundError" in done.stderr


# --- one generation's rooms (pipelines/pipeline/__init__.py) ------------------------------------------
# Each room imports only the rooms named here; the pipeline classes at the top import any room.
PIPELINE_ROOMS = {"checked": (), "load": (), "run": ("checked", "load")}
PIPELINE_TOP = ("image_pipeline.py", "vace_pipeline.py", "video_pipeline.py", "wan_pipeline.py")
MAX_PIPELINE_TOP_MODULES = 8


def _pipeline_room(module: str) -> str | None:
  """The room of a `pipelines.pipeline` module ("top" for the classes and the facade), else None."""
  parts = module.split(".")
  if parts[:2] != ["pipelines", "pipeline"]:
    return None
  return parts[2] if len(parts) > 3 or (len(parts) == 3 and parts[2] in PIPELINE_ROOMS) else "top"


def _room_violations(known: dict[str, pathlib.Path]) -> list[str]:
  """Imports between `pipelines.pipeline`'s rooms that the ranks of `PIPELINE_ROOMS` forbid (a room
  importing the top, or a room it does not build on)."""
  bad = []
  for module, path in known.items():
    own = _pipeline_room(module)
    if own is None or own == "top":
      continue
    for line, target, _ in _imports(path, known):
      theirs = _pipeline_room(target)
      if theirs is not None and theirs != own and theirs not in PIPELINE_ROOMS[own]:
        bad.append(f"{_where(path)}:{line} ({own}) imports {target} ({theirs})")
  return bad


def test_pipeline_in_rooms():
  top = sorted(p.name for p in (ROOT / "pipelines/pipeline").iterdir() if p.name != "__pycache__")
  assert top == sorted(["__init__.py", *PIPELINE_TOP, *PIPELINE_ROOMS]), top
  assert len(top) <= MAX_PIPELINE_TOP_MODULES, top
  bad = _room_violations(_modules("pipelines"))
  assert not bad, "imports across pipelines/pipeline's rooms:\n" + "\n".join(bad)


def test_positive_control_pipeline_rooms(tmp_path):
  """A ground room importing another room or the top, and a room importing the top, are reported;
  `run` importing `checked`, and the top importing `run`, are not."""
  files = {name: tmp_path / f"{name.replace('.', '_')}.py" for name in (
      "pipelines.pipeline.checked.request", "pipelines.pipeline.load.loading", "pipelines.pipeline.run.runner",
      "pipelines.pipeline.wan_pipeline")}
  files["pipelines.pipeline.checked.request"].write_text("from pipelines.pipeline.run import runner\n")
  files["pipelines.pipeline.load.loading"].write_text("from pipelines.pipeline.wan_pipeline import WanPipeline\n")
  files["pipelines.pipeline.run.runner"].write_text("from pipelines.pipeline.checked import request\n")
  files["pipelines.pipeline.wan_pipeline"].write_text("from pipelines.pipeline.run import runner\n")
  assert _room_violations(files) == [
      f"{files['pipelines.pipeline.checked.request']}:1 (checked) imports pipelines.pipeline.run.runner (run)",
      f"{files['pipelines.pipeline.load.loading']}:1 (load) imports pipelines.pipeline.wan_pipeline (top)"]


# --- tests mirror the product -------------------------------------------------------------------------
MIRRORED_FRACTION = 0.6  # of product modules with a same-named test file (tests/<folder>/test_<name>.py)


def _test_file_of(module: pathlib.Path) -> pathlib.Path:
  relative = module.relative_to(ROOT)
  return ROOT / "tests" / relative.parent / f"test_{relative.name}"


def test_tests_mirror_the_product():
  """Every product package has its test folder; most modules a test file at the same path."""
  modules = [p for p in _modules(*PRODUCT).values() if p.name != "__init__.py" and p.name != "__main__.py"]
  packages = {p.parent for p in modules}
  missing = sorted(str(p.relative_to(ROOT)) for p in packages if not (ROOT / "tests" / p.relative_to(ROOT)).is_dir())
  assert not missing, f"product packages without a test folder: {missing}"
  mirrored = [p for p in modules if _test_file_of(p).exists()]
  fraction = len(mirrored) / len(modules)
  lacking = sorted(str(p.relative_to(ROOT)) for p in modules if p not in mirrored)
  assert fraction >= MIRRORED_FRACTION, f"{fraction:.0%} of product modules have a test file; without: {lacking}"


def test_positive_control_mirror_paths():
  assert _test_file_of(ROOT / "pipelines/wan/vae/model.py") == ROOT / "tests/pipelines/wan/vae/test_model.py"
  assert _test_file_of(ROOT / "pipelines/wan/vae/model.py").exists()
  assert not _test_file_of(ROOT / "pipelines/wan/vae/no_such_module.py").exists()
