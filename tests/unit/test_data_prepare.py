"""`moetrain data prepare` (moetrain.train.tokenize): exact file contents for hand-computed inputs."""

import errno
import hashlib
import importlib.util
import json
import os
import re

import numpy as np
import pytest

from moetrain import cli
from moetrain.errors import UserError
from moetrain.train import tokenize
from moetrain.train.tokenize import prepare

EOS = 256


def read_dataset(d):
    meta = json.loads((d / "meta.json").read_text())
    tokens = np.fromfile(d / "tokens.bin", dtype=np.dtype(meta["dtype"]))
    docs = np.load(d / "docs.npy")
    return meta, tokens, docs


def test_txt_bytes(tmp_path):
    f = tmp_path / "a.txt"
    # Two documents: blank (and whitespace-only) lines separate them, CRLF endings are dropped,
    # trailing spaces inside a line are kept.
    f.write_bytes(b"Hi\r\nyou  \n\n  \n\nok\n")
    summary = prepare([str(f)], "bytes", str(tmp_path / "out"), progress=False)
    meta, tokens, docs = read_dataset(tmp_path / "out")
    expected = [72, 105, 10, 121, 111, 117, 32, 32, EOS, 111, 107, EOS]   # "Hi\nyou  " EOS "ok" EOS
    assert tokens.dtype == np.uint16
    assert tokens.tolist() == expected
    assert docs.dtype == np.int64 and docs.tolist() == [0, 9, 12]
    assert meta == {
        "format_version": 1, "dtype": "uint16", "vocab_size": 257, "eos_id": 256,
        "num_tokens": 12, "num_docs": 2, "tokenizer": {"type": "bytes"},
        "sources": [{"path": str(f.resolve()), "documents": 2, "tokens": 12, "bytes": 18}],
    }
    assert summary["num_tokens"] == 12 and summary["output"] == str(tmp_path / "out")
    assert sorted(os.listdir(tmp_path)) == ["a.txt", "out"]   # no temporary directory left behind


def test_jsonl_and_several_inputs(tmp_path):
    a = tmp_path / "a.jsonl"
    a.write_text('{"text": "h\\u00e9", "id": 7}\n\n{"text": ""}\n{"text": "a\\nb"}\n')
    b = tmp_path / "b.txt"
    b.write_text("xy")   # no final newline, a single document
    prepare([str(a), str(b)], "bytes", str(tmp_path / "ds"), progress=False)
    meta, tokens, docs = read_dataset(tmp_path / "ds")
    # "hé" = 104, 0xC3, 0xA9; "" is an empty document (only its EOS); "a\nb"; then "xy" from b.txt.
    assert tokens.tolist() == [104, 195, 169, EOS, EOS, 97, 10, 98, EOS, 120, 121, EOS]
    assert docs.tolist() == [0, 4, 5, 9, 12]
    assert meta["num_docs"] == 4 and meta["num_tokens"] == 12
    assert [(s["documents"], s["tokens"]) for s in meta["sources"]] == [(3, 9), (1, 3)]


@pytest.mark.parametrize("line, what", [
    ('{"text": "fine"', "invalid JSON"),
    ('{"txt": "typo"}', 'no "text" field'),
    ('["text"]', 'no "text" field'),
    ('{"text": 5}', '"text" is int'),
])
def test_bad_jsonl_line_names_file_and_line(tmp_path, line, what):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"text": "one"}\n\n' + line + "\n")
    with pytest.raises(UserError) as e:
        prepare([str(f)], "bytes", str(tmp_path / "out"), progress=False)
    assert f"{f}:3:" in str(e.value) and what in str(e.value)
    assert sorted(os.listdir(tmp_path)) == ["bad.jsonl"]   # nothing written, tmp removed


def test_input_errors(tmp_path):
    good = tmp_path / "g.txt"
    good.write_text("x\n")
    missing = str(tmp_path / "nope.txt")
    with pytest.raises(UserError, match="nope.txt"):
        prepare([missing], "bytes", str(tmp_path / "o"))
    with pytest.raises(UserError, match="tok.json"):
        prepare([str(good)], str(tmp_path / "tok.json"), str(tmp_path / "o"))
    empty = tmp_path / "empty.txt"
    empty.write_text("\n \n")
    with pytest.raises(UserError, match="no documents"):
        prepare([str(empty)], "bytes", str(tmp_path / "o"), progress=False)
    (tmp_path / "bin.txt").write_bytes(b"ok\n\xff\n")
    with pytest.raises(UserError, match=r"bin.txt:2: not valid UTF-8"):
        prepare([str(tmp_path / "bin.txt")], "bytes", str(tmp_path / "o"), progress=False)
    assert not (tmp_path / "o").exists()


def test_output_replaced_atomically_and_unrelated_dirs_protected(tmp_path):
    f = tmp_path / "a.txt"
    f.write_text("abc\n")
    out = tmp_path / "out"
    prepare([str(f)], "bytes", str(out), progress=False)
    f.write_text("de\n")
    prepare([str(f)], "bytes", str(out), progress=False)   # replaces the earlier dataset
    assert read_dataset(out)[1].tolist() == [100, 101, EOS]
    assert sorted(os.listdir(tmp_path)) == ["a.txt", "out"]
    other = tmp_path / "mine"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    with pytest.raises(UserError, match="not a moetrain dataset"):
        prepare([str(f)], "bytes", str(other), progress=False)
    assert (other / "notes.txt").read_text() == "keep me"
    with pytest.raises(UserError, match=r"'.*notes.txt/sub/ds': .*notes.txt is a file, not a directory"):
        prepare([str(f)], "bytes", str(other / "notes.txt" / "sub" / "ds"), progress=False)
    # A failure in a later file leaves the earlier dataset untouched.
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{oops\n")
    with pytest.raises(UserError):
        prepare([str(f), str(bad)], "bytes", str(out), progress=False)
    assert read_dataset(out)[1].tolist() == [100, 101, EOS]


MARKUP = re.compile(r"\[/?[a-z][a-z ._-]*\]")   # rich markup such as [yellow] or [/bold]


def test_progress_bar_only_on_a_terminal_same_result(tmp_path, monkeypatch, capsys):
    import sys
    monkeypatch.setattr(tokenize, "PROGRESS_MIN_BYTES", 0)
    monkeypatch.setattr(tokenize, "_CHUNK_DOCS", 2)   # several flushes
    f = tmp_path / "a.txt"
    f.write_text("a\n\nb\n\nc\n\nd\n\ne\n")
    code, out, err = prepare_cli(capsys, f, output=tmp_path / "o")   # stderr is not a terminal
    assert (code, err) == (0, []) and out.startswith("wrote 10 tokens in 5 documents to ")
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    code, out, err = prepare_cli(capsys, f, output=tmp_path / "o")
    assert code == 0 and "tokenizing" in "".join(err) and "14/14 bytes" in "".join(err)
    assert not MARKUP.search(out + "".join(err))
    _, tokens, docs = read_dataset(tmp_path / "o")
    assert tokens.tolist() == [97, EOS, 98, EOS, 99, EOS, 100, EOS, 101, EOS]
    assert docs.tolist() == [0, 2, 4, 6, 8, 10]


# ---- Hugging Face tokenizers ---------------------------------------------------------------------

needs_tokenizers = pytest.mark.skipif(importlib.util.find_spec("tokenizers") is None,
                                      reason="the tokenizers package is not installed")


def wordlevel(tmp_path, vocab, name="tokenizer.json"):
    from tokenizers import Tokenizer, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    path = tmp_path / name
    tok.save(str(path))
    return path


@needs_tokenizers
def test_wordlevel_exact_ids(tmp_path):
    vocab = {"<unk>": 0, "</s>": 1, "the": 2, "cat": 3, "sat": 4, "dog": 5}
    tp = wordlevel(tmp_path, vocab)
    f = tmp_path / "c.jsonl"
    f.write_text('{"text": "the cat sat"}\n{"text": "the dog ran"}\n')
    meta = prepare([str(f)], str(tp), str(tmp_path / "o"), progress=False)
    _, tokens, docs = read_dataset(tmp_path / "o")
    assert tokens.tolist() == [2, 3, 4, 1, 2, 5, 0, 1]   # "ran" is unknown -> <unk>; EOS = "</s>" = 1
    assert docs.tolist() == [0, 4, 8]
    assert (meta["vocab_size"], meta["eos_id"], meta["dtype"]) == (6, 1, "uint16")
    assert meta["tokenizer"] == {"type": "tokenizers", "path": str(tp.resolve()),
                                 "sha256": hashlib.sha256(tp.read_bytes()).hexdigest(), "eos_token": "</s>"}


@needs_tokenizers
def test_large_vocab_uses_uint32(tmp_path):
    vocab = {f"w{i}": i for i in range(70000)}
    vocab["<unk>"] = 70000
    vocab["<|endoftext|>"] = 70001
    tp = wordlevel(tmp_path, vocab)
    f = tmp_path / "c.txt"
    f.write_text("w69999 w3\n\nw65536\n")
    meta = prepare([str(f)], str(tp), str(tmp_path / "o"), progress=False)
    _, tokens, _ = read_dataset(tmp_path / "o")
    assert meta["dtype"] == "uint32" and meta["vocab_size"] == 70002 and meta["eos_id"] == 70001
    assert tokens.dtype == np.uint32 and tokens.tolist() == [69999, 3, 70001, 65536, 70001]


@needs_tokenizers
def test_tokenizer_without_eos_is_an_error(tmp_path):
    tp = wordlevel(tmp_path, {"<unk>": 0, "a": 1})
    f = tmp_path / "c.txt"
    f.write_text("a\n")
    with pytest.raises(UserError, match=r"tokenizer\.json.*end-of-document"):
        prepare([str(f)], str(tp), str(tmp_path / "o"), progress=False)
    bad = tmp_path / "broken.json"
    bad.write_text("{not json")
    with pytest.raises(UserError, match="broken.json"):
        prepare([str(f)], str(bad), str(tmp_path / "o"), progress=False)


@needs_tokenizers
def test_trained_bpe_round_trip(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    corpus = ["the quick brown fox jumps over the lazy dog", "a stitch in time saves nine",
              "héllo wörld, ünïcode too"] * 20
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    tp = tmp_path / "bpe.json"
    tok.save(str(tp))
    docs_text = ["the lazy fox saves time", "héllo dog\nsecond line", "zebra! (unseen words)"]
    f = tmp_path / "d.jsonl"
    f.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs_text))
    meta = prepare([str(f)], str(tp), str(tmp_path / "o"), progress=False)
    _, tokens, docs = read_dataset(tmp_path / "o")
    eos = tok.token_to_id("<|endoftext|>")
    assert meta["eos_id"] == eos and meta["vocab_size"] == tok.get_vocab_size()
    assert meta["num_docs"] == 3 and docs[-1] == len(tokens) == meta["num_tokens"]
    for i, text in enumerate(docs_text):
        ids = tokens[docs[i]:docs[i + 1]].tolist()
        assert ids[-1] == eos and eos not in ids[:-1]
        assert ids[:-1] == tok.encode(text, add_special_tokens=False).ids
        assert tok.decode(ids[:-1]) == text   # byte-level BPE decodes back to the exact text


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
def test_writer_reports_a_full_disk_with_its_errno(tmp_path):
    # /dev/full fails every write with ENOSPC; a chunk smaller than any buffer must still fail.
    writer = tokenize._Writer(tmp_path, tokenize.ByteTokenizer())
    writer.f.close()
    writer.f = open("/dev/full", "wb")
    writer.add("abc")
    with pytest.raises(OSError) as e:
        writer.close()
    assert e.value.errno == errno.ENOSPC


# ---- through the command line: one line on stderr, nothing left behind -----------------------------

def prepare_cli(capsys, *inputs, output, tokenizer="bytes"):
    """(exit code, stdout, stderr lines) of `moetrain data prepare`."""
    code = cli.main(["data", "prepare", "--input", *map(str, inputs), "--tokenizer", tokenizer,
                     "--output", str(output)])
    out, err = capsys.readouterr()
    return code, out, err.splitlines()


def one_error(capsys, *inputs, output, words=()):
    """The one stderr line of a failed prepare (exit 2); it contains each of `words`."""
    code, out, err = prepare_cli(capsys, *inputs, output=output)
    assert (code, out, len(err)) == (2, "", 1), err
    assert err[0].startswith("error: ")
    for w in words:
        assert w in err[0], (w, err[0])
    return err[0]


def test_a_file_of_any_other_name_is_text(tmp_path, capsys):
    (tmp_path / "corpus").mkdir()
    readme, notes = tmp_path / "corpus" / "README", tmp_path / "notes.md"
    readme.write_text("hi\n\nyo\n")
    notes.write_text("ok")
    code, out, err = prepare_cli(capsys, readme, notes, output=tmp_path / "ds")
    assert (code, err) == (0, []) and out.startswith("wrote 9 tokens in 3 documents to ")
    meta, tokens, _ = read_dataset(tmp_path / "ds")
    assert tokens.tolist() == [104, 105, EOS, 121, 111, EOS, 111, 107, EOS]
    assert [s["path"] for s in meta["sources"]] == [str(readme.resolve()), str(notes.resolve())]
    (tmp_path / "latin1").write_bytes("caf\n\ncaf\xe9\n".encode("latin-1"))
    one_error(capsys, tmp_path / "latin1", output=tmp_path / "o",
              words=[f"{tmp_path / 'latin1'}:3: not valid UTF-8 text"])
    assert sorted(os.listdir(tmp_path)) == ["corpus", "ds", "latin1", "notes.md"]


def test_a_directory_is_every_file_under_it_sorted_without_hidden_ones(tmp_path, capsys):
    root = tmp_path / "c"
    for rel, text in [("b/z.txt", "z"), ("a.jsonl", '{"text": "a"}\n'), ("b/a/README", "ba"),
                      ("B", "B"), (".hidden", "no"), (".git/config", "no"), ("b/.swp", "no")]:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    (root / "link").symlink_to(root / "B")   # a link to a file counts as that file
    out = root / "ds"
    for _ in range(2):   # the second run must not read the first run's output under root
        code, _, err = prepare_cli(capsys, root, output=out)
        assert (code, err) == (0, [])
        meta, tokens, _ = read_dataset(out)
        names = [os.path.relpath(s["path"], root.resolve()) for s in meta["sources"]]
        assert names == ["B", "a.jsonl", "b/a/README", "b/z.txt", "B"]   # "link" resolves to B
        assert bytes(t for t in tokens.tolist() if t != EOS) == b"BabazB"


def test_directory_and_missing_input_errors(tmp_path, capsys):
    empty = tmp_path / "empty"
    (empty / "sub").mkdir(parents=True)
    (empty / ".only-hidden").write_text("x")
    one_error(capsys, empty, output=tmp_path / "o", words=[f"input {str(empty)!r}", "a directory without files"])
    one_error(capsys, tmp_path / "nope", output=tmp_path / "o",
              words=[f"input {str(tmp_path / 'nope')!r}", "no such file or directory"])
    assert sorted(os.listdir(tmp_path)) == ["empty"]


def _zip_bytes():
    import io
    import zipfile
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("a.txt", "text")
    return buf.getvalue()


def _tar_bytes():
    import io
    import tarfile
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as t:
        info = tarfile.TarInfo("a.txt")
        info.size = 4
        t.addfile(info, io.BytesIO(b"text"))
    return buf.getvalue()


@pytest.mark.parametrize("name, content, words", [
    ("c.jsonl.gz", lambda: __import__("gzip").compress(b'{"text": "a"}\n'), ["gzip-compressed", "decompress"]),
    ("c.txt.bz2", lambda: __import__("bz2").compress(b"text\n"), ["bzip2-compressed", "bunzip2"]),
    ("c.xz", lambda: __import__("lzma").compress(b"text\n"), ["xz-compressed", "unxz"]),
    ("c.zst", lambda: b"\x28\xb5\x2f\xfd" + b"\x00" * 20, ["zstd-compressed", "zstd -d"]),
    ("c.zip", _zip_bytes, ["zip archive", "extract"]),
    ("c.tar", _tar_bytes, ["tar archive", "extract"]),
    ("train-00000", lambda: b"PAR1\x15\x04" + b"\x00" * 20 + b"PAR1", ["Parquet file", ".jsonl"]),
    ("u16.txt", lambda: "text\n".encode("utf-16"), ["UTF-16 text", "convert it to UTF-8"]),
    ("tokens.bin", lambda: np.arange(65, 75, dtype=np.uint16).tobytes(), ["binary data", "NUL byte at offset 1"]),
])
def test_binary_inputs_are_refused_with_what_they_are(tmp_path, capsys, name, content, words):
    f = tmp_path / name
    f.write_bytes(content())
    line = one_error(capsys, f, output=tmp_path / "o",
                     words=[f"input {str(f)!r} is ", "not text", *words])
    assert "not valid UTF-8" not in line
    assert sorted(os.listdir(tmp_path)) == [name]


def test_an_unreadable_input_is_one_line(tmp_path, capsys, monkeypatch):
    f = tmp_path / "a.txt"
    f.write_text("x")

    def denied(path, *args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    monkeypatch.setattr(tokenize, "open", denied, raising=False)
    one_error(capsys, f, output=tmp_path / "o", words=[f"reading input {str(f)!r}: permission denied ({f})"])
    assert sorted(os.listdir(tmp_path)) == ["a.txt"]


# ---- writing the output: read-only, no permission, full disk, interrupts, stale temporaries --------

def hidden(d):
    return sorted(n for n in os.listdir(d) if n.startswith("."))


@pytest.mark.parametrize("code, reason", [(errno.EROFS, "read-only file system"),
                                          (errno.EACCES, "permission denied")])
def test_output_directory_not_writable(tmp_path, capsys, monkeypatch, code, reason):
    f = tmp_path / "a.txt"
    f.write_text("abc\n")
    parent = tmp_path / "ro"
    parent.mkdir()
    real_mkdir = os.mkdir

    def mkdir(path, *args, **kwargs):   # what the OS does in a read-only or locked directory
        if os.path.dirname(os.fspath(path)) == str(parent):
            raise OSError(code, os.strerror(code), os.fspath(path))
        return real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", mkdir)
    out = parent / "ds"
    one_error(capsys, f, output=out,
              words=[f"error: writing dataset {out}: {reason} ({parent.resolve()}); no dataset was written"])
    assert os.listdir(parent) == []


def test_output_directory_without_write_permission(tmp_path, capsys):
    f = tmp_path / "a.txt"
    f.write_text("abc\n")
    parent = tmp_path / "locked"
    parent.mkdir()
    parent.chmod(0o555)
    try:
        if os.access(parent, os.W_OK):
            pytest.skip("chmod does not stop this user's writes (root)")
        one_error(capsys, f, output=parent / "ds",
                  words=[f"writing dataset {parent / 'ds'}: permission denied ({parent.resolve()})"])
        assert os.listdir(parent) == []
    finally:
        parent.chmod(0o755)


class _FullDisk:
    """A tokens.bin whose writes fail like a full disk's."""

    def __init__(self, f, filename):
        self.f, self.filename = f, filename

    def write(self, data):
        raise OSError(errno.ENOSPC, "No space left on device", self.filename)

    def close(self):
        self.f.close()


@pytest.mark.parametrize("with_filename", [False, True])
def test_disk_full_keeps_the_earlier_dataset(tmp_path, capsys, monkeypatch, with_filename):
    f = tmp_path / "a.txt"
    f.write_text("old\n")
    out = tmp_path / "ds"
    assert prepare_cli(capsys, f, output=out)[0] == 0
    f.write_text("new text\n")   # 9 bytes -> at most 9 uint16 tokens = 18 bytes

    def full_open(path, mode="r", *args, **kwargs):
        fh = open(path, mode, *args, **kwargs)
        if os.path.basename(path) == "tokens.bin" and "w" in mode:
            return _FullDisk(fh, str(path) if with_filename else None)
        return fh

    monkeypatch.setattr(tokenize, "open", full_open, raising=False)
    line = one_error(capsys, f, output=out, words=[
        f"error: writing dataset {out}: disk full ({tmp_path.resolve()}); ", " free; about 18 B needed; ",
        f"the dataset already at {out} is unchanged"])
    assert line.endswith("is unchanged")
    assert read_dataset(out)[1].tolist() == [111, 108, 100, EOS]   # "old"
    assert hidden(tmp_path) == []


def test_needed_bytes_follow_the_tokenizer_rate_so_far():
    c = tokenize._Counter()
    assert tokenize._needed_bytes(1000, c, 2) == 2000   # nothing flushed yet: a token a byte
    c.bytes = 400
    c.flushed(100)   # 100 tokens for the first 400 bytes
    c.bytes = 450    # read further, not yet tokenized: the rate stays that of the flush
    assert tokenize._needed_bytes(1000, c, 4) == 1000


def test_a_failed_final_rename_puts_the_earlier_dataset_back(tmp_path, capsys, monkeypatch):
    f = tmp_path / "a.txt"
    f.write_text("old\n")
    out = tmp_path / "ds"
    assert prepare_cli(capsys, f, output=out)[0] == 0
    real_rename = os.rename

    def rename(src, dst):
        if ".tmp-" in os.fspath(src):
            raise PermissionError(errno.EACCES, "Permission denied", os.fspath(src), os.fspath(dst))
        return real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    one_error(capsys, f, output=out, words=[f"writing dataset {out}: permission denied",
                                            f"the dataset already at {out} is unchanged"])
    assert read_dataset(out)[1].tolist() == [111, 108, 100, EOS]
    assert hidden(tmp_path) == []


def test_interrupt_or_bug_mid_prepare_removes_the_temporary_directory(tmp_path, capsys, monkeypatch):
    f = tmp_path / "a.txt"
    f.write_text("old\n")
    out = tmp_path / "ds"
    assert prepare_cli(capsys, f, output=out)[0] == 0
    for exc in (KeyboardInterrupt(), RuntimeError("a bug")):
        calls = []

        def encode(self, texts, exc=exc, calls=calls):
            calls.append(texts)
            assert os.listdir(out.parent / f".ds.tmp-{os.getpid()}") == ["tokens.bin"]   # writing has begun
            raise exc
        monkeypatch.setattr(tokenize.ByteTokenizer, "encode_batch", encode)
        if isinstance(exc, KeyboardInterrupt):
            assert prepare_cli(capsys, f, output=out) == (130, "", ["error: interrupted"])
        else:
            with pytest.raises(RuntimeError, match="a bug"):   # a bug keeps its traceback
                cli.main(["data", "prepare", "--input", str(f), "--tokenizer", "bytes", "--output", str(out)])
        assert hidden(tmp_path) == []
        assert read_dataset(out)[1].tolist() == [111, 108, 100, EOS]
        assert calls == [["old"]]   # cleaning up tokenizes nothing more


def dead_pid():
    import subprocess
    import sys
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()   # reaped: no process has this id now
    return p.pid


def test_stale_temporaries_of_dead_runs_are_removed_live_ones_kept(tmp_path, capsys):
    f = tmp_path / "a.txt"
    f.write_text("abc\n")
    dead, live = dead_pid(), os.getppid()
    made = {}
    for name, files in [(f".ds.tmp-{dead}", ["tokens.bin"]),               # killed while tokenizing
                        (f".other.old-{dead}", ["tokens.bin", "docs.npy", "meta.json"]),  # killed in _install
                        (f".ds.tmp-{live}", ["tokens.bin"]),               # another run, still going
                        (f".other.tmp-{os.getpid()}", []),                 # this process
                        (f".notes.tmp-{dead}", ["mine.txt"])]:             # not a dataset: not ours
        made[name] = tmp_path / name
        made[name].mkdir()
        for n in files:
            (made[name] / n).write_bytes(b"x")
    code, _, err = prepare_cli(capsys, f, output=tmp_path / "ds")
    assert code == 0
    assert err == [f"note: removed stale temporary directory {made[n]} left by an interrupted run (pid {dead})"
                   for n in (f".ds.tmp-{dead}", f".other.old-{dead}")]
    assert hidden(tmp_path) == sorted([f".ds.tmp-{live}", f".other.tmp-{os.getpid()}", f".notes.tmp-{dead}"])
    assert read_dataset(tmp_path / "ds")[1].tolist() == [97, 98, 99, EOS]
