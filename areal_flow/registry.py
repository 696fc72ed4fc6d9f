"""One `Registry` type, eight instances: everything selectable by name is looked up here, in
order: entry points of installed distributions (loaded when asked for), in-process decorators
(`@reward(...)`), then a ``"package.module:attribute"`` path."""

from __future__ import annotations

import contextlib
import difflib
import importlib
import threading
from collections.abc import Callable
from importlib.metadata import EntryPoint, entry_points
from typing import Any

import attrs

from areal_flow.types import AlgorithmSpec, RewardSpec, WorkflowSpec

SPEC_ATTR = "__areal_flow_spec__"
"""Decorators attach the spec under this attribute, leaving the object unchanged (picklable)."""


class RegistryError(Exception):
    """A name could not be resolved to exactly one registered object."""


class UnknownNameError(RegistryError, LookupError):
    pass


class DuplicateNameError(RegistryError):
    pass


class PluginLoadError(RegistryError, ImportError):
    pass


@attrs.frozen
class PluginInfo:
    """One row of `areal-flow plugins`."""

    kind: str
    name: str
    source: str
    """The announcing distribution (``name version``), or ``in-process``."""
    target: str
    """``module:attribute`` it resolves to."""


def _target(entry: Any) -> Any:
    return getattr(entry, "target", entry)


def _where(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}:{getattr(obj, '__qualname__', repr(obj))}"


def _distribution(ep: EntryPoint) -> str:
    dist = ep.dist
    return f"{dist.name} {dist.version}" if dist is not None else "an unknown distribution"


class Registry:
    """Names → registered objects of one kind, backed by entry-point group `group`; `wrap(name,
    obj)` makes an undecorated object this kind's spec (without it, objects are returned as is)."""

    def __init__(self, kind: str, group: str, wrap: Callable[[str, Any], Any] | None = None):
        self.kind = kind
        self.group = group
        self._wrap = wrap
        self._local: dict[str, Any] = {}
        self._loaded: dict[str, Any] = {}
        self._eps: dict[str, list[EntryPoint]] | None = None
        self._lock = threading.RLock()

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, group={self.group!r})"

    # -- registration -------------------------------------------------------------------

    def register(self, name: str, entry: Any) -> Any:
        """Register `entry` (a spec or plain object) in-process; returns the object unchanged."""
        target = _target(entry)
        with self._lock:
            old = self._local.get(name)
            # Re-running the same definition (a reloaded module, a notebook cell) replaces it.
            if old is not None and _where(_target(old)) != _where(target):
                raise DuplicateNameError(f"{self.kind} {name!r} is registered twice: by "
                                         f"{_where(_target(old))} and by {_where(target)}")
            self._local[name] = entry
            self._loaded.pop(name, None)
        if entry is not target:
            setattr(target, SPEC_ATTR, entry)
        return target

    # -- lookup -------------------------------------------------------------------------

    def entry_points(self) -> dict[str, list[EntryPoint]]:
        """Entry points of this group by name, one per distribution (discovered once)."""
        with self._lock:
            if self._eps is None:
                found: dict[str, list[EntryPoint]] = {}
                for ep in entry_points(group=self.group):
                    same = found.setdefault(ep.name, [])
                    if all(_distribution(e) != _distribution(ep) for e in same):
                        same.append(ep)
                self._eps = found
            return self._eps

    def names(self) -> list[str]:
        return sorted(set(self.entry_points()) | set(self._local))

    def __contains__(self, name: str) -> bool:
        return name in self._local or name in self.entry_points()

    def get(self, name: str) -> Any:
        """What was registered as `name` (the decorated function or class); imports only that."""
        return _target(self.spec(name))

    def spec(self, name: str) -> Any:
        """`name`'s spec: the object plus what its decorator declared (or the bare object)."""
        with self._lock:
            if name in self._loaded:
                return self._loaded[name]
            eps = self.entry_points().get(name)
            if eps:
                entry = self._load_entry_point(name, eps)
            elif name in self._local:
                entry = self._local[name]
            elif ":" in name:
                entry = self._load_path(name)
            else:
                raise UnknownNameError(self._unknown_message(name))
            self._loaded[name] = entry
            return entry

    def plugins(self) -> list[PluginInfo]:
        """Every announced or in-process registered name, without importing anything."""
        announced = self.entry_points()
        rows = [PluginInfo(self.kind, name, _distribution(ep), ep.value)
                for name, eps in announced.items() for ep in eps]
        rows += [PluginInfo(self.kind, name, "in-process", _where(_target(entry)))
                 for name, entry in self._local.items() if name not in announced]
        return sorted(rows, key=lambda r: (r.name, r.source))

    # -- helpers ------------------------------------------------------------------------

    def _coerce(self, name: str, obj: Any) -> Any:
        spec = getattr(obj, SPEC_ATTR, None)
        # A subclass inherits its parent's spec attribute; only the decorated object owns it.
        if spec is not None and _target(spec) is obj:
            return spec
        return self._wrap(name, obj) if self._wrap is not None else obj

    def _load_entry_point(self, name: str, eps: list[EntryPoint]) -> Any:
        if len(eps) > 1:
            sources = " and ".join(f"{_distribution(ep)} ({ep.value})" for ep in eps)
            raise DuplicateNameError(f"{self.kind} {name!r} is announced by two distributions: "
                                     f"{sources}; uninstall one of them or rename its entry point")
        ep = eps[0]
        try:
            obj = ep.load()
        except DuplicateNameError as exc:  # its decorator collided with an in-process one
            raise DuplicateNameError(f"{exc} (loading {ep.value} from {_distribution(ep)})") from exc
        except Exception as exc:
            raise PluginLoadError(
                f"{self.kind} {name!r} from distribution {_distribution(ep)} failed to load "
                f"({self.group} entry point {ep.value!r}): {type(exc).__name__}: {exc}"
            ) from exc
        entry = self._coerce(name, obj)
        if entry is not obj and entry.name != name:
            raise RegistryError(f"entry point {name!r} of {_distribution(ep)} points at a "
                                f"{self.kind} decorated as {entry.name!r}; the two names must "
                                "match")
        local = self._local.get(name)
        if local is not None and _where(_target(local)) != _where(_target(entry)):
            raise DuplicateNameError(f"{self.kind} {name!r} is announced by {_distribution(ep)} "
                                     f"({ep.value}) and also registered in-process by "
                                     f"{_where(_target(local))}")
        return entry

    def _load_path(self, path: str) -> Any:
        module_name, _, attr_path = path.partition(":")
        try:
            obj: Any = importlib.import_module(module_name)
            for part in attr_path.split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError) as exc:
            raise UnknownNameError(f"{self.kind} path {path!r} could not be imported: "
                                   f"{type(exc).__name__}: {exc}") from exc
        return self._coerce(path, obj)

    def _unknown_message(self, name: str) -> str:
        known = self.names()
        msg = f"unknown {self.kind} {name!r}; known: {', '.join(known) or '(none registered)'}"
        close = difflib.get_close_matches(name, known, n=1)
        if close:
            msg += f". Did you mean {close[0]!r}?"
        return msg + " (a 'package.module:attribute' path also works)"


workflows = Registry("workflow", "areal_flow.workflows",
                     lambda name, fn: WorkflowSpec(name=name, fn=fn))
rewards = Registry("reward", "areal_flow.rewards", lambda name, fn: RewardSpec(name=name, fn=fn))
algorithms = Registry("algorithm", "areal_flow.algorithms",
                      lambda name, cls: AlgorithmSpec(name=name, cls=cls))
generation_pools = Registry("generation pool", "areal_flow.generation_pools")
loggers = Registry("logger", "areal_flow.loggers")
environments = Registry("environment", "areal_flow.environments")
"""Text environments for the `env` workflow (`areal_flow.agents.environment`)."""
dataset_sources = Registry("dataset source", "areal_flow.dataset_sources")
"""`DatasetSource`s: ``--dataset '<name>:<spec>'`` (`areal_flow.data.offline.source`)."""

def show_options(reg: Registry, name: str) -> None:
    """Print workflow or algorithm `name`'s config class as tyro's help (`plugins --show NAME`)."""
    import tyro

    config = reg.spec(name).config
    if config is None:
        print(f"{reg.kind} {name} takes no options")
        return
    how = f"--algorithm {name} --algorithm.<field> value"
    if reg is workflows:
        how = "--workflow-config '{\"field\": value, ...}' (or a YAML file)"
        print("In --workflow-config each option below is a key, with underscores "
              "(--question-field: question_field).")
    with contextlib.suppress(SystemExit):  # tyro exits after printing the help
        tyro.cli(config, args=["--help"], prog=f"{reg.kind} {name}: {how}")


commands = Registry("command", "areal_flow.commands")
"""`areal-flow` subcommands: callables tyro builds from the command line, returning exit status."""

ALL = (workflows, rewards, algorithms, generation_pools, loggers, environments, dataset_sources,
       commands)
