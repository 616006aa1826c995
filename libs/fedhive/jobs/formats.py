"""A job's documents in each form FLARE reads: JSON, HOCON (`.conf`) and YAML (`.yml`, `.yaml`).

`parse_document(name, content, max_depth=...)` turns any of them into the value JSON would give
(dicts with string keys, lists, strings, numbers, booleans, None), held to the bounds
`fedhive.jobs.jsontext` holds JSON to: nesting depth, integer length, finite numbers. What else a
form can express is refused with one `JsonProblem` line instead of being carried along:

* HOCON: `include` (it reads files and URLs of whichever machine parses the job) and `${...}`
  substitutions (they read that machine's environment variables), and values JSON has no type
  for (durations such as `10s`);
* YAML: aliases (`*name`: a few lines can stand for a huge value), types JSON has none for
  (dates, binary, sets; explicit tags), keys that are not strings, more than one document.

Both parsers are pure Python and slow; `fedhive.jobs.limits.MAX_TEXT_FORM_BYTES` bounds what
they are given (the callers check it, naming the file).
"""

from __future__ import annotations

import math
import re
import threading
from pathlib import PurePosixPath
from typing import Any

import yaml

from fedhive.jobs.jsontext import MAX_INT_DIGITS, JsonProblem, depth, parse_json
from fedhive.text import clip

FORMS = (".json", ".conf", ".yml", ".yaml")  # FLARE's order; fedhive accepts one per file
TEXT_FORMS = (".conf", ".yml", ".yaml")
# pyhocon switches pyparsing's process-wide default whitespace while it builds its grammar:
# two parses at once in one process could see each other's setting.
_HOCON_LOCK = threading.Lock()
_INCLUDE = re.compile(r"\binclude\s*(\"|(required|url|file|package|classpath)\s*\()",
                      re.IGNORECASE)
_REFUSED_HOCON = (
    (_INCLUDE, "include", "it would read files or URLs of the machine that reads the job"),
    (re.compile(r"\$\{"), "substitution ${...}",
     "it would read the environment of the machine that reads the job; write the value out"),
)
_YAML_LOADER: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def is_text_form(name: str) -> bool:
    """Whether `name` is a HOCON or YAML file (held to MAX_TEXT_FORM_BYTES)."""
    return PurePosixPath(name).suffix in TEXT_FORMS


def parse_document(name: str, content: bytes, *, max_depth: int) -> Any:
    """The plain value of a JSON, HOCON or YAML document (by `name`'s suffix; anything but
    `.conf`, `.yml` and `.yaml` is JSON); `JsonProblem` (one line) when it is not acceptable."""
    suffix = PurePosixPath(name).suffix
    if suffix == ".conf":
        return _plain(_hocon(_text(content), max_depth), max_depth)
    if suffix in (".yml", ".yaml"):
        return _plain(_yaml(_text(content), max_depth), max_depth)
    return parse_json(content, max_depth=max_depth)


def _text(content: bytes) -> str:
    try:
        return content.decode("utf-8")
    except UnicodeDecodeError as err:
        raise JsonProblem(f"is not UTF-8 text (byte {err.start})") from None


# HOCON -----------------------------------------------------------------------------------------
def _hocon(text: str, max_depth: int) -> Any:
    from pyhocon import ConfigFactory  # loaded only for a job that has a .conf file

    code = _hocon_code(text)
    for pattern, what, why in _REFUSED_HOCON:
        found = pattern.search(code)
        if found is not None:
            line = code.count("\n", 0, found.start()) + 1
            raise JsonProblem(f"HOCON {what} at line {line} is not accepted ({why})")
    with _HOCON_LOCK:
        try:
            return ConfigFactory.parse_string(text, resolve=True)
        except RecursionError:
            raise JsonProblem(f"is nested deeper than the limit of {max_depth} levels") from None
        except Exception as err:  # pyparsing's and pyhocon's errors, and whatever else a
            raise JsonProblem(f"invalid HOCON{_hocon_where(err)}: "  # malformed text raises
                              f"{clip(_hocon_message(err), quote=False)}") from None


def _hocon_code(text: str) -> str:
    """`text` with the inside of its quoted strings and its `#` comments blanked (newlines
    kept), so what is left is HOCON syntax. A backslash outside quotes escapes the next
    character (pyhocon reads `\\"` in an unquoted string as a quote character). `//` is not
    taken for a comment: pyhocon reads it inside unquoted values (`http://...`)."""
    out: list[str] = []
    i, n = 0, len(text)
    while i < n:
        ch = text[i]
        if text.startswith('"""', i):
            end = text.find('"""', i + 3)
            end = n if end < 0 else end + 3
            while end < n and text[end] == '"':  # """a"""" ends at its last quote
                end += 1
            out.append('"""' + _blank(text[i + 3:end]))
            i = end
        elif ch == '"':
            j = i + 1
            while j < n and text[j] not in '"\n':
                j += 2 if text[j] == "\\" else 1
            out.append('"' + _blank(text[i + 1:j + 1]))
            i = j + 1
        elif ch == "#":
            end = text.find("\n", i)
            end = n if end < 0 else end
            out.append(_blank(text[i:end]))
            i = end
        elif ch == "\\":
            out.append(_blank(text[i:i + 2]))
            i += 2
        else:
            out.append(ch)
            i += 1
    return "".join(out)


def _blank(part: str) -> str:
    return "".join("\n" if c == "\n" else " " for c in part)


def _hocon_where(err: Exception) -> str:
    line, column = getattr(err, "lineno", None), getattr(err, "col", None)
    return f" at line {line} column {column}" if isinstance(line, int) else ""


def _hocon_message(err: Exception) -> str:
    text = getattr(err, "msg", None) or str(err) or type(err).__name__
    return " ".join(str(text).split())


# YAML ------------------------------------------------------------------------------------------
def _yaml(text: str, max_depth: int) -> Any:
    """One YAML document. Its events are read first (no value is built): an alias, or nesting
    past `max_depth` (the C composer recurses without a bound), is refused before loading."""
    try:
        level = 0
        for event in yaml.parse(text, Loader=_YAML_LOADER):
            if isinstance(event, yaml.AliasEvent):
                raise JsonProblem(f"YAML alias *{clip(event.anchor, quote=False)}{_mark(event)} "
                                  "is not accepted (write the value out)")
            if isinstance(event, yaml.CollectionStartEvent):
                level += 1
                if level > max_depth:
                    raise JsonProblem(f"is nested deeper than the limit of {max_depth} levels")
            elif isinstance(event, yaml.CollectionEndEvent):
                level -= 1
        return yaml.load(text, Loader=_YAML_LOADER)  # a safe loader (no Python objects)
    except yaml.YAMLError as err:
        raise JsonProblem(f"invalid YAML{_yaml_where(err)}: "
                          f"{clip(_yaml_message(err), quote=False)}") from None
    except RecursionError:
        raise JsonProblem(f"is nested deeper than the limit of {max_depth} levels") from None


def _mark(event: Any) -> str:
    mark = getattr(event, "start_mark", None)
    return f" at line {mark.line + 1} column {mark.column + 1}" if mark is not None else ""


def _yaml_where(err: yaml.YAMLError) -> str:
    mark = getattr(err, "problem_mark", None)
    return f" at line {mark.line + 1} column {mark.column + 1}" if mark is not None else ""


def _yaml_message(err: yaml.YAMLError) -> str:
    text = getattr(err, "problem", None) or str(err)
    return " ".join(str(text).split())


# plain values ----------------------------------------------------------------------------------
def _plain(value: Any, max_depth: int) -> Any:
    """`value` as JSON would give it (HOCON's ordered trees become dicts, its quoted keys lose
    their quotes), or JsonProblem naming where a value JSON has no type for is."""
    found = depth(value)
    if found > max_depth:
        raise JsonProblem(f"is nested {found} levels deep, more than the limit of {max_depth}")
    return _convert(value, "")


def _convert(value: Any, where: str) -> Any:
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, dict):
        result = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise JsonProblem(f"key {clip(key)}{_at(where)} is not a string")
            name = key[1:-1] if len(key) >= 2 and key[0] == key[-1] == '"' else str(key)
            result[name] = _convert(item, f"{where}.{name}" if where else name)
        return result
    if isinstance(value, list):
        return [_convert(item, f"{where}[{i}]") for i, item in enumerate(value)]
    if isinstance(value, str):
        return str(value)
    if isinstance(value, int):
        if len(str(abs(value))) > MAX_INT_DIGITS:
            raise JsonProblem(f"an integer{_at(where)} is longer than the limit of "
                              f"{MAX_INT_DIGITS} digits")
        return int(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise JsonProblem(f"number {value}{_at(where)} is not a finite number")
        return float(value)
    if type(value).__name__ == "NoneValue":  # pyhocon's null
        return None
    raise JsonProblem(f"value{_at(where)} is a {type(value).__name__}, which JSON has no type "
                      "for (give a string or a number)")


def _at(where: str) -> str:
    return f" at {clip(where, quote=False)}" if where else ""
