"""Load a Config: YAML files with `extends:` chains, ${ENV} interpolation, dotted overrides.

Order of application (later wins): the files of an `extends:` chain (depth first, a list
in order), the file's own keys, then command-line overrides ``section.key=value``. Every
dotted key remembers where its value came from (a file, ``preset NAME`` or ``command
line``) so that errors can say which input to fix. ``model.from_hf: DIR`` then supplies
the architecture keys from a Hugging Face checkpoint (``apply_from_hf``). After merging,
values are checked against the annotations of ``moetrain.config.schema`` with exact types
(``coerce``) and then ``Config.check()`` validates cross-field consistency.

YAML is read with YAML 1.2 scalar rules rather than PyYAML's 1.1 defaults, because the
1.1 rules surprise people writing training configs: ``lr: 1e-3`` would be a string,
``yes``/``off`` booleans, ``010`` an octal 8 and ``1:30`` a base-60 integer.

Imports no torch.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import types
import typing
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from moetrain.config.schema import SECTIONS, VALUE_RANGES, Config
from moetrain.errors import ConfigError

PRESET_DIR = Path(__file__).resolve().parent / "presets"
DEFAULT_PRESET = "tiny"
COMMAND_LINE = "command line"
DEFAULT_SOURCE = "default"


# ---- YAML dialect -------------------------------------------------------------------------

_FLOAT = re.compile(
    r"""^(?:[-+]?(?:[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |\.[0-9][0-9_]*(?:[eE][-+]?[0-9]+)?
    |[0-9][0-9_]*[eE][-+]?[0-9]+)
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""",
    re.VERBOSE,
)
_INT = re.compile(r"^(?:[-+]?(?:0|[1-9][0-9_]*)|0x[0-9a-fA-F_]+)$")
_BOOL = re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$")
_NULL = re.compile(r"^(?:~|null|Null|NULL|)$")


def _install_resolvers(cls) -> None:
    """YAML 1.2 core-schema implicit types (plus `<<` merge keys) on a Loader/Dumper class."""
    cls.yaml_implicit_resolvers = {}
    cls.add_implicit_resolver("tag:yaml.org,2002:bool", _BOOL, list("tTfF"))
    cls.add_implicit_resolver("tag:yaml.org,2002:int", _INT, list("-+0123456789"))
    cls.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT, list("-+0123456789."))
    cls.add_implicit_resolver("tag:yaml.org,2002:null", _NULL, ["~", "n", "N", ""])
    cls.add_implicit_resolver("tag:yaml.org,2002:merge", re.compile(r"^<<$"), ["<"])


class _Loader(yaml.SafeLoader):
    def construct_mapping(self, node, deep=False):
        # PyYAML silently keeps the last of duplicate keys; in a config that hides mistakes.
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(key_node, yaml.ScalarNode):
                continue
            if key_node.value in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key_node.value!r}", key_node.start_mark)
            seen.add(key_node.value)
        return super().construct_mapping(node, deep=deep)


class _Dumper(yaml.SafeDumper):
    pass


def _represent_list(dumper, data):
    # Block style for sections, flow style for list values: `recompute_layer_ids: [0, 1]`.
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=True)


_Dumper.add_representer(list, _represent_list)


_install_resolvers(_Loader)
_install_resolvers(_Dumper)  # so strings that would read back as numbers/bools get quoted


def _yaml_error(label: str, err: yaml.YAMLError) -> ConfigError:
    mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
    problem = getattr(err, "problem", None) or str(err)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return ConfigError(f"invalid YAML in {label}{where}: {problem}")


def parse_yaml_value(text: str) -> Any:
    """Parse one override/env value as YAML; text that is not valid YAML stays a string."""
    if text.strip() == "":
        return text
    try:
        return yaml.load(text, Loader=_Loader)
    except yaml.YAMLError:
        return text


# ---- presets ------------------------------------------------------------------------------

def list_presets() -> list[str]:
    """Names of the built-in presets (moetrain/config/presets/NAME.yaml)."""
    if not PRESET_DIR.is_dir():
        return []
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def preset_path(name: str) -> Path:
    path = PRESET_DIR / f"{name}.yaml"
    if not path.is_file():
        names = list_presets()
        close = difflib.get_close_matches(name, names, n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        raise ConfigError(f"unknown preset {name!r}{hint} (available: {', '.join(names) or 'none'})")
    return path


def _label(path: Path, shown: str) -> str:
    """How a file is named in messages: 'preset NAME' for built-ins, else the path as written."""
    try:
        if path.resolve().parent == PRESET_DIR:
            return f"preset {path.stem}"
    except OSError:
        pass
    return shown


# ---- reading files, extends, interpolation -------------------------------------------------

_ENV = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::([^}]*))?\}")


def _interpolate(value: Any, label: str, key: str) -> Any:
    """Replace ${NAME} / ${NAME:default} in string values (recursively)."""
    if isinstance(value, dict):
        return {k: _interpolate(v, label, f"{key}.{k}" if key else str(k)) for k, v in value.items()}
    if isinstance(value, list):
        return [_interpolate(v, label, key) for v in value]
    if not isinstance(value, str) or "${" not in value:
        return value

    def lookup(match: re.Match) -> str:
        name, default = match.group(1), match.group(2)
        if name in os.environ:
            return os.environ[name]
        if default is not None:
            return default
        raise ConfigError(
            f"environment variable {name} is not set (used by {key} in {label}); "
            f"set it or write ${{{name}:default}}")

    whole = _ENV.fullmatch(value)
    if whole:
        # A value that is exactly one ${...} takes the YAML type of the substituted text,
        # so `steps: ${STEPS:100}` stays an int.
        return parse_yaml_value(lookup(whole))
    return _ENV.sub(lookup, value)


def _read_yaml(path: Path, label: str) -> dict:
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {label}") from None
    except OSError as err:
        raise ConfigError(f"cannot read config file {label}: {err.strerror or err}") from None
    try:
        data = yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as err:
        raise _yaml_error(label, err) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{label}: expected a mapping of sections (model:, moe:, train:, ...) at the top level; "
            f"got {type(data).__name__}")
    return data


def _leaves(data: Any, prefix: str) -> Iterable[str]:
    """Dotted paths of the leaves of a nested dict (an empty dict counts as a leaf)."""
    if isinstance(data, dict) and data:
        for k, v in data.items():
            yield from _leaves(v, f"{prefix}.{k}" if prefix else str(k))
    elif prefix:
        yield prefix


def _deep_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = v
    return out


class ResolvedConfig:
    """A merged raw config (nested dicts) and the source of every dotted key."""

    def __init__(self) -> None:
        self.data: dict = {}
        self.sources: dict[str, str] = {}
        # Keys set by the default preset that nobody asked for (no file, no --preset): their
        # sources, so that model.from_hf may replace them (see apply_from_hf).
        self.implicit: dict[str, str] = {}

    def is_explicit(self, key: str) -> bool:
        """Whether the user's inputs set ``key`` (a file, a chosen preset or the command line)."""
        section, _, name = key.partition(".")
        value = self.data.get(section)
        if not isinstance(value, dict) or name not in value:
            return False
        return key not in self.implicit or self.sources.get(key) != self.implicit[key]

    def apply(self, data: dict, source: str) -> None:
        self.data = _deep_merge(self.data, data)
        for key in _leaves(data, ""):
            self.sources[key] = source

    def source_of(self, key: str) -> str:
        # The key itself, or the closest parent that was set as a whole (e.g. a section).
        parts = key.split(".")
        for i in range(len(parts), 0, -1):
            src = self.sources.get(".".join(parts[:i]))
            if src is not None:
                return src
        # A section that was only ever set key by key: where its keys came from.
        for k, src in self.sources.items():
            if k.startswith(key + "."):
                return src
        return DEFAULT_SOURCE


def _resolve_extends(ref: Any, base: Path, base_shown: str, label: str) -> tuple[Path, str, str]:
    """An `extends:` entry: a path relative to the extending file, or a preset name.

    Returns the file, its label for messages and how its path is shown (relative to what
    the user wrote for the extending file).
    """
    if not isinstance(ref, str) or not ref:
        raise ConfigError(f"{label}: extends must be a file path, a preset name or a list of them; got {ref!r}")
    path = Path(ref) if os.path.isabs(ref) else base.parent / ref
    shown = ref if os.path.isabs(ref) else os.path.normpath(os.path.join(os.path.dirname(base_shown), ref))
    if path.is_file():
        return path, _label(path, shown), shown
    preset = PRESET_DIR / f"{ref}.yaml"
    if preset.is_file():
        return preset, f"preset {ref}", str(preset)
    names = list_presets()
    raise ConfigError(
        f"{label}: extends {ref!r}: no such file ({shown}) and no preset of that name "
        f"(presets: {', '.join(names) or 'none'})")


def _load_file(path: Path, label: str, shown: str, out: ResolvedConfig, stack: list[tuple[str, str]]) -> None:
    """Apply `path` (its extends chain first, then its own keys) onto `out`."""
    ident = os.path.realpath(path)
    if any(ident == seen for seen, _ in stack):
        chain = " -> ".join([lbl for _, lbl in stack] + [label])
        raise ConfigError(f"extends cycle: {chain}")
    stack = stack + [(ident, label)]

    data = _interpolate(_read_yaml(path, label), label, "")
    parents = data.pop("extends", None)
    # `moe:` with everything under it commented out is an empty section, not "erase moe".
    data = {k: ({} if v is None else v) for k, v in data.items()}
    if parents is not None:
        for ref in parents if isinstance(parents, list) else [parents]:
            _load_file(*_resolve_extends(ref, path, shown, label), out, stack)
    out.apply(data, label)


def _parse_override(text: str) -> dict:
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r}: expected section.key=value (e.g. moe.topk=2)")
    value: Any = parse_yaml_value(raw)
    for part in reversed(key.split(".")):
        value = {part: value}
    return value


def resolve(path: str | None = None, preset: str | None = None, overrides: Iterable[str] = ()) -> ResolvedConfig:
    """Merge files/preset and overrides into nested dicts with per-key sources (no validation)."""
    if path is not None and preset is not None:
        raise ConfigError("give either a config file or a preset, not both")
    out = ResolvedConfig()
    if path is not None:
        _load_file(Path(path), _label(Path(path), str(path)), str(path), out, [])
    else:
        p = preset_path(preset or DEFAULT_PRESET)
        _load_file(p, f"preset {p.stem}", str(p), out, [])
        if preset is None:
            out.implicit = dict(out.sources)
    for text in overrides:
        out.apply(_parse_override(text), COMMAND_LINE)
    return out


# ---- validation ---------------------------------------------------------------------------

def _show(value: Any) -> str:
    """A value as the user would write it in YAML (strings quoted so their type is visible)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "a mapping"
    return repr(value)


def _is_union(tp: Any) -> bool:
    return typing.get_origin(tp) is Union or isinstance(tp, types.UnionType)


def describe(tp: Any) -> str:
    """Human name of a schema annotation: 'int', 'int or null', 'one of a, b', 'list of int'."""
    if _is_union(tp):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return " or ".join(describe(a) for a in args) + " or null"
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(str(c) for c in typing.get_args(tp))
    if origin is list:
        (item,) = typing.get_args(tp)
        return f"list of {describe(item)}"
    return getattr(tp, "__name__", str(tp))


class _Mismatch(Exception):
    pass


def _coerce(value: Any, tp: Any) -> Any:
    if _is_union(tp):
        if value is None and type(None) in typing.get_args(tp):
            return None
        for arg in typing.get_args(tp):
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg)
            except _Mismatch:
                pass
        raise _Mismatch
    origin = typing.get_origin(tp)
    if origin is Literal:
        # Compare types too: True == 1 must not select a choice.
        for choice in typing.get_args(tp):
            if type(value) is type(choice) and value == choice:
                return value
        raise _Mismatch
    if origin is list:
        (item,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise _Mismatch
        return [_coerce(v, item) for v in value]
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise _Mismatch
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _Mismatch
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise _Mismatch
    if tp is str:
        if isinstance(value, str):
            return value
        raise _Mismatch
    raise TypeError(f"unsupported annotation in the config schema: {tp!r}")  # a schema bug


def _literal_choices(tp: Any) -> list[str]:
    if _is_union(tp):
        return [c for a in typing.get_args(tp) for c in _literal_choices(a)]
    if typing.get_origin(tp) is Literal:
        return [str(c) for c in typing.get_args(tp)]
    return []


def coerce(value: Any, tp: Any, key: str, source: str) -> Any:
    """Check `value` against annotation `tp` exactly (floats accept ints); ConfigError if not."""
    try:
        return _coerce(value, tp)
    except _Mismatch:
        pass
    expected = "bool (true or false)" if tp is bool else describe(tp)
    msg = f"{key}: expected {expected}; got {_show(value)} (from {source})"
    if isinstance(value, str):
        close = difflib.get_close_matches(value, _literal_choices(tp), n=1)
        if close:
            msg += f"; did you mean {close[0]}?"
    elif value is not None and not isinstance(value, (dict, list)) and "str" in describe(tp).split(" or "):
        msg += f"; quote it for a string: '{value}'"
    raise ConfigError(msg)


def _all_keys() -> list[str]:
    return [f"{s}.{f.name}" for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)]


def _unknown_key(key: str, source: str) -> ConfigError:
    section, _, name = key.partition(".")
    if not name:  # a top-level key that is not a section
        close = difflib.get_close_matches(key, list(SECTIONS), n=1)
        if not close:  # maybe a key written without its section (`topk: 2` instead of `moe: {topk: 2}`)
            close = [k for k in _all_keys() if k.split(".")[1] == key][:1]
        hint = f"did you mean {close[0]}?" if close else f"valid sections: {', '.join(SECTIONS)}"
        return ConfigError(f"unknown section {key} (from {source}); {hint}")
    names = [f.name for f in dataclasses.fields(SECTIONS[section])]
    close = [f"{section}.{c}" for c in difflib.get_close_matches(name, names, n=1)]
    if not close:  # the right key in the wrong section?
        close = [k for k in _all_keys() if k.split(".")[1] == name][:1]
    if not close:  # a misspelt key in the wrong section: compare names, not "section." prefixes
        by_name = {k.split(".")[1]: k for k in reversed(_all_keys())}
        close = [by_name[c] for c in difflib.get_close_matches(name, list(by_name), n=1)]
    hint = f"did you mean {close[0]}?" if close else "see `moetrain config show --doc` for the valid keys"
    return ConfigError(f"unknown key {key} (from {source}); {hint}")


_KEY_IN_MESSAGE = re.compile(r"\b(?:" + "|".join(SECTIONS) + r")\.[A-Za-z_][A-Za-z0-9_]*")


def build(resolved: ResolvedConfig) -> Config:
    """Turn merged raw dicts into a validated Config (types, then Config.check())."""
    sections = {}
    for name, value in resolved.data.items():
        if name not in SECTIONS:
            raise _unknown_key(str(name), resolved.source_of(str(name)))
        if not isinstance(value, dict):
            raise ConfigError(
                f"{name}: expected a mapping of {name}.* keys; got {_show(value)} (from {resolved.source_of(name)})")
        cls = SECTIONS[name]
        hints = typing.get_type_hints(cls)
        kwargs = {}
        for key, raw in value.items():
            dotted = f"{name}.{key}"
            if key not in hints:
                raise _unknown_key(dotted, resolved.source_of(dotted))
            kwargs[key] = coerce(raw, hints[key], dotted, resolved.source_of(dotted))
        sections[name] = cls(**kwargs)
    cfg = Config(**sections)
    try:
        cfg.check()
    except ConfigError as err:
        # check() names the keys; add where the non-default ones came from.
        valid = set(_all_keys())
        keys = [k for k in dict.fromkeys(_KEY_IN_MESSAGE.findall(str(err))) if k in valid]
        where = [f"{k} from {resolved.source_of(k)}" for k in keys if resolved.source_of(k) != DEFAULT_SOURCE]
        if where:
            raise ConfigError(f"{err} ({', '.join(where)})") from None
        raise
    return cfg


def load_config(path: str | None = None, preset: str | None = None, overrides: Iterable[str] = ()) -> Config:
    """Load and validate a Config from a YAML file or a preset (default: the `tiny` preset).

    ``overrides`` are ``section.key=value`` strings; values are parsed as YAML.
    Raises ConfigError naming the key or file and its source on any user mistake.
    """
    resolved = resolve(path, preset, overrides)
    apply_from_hf(resolved)
    return build(resolved)


# ---- model.from_hf ------------------------------------------------------------------------

def _same(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool) or not isinstance(a, (int, float)) or not isinstance(b, (int, float)):
        return type(a) is type(b) and a == b
    return math.isclose(a, b, rel_tol=1e-12)


def apply_from_hf(resolved: ResolvedConfig) -> None:
    """``model.from_hf: DIR``: every architecture key (the model.*/moe.* keys that shape the
    network) comes from DIR/config.json (or the config.yaml of a `moetrain convert` output), on
    top of the schema defaults. A key that a file, a chosen preset or the command line sets to a
    different value is a ConfigError naming both values and sources; keys of the default preset
    (used when no config is given) are replaced silently. ``model.mtp_num_layers: 0`` is allowed
    (drops the MTP weights). Soft hints (name, init_std, aux loss) fill keys nobody set.
    """
    model = resolved.data.get("model")
    if not isinstance(model, dict) or not isinstance(model.get("from_hf"), str):
        return  # unset, null, or a type error that build() reports
    directory = model["from_hf"]
    where = f"model.from_hf = {directory!r} (from {resolved.source_of('model.from_hf')})"
    if not os.path.isdir(directory):
        raise ConfigError(f"{where}: no such directory")
    from moetrain.errors import UserError
    from moetrain.models.hf_config import source_arch

    try:
        arch, hints, label = source_arch(directory)
    except UserError as err:
        raise ConfigError(f"{where}: {err}") from None
    take: dict = {}
    for key, value in arch.items():
        if not resolved.is_explicit(key):
            take[key] = value
            continue
        section, name = key.split(".")
        source = resolved.source_of(key)
        try:
            mine = coerce(resolved.data[section][name], typing.get_type_hints(SECTIONS[section])[name], key, source)
        except ConfigError:
            continue  # build() reports the type error
        if _same(mine, value) or (key == "model.mtp_num_layers" and mine == 0):
            continue
        raise ConfigError(
            f"{key} = {_show(mine)} (from {source}) conflicts with the architecture of model.from_hf: "
            f"{label} gives {_show(value)}; remove {key} or set it to {_show(value)}")
    take.update({k: v for k, v in hints.items() if not resolved.is_explicit(k)})
    nested: dict = {}
    for key, value in take.items():
        section, name = key.split(".")
        nested.setdefault(section, {})[name] = value
    resolved.apply(nested, label)


# ---- output -------------------------------------------------------------------------------

def dump_config(cfg: Config) -> str:
    """The resolved config as YAML, sections and keys in schema order; load_config reads it back."""
    text = yaml.dump(cfg.to_dict(), Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=10**6)
    # A blank line before each section header (every unindented line but the first).
    return re.sub(r"\n(?=\S)", "\n\n", text)


def _yaml_scalar(value: Any) -> str:
    return yaml.dump(value, Dumper=_Dumper, default_flow_style=True).strip().removesuffix("...").strip()


def config_docs() -> str:
    """Every key with its type, default and one-line doc, grouped by section."""
    lines = []
    for name, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        lines.append(f"{name}:")
        defaults = cls()
        for f in dataclasses.fields(cls):
            default = _yaml_scalar(getattr(defaults, f.name))
            valid = VALUE_RANGES.get(f"{name}.{f.name}")
            where = f" ({valid})" if valid is not None else ""
            lines.append(f"  {name}.{f.name}: {describe(hints[f.name])}{where} = {default}")
            lines.append(f"      {f.metadata.get('doc', '')}")
        lines.append("")
    return "\n".join(lines)
