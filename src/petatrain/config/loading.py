"""Reading a job config: YAML in (no aliases, no repeated keys), `--set a.b=c` overrides on top,
built into the schema's dataclasses with unknown keys and wrong types named in one line."""

import dataclasses
import math
import reprlib
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from petatrain.config.schema import SECRET_STORAGE_KEYS, JobConfig
from petatrain.errors import ConfigError


def build(cls: type, values: dict[str, Any], prefix: str = "") -> Any:
    """Build dataclass `cls` from a mapping; unknown keys and wrong types name the key."""
    if not isinstance(values, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {type(values).__name__}")
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in values.items():
        if key not in known:
            close = [k for k in known if k.startswith(str(key)[:3])]
            hint = f" (did you mean {', '.join(prefix + c for c in close)}?)" if close else ""
            raise ConfigError(f"unknown config key '{prefix}{key}'{hint}")
        kwargs[key] = _coerce(hints[key], value, prefix + key)
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: {exc}") from None


def _coerce(hint: Any, value: Any, key: str) -> Any:
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return build(hint, value, key + ".")
    origin = typing.get_origin(hint)
    if origin is Literal:
        if value not in typing.get_args(hint):
            allowed = ", ".join(map(str, typing.get_args(hint)))
            raise ConfigError(f"{key}: {_shown(key, value)} is not one of {allowed}")
        return value
    if origin in (typing.Union, types.UnionType):
        return value
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true or false, got {_shown(key, value)}")
    if hint in (int, float):
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{key}: expected a number, got {_shown(key, value)}")
        if math.isnan(value):  # every comparison with nan is False: no range check would catch it
            raise ConfigError(f"{key}: expected a number, got nan")
        if hint is int and isinstance(value, float) and not value.is_integer():
            raise ConfigError(f"{key}: expected an integer, got {_shown(key, value)}")
        return hint(value)
    if hint is str:
        if isinstance(value, dict | list):
            raise ConfigError(f"{key}: expected a string, got {_shown(key, value)}")
        return str(value)
    return value


_SHORT = reprlib.Repr()  # how much of a value an error message shows
_SHORT.maxstring, _SHORT.maxother, _SHORT.maxlist, _SHORT.maxdict, _SHORT.maxlevel = 60, 60, 4, 4, 2


def _shown(key: str, value: Any) -> str:
    """`value` as an error message shows it: never a credential, never more than a line."""
    if key.rpartition(".")[2] in SECRET_STORAGE_KEYS or key.endswith("sse.customer_key"):
        return f"a {type(value).__name__} (not shown: a credential)"
    return _SHORT.repr(value)


class _JobConfigLoader(yaml.SafeLoader):
    """YAML for job configs: no aliases (a few hundred bytes of them expand to gigabytes, the
    "billion laughs") and no repeated keys (YAML lets the last one win, silently)."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            raise yaml.MarkedYAMLError(
                problem="aliases (*name) are not allowed in a job config; write the value out",
                problem_mark=self.peek_event().start_mark,
            )
        return super().compose_node(parent, index)

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        seen = set()
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode):
                if key_node.value in seen:
                    raise yaml.MarkedYAMLError(
                        problem=f"duplicate key {key_node.value!r}", problem_mark=key_node.start_mark
                    )
                seen.add(key_node.value)
        return super().construct_mapping(node, deep)


MAX_DEPTH = 100  # nesting a config or manifest may have (a pod template is ~15 deep)
MAX_ALIASES = 100  # a few hundred bytes of aliases expand to gigabytes (the "billion laughs")


def bounded_yaml(text: str) -> str:
    """Why `text` is refused before it is built (too deep, too many aliases), "" when it is not: the
    pure-Python event scanner keeps no recursion, libyaml's composer would crash on 50,000 levels."""
    depth = aliases = 0
    try:
        for event in yaml.parse(text, Loader=yaml.SafeLoader):
            if isinstance(event, yaml.CollectionStartEvent):
                depth += 1
                if depth > MAX_DEPTH:
                    line = event.start_mark.line + 1
                    return f"line {line}: nested deeper than {MAX_DEPTH} levels; no config or manifest is"
            elif isinstance(event, yaml.CollectionEndEvent):
                depth -= 1
            elif isinstance(event, yaml.AliasEvent):
                aliases += 1
                if aliases > MAX_ALIASES:
                    line = event.start_mark.line + 1
                    return f"line {line}: more than {MAX_ALIASES} YAML aliases (a billion-laughs bomb?)"
    except yaml.YAMLError:
        return ""  # the loader below says where the YAML is broken
    return ""


def read_yaml(text: str, where: str, *, numbered: bool = True) -> Any:
    """Parse job-config YAML; errors are one line naming `where` (and the line, if `numbered`)."""
    refused = bounded_yaml(text)
    if refused:
        raise ConfigError(f"{where}: {refused}")
    try:
        return yaml.load(text, Loader=_JobConfigLoader)  # a SafeLoader: builds plain data only
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        line = f" line {mark.line + 1}" if mark and numbered else ""
        raise ConfigError(f"{where}{line}: {problem}") from None


def apply_overrides(values: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `a.b=c` strings to a nested mapping; values are read as YAML scalars."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. train.steps=100")
        dotted, raw = item.split("=", 1)
        parts = dotted.strip().split(".")
        node = values
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {dotted}: '{part}' is not a section")
        node[parts[-1]] = read_yaml(raw, f"--set {dotted}", numbered=False) if raw.strip() else ""
    return values


def from_yaml(text: str, where: str) -> JobConfig:
    """A job config from YAML text (a run's config.yaml read from storage); `where` names it in errors."""
    return build(JobConfig, read_yaml(text, where) or {})


def load(path: str | Path | None = None, overrides: list[str] | None = None) -> JobConfig:
    """Read a YAML job config (or the defaults) and apply `--set` overrides."""
    values: dict[str, Any] = {}
    if path:
        try:
            text = Path(path).read_text()
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        values = read_yaml(text, f"config file {path}") or {}
    values = apply_overrides(values, overrides or [])
    return build(JobConfig, values)
