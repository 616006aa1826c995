"""Where a job's meta and an app's configs are, in whichever of FLARE's forms they are written.

FLARE reads `meta.json`, `meta.conf`, `meta.yml` or `meta.yaml` (the first it finds, in that
order), and `config/config_fed_server.<form>` and `config/config_fed_client.<form>` alike.
fedhive reads the same names, every form through `fedhive.jobs.formats.parse_document` into the
same dict, and refuses two forms of one document in one place (which one FLARE would pick is
easy to miss, and the other would be dead text that looks alive).

`find` is used by the job validation (on a job's files); `load_app_config` by the server job
and the client job (on the deployed app folder), with the same parsing and the same
translation (`fedhive.jobs.flare_config`) the validation used.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from fedhive.errors import InvalidArgument
from fedhive.jobs import limits
from fedhive.jobs.flare_config import translate_config
from fedhive.jobs.formats import FORMS, is_text_form, parse_document
from fedhive.jobs.jsontext import JsonProblem

META = "meta"
SERVER_CONFIG = "config/config_fed_server"
CLIENT_CONFIG = "config/config_fed_client"


class Files(Protocol):
    def has_file(self, name: str) -> bool: ...

    def size(self, name: str) -> int: ...

    def read(self, name: str) -> bytes: ...


def find(files: Files, stem: str) -> list[str]:
    """The forms of document `stem` (`meta`, `app/config/config_fed_server`) present, in
    FLARE's order: none, one, or (a problem) more."""
    return [stem + suffix for suffix in FORMS if files.has_file(stem + suffix)]


def two_forms(found: list[str]) -> str:
    """The problem of a document present in more than one form (reported on `found[0]`)."""
    others = found[1:]
    return (f"{' and '.join(others)} {'is another form' if len(others) == 1 else 'are other forms'}"
            " of the same file; keep one")


def size_problem(name: str, size: int, limit: int | None) -> str | None:
    """Why a document of `size` bytes is refused unread (HOCON and YAML are held to
    MAX_TEXT_FORM_BYTES, besides `limit`), or None."""
    if is_text_form(name):
        limit = min(limits.MAX_TEXT_FORM_BYTES, limit or limits.MAX_TEXT_FORM_BYTES)
    if limit is not None and size > limit:
        return f"is {size} bytes, more than the limit of {limit}"
    return None


class _Folder:
    def __init__(self, root: Path) -> None:
        self.root = root

    def has_file(self, name: str) -> bool:
        return (self.root / name).is_file()

    def size(self, name: str) -> int:
        return (self.root / name).stat().st_size

    def read(self, name: str) -> bytes:
        return (self.root / name).read_bytes()


def load_app_config(app_dir: Path, stem: str) -> tuple[str, dict[str, Any]]:
    """The deployed app's config `stem` (SERVER_CONFIG or CLIENT_CONFIG) in whichever form it
    has, parsed and translated as the validation did: (its file name, the config).
    InvalidArgument (one line, naming the file) when it cannot be used."""
    folder = _Folder(app_dir)
    found = find(folder, stem)
    if not found:
        raise InvalidArgument(f"{stem}.json: is missing", field=f"{stem}.json")
    if len(found) > 1:
        raise InvalidArgument(f"{found[0]}: {two_forms(found)}", field=found[0])
    name = found[0]
    try:
        problem = size_problem(name, folder.size(name), None)
        if problem is not None:
            raise JsonProblem(problem)
        config = parse_document(name, folder.read(name), max_depth=limits.MAX_CONFIG_DEPTH)
    except OSError as err:
        raise InvalidArgument(f"{name}: cannot read: {err.strerror}", field=name) from None
    except JsonProblem as err:
        raise InvalidArgument(f"{name}: {err}", field=name) from None
    if not isinstance(config, dict):
        raise InvalidArgument(f"{name}: must be an object", field=name)
    translated = translate_config(config, name)
    if translated.problems:
        field, problem = translated.problems[0]
        more = len(translated.problems) - 1
        raise InvalidArgument(f"{field}: {problem}" + (f" (and {more} more)" if more else ""),
                              field=field)
    return name, translated.config
