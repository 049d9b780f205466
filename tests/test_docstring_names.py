"""Every name the prose gives in backticks is a name the code has, so that a rename or a move cannot
leave the old name behind in a docstring, a comment or a page of the docs (the docs' commands and
links have their own test: tests/system/test_docs_commands.py).

Read with `ast` and `tokenize` (nothing imported): every docstring and comment of attention/,
producers/, pipelines/ and end_to_end/, and the Markdown pages (`DOCS`) outside their ``` blocks.

- A backticked dotted name (`a.b`, `a.b.c`: identifiers only; a trailing call `(...)` dropped) must
  resolve: as a module, a module's attribute (a top-level name, a name of its lazy facade's `_HOMES`
  or `__all__`, a submodule) or a class's member (a method, a field, an attribute set on `self`),
  as far as these reach. Its first word is a module looked up under a prefix: none, the writing
  file's own packages (innermost first), `PREFIXES` (`wan.vae.model`, `pipeline.run.continued`,
  `blockwise.attend`) or `COMPONENTS` (`umt5.encode_text`, `tiny.train_vae`); or an alias the writing
  file imports (`fm.offsets_of_rows` after `from attention import fixed_m as fm`); or a parameter
  of the function whose docstring it is (`request.seed`: checked against the parameter's annotated
  class); or a class of the product (`WanPipeline.quantize`). `module.member` also resolves when the
  member is one of a class's in that module (the prose names an instance: `plan.mesh`).
- A backticked path whose first folder is the repository's (`pipelines/wan/vae/model.py`; from
  end_to_end/ `bench/presets.py`; under pipelines/ `pipeline/run/ti2v.py`) must exist; a bare
  `name.py` must be a module of the product.
- Not checked: bare names (`decode`); another project's names (a first word in `FOREIGN`: `jax.`,
  diffusers' classes, checkpoint keys; a span right after "diffusers", "Wan", ...; a path from
  `wan/` that pipelines/wan/ lacks, Wan-Video's); file names (`config.json`); and an instance the
  prose names (`INSTANCES`: `pipe.run`, `state.step`) when no module of that name resolves it.
"""

from __future__ import annotations

import ast
import functools
import io
import pathlib
import re
import tokenize

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCANNED = ("attention", "producers", "pipelines", "end_to_end", "lazy_facade.py")
# Where a dotted name's first word is looked for, besides the writing file's own packages (and the
# Wan components and the measuring tools' folders, `COMPONENTS`: `umt5.encode_text` is
# `pipelines.wan.encoders.umt5.encode_text`, `tiny.train_vae` is `end_to_end.train.tiny.train_vae`).
PREFIXES = ("", "pipelines.", "pipelines.pipeline.", "pipelines.pipeline.checked.", "pipelines.pipeline.load.",
            "pipelines.pipeline.run.", "pipelines.wan.", "pipelines.commands.", "pipelines.parallel.",
            "pipelines.storage.", "attention.", "end_to_end.")
# First words that are not the product's: other libraries (and their usual aliases), the classes of
# diffusers and transformers that the prose compares with ours, checkpoint keys, HLO and Mosaic words.
FOREIGN = frozenset({
    "jax", "jnp", "lax", "np", "numpy", "nnx", "flax", "optax", "qwix", "torch", "F", "nn", "cuda", "PIL",
    "transformers", "diffusers", "ftfy", "os", "multihost_utils", "safetensors", "imageio", "httpx", "openai",
    "uvicorn", "pytest", "tpu", "scf", "functools", "math", "json", "subprocess", "sys", "Precision", "Device",
    "AutoencoderKLWan", "DPMSolverMultistepScheduler", "FBCHeadBlockHook", "FlowMatchEulerDiscreteScheduler",
    "LoraLayer", "MagCacheBlockHook", "UMT5Attention", "UMT5EncoderModel", "UMT5PreTrainedModel",
    "UniPCMultistepScheduler", "VaeImageProcessor", "VideoProcessor", "WanAttnProcessor", "WanLoraLoaderMixin",
    "WanRotaryPosEmbed", "WanTransformer3DModel", "WanTransformerBlock",
    "attn", "blocks", "condition_embedder", "decoder", "encoder", "ffn", "head", "resnets", "shared",
    "up_blocks", "X", "backend_config", "self", "cls",
})
# Words the prose uses for an instance (`pipe.run`, `state.step`): accepted when no module of that
# name resolves the rest.
INSTANCES = frozenset({"pipe", "args", "r", "remix", "preset", "jobs", "cross_kv", "text_states", "state",
                       "schedule", "scheduler", "solver", "config", "run", "compiled", "client", "latents", "recv",
                       "error", "OUT"})
# Last words of checkpoint keys (`lora_unet_blocks_0_self_attn_q.lora_down.weight`).
KEY_ENDINGS = frozenset({"weight", "bias", "alpha", "diff", "diff_b", "scale_shift_table", "modulation"})
# A span right after another project's name (diffusers `pipelines/wan/pipeline_wan.py`).
LIBRARY_BEFORE = re.compile(
    r"\b(diffusers|transformers|torch|PyTorch|peft|ComfyUI|Wan-Video|Wan|MLPerf|Self-Forcing)(?:'s?)?\W{0,3}$")
FILE_SUFFIXES = frozenset({"json", "py", "md", "png", "mp4", "safetensors", "txt", "yaml", "yml", "sh", "toml",
                           "pt", "bin", "npz", "jpg", "jpeg", "gif", "webm", "html", "csv", "log", "sqlite3",
                           "pth", "ckpt", "webp"})
SPAN = re.compile(r"`([^`\n]+)`")
DOTTED = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+")
PATH = re.compile(r"[\w.-]+(?:/[\w.-]+)*(?:\.py|/)|[\w.-]+(?:/[\w.-]+)+")


def _modules() -> dict[str, pathlib.Path]:
  """Dotted module name -> path, for every .py file under SCANNED."""
  out = {}
  for top in SCANNED:
    for path in [ROOT / top] if top.endswith(".py") else sorted((ROOT / top).rglob("*.py")):
      parts = list(path.relative_to(ROOT).with_suffix("").parts)
      if parts[-1] == "__init__":
        parts = parts[:-1]
      out[".".join(parts)] = path
  return out


MODULES = _modules()
COMPONENTS = tuple(f"{m}." for m in MODULES if (ROOT / m.replace(".", "/")).is_dir()
                   and m.rsplit(".", 1)[0] in ("pipelines.wan", "end_to_end"))
# The Markdown pages whose prose is checked the same way (outside their ``` blocks).
DOCS = ("*.md", "docs/**/*.md", "end_to_end/**/*.md")


def _top_level(body: list[ast.stmt]):
  """The statements of a module body, those inside top-level `if`, `try` and `with` too."""
  for node in body:
    yield node
    if isinstance(node, (ast.If, ast.Try, ast.With)):
      for block in (node.body, getattr(node, "orelse", []), getattr(node, "finalbody", []),
                    *(h.body for h in getattr(node, "handlers", []))):
        yield from _top_level(block)


def _targets(node: ast.stmt) -> list[str]:
  targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
      node, (ast.AnnAssign, ast.AugAssign)) else []
  names = []
  for target in targets:
    names += [n.id for n in ast.walk(target) if isinstance(n, ast.Name)]
  return names


@functools.cache
def _tree(path: pathlib.Path) -> ast.Module:
  return ast.parse(path.read_text(encoding="utf-8"))


@functools.cache
def _module_names(module: str) -> dict[str, ast.AST | None]:
  """A module's attributes: name -> its class or function node (None for any other kind)."""
  names: dict[str, ast.AST | None] = {}
  for node in _top_level(_tree(MODULES[module]).body):
    if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
      names[node.name] = node
    elif isinstance(node, (ast.Import, ast.ImportFrom)):
      names.update({(a.asname or a.name).split(".")[0]: None for a in node.names})
    else:
      for name in _targets(node):
        names.setdefault(name, None)
      if isinstance(node, ast.Assign) and _targets(node) in (["_HOMES"], ["__all__"]):
        names.update({n.value: None for n in ast.walk(node.value)
                      if isinstance(n, ast.Constant) and isinstance(n.value, str)})
  names.update({m.rsplit(".", 1)[1]: None for m in MODULES if "." in m and m.rsplit(".", 1)[0] == module})
  return names


@functools.cache
def _classes() -> dict[str, list[tuple[str, ast.ClassDef]]]:
  """Every top-level class of the product, by name: [(module, class)]."""
  out: dict[str, list[tuple[str, ast.ClassDef]]] = {}
  for module in MODULES:
    for name, node in _module_names(module).items():
      if isinstance(node, ast.ClassDef):
        out.setdefault(name, []).append((module, node))
  return out


def _members(module: str, cls: ast.ClassDef, seen: frozenset = frozenset()) -> set[str] | None:
  """The members of a class: what its body defines, what its methods set on `self`, what its
  product bases have; None when a base is another library's (any member may come from there)."""
  members = set()
  for node in cls.body:
    if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
      members.add(node.name)
    else:
      members.update(_targets(node))
  members |= {node.attr for node in ast.walk(cls) if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
              and isinstance(node.value, ast.Name) and node.value.id == "self"}
  for base in cls.bases:
    name = ast.unparse(base).split("[")[0].split(".")[-1]
    if name in ("object", "Generic", "Protocol") or name.endswith(("Error", "Exception")):
      continue
    homes = [(m, c) for m, c in _classes().get(name, []) if (m, c.name) not in seen]
    if not homes:
      return None
    for home, base_cls in homes:
      inherited = _members(home, base_cls, seen | {(module, cls.name)})
      if inherited is None:
        return None
      members |= inherited
  return members


def _has_member(module: str, cls: ast.ClassDef, name: str) -> bool:
  members = _members(module, cls)
  return members is None or name in members


def _resolves_in(module: str, rest: list[str]) -> bool:
  """Whether `rest` names something inside `module` (attribute, then class member)."""
  if not rest:
    return True
  names = _module_names(module)
  first = rest[0]
  if first in names:
    node = names[first]
    if f"{module}.{first}" in MODULES:
      return _resolves_in(f"{module}.{first}", rest[1:])
    if isinstance(node, ast.ClassDef) and len(rest) > 1:
      return _has_member(module, node, rest[1])
    return True
  # An instance of one of the module's classes (`request.seed`, `plan.mesh`).
  return any(isinstance(node, ast.ClassDef) and (members := _members(module, node)) is not None and first in members
             for node in names.values())


def _aliases(path: pathlib.Path) -> dict[str, str]:
  """The names a file imports, anywhere in it: alias -> the dotted name imported."""
  out = {}
  for node in ast.walk(_tree(path)):
    if isinstance(node, ast.Import):
      out.update({a.asname or a.name.split(".")[0]: a.name if a.asname else a.name.split(".")[0] for a in node.names})
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      out.update({a.asname or a.name: f"{node.module}.{a.name}" for a in node.names})
  return out


def _own_packages(path: pathlib.Path) -> list[str]:
  """The packages a file is in, innermost first, each with a trailing dot."""
  parts = list(path.relative_to(ROOT).parts[:-1]) if path.is_relative_to(ROOT) else []
  return [".".join(parts[:i]) + "." for i in range(len(parts), 0, -1)]


def _class_of(annotation: str) -> list[tuple[str, ast.ClassDef]]:
  """The product classes an annotation names (`GenerationRequest`, `"WanPipeline"`, `X | None`)."""
  names = [n.strip(" '\"") for n in annotation.split("|") if n.strip(" '\"") != "None"]
  return _classes().get(names[0], []) if len(names) == 1 else []


def resolves(name: str, path: pathlib.Path, parameters: dict[str, str] | None = None) -> bool:
  """Whether the dotted `name`, written in `path` where `parameters` (name -> annotation) are in
  scope, names a module, a module's attribute, a class's member or a parameter's attribute of the
  product (or is not the product's to check: FOREIGN, a file name)."""
  words = name.split(".")
  if words[0] in FOREIGN or words[-1] in FILE_SUFFIXES or words[-1] in KEY_ENDINGS:
    return True
  if parameters and words[0] in parameters:
    homes = _class_of(parameters[words[0]])
    return not homes or any(_has_member(module, cls, words[1]) for module, cls in homes)
  aliases = _aliases(path) if path.suffix == ".py" and path.exists() else {}
  if words[0] in aliases:
    imported = aliases[words[0]]
    if imported.split(".")[0] not in SCANNED:
      return True
    words = imported.split(".") + words[1:]
    name = ".".join(words)
  for prefix in (*(_own_packages(path)), *PREFIXES, *COMPONENTS):
    full = (prefix + name).split(".")
    for cut in range(len(full), 0, -1):
      module = ".".join(full[:cut])
      if module in MODULES:
        if cut > len(prefix.split(".")) - 1 and _resolves_in(module, full[cut:]):
          return True
        break
  classes = _classes().get(words[0], [])
  return any(_has_member(module, cls, words[1]) for module, cls in classes) or words[0] in INSTANCES


def path_exists(text: str, path: pathlib.Path) -> bool:
  """Whether the backticked path `text`, written in `path`, names a file or folder of the repository.

  A path is the repository's when its first folder is one at the root, in a folder above `path`
  (`bench/presets.py` in end_to_end/) or in pipelines/ (`pipeline/run/continued.py`); then it must
  exist there. A bare `name.py` must be a module of the product. Other paths (a Wan folder's
  `text_encoder/`, Wan-Video's `wan/modules/t5.py`, `multipart/form-data`) are not the
  repository's to check.
  """
  if "/" not in text:
    return any(p.name == text for p in MODULES.values())
  parts, text = text.split("/"), text.rstrip("/")
  if parts[0] == "wan" and not (ROOT / "pipelines/wan" / parts[1]).exists():  # Wan-Video's repository
    return True
  bases = [f for f in (ROOT, *path.parents) if f.is_relative_to(ROOT)] + [ROOT / "pipelines"]
  folders = [f for f in bases if (f / parts[0]).is_dir()]
  return not folders or any((folder / text).exists() for folder in folders)


def _parameters(node: ast.AST | None) -> dict[str, str]:
  """A function's parameters (a class's: its `__init__`'s), each with its annotation's text."""
  if isinstance(node, ast.ClassDef):
    node = next((n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
  if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
    return {}
  arguments = node.args
  every = [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs,
           *filter(None, (arguments.vararg, arguments.kwarg))]
  return {a.arg: ast.unparse(a.annotation) if a.annotation is not None else "" for a in every}


def _prose(text: str) -> list[tuple[int, str, dict[str, str]]]:
  """(line, text, the parameters in scope) of every docstring and comment of a Python source: a
  function's docstring and the comments inside it see its parameters."""
  tree = ast.parse(text)
  found, scopes = [], []
  for node in ast.walk(tree):
    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
      if not isinstance(node, ast.Module):
        scopes.append((node.lineno, node.end_lineno, node))
      first = node.body[0]
      if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        found.append((first.lineno, first.value.value, _parameters(node)))
  for tok in tokenize.generate_tokens(io.StringIO(text).readline):
    if tok.type == tokenize.COMMENT:
      line = tok.start[0]
      inside = [s for s in scopes if s[0] <= line <= s[1]]
      innermost = max(inside, key=lambda s: s[0])[2] if inside else None
      found.append((line, tok.string, _parameters(innermost)))
  return found


def _markdown_prose(text: str) -> list[tuple[int, str, dict[str, str]]]:
  """(line, text, no parameters) of every line of a Markdown page outside its ``` blocks."""
  found, fenced = [], False
  for number, line in enumerate(text.splitlines(), 1):
    if line.strip().startswith("```"):
      fenced = not fenced
    elif not fenced:
      found.append((number, line, {}))
  return found


def stale_names(path: pathlib.Path, text: str | None = None) -> list[str]:
  """Every backticked name or path in the prose of `path` (a Python module's docstrings and comments,
  or a Markdown page; or `text`, written as if there) that names nothing, as "file:line `name`"."""
  text = path.read_text(encoding="utf-8") if text is None else text
  where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
  stale = []
  for line, prose, parameters in (_markdown_prose(text) if path.suffix == ".md" else _prose(text)):
    for match in SPAN.finditer(prose):
      span = re.sub(r"\(.*\)$", "", match.group(1).strip())
      if LIBRARY_BEFORE.search(prose[:match.start()]):
        continue
      if span.endswith(".py") or "/" in span:
        if PATH.fullmatch(span) and not path_exists(span, path):
          stale.append(f"{where}:{line} `{span}`")
      elif DOTTED.fullmatch(span) and not resolves(span, path, parameters):
        stale.append(f"{where}:{line} `{span}`")
  return stale


def test_the_prose_names_what_the_code_has():
  pages = sorted({page for pattern in DOCS for page in ROOT.glob(pattern)})
  assert ROOT / "DESIGN.md" in pages and ROOT / "docs/usage.md" in pages, pages
  stale = [name for path in (*MODULES.values(), *pages) for name in stale_names(path)]
  assert not stale, f"{len(stale)} backticked names that name nothing (rename them):\n" + "\n".join(stale)


def test_positive_control_stale_names_are_reported():
  """A module that does not exist, a name a module lacks, a class's missing member, a missing file and
  a module the rooms moved are reported; what exists (by each route) and what is not ours are not."""
  home = ROOT / "pipelines/pipeline/run/decoding.py"
  text = ('"""See `pipelines.no_such_module` and `wan.vae.no_such_name`, `WanPipeline.no_such_method`,\n'
          '`pipelines/wan/vae/no_such.py` and `no_such_module.py`; but `pipelines.wan.vae.model`, `wan.vae`,\n'
          '`vae.decode`, `continued.run_continued`, `WanPipeline.quantize`, `run/continued.py`, `umt5.encode_text`,\n'
          '`jax.no_such_name`, `config.json` and diffusers\' `WanPipeline.check_inputs` name something or are not\n'
          'ours."""\n'
          "# `pipeline.continued` moved; `pipeline.run.continued`, `call_options.CALL_DOCS`; `no_such_module.f`\n"
          "# `pipeline/continued.py` moved; `pipeline/run/continued.py`; Wan-Video's `wan/modules/t5.py`\n"
          "def f(request: GenerationRequest):\n"
          '  """`request.seed`, `request.no_such_field`."""\n')
  where = home.relative_to(ROOT)
  assert stale_names(home, text) == [
      f"{where}:1 `{name}`" for name in (
          "pipelines.no_such_module", "wan.vae.no_such_name", "WanPipeline.no_such_method",
          "pipelines/wan/vae/no_such.py", "no_such_module.py")] + [
      f"{where}:9 `request.no_such_field`", f"{where}:6 `pipeline.continued`", f"{where}:6 `no_such_module.f`",
      f"{where}:7 `pipeline/continued.py`"]
