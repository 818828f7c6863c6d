"""Search spaces over job-config fields: `train.lr=loguniform:1e-4:1e-2`, `train.warmup_steps=randint:0:20`,
`model.d_model=choice:64,128`, `train.weight_decay=uniform:0:0.1`.

A space is parsed, and checked against the config it searches, before anything starts: the
field must exist and be a value (not a section), and the config must build at both ends of a
range and at every choice (so `train.lr` reaching below `train.min_lr` is one line here, not a
trial failing on the cluster). Sampled values are applied to the config as typed values.
"""

from __future__ import annotations

import dataclasses
import difflib
import itertools
import math
from dataclasses import dataclass
from typing import Any

import yaml

from petatrain.config import JobConfig, build
from petatrain.errors import ConfigError

KINDS = ("loguniform", "uniform", "choice", "randint")
EXAMPLES = "loguniform:1e-4:1e-2, uniform:0:0.1, choice:64,128,256 or randint:1:8"
MAX_CHOICES = 1000  # a choice is a list someone wrote; beyond this, a range says it better (and checks fast)
MAX_COMBINATIONS = 4096  # the spaces' corners checked together; beyond this, each space's two ends together


@dataclass(frozen=True, slots=True)
class Space:
    key: str  # a dotted config field: train.lr
    kind: str  # one of KINDS
    low: float = 0.0
    high: float = 0.0
    choices: tuple[Any, ...] = ()

    def __str__(self) -> str:
        if self.kind == "choice":
            return f"choice:{','.join(map(str, self.choices))}"
        return f"{self.kind}:{self.low:g}:{self.high:g}"

    def domain(self) -> Any:
        """The Ray Tune domain that samples it (randint's upper bound is inclusive here, exclusive in Tune)."""
        from ray import tune

        if self.kind == "loguniform":
            return tune.loguniform(self.low, self.high)
        if self.kind == "uniform":
            return tune.uniform(self.low, self.high)
        if self.kind == "randint":
            return tune.randint(int(self.low), int(self.high) + 1)
        return tune.choice(list(self.choices))

    def corners(self) -> list[Any]:
        """The values the config is checked at: both ends of a range, every choice."""
        if self.kind == "choice":
            return list(self.choices)
        if self.kind == "randint":
            return [int(self.low), int(self.high)]
        return [self.low, self.high]


def parse(spec: str) -> Space:
    """`KEY=SPACE` -> Space; ConfigError naming what is wrong."""
    key, eq, text = spec.partition("=")
    key, text = key.strip(), text.strip()
    if not eq or not key or not text:
        raise ConfigError(f"--param {spec!r}: write KEY=SPACE, e.g. train.lr=loguniform:1e-4:1e-2")
    return parse_space(key, text)


def parse_space(key: str, text: str) -> Space:
    kind, _, rest = text.partition(":")
    where = f"--param {key}={text}"
    if kind not in KINDS:
        raise ConfigError(f"{where}: unknown space {kind!r} (one of {EXAMPLES})")
    if kind == "choice":
        values = tuple(_scalar(v.strip()) for v in rest.split(",") if v.strip())
        if not values:
            raise ConfigError(f"{where}: give the choices, e.g. choice:64,128,256")
        if len(values) > MAX_CHOICES:
            raise ConfigError(f"{where}: {len(values)} choices, over {MAX_CHOICES}; search a range (randint, uniform)")
        if len(set(map(repr, values))) != len(values):
            raise ConfigError(f"{where}: a choice is repeated")
        return Space(key, kind, choices=values)
    parts = rest.split(":")
    if len(parts) != 2:
        raise ConfigError(f"{where}: a {kind} space is {kind}:LOW:HIGH")
    try:
        low, high = float(parts[0]), float(parts[1])
    except ValueError:
        raise ConfigError(f"{where}: LOW and HIGH must be numbers") from None
    if not (math.isfinite(low) and math.isfinite(high)) or low >= high:
        raise ConfigError(f"{where}: LOW must be below HIGH, both finite")
    if kind == "loguniform" and low <= 0:
        raise ConfigError(f"{where}: a loguniform space needs LOW > 0")
    if kind == "randint" and not (low.is_integer() and high.is_integer()):
        raise ConfigError(f"{where}: randint's bounds are integers (both included)")
    return Space(key, kind, low=low, high=high)


def _scalar(text: str) -> Any:
    """A choice as YAML reads it: 64 -> int, 0.1 -> float, true -> bool, gelu -> str."""
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    return value if isinstance(value, int | float | bool | str) else text


def check(base: JobConfig, spaces: list[Space]) -> list[JobConfig]:
    """Each space names a config field, an integer field is searched with integers, and the config
    builds at every corner of every space and at every combination of the spaces' corners (a
    `model.d_model` choice with a `model.n_head` choice: each pair must divide); the configs built
    at the combinations, for what a trial needs at most."""
    if not spaces:
        raise ConfigError("nothing to search: give --param KEY=SPACE (or a tune.params section in the config)")
    seen: set[str] = set()
    fields = _leaves(dataclasses.asdict(base))
    for space in spaces:
        if space.key in seen:
            raise ConfigError(f"--param {space.key}: given twice")
        seen.add(space.key)
        if space.key.startswith("storage."):
            raise ConfigError(
                f"--param {space.key}: the storage section says how data is reached, with which credentials and "
                "keys; it is not searched (a search writes what it samples into its trials' records)"
            )
        if space.key.startswith("tune.") or space.key not in fields:
            close = difflib.get_close_matches(space.key, [f for f in fields if not f.startswith("tune.")], n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ConfigError(f"--param {space.key}: no such config field{hint}")
        if space.kind in ("uniform", "loguniform") and _is_integer(base, space.key):
            raise ConfigError(
                f"--param {space.key}={space}: {space.key} is an integer, and {space.kind} draws fractions; "
                f"search it with randint:{math.ceil(space.low)}:{math.floor(space.high)} or a choice"
            )
        at_corners = []
        for value in space.corners():
            try:
                at_corners.append(apply(base, {space.key: value}))
            except ConfigError as exc:
                raise ConfigError(f"--param {space.key}={space}: at {value!r}: {exc}") from None
    if len(spaces) == 1:  # its corners are all the combinations there are
        return at_corners
    corners = [space.corners() for space in spaces]
    if math.prod(len(c) for c in corners) > MAX_COMBINATIONS:
        corners = [_ends(c) for c in corners]
    built = []
    for values in itertools.product(*corners):
        chosen = dict(zip((s.key for s in spaces), values, strict=True))
        try:
            built.append(apply(base, chosen))
        except ConfigError as exc:
            together = " with ".join(f"{k}={v!r}" for k, v in chosen.items())
            raise ConfigError(f"--param: at {together}: {exc}") from None
    return built


def _is_integer(base: JobConfig, key: str) -> bool:
    node: Any = base
    for part in key.split("."):
        node = getattr(node, part, None)
    return isinstance(node, int) and not isinstance(node, bool)


def _ends(values: list[Any]) -> list[Any]:
    """A space's smallest and largest corner (its first and last, if they do not compare)."""
    try:
        ordered = sorted(values)
    except TypeError:
        ordered = values
    return [ordered[0], ordered[-1]] if len(ordered) > 1 else ordered


def apply(base: JobConfig, values: dict[str, Any]) -> JobConfig:
    """`base` with each dotted field set to its value, built and checked as a loaded config is."""
    tree = dataclasses.asdict(base)  # credentials included: this never leaves the process
    for key, value in values.items():
        node = tree
        *sections, leaf = key.split(".")
        for section in sections:
            node = node[section]
        node[leaf] = value
    return build(JobConfig, tree)


def _leaves(tree: dict[str, Any], prefix: str = "") -> set[str]:
    out: set[str] = set()
    for key, value in tree.items():
        if isinstance(value, dict) and key != "params":
            out |= _leaves(value, f"{prefix}{key}.")
        else:
            out.add(f"{prefix}{key}")
    return out
