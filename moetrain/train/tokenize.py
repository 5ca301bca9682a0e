"""`moetrain data prepare`: turn text files into a token dataset that `TokenDataset` reads.

Inputs
  Each input is a file or a directory; a directory stands for every regular file under it,
  recursively, in sorted path order, skipping names that start with ``.`` (and the output
  directory itself).
  * ``.jsonl`` (or ``.ndjson``): one JSON object per line with a string field ``"text"``;
    each line is one document. Blank lines are skipped. A line that is not valid JSON or
    has no string ``"text"`` is a UserError naming the file and the 1-based line number.
  * any other file (``.txt``, ``.md``, ``README``, ...) is text: documents are separated by
    one or more blank lines (lines holding only whitespace). The lines of one document are
    joined with a single ``\\n``; line endings (``\\n`` or ``\\r\\n``) are not part of the
    text. A file without blank lines is one document.
  Files must be UTF-8. Compressed files, archives and binary formats (gzip, zstd, zip,
  Parquet, ...: recognised by their first bytes, or a NUL byte near the start) are refused
  with what they are and what to do, before any work.

Tokenizers
  * ``bytes``: byte-level; token id = UTF-8 byte value (0..255), end-of-document id 256,
    vocabulary size 257.
  * a Hugging Face ``tokenizer.json`` (needs the ``tokenizers`` package). Text is encoded
    without the tokenizer's own special tokens; the end-of-document id is the first of
    ``EOS_CANDIDATES`` the tokenizer knows.

Output directory (format version 1)
  * ``tokens.bin``: all documents concatenated, each followed by the end-of-document id;
    flat, native little-endian ``uint16`` when vocab_size <= 65535, else ``uint32``.
  * ``docs.npy``: int64 [num_docs + 1]; document i is tokens[docs[i]:docs[i+1]] (its EOS
    included); docs[0] = 0 and docs[-1] = num_tokens.
  * ``meta.json``: format_version, dtype, vocab_size, eos_id, num_tokens, num_docs,
    tokenizer (description), sources (per file: path, documents, tokens, bytes).
The directory is written under a temporary name next to the target (``.<name>.tmp-<pid>``)
and renamed into place at the end, so an interrupted run never leaves a half-written dataset
behind; an earlier dataset there is replaced only by a complete one. A failure or Ctrl-C
removes the temporary directory; one left by a killed process is removed by the next prepare
into the same parent directory, once no process with that pid exists.

Text is streamed: documents are read one at a time, tokenized in chunks of a few MB and
appended to tokens.bin, so memory does not grow with the input size (only the offsets do,
8 bytes per document).
"""

from __future__ import annotations

import hashlib
import errno
import json
import os
import re
import shutil
import sys
import time
from array import array
from pathlib import Path
from typing import Iterator

import numpy as np

from moetrain.errors import UserError, format_bytes, os_error

FORMAT_VERSION = 1
BYTE_VOCAB_SIZE = 257
BYTE_EOS_ID = 256
# Special tokens that mark the end of a document in common tokenizers, in order of preference.
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|eos|>", "[EOS]", "<|im_end|>")
JSONL_SUFFIXES = (".jsonl", ".ndjson")
# Flush the document buffer to the tokenizer once it holds this many characters (or documents).
_CHUNK_CHARS = 4 << 20
_CHUNK_DOCS = 8192
# Show a progress bar only when the inputs are at least this large (small runs stay quiet).
PROGRESS_MIN_BYTES = 8 << 20


# ---- tokenizers -----------------------------------------------------------------------------

class ByteTokenizer:
    """UTF-8 bytes as token ids; id 256 ends a document."""

    vocab_size = BYTE_VOCAB_SIZE
    eos_id = BYTE_EOS_ID

    def describe(self) -> dict:
        return {"type": "bytes"}

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]


class HFTokenizer:
    """A Hugging Face `tokenizers` tokenizer loaded from tokenizer.json."""

    def __init__(self, path: str):
        p = Path(path)
        if not p.is_file():
            raise UserError(f"tokenizer {path!r}: no such file (give a tokenizer.json or 'bytes')")
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise UserError(
                f"tokenizer {path!r}: reading tokenizer.json needs the 'tokenizers' package "
                "(pip install tokenizers), or use --tokenizer bytes") from None
        try:
            self.tok = Tokenizer.from_file(str(p))
        except Exception as e:  # the Rust side raises a bare Exception for malformed files
            raise UserError(f"tokenizer {path!r}: cannot load ({str(e).splitlines()[0]})") from None
        self.path = p
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        for name in EOS_CANDIDATES:
            tid = self.tok.token_to_id(name)
            if tid is not None:
                self.eos_token, self.eos_id = name, tid
                break
        else:
            raise UserError(
                f"tokenizer {path!r} has no end-of-document token; add one of "
                f"{', '.join(EOS_CANDIDATES)} as a special token")

    def describe(self) -> dict:
        digest = hashlib.sha256(self.path.read_bytes()).hexdigest()
        return {"type": "tokenizers", "path": str(self.path.resolve()), "sha256": digest,
                "eos_token": self.eos_token}

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        encs = self.tok.encode_batch(texts, add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int64) for e in encs]


def load_tokenizer(spec: str):
    """``bytes`` or a path to tokenizer.json -> an object with vocab_size, eos_id, encode_batch."""
    if spec == "bytes":
        return ByteTokenizer()
    return HFTokenizer(spec)


# ---- readers: yield documents one at a time --------------------------------------------------

class _Counter:
    """Bytes consumed so far over all inputs (drives the progress bar), and at the last flush.

    (bytes_flushed, tokens_flushed) pair input consumed with tokens written, so the size of the
    whole output can be estimated from the tokenizer's real rate.
    """

    def __init__(self):
        self.bytes = 0
        self.bytes_flushed = 0
        self.tokens_flushed = 0

    def flushed(self, num_tokens: int) -> None:
        self.bytes_flushed, self.tokens_flushed = self.bytes, num_tokens


def _needed_bytes(total_bytes: int, counter: _Counter, itemsize: int) -> int:
    """About how large tokens.bin gets for `total_bytes` of input: the rate so far, else a token a byte."""
    rate = counter.tokens_flushed / counter.bytes_flushed if counter.bytes_flushed else 1.0
    return int(total_bytes * rate * itemsize)


def _decode(raw: bytes, path: Path, lineno: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise UserError(f"{path}:{lineno}: not valid UTF-8 text") from None


def read_txt(path: Path, counter: _Counter) -> Iterator[str]:
    """Documents of a .txt file: runs of non-blank lines, joined with '\\n'."""
    lines: list[str] = []
    with _open_input(path) as f:
        for lineno, raw in enumerate(f, 1):
            counter.bytes += len(raw)
            line = _decode(raw, path, lineno).rstrip("\r\n")
            if line.strip():
                lines.append(line)
            elif lines:
                yield "\n".join(lines)
                lines = []
    if lines:
        yield "\n".join(lines)


def read_jsonl(path: Path, counter: _Counter) -> Iterator[str]:
    """Documents of a .jsonl file: the "text" field of each non-blank line."""
    with _open_input(path) as f:
        for lineno, raw in enumerate(f, 1):
            counter.bytes += len(raw)
            line = _decode(raw, path, lineno)
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(f"{path}:{lineno}: invalid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(obj, dict) or "text" not in obj:
                raise UserError(f"{path}:{lineno}: no \"text\" field (each line must be an object with \"text\")")
            if not isinstance(obj["text"], str):
                raise UserError(f"{path}:{lineno}: \"text\" is {type(obj['text']).__name__}, expected a string")
            yield obj["text"]


def _open_input(path: Path):
    try:
        return open(path, "rb")
    except OSError as e:
        raise os_error(e, f"reading input {str(path)!r}") from None


_EXTRACT = "extract it and give its text files (or their directory)"
_EXPORT = 'export the text as .jsonl (one {"text": ...} object per line)'
# (offset, bytes, what the file is, what to do): formats that are not text.
_BINARY_SIGNATURES = (
    (0, b"\x1f\x8b", "gzip-compressed", "decompress it first (gunzip)"),
    (0, b"\x28\xb5\x2f\xfd", "zstd-compressed", "decompress it first (zstd -d)"),
    (4, b"1AY&SY", "bzip2-compressed", "decompress it first (bunzip2)"),
    (0, b"\xfd7zXZ\x00", "xz-compressed", "decompress it first (unxz)"),
    (0, b"\x04\x22\x4d\x18", "lz4-compressed", "decompress it first (lz4 -d)"),
    (0, b"PK\x03\x04", "a zip archive", _EXTRACT),
    (0, b"PK\x05\x06", "a zip archive", _EXTRACT),
    (0, b"7z\xbc\xaf\x27\x1c", "a 7-Zip archive", _EXTRACT),
    (257, b"ustar", "a tar archive", _EXTRACT),
    (0, b"PAR1", "a Parquet file", _EXPORT),
    (0, b"ARROW1", "an Arrow file", _EXPORT),
    (0, b"SQLite format 3\x00", "an SQLite database", _EXPORT),
    (0, b"\x93NUMPY", "a NumPy array", "give text or .jsonl files"),
    (0, b"%PDF-", "a PDF document", "extract its text first (e.g. pdftotext)"),
    (0, b"\xff\xfe", "UTF-16 text", "convert it to UTF-8 (iconv -f UTF-16 -t UTF-8)"),
    (0, b"\xfe\xff", "UTF-16 text", "convert it to UTF-8 (iconv -f UTF-16 -t UTF-8)"),
)
_SNIFF_BYTES = 8192


def _refuse_binary(path: Path) -> None:
    """UserError when the file's first bytes say it is not text (a known format, or a NUL byte)."""
    with _open_input(path) as f:
        head = f.read(_SNIFF_BYTES)
    for offset, magic, what, todo in _BINARY_SIGNATURES:
        if head[offset:offset + len(magic)] == magic:
            raise UserError(f"input {str(path)!r} is {what}, not text; {todo}")
    nul = head.find(b"\x00")
    if nul >= 0:
        raise UserError(f"input {str(path)!r} is binary data (a NUL byte at offset {nul}), not text; "
                        "give UTF-8 text or .jsonl files")


def _reader(path: Path):
    """The reader for `path` (by suffix: .jsonl/.ndjson, else text); refuses binary files."""
    _refuse_binary(path)
    return read_jsonl if path.suffix.lower() in JSONL_SUFFIXES else read_txt


def _walk_error(err: OSError) -> None:
    raise os_error(err, "listing input directory")


def _files_under(root: Path, skip: Path) -> list[Path]:
    """Regular files under `root`, recursively, sorted; hidden names and `skip` (resolved) left out."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root, onerror=_walk_error):
        here = Path(dirpath)
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and (here / d).resolve() != skip]
        found += [here / n for n in filenames if not n.startswith(".") and (here / n).is_file()]
    return sorted(found, key=lambda p: p.relative_to(root).parts)


def input_files(inputs: list[str], output: Path) -> list[Path]:
    """The files `inputs` name, in order: a file itself, a directory every regular file under it."""
    if not inputs:
        raise UserError("data prepare: no input files given (--input PATH ...)")
    skip = output.resolve()
    paths: list[Path] = []
    for spec in inputs:
        p = Path(spec)
        if p.is_dir():
            under = _files_under(p, skip)
            if not under:
                raise UserError(f"input {spec!r}: a directory without files (hidden names are skipped); "
                                "give text or .jsonl files, or a directory holding them")
            paths += under
        elif p.is_file():
            paths.append(p)
        elif p.exists():
            raise UserError(f"input {spec!r}: not a regular file or directory")
        else:
            raise UserError(f"input {spec!r}: no such file or directory")
    return paths


# ---- writing ----------------------------------------------------------------------------------

def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 65535 else np.dtype(np.uint32)


class _Writer:
    """Appends tokenized documents to tokens.bin and records document offsets."""

    def __init__(self, tmp: Path, tokenizer):
        self.tok = tokenizer
        self.dtype = token_dtype(tokenizer.vocab_size)
        self.f = open(tmp / "tokens.bin", "wb")
        self.offsets = array("q", [0])
        self.buffer: list[str] = []
        self.buffer_chars = 0

    @property
    def num_tokens(self) -> int:
        return self.offsets[-1]

    def add(self, text: str) -> None:
        self.buffer.append(text)
        self.buffer_chars += len(text)
        if self.buffer_chars >= _CHUNK_CHARS or len(self.buffer) >= _CHUNK_DOCS:
            self.flush()

    def flush(self) -> None:
        if not self.buffer:
            return
        encoded = self.tok.encode_batch(self.buffer)
        self.buffer, self.buffer_chars = [], 0
        # One array per chunk: each document's ids followed by the EOS id.
        lengths = np.array([len(ids) + 1 for ids in encoded], dtype=np.int64)
        out = np.empty(int(lengths.sum()), dtype=self.dtype)
        ends = np.cumsum(lengths)
        pos = 0
        for ids, end in zip(encoded, ends):
            if len(ids) and int(ids.max()) >= self.tok.vocab_size:
                # A tokenizer whose ids exceed its own vocabulary would silently wrap in uint16.
                raise UserError(f"tokenizer produced id {int(ids.max())} >= its vocab size {self.tok.vocab_size}")
            out[pos:end - 1] = ids
            out[end - 1] = self.tok.eos_id
            pos = int(end)
        # file.write, not ndarray.tofile: tofile loses small writes to a full disk silently and
        # reports large ones without an errno.
        self.f.write(memoryview(out))
        base = self.offsets[-1]
        self.offsets.extend((ends + base).tolist())

    def close(self) -> None:
        try:
            self.flush()
        finally:
            self.f.close()


def _progress(total_bytes: int, enabled: bool):
    """A rich progress bar on stderr for large inputs when stderr is a terminal, or None.

    Not on a pipe or a log file: a bar there is only noise (the summary line says what was done).
    """
    isatty = getattr(sys.stderr, "isatty", None)
    if not enabled or total_bytes < PROGRESS_MIN_BYTES or not (isatty and isatty()):
        return None
    from rich.console import Console
    from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                               TransferSpeedColumn)
    return Progress(TextColumn("tokenizing"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                    TimeRemainingColumn(), console=Console(stderr=True), transient=False)


def _temporary_names(output: Path) -> tuple[Path, Path]:
    """(directory being written, earlier dataset being replaced): hidden names beside `output`."""
    stem = output.parent / f".{output.name}"
    return Path(f"{stem}.tmp-{os.getpid()}"), Path(f"{stem}.old-{os.getpid()}")


def _install(tmp: Path, output: Path) -> None:
    """Move the finished temporary directory to `output`, replacing an older dataset there.

    If the final rename fails the older dataset is moved back, so `output` is never lost.
    """
    if not output.exists():
        os.rename(tmp, output)
        return
    old = _temporary_names(output)[1]
    os.rename(output, old)
    try:
        os.rename(tmp, output)
    except BaseException:
        os.rename(old, output)
        raise
    shutil.rmtree(old, ignore_errors=True)


_TEMPORARY = re.compile(r"\..+\.(?:tmp|old)-(?P<pid>[0-9]+)")
_DATASET_FILES = frozenset({"tokens.bin", "docs.npy", "meta.json"})


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    except OverflowError:  # no process can have this id
        return False
    return True


def _is_stale_temporary(entry: Path) -> bool:
    """A directory named like ours, holding only dataset files, whose writing process is gone."""
    m = _TEMPORARY.fullmatch(entry.name)
    if not m or int(m["pid"]) == os.getpid() or _process_alive(int(m["pid"])):
        return False
    if entry.is_symlink() or not entry.is_dir():
        return False
    return all(c.name in _DATASET_FILES and c.is_file() and not c.is_symlink() for c in entry.iterdir())


def remove_stale_temporaries(parent: Path) -> list[Path]:
    """Remove the temporary directories that killed runs of `prepare` left in `parent`.

    Only those whose process no longer exists on this machine; says so on stderr, one line each.
    """
    removed = []
    for entry in sorted(parent.iterdir()):
        if _is_stale_temporary(entry):
            shutil.rmtree(entry, ignore_errors=True)
            if not entry.exists():
                removed.append(entry)
                print(f"note: removed stale temporary directory {entry} left by an interrupted run "
                      f"(pid {_TEMPORARY.fullmatch(entry.name)['pid']})", file=sys.stderr)
    return removed


def _check_output(output: Path) -> None:
    if output.exists() and not output.is_dir():
        raise UserError(f"output {str(output)!r} exists and is not a directory")
    existing = next(a for a in output.absolute().parents if a.exists())
    if not existing.is_dir():
        raise UserError(f"output {str(output)!r}: {existing} is a file, not a directory")
    if output.is_dir() and any(output.iterdir()) and not (output / "meta.json").exists():
        # Only replace an earlier dataset (or an empty directory), never unrelated files.
        raise UserError(
            f"output {str(output)!r} is a non-empty directory that is not a moetrain dataset; "
            "choose a new or empty directory")


def _output_error(err: OSError, output: Path, had_dataset: bool, needed_bytes: int) -> UserError:
    """One line for a failure to write `output`: why, where, and what is left as it was.

    Paths of our own temporary directories are reported as the directory that holds them.
    """
    tmp, old = _temporary_names(output)
    where = err.filename
    if where is None or any(Path(where).is_relative_to(p) for p in (tmp, old, output)):
        where = str(output.parent.resolve())
    after = []
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        after.append(f"about {format_bytes(needed_bytes)} needed")
    if not had_dataset:
        after.append("no dataset was written")
    elif (output / "meta.json").exists():
        after.append(f"the dataset already at {output} is unchanged")
    elif old.exists():
        after.append(f"the earlier dataset is at {old}; rename it back to {output}")
    if tmp.exists():
        after.append(f"remove {tmp} by hand")
    reported = OSError(err.errno, err.strerror, where)
    return os_error(reported, f"writing dataset {output}", after="; ".join(after))


def _write_dataset(tmp: Path, paths: list[Path], readers: list, tok, description: dict, inputs: list[str],
                   counter: _Counter, progress: bool) -> dict:
    """Tokenize `paths` (from `inputs`) into the existing directory `tmp`; returns the meta.json written."""
    sources = []
    writer = _Writer(tmp, tok)
    total_bytes = sum(p.stat().st_size for p in paths)
    bar = _progress(total_bytes, progress)
    task = bar.add_task("tokenize", total=total_bytes) if bar else None
    if bar:
        bar.start()
    try:
        for p, read in zip(paths, readers):
            docs_before = len(writer.offsets) - 1  # the buffer is empty between files
            for text in read(p, counter):
                writer.add(text)
                if not writer.buffer:  # just flushed a chunk
                    counter.flushed(writer.num_tokens)
                    if bar:
                        bar.update(task, completed=counter.bytes)
            writer.flush()  # so per-file token counts are exact
            counter.flushed(writer.num_tokens)
            ndocs = len(writer.offsets) - 1 - docs_before
            ntok = writer.offsets[-1] - writer.offsets[-1 - ndocs] if ndocs else 0
            sources.append({"path": str(p.resolve()), "documents": ndocs, "tokens": int(ntok),
                            "bytes": p.stat().st_size})
            if bar:
                bar.update(task, completed=counter.bytes)
        writer.close()
    finally:
        writer.f.close()  # after a failure: only the file, no more tokenizing
        if bar:
            bar.stop()
    num_docs = len(writer.offsets) - 1
    if num_docs == 0:
        raise UserError(f"no documents found in {', '.join(inputs)}: "
                        "the files are empty or hold only blank lines")
    np.save(tmp / "docs.npy", np.frombuffer(writer.offsets, dtype=np.int64))
    meta = {
        "format_version": FORMAT_VERSION,
        "dtype": writer.dtype.name,
        "vocab_size": int(tok.vocab_size),
        "eos_id": int(tok.eos_id),
        "num_tokens": int(writer.num_tokens),
        "num_docs": num_docs,
        "tokenizer": description,
        "sources": sources,
    }
    (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def prepare(inputs: list[str], tokenizer: str, output: str, progress: bool = True) -> dict:
    """Tokenize `inputs` with `tokenizer` ('bytes' or a tokenizer.json) into dataset dir `output`.

    Returns the dataset's meta.json content plus ``output`` (the directory) and ``seconds``.
    The train/eval split is not decided here: `TokenDataset` splits documents when it loads.
    ``progress``: a progress bar on stderr for large inputs when stderr is a terminal.
    Failures to write are one-line UserErrors; the temporary directory is removed on any
    failure or interrupt, and an earlier dataset at `output` is left as it was.
    """
    out = Path(output)
    paths = input_files(inputs, out)
    readers = [_reader(p) for p in paths]  # refuses binary inputs before any work
    _check_output(out)
    tok = load_tokenizer(tokenizer)
    description = tok.describe()  # reads the tokenizer file: an OSError below is about the output

    t0 = time.perf_counter()
    had_dataset = (out / "meta.json").exists()
    counter = _Counter()
    tmp = _temporary_names(out)[0]
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(out.parent)
        try:
            if tmp.exists():  # left by an earlier process that had our pid
                shutil.rmtree(tmp)
            tmp.mkdir()
            meta = _write_dataset(tmp, paths, readers, tok, description, inputs, counter, progress)
            _install(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    except OSError as err:
        total_bytes = sum(p.stat().st_size for p in paths)
        needed = _needed_bytes(total_bytes, counter, token_dtype(tok.vocab_size).itemsize)
        raise _output_error(err, out, had_dataset, needed) from None
    return {**meta, "output": str(out), "seconds": round(time.perf_counter() - t0, 3)}
