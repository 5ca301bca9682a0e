"""moetrain.train.data: packing, split, shuffle, resume, data-parallel slicing, synthetic data."""

import json
import math
import shutil
import sys
import types

import numpy as np
import pytest
import torch

from moetrain import cli
from moetrain.config.schema import Config
from moetrain.errors import UserError
from moetrain.train import data as data_mod
from moetrain.train.data import BatchAhead, DataIterator, SyntheticData, TokenDataset, build_data
from moetrain.train.tokenize import prepare

EOS = 256
NDOCS = 120


def doc_text(i):
    # Unique, recognisable documents of varying length (3..40 bytes), no EOS inside.
    rng = np.random.default_rng(i)
    return f"d{i:03d}:" + "".join(chr(c) for c in rng.integers(97, 123, size=int(rng.integers(0, 35))))


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    f = d / "docs.jsonl"
    f.write_text("".join(json.dumps({"text": doc_text(i)}) + "\n" for i in range(NDOCS)))
    prepare([str(f)], "bytes", str(d / "ds"), progress=False)
    return d / "ds"


def full_stream():
    return np.array([t for i in range(NDOCS) for t in list(doc_text(i).encode()) + [EOS]], dtype=np.int64)


def doc_ids(stream):
    """Document numbers in a stream of whole documents, in order."""
    parts = bytes(int(t) for t in stream if t != EOS).split(b"d")  # every document starts with "dNNN:"
    return [int(p[:3]) for p in parts if p[3:4] == b":"]


def epoch_batches(it, n_seq, B):
    xs, ys = [], []
    for _ in range(n_seq // B):
        x, y = it.next_batch(B)
        xs.append(x)
        ys.append(y)
    return torch.cat(xs), torch.cat(ys)


# ---- packing ----------------------------------------------------------------------------------

def test_packing_covers_stream_without_loss(dataset):
    S = 8
    ds = TokenDataset(str(dataset), S, eval_fraction=0.0, shuffle=False, vocab_size=257)
    stream = full_stream()
    L = len(stream)
    assert ds.num_tokens == L and ds.num_sequences == (L - 1) // S
    N = ds.num_sequences
    x, y = epoch_batches(DataIterator(ds), N, 1)
    assert x.dtype == torch.int64 and y.dtype == torch.int64 and x.shape == (N, S)
    # Consecutive sequences overlap by one token: inputs tile stream[:N*S], labels stream[1:N*S+1].
    assert x.reshape(-1).tolist() == stream[:N * S].tolist()
    assert y.reshape(-1).tolist() == stream[1:N * S + 1].tolist()
    assert L - 1 - N * S < S   # fewer than S tokens left unused per epoch


def test_split_disjoint_deterministic_and_packed(dataset):
    S = 4
    tr = TokenDataset(str(dataset), S, split="train", eval_fraction=0.25, shuffle=False)
    ev = TokenDataset(str(dataset), S, split="eval", eval_fraction=0.25, shuffle=False)
    tr_ids, ev_ids = doc_ids(tr.stream(0, tr.num_tokens)), doc_ids(ev.stream(0, ev.num_tokens))
    assert set(tr_ids).isdisjoint(ev_ids) and sorted(tr_ids + ev_ids) == list(range(NDOCS))
    assert tr_ids == sorted(tr_ids) and ev_ids == sorted(ev_ids)   # file order kept inside a split
    assert 15 <= len(ev_ids) <= 45   # ~0.25 * 120 = 30
    # Each split's stream is exactly its documents, each followed by EOS.
    expect = [t for i in ev_ids for t in list(doc_text(i).encode()) + [EOS]]
    assert ev.stream(0, ev.num_tokens).tolist() == expect
    # Batches of the train split tile the train stream.
    x, _ = epoch_batches(DataIterator(tr), tr.num_sequences, 1)
    assert x.reshape(-1).tolist() == tr.stream(0, tr.num_sequences * S).tolist()
    # Deterministic; the split does not depend on the training seed, only on split_seed.
    again = TokenDataset(str(dataset), S, split="eval", eval_fraction=0.25, seed=99)
    assert doc_ids(again.stream(0, again.num_tokens)) == ev_ids
    other = TokenDataset(str(dataset), S, split="eval", eval_fraction=0.25, split_seed=1)
    assert doc_ids(other.stream(0, other.num_tokens)) != ev_ids


def test_split_hash_matches_pure_python_splitmix64():
    def ref(i, seed):
        m = (1 << 64) - 1
        x = (i + seed * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) & m
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & m
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & m
        x ^= x >> 31
        return (x >> 11) / 2.0 ** 53
    ids = np.array([0, 1, 2, 1000, 2**40 + 3])
    for seed in (0, 7):
        u = [ref(int(i), seed) for i in ids]
        assert data_mod._split_is_eval(ids, 0.5, seed).tolist() == [v < 0.5 for v in u]
        for frac in sorted(u):   # the threshold is strict: u < fraction
            assert data_mod._split_is_eval(ids, frac, seed).tolist() == [v < frac for v in u]


def test_split_ranges_merge_across_chunks(dataset, monkeypatch):
    base = TokenDataset(str(dataset), 4, eval_fraction=0.25)
    monkeypatch.setattr(data_mod, "_DOC_CHUNK", 7)
    small = TokenDataset(str(dataset), 4, eval_fraction=0.25)
    assert small._starts.tolist() == base._starts.tolist() and small._ends.tolist() == base._ends.tolist()
    # With no eval split the whole file is a single range even when processed in chunks.
    whole = TokenDataset(str(dataset), 4, eval_fraction=0.0)
    assert whole._starts.tolist() == [0] and whole._ends.tolist() == [len(full_stream())]


# ---- shuffle and epochs ---------------------------------------------------------------------------

def test_shuffle_deterministic_and_a_permutation(dataset):
    S = 8
    plain = TokenDataset(str(dataset), S, eval_fraction=0.0, shuffle=False)
    N = plain.num_sequences
    ref = [plain.sequence(j).tolist() for j in range(N)]

    def epochs(seed, n_epochs=2):
        ds = TokenDataset(str(dataset), S, eval_fraction=0.0, seed=seed, shuffle=True)
        it = DataIterator(ds)
        out = []
        for _ in range(n_epochs):
            out.append([r.tolist() for r in it.next_batch_numpy(N)])
        assert (it.epoch, it.index) == (n_epochs, 0)
        return out

    a, b, c = epochs(1), epochs(1), epochs(2)
    assert a == b
    for ep in a + c:
        assert sorted(ep) == sorted(ref)   # each epoch visits every sequence exactly once
    assert a[0] != ref and a[0] != a[1] and a[0] != c[0]
    # The order of epoch 0 is exactly the documented permutation.
    perm = np.random.default_rng([1, data_mod._SALT_SHUFFLE, 0]).permutation(N)
    assert a[0] == [ref[j] for j in perm]


def test_epoch_wraps_inside_a_batch(dataset):
    ds = TokenDataset(str(dataset), 8, eval_fraction=0.0, shuffle=True, seed=3)
    N = ds.num_sequences
    it = DataIterator(ds)
    it.next_batch_numpy(N - 2)
    rows = it.next_batch_numpy(5)   # 2 from epoch 0, 3 from epoch 1
    assert (it.epoch, it.index) == (1, 3)
    o0, o1 = ds.order(0), ds.order(1)
    expect = [ds.sequence(int(o0[N - 2])), ds.sequence(int(o0[N - 1]))] + [ds.sequence(int(o1[k])) for k in range(3)]
    assert rows.tolist() == np.stack(expect).tolist()


# ---- resume and data parallelism ------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["tokens", "synthetic"])
def test_resume_gives_same_batches(dataset, kind):
    def make():
        if kind == "tokens":
            return DataIterator(TokenDataset(str(dataset), 16, eval_fraction=0.1, seed=5))
        return DataIterator(SyntheticData(50, 16, seed=5))

    it = make()
    n = it.source.num_sequences or 60   # token split: ~ 160 sequences
    for _ in range(n // 3 + 4):   # past the end of the first epoch of the token data
        it.next_batch(3)
    state = json.loads(json.dumps(it.state_dict()))   # survives a JSON round trip
    cont = [it.next_batch(3) for _ in range(20)]
    resumed = make()
    resumed.load_state_dict(state)
    for (x, y), (rx, ry) in zip(cont, [resumed.next_batch(3) for _ in range(20)]):
        assert torch.equal(x, rx) and torch.equal(y, ry)
    if kind == "tokens":
        assert state["epoch"] >= 1


def test_batch_ahead_yields_the_same_batches_and_resumes_at_the_first_untaken():
    plain = DataIterator(SyntheticData(50, 16, seed=5))
    want = [plain.next_batch(3) for _ in range(4)]
    ahead = BatchAhead(DataIterator(SyntheticData(50, 16, seed=5)), 3)
    got = [ahead.take()]
    ahead.fetch_ahead()  # holds batch 1
    assert ahead.state_dict() == {"epoch": 0, "index": 3, "source": ahead.data.source.describe()}
    got += [ahead.take(), ahead.take()]  # batch 1 held, batch 2 read on demand
    ahead.fetch_ahead()
    ahead.fetch_ahead()  # still batch 3
    state = json.loads(json.dumps(ahead.state_dict()))
    assert state["index"] == 9
    resumed = DataIterator(SyntheticData(50, 16, seed=5))
    resumed.load_state_dict(state)
    got += [ahead.take(), resumed.next_batch(3)]
    for (x, y), (wx, wy) in zip(got, want + [want[3]]):
        assert torch.equal(x, wx) and torch.equal(y, wy)


def test_resume_refuses_changed_data(dataset):
    it = DataIterator(TokenDataset(str(dataset), 16, eval_fraction=0.1, seed=5))
    state = it.state_dict()
    other = DataIterator(TokenDataset(str(dataset), 8, eval_fraction=0.1, seed=5))
    with pytest.raises(UserError, match=r"seq_length: saved 16, now 8"):
        other.load_state_dict(state)


@pytest.mark.parametrize("kind", ["tokens", "synthetic"])
def test_dp_slices_disjoint_and_equal_single_rank_batch(dataset, kind):
    dp, B = 3, 2

    def make(rank, size):
        src = (TokenDataset(str(dataset), 8, eval_fraction=0.0, seed=11) if kind == "tokens"
               else SyntheticData(40, 8, seed=11))
        return DataIterator(src, dp_rank=rank, dp_size=size)

    single = make(0, 1)
    ranks = [make(r, dp) for r in range(dp)]
    n = single.source.num_sequences or 60   # token data: 357 sequences of 8
    for _ in range(n // (dp * B) + 3):   # crosses the end of the first epoch of the token data
        ref = single.next_batch_numpy(dp * B)
        parts = [it.next_batch_numpy(B) for it in ranks]
        assert np.concatenate(parts).tolist() == ref.tolist()
        rows = [tuple(r) for p in parts for r in p.tolist()]
        assert len(set(rows)) == dp * B   # disjoint (all sequences here are distinct)
        assert all((it.epoch, it.index) == (single.epoch, single.index) for it in ranks)


# ---- validation errors --------------------------------------------------------------------------

def write_dataset(d, tokens, vocab_size, eos_id, docs=None, **meta):
    """A dataset directory in format 1, written by hand (uint16 tokens)."""
    d.mkdir(parents=True, exist_ok=True)
    tokens = np.asarray(tokens, dtype=np.uint16)
    tokens.tofile(d / "tokens.bin")
    docs = np.asarray(docs if docs is not None else [0, len(tokens)], dtype=np.int64)
    np.save(d / "docs.npy", docs)
    meta = {"format_version": 1, "dtype": "uint16", "vocab_size": vocab_size, "eos_id": eos_id,
            "num_tokens": len(tokens), "num_docs": len(docs) - 1, **meta}
    (d / "meta.json").write_text(json.dumps(meta))
    return d


def train_error(capsys, *overrides, monkeypatch=None):
    """The one stderr line of `moetrain train` (exit 2); with monkeypatch, `run` only builds the data."""
    if monkeypatch is not None:
        fake = types.ModuleType("moetrain.train.trainer")
        fake.run = lambda cfg: build_data(cfg)
        monkeypatch.setitem(sys.modules, "moetrain.train.trainer", fake)
    code = cli.main(["train", "train.device=cpu", *overrides])
    out, err = capsys.readouterr()
    assert (code, len(err.splitlines())) == (2, 1), err
    assert err.startswith("error: ")
    return err.strip()


def test_model_vocab_smaller_than_the_dataset_names_both_and_the_override(tmp_path, capsys):
    ds = write_dataset(tmp_path / "x", list(range(1, 1000)) + [0], vocab_size=1000, eos_id=0)
    line = train_error(capsys, "data.source=tokens", f"data.path={ds}", "model.vocab_size=512",
                       f"train.out_dir={tmp_path / 'run'}")   # the real trainer, up to loading the data
    assert line == (f"error: dataset {ds} has token ids up to 999 (vocab 1000) but model.vocab_size = 512; "
                    "set model.vocab_size=1000 or larger, or prepare the data with the model's tokenizer")


def test_vocab_checks_scan_every_chunk(tmp_path, monkeypatch):
    monkeypatch.setattr(data_mod, "_SCAN_CHUNK", 3)
    monkeypatch.setattr(data_mod, "_MAX_ID_CACHE", {})
    tokens = [5, 1, 2, 9, 700, 3, 4, 0]   # the largest id lies in the second of three chunks
    ds = write_dataset(tmp_path / "x", tokens, vocab_size=1000, eos_id=0)
    assert TokenDataset(str(ds), 2, eval_fraction=0.0, vocab_size=701).max_token_id == 700
    with pytest.raises(UserError, match=r"up to 700 \(vocab 1000\) but model.vocab_size = 700; set model.vocab_size=1000"):
        TokenDataset(str(ds), 2, eval_fraction=0.0, vocab_size=700)
    bad = write_dataset(tmp_path / "bad", tokens, vocab_size=600, eos_id=0)
    with pytest.raises(UserError, match=r"bad/tokens.bin: token id 700 >= the dataset's vocab_size 600 .*corrupt"):
        TokenDataset(str(bad), 2, eval_fraction=0.0)


def _meta(ds):
    return json.loads((ds / "meta.json").read_text())


def _set_meta(**kv):
    return lambda ds: (ds / "meta.json").write_text(json.dumps({**_meta(ds), **kv}))


def _drop_meta(key):
    return lambda ds: (ds / "meta.json").write_text(json.dumps({k: v for k, v in _meta(ds).items() if k != key}))


# (how the dataset is damaged, words the one line must hold after the dataset's path)
DAMAGE = [
    (lambda ds: shutil.rmtree(ds), ["data.path", "no such directory", "moetrain data prepare"]),
    (lambda ds: (shutil.rmtree(ds), ds.write_text("x")), ["data.path", "is not a directory"]),
    (lambda ds: (ds / "meta.json").unlink(), ["meta.json: missing", "not a dataset from `moetrain data prepare`"]),
    (lambda ds: (ds / "meta.json").write_text(""), ["meta.json: empty; re-run `moetrain data prepare`"]),
    (lambda ds: (ds / "meta.json").write_text("{garbage"), ["meta.json: not valid JSON (", "line 1 column 2", "re-run"]),
    (lambda ds: (ds / "meta.json").write_bytes(b"\xff\xfe{}"), ["meta.json: not UTF-8 text; re-run"]),
    (lambda ds: (ds / "meta.json").write_text("[1, 2]"), ["meta.json: a JSON list, expected an object; re-run"]),
    (_set_meta(format_version=9), ["meta.json: format_version 9, this moetrain reads format_version 1",
                                   "re-run `moetrain data prepare` with this moetrain"]),
    (_drop_meta("format_version"), ["meta.json: no format_version, this moetrain reads format_version 1"]),
    (_drop_meta("num_docs"), ["meta.json: missing key 'num_docs'; re-run"]),
    (_set_meta(num_tokens="28"), ["meta.json: num_tokens = '28', expected an integer >= 0; re-run"]),
    (_set_meta(dtype="int8"), ["meta.json: dtype 'int8', valid: uint16, uint32; re-run"]),
    (lambda ds: (ds / "tokens.bin").write_bytes((ds / "tokens.bin").read_bytes()[:-2]),
     ["tokens.bin: 54 bytes, meta.json says 28 uint16 tokens = 56 bytes", "incomplete or corrupt; re-run"]),
    (lambda ds: (ds / "tokens.bin").unlink(), ["tokens.bin: missing; re-run"]),
    (lambda ds: (ds / "docs.npy").write_bytes(b""), ["docs.npy: empty; re-run"]),
    (lambda ds: (ds / "docs.npy").write_bytes(b"garbage"), ["docs.npy: not a NumPy .npy file; re-run"]),
    (lambda ds: (ds / "docs.npy").write_bytes((ds / "docs.npy").read_bytes()[:20]),
     ["docs.npy: damaged NumPy file (", "re-run"]),
    (lambda ds: np.save(ds / "docs.npy", np.array([0, 20, 12], dtype=np.int64)),
     ["docs.npy: expected int64 offsets [num_docs + 1 = 3] from 0 to num_tokens = 28, got int64 [3] from 0 to 12"]),
]


@pytest.mark.parametrize("damage, words", DAMAGE, ids=range(len(DAMAGE)))
def test_damaged_dataset_is_one_line_through_the_cli(tmp_path, capsys, monkeypatch, damage, words):
    f = tmp_path / "a.txt"
    f.write_text("hello world\n\nagain and again\n")   # 2 documents, 28 byte tokens with EOS
    ds = tmp_path / "ds"
    prepare([str(f)], "bytes", str(ds), progress=False)
    damage(ds)
    line = train_error(capsys, "data.source=tokens", f"data.path={ds}", "data.eval_fraction=0",
                       monkeypatch=monkeypatch)
    assert str(ds) in line
    for w in words:
        assert w in line, (w, line)


def test_missing_and_corrupt_files(tmp_path):
    with pytest.raises(UserError, match=r"'.*nowhere': no such directory"):
        TokenDataset(str(tmp_path / "nowhere"), 4)
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match=r"empty/meta.json: missing"):
        TokenDataset(str(tmp_path / "empty"), 4)
    f = tmp_path / "a.txt"
    f.write_text("hello world\n\nagain and again\n")
    ds = tmp_path / "ds"
    prepare([str(f)], "bytes", str(ds), progress=False)
    data = (ds / "tokens.bin").read_bytes()
    (ds / "tokens.bin").write_bytes(data[:-2])
    with pytest.raises(UserError, match=r"tokens.bin: 54 bytes, meta.json says 28 uint16 tokens = 56 bytes"):
        TokenDataset(str(ds), 4, eval_fraction=0.0)
    (ds / "tokens.bin").unlink()
    with pytest.raises(UserError, match=r"tokens.bin: missing"):
        TokenDataset(str(ds), 4, eval_fraction=0.0)
    (ds / "tokens.bin").write_bytes(data)
    with pytest.raises(UserError, match=r"train split has 28 tokens, fewer than train.seq_length \+ 1 = 41"):
        TokenDataset(str(ds), 40, eval_fraction=0.0)
    with pytest.raises(UserError, match="no eval split"):
        TokenDataset(str(ds), 4, split="eval", eval_fraction=0.0)
    meta = json.loads((ds / "meta.json").read_text())
    (ds / "meta.json").write_text(json.dumps({**meta, "format_version": 9}))
    with pytest.raises(UserError, match="format_version 9"):
        TokenDataset(str(ds), 4, eval_fraction=0.0)


# ---- synthetic data -----------------------------------------------------------------------------

def test_synthetic_deterministic_and_indexable():
    a, b = SyntheticData(64, 16, seed=7), SyntheticData(64, 16, seed=7)
    rows = a.sequences(0, np.arange(8))
    assert rows.tolist() == b.sequences(0, np.arange(8)).tolist()
    assert a.sequences(0, np.array([5])).tolist() == rows[5:6].tolist()   # independent of batching
    assert rows.min() >= 0 and rows.max() < 64
    assert rows.tolist() != SyntheticData(64, 16, seed=8).sequences(0, np.arange(8)).tolist()
    ev = SyntheticData(64, 16, seed=7, split="eval")
    assert ev.successors.tolist() == a.successors.tolist()   # same chain ...
    assert ev.sequences(0, np.arange(8)).tolist() != rows.tolist()   # ... different sequences
    x, y = DataIterator(a).next_batch(4)
    assert x.tolist() == rows[:4, :-1].tolist() and y.tolist() == rows[:4, 1:].tolist()


def test_synthetic_entropy_and_learnability():
    V = 64
    syn = SyntheticData(V, 64, seed=3)
    P = syn.transition_matrix()
    assert np.allclose(P.sum(1), 1.0, atol=1e-12)
    assert len({tuple(sorted(r)) for r in syn.successors.tolist()}) > 1
    assert all(len(set(r)) == 4 for r in syn.successors.tolist())
    H_rows = -(P * np.log(P)).sum(1)
    H = syn.conditional_entropy()
    assert np.allclose(H_rows, H, rtol=0, atol=1e-12)
    q = 0.95 * np.array([0.6, 0.25, 0.1, 0.05]) + 0.05 / V
    assert H == pytest.approx(-(q * np.log(q)).sum() - (V - 4) * (0.05 / V) * math.log(0.05 / V), abs=1e-12)
    assert H < 0.35 * math.log(V)   # 1.37 nats against ln 64 = 4.16
    # A bigram model estimated on train sequences reaches ~H on eval sequences: the data is learnable
    # by anything that can represent a bigram table, and the samples follow the chain.
    train = syn.sequences(0, np.arange(300))
    counts = np.full((V, V), 0.1)
    np.add.at(counts, (train[:, :-1].ravel(), train[:, 1:].ravel()), 1.0)
    est = counts / counts.sum(1, keepdims=True)
    ev = SyntheticData(V, 64, seed=3, split="eval").sequences(0, np.arange(100))
    ce = -np.log(est[ev[:, :-1].ravel(), ev[:, 1:].ravel()]).mean()
    true_ce = -np.log(P[ev[:, :-1].ravel(), ev[:, 1:].ravel()]).mean()
    assert abs(true_ce - H) < 0.05 and abs(ce - H) < 0.12


# ---- build_data -----------------------------------------------------------------------------------

def test_build_data_from_config(dataset):
    cfg = Config()
    cfg.train.seq_length, cfg.train.seed = 12, 21
    it = build_data(cfg, split="eval")
    assert isinstance(it.source, SyntheticData)
    assert (it.source.vocab_size, it.source.seq_length, it.source.seed, it.source.split) == (512, 12, 21, "eval")
    ref = SyntheticData(512, 12, seed=21, split="eval").sequences(0, np.arange(2))
    x, y = it.next_batch(2)
    assert x.tolist() == ref[:, :-1].tolist() and y.tolist() == ref[:, 1:].tolist()

    cfg.data.source, cfg.data.path, cfg.data.eval_fraction, cfg.data.shuffle = "tokens", str(dataset), 0.2, False
    it = build_data(cfg, vocab_size=300, split="train", dp_rank=1, dp_size=2)
    ds = it.source
    assert (ds.seq_length, ds.seed, ds.eval_fraction, ds.shuffle, ds.split) == (12, 21, 0.2, False, "train")
    x, _ = it.next_batch(2)   # rank 1 of 2 takes sequences 2 and 3 of the global micro-batch
    assert x.tolist() == [ds.sequence(2)[:-1].tolist(), ds.sequence(3)[:-1].tolist()]
    with pytest.raises(UserError, match="model.vocab_size = 200"):
        build_data(cfg, vocab_size=200)
