"""Reading a YAML run config within bounds, and the error every config problem raises.

A config file is read no further than :data:`MAX_CONFIG_BYTES` and may expand to at most
:data:`MAX_CONFIG_NODES` YAML nodes (aliases counted at every use), so a wrong or hostile file
(``/dev/zero``, an alias bomb) fails in milliseconds instead of exhausting memory. A key given twice
in one mapping is refused (plain YAML keeps the last). Values quoted in messages are cut short.
"""

from __future__ import annotations

import functools
import reprlib
from pathlib import Path
from typing import Any

__all__ = ["MAX_CONFIG_BYTES", "MAX_CONFIG_NODES", "ConfigError", "key_text", "load_yaml_bounded", "shown"]

# A run config is a few dozen keys; anything larger is a wrong file (``/dev/zero``, a data dump).
MAX_CONFIG_BYTES = 2**20
# YAML aliases repeat a node without repeating its text, so nine lines can expand to a billion
# values; the schema has under a hundred keys, so this bound never meets a real config.
MAX_CONFIG_NODES = 10_000

# Values quoted in error messages are cut short: a message must stay one readable line.
_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxlist, _SHORT.maxdict = 2, 4, 4
_SHORT.maxstring, _SHORT.maxother, _SHORT.maxlong = 60, 60, 40


def shown(value: Any) -> str:
    """``repr(value)`` cut to a few dozen characters, without formatting the whole value first."""
    return _SHORT.repr(value)


class ConfigError(ValueError):
    """A configuration problem; the message starts with the full key path."""


def key_text(key: Any) -> str:
    """A mapping key as a message names it: a string as written (cut short), anything else by repr."""
    return key[:60] if isinstance(key, str) else shown(key)


def load_yaml_bounded(path: Path, *, missing_hint: str = "") -> Any:
    """The YAML document in ``path``, read within the bounds above; every problem is a :class:`ConfigError`
    naming the file (``missing_hint`` is added when the file does not exist)."""
    import yaml

    text = _read_text(path, missing_hint)
    try:
        return yaml.load(text, Loader=_unique_key_loader())
    except yaml.YAMLError as exc:
        one_line = " ".join(str(exc).split())
        raise ConfigError(f"config file {str(path)!r}: not valid YAML ({one_line[:300]})") from None
    except RecursionError:  # PyYAML composes nested collections recursively
        raise ConfigError(f"config file {str(path)!r}: nested too deeply to be a run config") from None


def _read_text(path: Path, missing_hint: str) -> str:
    """The file's text, read no further than :data:`MAX_CONFIG_BYTES` (a device such as
    ``/dev/zero`` reports size 0 and never ends, so the size is bounded while reading)."""
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        hint = f"; {missing_hint}" if missing_hint and isinstance(exc, FileNotFoundError) else ""
        raise ConfigError(f"config file {str(path)!r}: cannot be read ({exc.strerror or exc}{hint})") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(f"config file {str(path)!r}: larger than {MAX_CONFIG_BYTES} bytes; not a run config")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {str(path)!r}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None


@functools.cache
def _unique_key_loader() -> type:
    """``yaml.SafeLoader`` that bounds alias expansion and refuses a key given twice in one mapping
    (plain YAML keeps the last)."""
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_document(self, node):
            _refuse_expansion_beyond(node, MAX_CONFIG_NODES)
            _refuse_duplicate_keys(node, "", set())
            return super().construct_document(node)

    return UniqueKeyLoader


def _refuse_expansion_beyond(root: Any, limit: int) -> None:
    """Count the nodes ``root`` expands to, each alias at every use, refusing more than ``limit`` or
    an alias inside its own anchor (a cycle). Sizes are memoised per node, so the count costs one
    visit per distinct node however far the aliases would expand."""
    import yaml

    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()

    def size(node: Any) -> int:
        if id(node) in sizes:
            return sizes[id(node)]
        if id(node) in open_nodes:
            raise ConfigError(f"config: an alias refers to its own anchor (line {node.start_mark.line + 1})")
        open_nodes.add(id(node))
        total = 1
        if isinstance(node, yaml.SequenceNode):
            children: list = node.value
        elif isinstance(node, yaml.MappingNode):
            children = [n for pair in node.value for n in pair]
        else:
            children = []
        for child in children:
            total += size(child)
            if total > limit:
                raise ConfigError(
                    f"config: expands to more than {limit} YAML values (aliases repeated at line "
                    f"{node.start_mark.line + 1}); a run config has under a hundred keys"
                )
        open_nodes.discard(id(node))
        sizes[id(node)] = total
        return total

    size(root)


def _refuse_duplicate_keys(node: Any, path: str, seen_nodes: set[int]) -> None:
    import yaml

    if id(node) in seen_nodes:  # aliases share nodes and may even form cycles
        return
    seen_nodes.add(id(node))
    if isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _refuse_duplicate_keys(item, f"{path}[{i}]", seen_nodes)
    elif isinstance(node, yaml.MappingNode):
        lines: dict[str, int] = {}
        for key_node, value_node in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            line = key_node.start_mark.line + 1
            key = str(key_node.value) if isinstance(key_node, yaml.ScalarNode) else f"<collection at line {line}>"
            full = f"{path}.{key_text(key)}" if path else key_text(key)
            if key in lines:
                raise ConfigError(f"{full}: duplicate key (lines {lines[key]} and {line}; give it once)")
            lines[key] = line
            _refuse_duplicate_keys(value_node, full, seen_nodes)
