"""The command line around Hydra: what ``python -m bstrain`` does to argv before Hydra parses it,
and how it reports a user's error after.

Before (:func:`rewrite`): ``config=PATH.yaml`` becomes a config Hydra can find; a sample prompt
goes through a temporary file; the value of a path key (``data.path=~/src/**/*.py``) has ``~``
expanded and is quoted for Hydra's override grammar; ``trainer.resume`` without ``config=``
composes on the config saved in the checkpoint it resumes, once its ``_target_``s are trusted
(bstrain/train/trust.py); ``trainer.run_dir`` and ``hydra.run.dir`` name the same directory.

After (:func:`one_line`): a misspelled key, a value of the wrong type, an override Hydra cannot
parse or a :class:`bstrain.errors.UserError` become one line naming the key; None means a bug.
A user's ``_target_`` model section lists only some of its constructor's arguments, so Hydra
refuses ``model.NAME=VALUE`` for another one: :func:`with_constructor_argument` gives the command
line again with ``+model.NAME=VALUE`` when the constructor takes NAME, and :func:`one_line` names
the closest argument when it does not.
"""
from __future__ import annotations

import atexit
import enum
import os
import re
import shutil
import tempfile
import typing
from pathlib import Path

from bstrain.train.rundir import _quoted, quote_path  # (the launcher quotes the run dir alike)

CONFIGS = Path(__file__).parent / "configs"

PATH_KEYS = frozenset({"data.path", "trainer.run_dir", "trainer.resume", "hydra.run.dir", "ckpt", "data_path",
                       "prompt_file", "out"})
"""Keys whose values are file or directory names: ``~`` expanded, quoted when Hydra would not parse them."""

_FALSE = ("false", "none", "null", "", "0")


class UsageError(Exception):
    """A one-line problem with the command line itself, found before Hydra runs."""


def experiments() -> list[str]:
    return sorted(p.stem for p in (CONFIGS / "config").glob("*.yaml"))


def _search_path_config(name: str, text: str) -> list[str]:
    """A temporary search path holding config/NAME.yaml; the overrides that select it."""
    root = tempfile.mkdtemp(prefix="bstrain-config-")
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    os.makedirs(os.path.join(root, "config"))
    Path(root, "config", name + ".yaml").write_text(text, encoding="utf-8")
    return [f"config={name}", f"hydra.searchpath=[file://{root}]"]


def _user_yaml(path: str) -> list[str]:
    """config=PATH.yaml -> config=NAME on a temporary search path holding config/NAME.yaml.

    The copy gets ``# @package _global_`` when the file has no package line, so a plain YAML of
    top-level sections (model:, data:, trainer: ...) works as written.
    """
    if not os.path.isfile(path):
        raise UsageError(f"config: no such file {path}")
    # a name of its own, so it can't be shadowed by a shipped experiment of the same name
    name = "user_" + os.path.splitext(os.path.basename(path))[0]
    text = Path(path).read_text(encoding="utf-8")
    if not any(line.startswith("# @package") for line in text.splitlines()[:3]):
        text = "# @package _global_\n" + text
    return _search_path_config(name, text)


def _prompt_file(value: str) -> str:
    """A sample prompt, any characters, passed to the command through a temporary file: Hydra's
    override parser would drop trailing spaces, unescape backslashes and resolve ``${...}``."""
    fd, path = tempfile.mkstemp(prefix="bstrain-prompt-", suffix=".txt")
    atexit.register(os.unlink, path)
    with os.fdopen(fd, "wb") as f:
        f.write(os.fsencode(value))                     # the bytes the shell passed, undecodable ones too
    return path


# --- trainer.resume: the saved config ----------------------------------------------------------------
def _builtin_option(group: str, node: dict) -> str | None:
    """The config-group option (model=lstm, data=bytes ...) whose schema builds ``node``'s _target_."""
    from bstrain.configs.schema import GROUP_SCHEMAS
    target = (node or {}).get("_target_")
    return next((name for (g, name), schema in GROUP_SCHEMAS.items() if g == group and schema._target_ == target),
                None)


def _sections(saved: dict) -> dict:
    """The sections of a saved config that a train config has (model, data, task, optim ...), and
    nothing else: no ``defaults`` list, ``hydra`` settings or ``trust`` of the checkpoint's author."""
    import dataclasses

    from bstrain.configs.schema import TrainConfig
    return {f.name: saved[f.name] for f in dataclasses.fields(TrainConfig) if f.name in saved and f.name != "trust"}


def _resumed_config(saved: dict) -> str:
    """An experiment YAML that rebuilds a checkpoint's config: its group options (so the schemas
    type and check its keys again), then its values. The run directory comes from this command."""
    from omegaconf import OmegaConf
    saved = _sections(saved)
    defaults = [{"/model": m}] if (m := _builtin_option("model", saved.get("model"))) else []
    defaults += [{f"override /{g}": _builtin_option(g, saved.get(g))} for g in ("data", "task")]
    trainer = {**saved.get("trainer", {}), "run_dir": None, "resume": "false"}
    return "# @package _global_\n" + OmegaConf.to_yaml({"defaults": defaults, **saved, "trainer": trainer})


def _check_trust(saved: dict, path, args: dict[str, str]) -> None:
    """A resume on a checkpoint's config builds its ``_target_``s: each must be bstrain's, set on
    this command line (``model._target_=...``) or matched by its ``trust=[...]`` (bstrain/train/trust.py)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from bstrain.train import trust
    value = args.get("trust")
    trusted = trust.globs(OverridesParser.create().parse_override(f"trust={value}").value()) if value else []
    overridden = {k.lstrip("+~") for k in args if k.endswith("._target_")}
    trust.check_config(_sections(saved), path, trusted, overridden)


def _resume_config(args: dict[str, str]) -> list[str]:
    """``trainer.resume`` without ``config=``: the overrides that compose on the config saved in the
    checkpoint it resumes (the command line's own overrides then apply on top); [] when there is
    none to find (the trainer then says what is missing)."""
    value = args.get("trainer.resume", "false")
    if value.lower() in _FALSE:
        return []
    if value.lower() in ("true", "1"):
        value = args.get("hydra.run.dir") or args.get("trainer.run_dir") or ""
        if not value:
            return []
    from bstrain.train.checkpoint import find_checkpoint, saved_config
    path = find_checkpoint(os.path.expanduser(value))
    saved = saved_config(path) if path is not None else None
    if not isinstance(saved, dict) or "_target_" not in (saved.get("model") or {}):
        return []                                        # a checkpoint from before _target_ configs
    _check_trust(saved, path, args)
    return _search_path_config("resumed_run", _resumed_config(saved))


def rewrite(command: str, argv: list[str]) -> list[str]:
    """The command line Hydra gets (see the module's docstring)."""
    out: list[str] = []
    for arg in argv:
        key, eq, value = arg.partition("=")
        if key == "config" and eq:
            if value.endswith((".yaml", ".yml")) or os.sep in value:
                out += _user_yaml(value)
                continue
            if command == "train" and value not in experiments():
                raise UsageError(f"config: no experiment named {value!r}; shipped: {', '.join(experiments())}; or "
                                 f"pass the path of a YAML file")
        if key == "prompt" and eq and command == "sample":
            if any(a.startswith("prompt_file=") for a in argv):
                raise UsageError("prompt, prompt_file: give one of them")
            arg = "prompt_file=" + _prompt_file(value)
        elif key in PATH_KEYS and eq:
            arg = f"{key}={quote_path(value)}"
        elif eq and "," in value and value[:1] not in ("'", '"', "[", "{") and string_key(key):
            arg = f"{key}={_quoted(value)}"          # a string with commas, not a list or a sweep
        out.append(arg)
    if command == "train":
        raw = {k: v for k, eq, v in (a.partition("=") for a in argv) if eq}
        out += _one_run_dir(raw)
        if "config" not in raw:
            out = _resume_config(raw) + out
    return out


def string_key(key: str) -> bool:
    """Whether a schema types ``key`` (``section.field``; a built-in option's model, data or task
    field, or an optim, trainer or sparsity one) as a string: Hydra would read its comma value
    (``model.attention=strided,fixed``) as a list or a sweep."""
    from bstrain.configs import schema
    section, _, name = key.lstrip("+~").partition(".")
    nodes = [node for (group, _), node in schema.GROUP_SCHEMAS.items() if group == section]
    nodes += {"optim": [schema.OptimConfig], "trainer": [schema.TrainerConfig],
              "sparsity": [schema.SparsityConfig]}.get(section, [])
    return any(typing.get_type_hints(node).get(name) in (str, typing.Optional[str]) for node in nodes)


def _one_run_dir(raw: dict[str, str]) -> list[str]:
    """hydra.run.dir for trainer.run_dir or the other way round; a UsageError when both differ."""
    runs = {k: raw[k] for k in ("trainer.run_dir", "hydra.run.dir") if k in raw}
    same = {os.path.abspath(os.path.expanduser(v)) for v in runs.values()}
    if len(same) > 1:
        raise UsageError(f"trainer.run_dir={runs['trainer.run_dir']} and hydra.run.dir={runs['hydra.run.dir']}: "
                         f"one run has one directory; give one of them")
    if len(runs) == 1:
        (key, value), = runs.items()
        return [f"{'hydra.run.dir' if key == 'trainer.run_dir' else 'trainer.run_dir'}={quote_path(value)}"]
    return []


# --- errors in one line ---------------------------------------------------------------------------------
def one_line(exc: BaseException) -> str | None:
    """The line that states a user's error (without ``error:``), or None for a bug."""
    from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
    from omegaconf.errors import OmegaConfBaseException

    from bstrain.errors import UserError
    if isinstance(exc, (UserError, UsageError)):
        return " ".join(str(exc).split())
    if isinstance(exc, OverrideParseException):
        key, eq, value = exc.override.partition("=")
        if not eq:
            return f"{exc.override}: expected key=value"
        return (f"{exc.override}: Hydra cannot parse this key=value; quote the value, e.g. "
                f"\"{key}='{value}'\"")
    if isinstance(exc, MissingConfigException) and exc.missing_cfg_file:
        group, _, name = exc.missing_cfg_file.rpartition("/")
        options = sorted(o for o in (exc.options or []) if not o.startswith("base_"))
        return f"{group}={name}: no such option; options: {', '.join(options)}" if group else " ".join(
            str(exc).split())
    if isinstance(exc, ConfigCompositionException) and "Ambiguous value for argument" in str(exc):
        override = str(exc).split("argument '", 1)[1].split("'", 1)[0]
        key, _, value = override.partition("=")
        return (f"{override}: Hydra reads a comma value as a list or a sweep; for the string, quote it: "
                f"\"{key}='{value}'\"; for a list: {key}=[{value}]")
    if isinstance(exc, ConfigCompositionException):
        cause = exc.__cause__
        if isinstance(cause, OmegaConfBaseException) and getattr(cause, "full_key", None):
            found = _user_model_key(cause)
            return _omegaconf_line(cause) if found is None else _constructor_line(cause, *found, _added(exc))
        return " ".join(str(exc).split())
    return None


def _omegaconf_line(exc) -> str:
    """A key that does not exist, or a value its field's type rejects, in one line."""
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

    from bstrain.configs.schema import did_you_mean
    if isinstance(exc, (ConfigAttributeError, ConfigKeyError)) and exc.parent_node is not None:
        return f"{exc.full_key}: no such key{did_you_mean(exc.full_key, exc.parent_node)}"
    if isinstance(exc, ValidationError):
        want = _expected(exc)
        if want:
            return f"{exc.full_key}: expected {want}, got {exc.value!r}"
    return f"{exc.full_key}: {str(exc.msg).splitlines()[0]}"


def _expected(exc) -> str | None:
    """What the field ``exc.key`` of a typed node takes, from its dataclass."""
    import dataclasses

    from omegaconf import OmegaConf
    kind = OmegaConf.get_type(exc.parent_node) if exc.parent_node is not None else None
    if not (kind and dataclasses.is_dataclass(kind)):
        return None
    return type_expectation(typing.get_type_hints(kind).get(str(exc.key)), str(exc.key))


def type_expectation(tp, key: str = "") -> str | None:
    """'one of fp32, fp16, bf16', 'an integer', 'a number or null' ... for a schema field's type."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if args and type(None) in typing.get_args(tp):
        inner = type_expectation(args[0], key)
        return f"{inner} or null" if inner else None
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return "one of " + ", ".join(m.value for m in tp)
    names = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
    if tp in names:
        return names[tp]
    return f"the {key} section's keys, as {key}.KEY=VALUE" if key and isinstance(tp, type) else None


# --- a user's model: its constructor's arguments on the command line --------------------------------------
def _user_model_key(exc) -> tuple[str, str] | None:
    """(NAME, the model's _target_) when ``exc`` is OmegaConf refusing ``model.NAME=...`` because a
    user's model section (a plain mapping with a _target_, not a shipped model's schema) lacks NAME."""
    from omegaconf import OmegaConf
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError
    if not isinstance(exc, (ConfigAttributeError, ConfigKeyError)) or exc.parent_node is None:
        return None
    section, _, name = str(exc.full_key).rpartition(".")
    node = exc.parent_node
    if section != "model" or OmegaConf.get_type(node) is not dict or "_target_" not in node:
        return None
    return name, str(node._get_node("_target_")._value())


def _arguments(target: str) -> tuple[list[str], bool] | None:
    """(the keyword arguments the class or function ``target`` names, whether it takes any
    ``**kwargs``); None when it cannot be imported or has no signature."""
    import inspect

    from hydra._internal.utils import _locate      # what instantiate() calls (hydra.utils.get_object logs failures)
    try:
        params = list(inspect.signature(_locate(target)).parameters.values())
    except Exception:           # not importable from here, or no signature: the error then says how to add one
        return None
    named = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    return named, any(p.kind is p.VAR_KEYWORD for p in params)


def _takes(target: str, name: str) -> bool:
    from bstrain.train.fsdp import SHARD_KEY
    found = _arguments(target)
    return name == SHARD_KEY or found is not None and (name in found[0] or found[1])


def with_constructor_argument(exc, args: list[str]) -> list[str] | None:
    """``args`` with ``model.NAME=VALUE`` written ``+model.NAME=VALUE`` when Hydra refused it (``exc``)
    because a user's model section lacks NAME, and the model's constructor takes NAME (an argument
    its YAML leaves at its default); else None. A shipped model's misspelt keys stay errors."""
    found = _user_model_key(exc.__cause__)
    if found is None or not _takes(found[1], found[0]):
        return None
    key = f"model.{found[0]}"
    if not any(a.partition("=")[0] == key for a in args):
        return None
    return ["+" + a if a.partition("=")[0] == key else a for a in args]


def _added(exc) -> str | None:
    """The ``+key=value`` Hydra's message proposes for an override of a key the config lacks."""
    found = re.search(r"use (\+\S.*)$", str(exc))
    return found.group(1) if found else None


def _constructor_line(exc, name: str, target: str, added: str | None) -> str:
    """``model.NAME=...`` that a user's model does not take: the closest of its section's keys and its
    constructor's arguments, or how to add an argument when its constructor cannot be inspected."""
    import difflib
    found = _arguments(target)
    params = found[0] if found is not None else []
    known = [str(k) for k in exc.parent_node.keys() if str(k) != name] + [p for p in params if p not in exc.parent_node]
    close = difflib.get_close_matches(name, known, n=1)
    line = f"{exc.full_key}: no such key" + (f"; did you mean model.{close[0]}?" if close else "")
    if found is None:
        return line + f"; to add a constructor argument of {target}, write {added or '+' + exc.full_key + '=VALUE'}"
    return line if close else line + f"; {target} takes {', '.join(params) or 'no arguments'}"
