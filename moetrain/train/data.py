"""Training data: synthetic sequences or a token dataset, served as resumable micro-batches.

Shape legend: B micro-batch size (sequences per data-parallel rank), S sequence length
(train.seq_length), V vocabulary size, N sequences in one epoch of a split.

A *source* (`SyntheticData` or `TokenDataset`) maps (epoch, position) to one sequence of
S + 1 tokens; `DataIterator` walks positions in order and cuts micro-batches:
``input_ids = seq[:, :-1]`` and ``labels = seq[:, 1:]`` (labels[b, i] is the token after
input_ids[b, i]; the model contract). Everything is a pure function of the seed and the
position, so a run resumed from `DataIterator.state_dict()` sees exactly the same batches.

Data parallelism: each call to `next_batch(B)` consumes one *global* micro-batch of
dp_size * B consecutive positions; rank r takes positions [r*B, (r+1)*B) of it. The ranks'
slices are disjoint and, concatenated in rank order, equal the batch a dp_size=1 iterator
returns for next_batch(dp_size * B). The position (epoch, index) is global, so every rank
holds the same state and a checkpoint may be resumed with a different dp_size.

numpy only at import; torch is imported when the first batch is built.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import numpy as np

from moetrain.errors import UserError, os_error

FORMAT_VERSION = 1  # must match moetrain.train.tokenize.FORMAT_VERSION
_REPREPARE = "re-run `moetrain data prepare` to rewrite the dataset"
_NPY_MAGIC = b"\x93NUMPY"
SPLITS = ("train", "eval")
_MASK64 = (1 << 64) - 1
_SCAN_CHUNK = 1 << 24   # tokens per chunk of the vocabulary scan
_DOC_CHUNK = 1 << 22    # documents per chunk while splitting
# Salts keep the random streams of different purposes independent for one seed.
_SALT_CHAIN, _SALT_SEQ, _SALT_SHUFFLE = 0x5EED_C4A1, 0x5EED_5E90, 0x5EED_5A0F


# ---- synthetic data ---------------------------------------------------------------------------

class SyntheticData:
    """Sequences from a random first-order Markov chain over V tokens, learnable by a small model.

    The chain (fixed by `seed`, shared by both splits): from token v the next token is
    ``successors[v, j]`` with probability ``(1 - noise) * probs[j]``, or, with probability
    ``noise``, a uniformly random token. The successors of v are distinct, so every row of
    the transition matrix has the same entropy, `conditional_entropy()` (about 1.49 nats for
    V=512 against ln V = 6.24 for a uniform guess): the loss of a model that learns the
    bigram table falls from ln V towards it.

    Sequence i of a split is generated from its own random stream (seed, split, i), so any
    sequence is reproducible without generating the ones before it. The train and eval
    splits use different streams over the same chain. There are no epochs (infinite data).
    """

    probs = (0.6, 0.25, 0.1, 0.05)
    noise = 0.05
    num_sequences = None  # infinite

    def __init__(self, vocab_size: int, seq_length: int, seed: int = 0, split: str = "train"):
        if vocab_size < len(self.probs):
            raise UserError(f"synthetic data needs model.vocab_size >= {len(self.probs)}, got {vocab_size}")
        if split not in SPLITS:
            raise UserError(f"data split {split!r}: valid: {', '.join(SPLITS)}")
        self.vocab_size, self.seq_length, self.seed, self.split = vocab_size, seq_length, seed, split
        rng = np.random.default_rng([seed & _MASK64, _SALT_CHAIN])
        k = len(self.probs)
        # successors[v] = (base[v] + offsets) mod V: distinct per row because the offsets are.
        offsets = rng.choice(vocab_size, size=k, replace=False)
        base = rng.integers(0, vocab_size, size=vocab_size)
        self.successors = (base[:, None] + offsets[None, :]) % vocab_size  # [V, k] int64
        self._cum_probs = np.cumsum(self.probs)
        self._cum_probs[-1] = 1.0

    def transition_matrix(self) -> np.ndarray:
        """Dense [V, V] float64 P(next | current); for tests and small V."""
        V = self.vocab_size
        P = np.full((V, V), self.noise / V)
        rows = np.arange(V)[:, None]
        P[rows, self.successors] += (1.0 - self.noise) * np.asarray(self.probs)[None, :]
        return P

    def conditional_entropy(self) -> float:
        """H(next | current) in nats: the lowest loss a model can reach on this data."""
        V, eps = self.vocab_size, self.noise
        q = (1 - eps) * np.asarray(self.probs) + eps / V   # the k successors
        rest = (V - len(self.probs)) * (eps / V) * np.log(eps / V) if eps > 0 else 0.0
        return float(-(q * np.log(q)).sum() - rest)

    def describe(self) -> dict:
        return {"kind": "synthetic", "vocab_size": self.vocab_size, "seq_length": self.seq_length,
                "seed": self.seed, "split": self.split}

    def sequences(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        """[n, S+1] int64: the sequences at `positions` (epoch is ignored: no epochs)."""
        n, L = len(positions), self.seq_length + 1
        split_id = SPLITS.index(self.split)
        starts = np.empty(n, dtype=np.int64)
        branch = np.empty((n, L - 1), dtype=np.int64)
        is_noise = np.empty((n, L - 1), dtype=bool)
        noise_tok = np.empty((n, L - 1), dtype=np.int64)
        for r, pos in enumerate(positions):
            rng = np.random.default_rng([self.seed & _MASK64, _SALT_SEQ, split_id, int(pos)])
            starts[r] = rng.integers(0, self.vocab_size)
            branch[r] = np.searchsorted(self._cum_probs, rng.random(L - 1), side="right")
            is_noise[r] = rng.random(L - 1) < self.noise
            noise_tok[r] = rng.integers(0, self.vocab_size, size=L - 1)
        out = np.empty((n, L), dtype=np.int64)
        out[:, 0] = starts
        cur = starts
        # The walk is sequential in time but vectorised over the n sequences.
        for t in range(L - 1):
            cur = np.where(is_noise[:, t], noise_tok[:, t], self.successors[cur, branch[:, t]])
            out[:, t + 1] = cur
        return out


# ---- token datasets -----------------------------------------------------------------------------

_MAX_ID_CACHE: dict[tuple, int] = {}


def _max_token(path: Path, tokens: np.ndarray) -> int:
    """Largest token id in `tokens` (-1 when empty), scanned in chunks.

    The result is cached per (file, size, mtime) so the train and eval splits scan once.
    """
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _MAX_ID_CACHE:
        best = -1
        for start in range(0, len(tokens), _SCAN_CHUNK):
            best = max(best, int(tokens[start:start + _SCAN_CHUNK].max()))
        _MAX_ID_CACHE[key] = best
    return _MAX_ID_CACHE[key]


def _split_is_eval(doc_ids: np.ndarray, eval_fraction: float, split_seed: int) -> np.ndarray:
    """Whether each document goes to the eval split: a seeded 64-bit hash (splitmix64) of its index."""
    x = doc_ids.astype(np.uint64) + np.uint64((split_seed * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) & _MASK64)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    x = x ^ (x >> np.uint64(31))
    u = (x >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))   # uniform in [0, 1)
    return u < eval_fraction


class TokenDataset:
    """Fixed-length sequences packed from a directory written by `moetrain data prepare`.

    Split: document i goes to eval when a seeded hash of i falls below eval_fraction, else to
    train. The split depends only on (document index, eval_fraction, split_seed) -- not on the
    training seed -- so runs with different seeds evaluate on the same documents.

    Packing: the documents of a split are concatenated in file order (each ends with its EOS)
    into one stream of L tokens. Sequence j is stream[j*S : j*S + S + 1]; consecutive sequences
    overlap by one token so every token after the first is a label exactly once per epoch.
    N = (L - 1) // S sequences; the last < S tokens of the stream are not used. Sequences
    cross document boundaries (the EOS between documents tells the model one ended); attention
    is not masked at boundaries.

    Order: epoch e visits the N sequences in a permutation seeded by (seed, e) when shuffle,
    else in stream order. Epochs wrap around without end.
    """

    def __init__(self, path: str, seq_length: int, split: str = "train", eval_fraction: float = 0.05,
                 seed: int = 1234, shuffle: bool = True, vocab_size: Optional[int] = None,
                 split_seed: int = 0):
        if split not in SPLITS:
            raise UserError(f"data split {split!r}: valid: {', '.join(SPLITS)}")
        if not 0.0 <= eval_fraction < 1.0:
            raise UserError(f"data.eval_fraction = {eval_fraction}: must be in [0, 1)")
        if split == "eval" and eval_fraction == 0.0:
            raise UserError("data.eval_fraction = 0: there is no eval split (set it > 0 or disable eval)")
        self.path = Path(path)
        self.seq_length, self.split, self.eval_fraction = seq_length, split, eval_fraction
        self.seed, self.shuffle, self.split_seed = seed, shuffle, split_seed
        self.meta = self._read_meta()
        self.tokens = self._open_tokens()
        self.max_token_id = _max_token(self.path / "tokens.bin", self.tokens)
        self._check_vocab(vocab_size)
        self.eos_id = self.meta["eos_id"]
        self._starts, self._ends = self._split_ranges()
        self._cum = np.concatenate([[0], np.cumsum(self._ends - self._starts)])  # [R+1] stream offsets
        self.num_tokens = int(self._cum[-1])   # L: tokens in this split's stream
        self.num_sequences = max(0, (self.num_tokens - 1) // seq_length)
        if self.num_sequences == 0:
            raise UserError(
                f"{self.path}: the {split} split has {self.num_tokens} tokens, fewer than train.seq_length + 1 "
                f"= {seq_length + 1}; add data, lower train.seq_length or change data.eval_fraction")
        self._order_epoch, self._order = None, None

    # -- loading and validation --

    def _read_meta(self) -> dict:
        if not self.path.is_dir():
            what = "is not a directory" if self.path.exists() else "no such directory"
            raise UserError(f"data.path {str(self.path)!r}: {what} (create a dataset with `moetrain data prepare`)")
        mp = self.path / "meta.json"
        if not mp.is_file():
            raise UserError(f"{mp}: missing; {self.path} is not a dataset from `moetrain data prepare`")
        try:
            text = mp.read_bytes().decode("utf-8")
            meta = json.loads(text)
        except OSError as e:
            raise os_error(e, "reading the dataset's meta.json") from None
        except UnicodeDecodeError:
            raise UserError(f"{mp}: not UTF-8 text; {_REPREPARE}") from None
        except json.JSONDecodeError as e:
            why = "empty" if not text.strip() else f"not valid JSON ({e.msg} at line {e.lineno} column {e.colno})"
            raise UserError(f"{mp}: {why}; {_REPREPARE}") from None
        if not isinstance(meta, dict):
            raise UserError(f"{mp}: a JSON {type(meta).__name__}, expected an object; {_REPREPARE}")
        version = meta.get("format_version")
        if version != FORMAT_VERSION or isinstance(version, bool):
            found = "no format_version" if version is None else f"format_version {version!r}"
            raise UserError(f"{mp}: {found}, this moetrain reads format_version {FORMAT_VERSION}; "
                            "re-run `moetrain data prepare` with this moetrain")
        for key in ("vocab_size", "eos_id", "num_tokens", "num_docs"):
            if key not in meta:
                raise UserError(f"{mp}: missing key {key!r}; {_REPREPARE}")
            v = meta[key]
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise UserError(f"{mp}: {key} = {v!r}, expected an integer >= 0; {_REPREPARE}")
        if meta.get("dtype") not in ("uint16", "uint32"):
            raise UserError(f"{mp}: dtype {meta.get('dtype')!r}, valid: uint16, uint32; {_REPREPARE}")
        if meta["eos_id"] >= meta["vocab_size"]:
            raise UserError(f"{mp}: eos_id {meta['eos_id']} >= vocab_size {meta['vocab_size']}; {_REPREPARE}")
        return meta

    def _check_vocab(self, model_vocab: Optional[int]) -> None:
        """UserError when a token id does not fit the dataset's own vocabulary or the model's."""
        top, vocab = self.max_token_id, self.meta["vocab_size"]
        if top >= vocab:
            raise UserError(f"{self.path / 'tokens.bin'}: token id {top} >= the dataset's vocab_size {vocab} "
                            f"(meta.json); the dataset is corrupt, {_REPREPARE}")
        if model_vocab is not None and top >= model_vocab:
            need = max(vocab, top + 1)
            raise UserError(
                f"dataset {self.path} has token ids up to {top} (vocab {vocab}) but model.vocab_size = "
                f"{model_vocab}; set model.vocab_size={need} or larger, or prepare the data with the "
                "model's tokenizer")

    def _open_tokens(self) -> np.ndarray:
        meta, tp, dp = self.meta, self.path / "tokens.bin", self.path / "docs.npy"
        for p in (tp, dp):
            if not p.is_file():
                raise UserError(f"{p}: missing; {_REPREPARE}")
        dtype = np.dtype(meta["dtype"])
        expected = meta["num_tokens"] * dtype.itemsize
        size = tp.stat().st_size
        if size != expected:
            raise UserError(
                f"{tp}: {size} bytes, meta.json says {meta['num_tokens']} {meta['dtype']} tokens = {expected} bytes; "
                f"the dataset is incomplete or corrupt; {_REPREPARE}")
        try:
            with open(dp, "rb") as f:
                magic = f.read(len(_NPY_MAGIC))
            if magic != _NPY_MAGIC:  # np.load would call any other file "pickled data"
                raise UserError(f"{dp}: {'empty' if not magic else 'not a NumPy .npy file'}; {_REPREPARE}")
            docs = np.load(dp, mmap_mode="r")
        except (ValueError, EOFError) as e:  # a cut-off or damaged header
            raise UserError(f"{dp}: damaged NumPy file ({str(e).splitlines()[0]}); {_REPREPARE}") from None
        except OSError as e:
            raise os_error(e, "reading the dataset's docs.npy") from None
        n = meta["num_docs"]
        got = f"{docs.dtype} {list(docs.shape)}"
        if docs.dtype == np.int64 and docs.shape == (n + 1,):
            got += f" from {int(docs[0])} to {int(docs[-1])}"
        if docs.dtype != np.int64 or docs.shape != (n + 1,) or docs[0] != 0 or docs[-1] != meta["num_tokens"]:
            raise UserError(
                f"{dp}: expected int64 offsets [num_docs + 1 = {n + 1}] from 0 to num_tokens = {meta['num_tokens']}, "
                f"got {got}; {_REPREPARE}")
        self.docs = docs
        if meta["num_tokens"] == 0:
            return np.zeros(0, dtype=dtype)
        return np.memmap(tp, dtype=dtype, mode="r", shape=(meta["num_tokens"],))

    def _split_ranges(self) -> tuple[np.ndarray, np.ndarray]:
        """Token ranges [start, end) of the split's documents, adjacent ones merged."""
        n, want_eval = self.meta["num_docs"], self.split == "eval"
        starts, ends = [], []
        for c0 in range(0, n, _DOC_CHUNK):
            c1 = min(n, c0 + _DOC_CHUNK)
            d = np.asarray(self.docs[c0:c1 + 1])
            if np.any(d[1:] < d[:-1]):
                raise UserError(f"{self.path / 'docs.npy'}: offsets are not increasing; {_REPREPARE}")
            ids = np.arange(c0, c1)
            if self.eval_fraction > 0:
                ids = ids[_split_is_eval(ids, self.eval_fraction, self.split_seed) == want_eval]
            if len(ids) == 0:
                continue
            # Runs of consecutive document indices become one token range.
            brk = np.flatnonzero(np.diff(ids) != 1) + 1
            first = ids[np.concatenate([[0], brk])]
            last = ids[np.concatenate([brk - 1, [len(ids) - 1]])]
            starts.append(d[first - c0])
            ends.append(d[last + 1 - c0])
        if not starts:
            raise UserError(
                f"{self.path}: no document fell into the {self.split} split ({n} documents, data.eval_fraction = "
                f"{self.eval_fraction}); add documents or change data.eval_fraction")
        s, e = np.concatenate(starts), np.concatenate(ends)
        # Merge ranges that touch (runs cut by a chunk boundary): a run starts where the
        # previous range does not end at this one's start, and ends before the next run starts.
        first = np.concatenate([[True], s[1:] != e[:-1]])
        last = np.concatenate([first[1:], [True]])
        return s[first].astype(np.int64), e[last].astype(np.int64)

    # -- access --

    def describe(self) -> dict:
        return {"kind": "tokens", "path": str(self.path.resolve()), "split": self.split,
                "seq_length": self.seq_length, "num_sequences": self.num_sequences,
                "eval_fraction": self.eval_fraction, "seed": self.seed, "shuffle": self.shuffle}

    def stream(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of this split's concatenated document stream, int64."""
        out = np.empty(stop - start, dtype=np.int64)
        r = int(np.searchsorted(self._cum, start, side="right")) - 1
        pos = start
        while pos < stop:
            off = pos - int(self._cum[r])
            take = min(stop - pos, int(self._cum[r + 1]) - pos)
            a = int(self._starts[r]) + off
            out[pos - start:pos - start + take] = self.tokens[a:a + take]
            pos += take
            r += 1
        return out

    def sequence(self, j: int) -> np.ndarray:
        """Sequence j in stream order: [S+1] int64."""
        return self.stream(j * self.seq_length, j * self.seq_length + self.seq_length + 1)

    def order(self, epoch: int) -> np.ndarray:
        """The order epoch `epoch` visits sequences in (a permutation of 0..N-1); cached per epoch."""
        if self._order_epoch != epoch:
            if self.shuffle:
                rng = np.random.default_rng([self.seed & _MASK64, _SALT_SHUFFLE, epoch])
                self._order = rng.permutation(self.num_sequences)
            else:
                self._order = np.arange(self.num_sequences)
            self._order_epoch = epoch
        return self._order

    def sequences(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        """[n, S+1] int64: the sequences at `positions` of epoch `epoch`'s order."""
        order = self.order(epoch)
        return np.stack([self.sequence(int(order[p])) for p in positions])


# ---- the iterator the trainer uses ----------------------------------------------------------------

class DataIterator:
    """Micro-batches from a source, with a resumable global position (epoch, index).

    `next_batch(B)` returns this rank's CPU int64 tensors (input_ids [B,S], labels [B,S]) and
    advances the position by dp_size * B (see the module doc for the data-parallel slicing).
    For evaluation call `reset()` before each evaluation so each one sees the same batches.
    """

    def __init__(self, source, dp_rank: int = 0, dp_size: int = 1):
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} must be in [0, dp_size {dp_size})")
        self.source, self.dp_rank, self.dp_size = source, dp_rank, dp_size
        self.epoch, self.index = 0, 0

    @property
    def seq_length(self) -> int:
        return self.source.seq_length

    def reset(self) -> None:
        self.epoch, self.index = 0, 0

    def next_batch_numpy(self, micro_batch_size: int) -> np.ndarray:
        """This rank's [B, S+1] int64 sequences; advances the position."""
        B, n = micro_batch_size, self.source.num_sequences
        offs = self.index + self.dp_rank * B + np.arange(B)
        if n is None:
            epochs, pos = np.zeros(B, dtype=np.int64), offs
        else:
            epochs, pos = self.epoch + offs // n, offs % n
        out = np.empty((B, self.seq_length + 1), dtype=np.int64)
        for e in np.unique(epochs):  # a batch may straddle an epoch end
            sel = epochs == e
            out[sel] = self.source.sequences(int(e), pos[sel])
        self.index += self.dp_size * B
        if n is not None:
            self.epoch += self.index // n
            self.index %= n
        return out

    def next_batch(self, micro_batch_size: int):
        """(input_ids [B,S] int64, labels [B,S] int64) CPU tensors; labels[b,i] follows input_ids[b,i]."""
        import torch

        seq = self.next_batch_numpy(micro_batch_size)
        return torch.from_numpy(np.ascontiguousarray(seq[:, :-1])), torch.from_numpy(np.ascontiguousarray(seq[:, 1:]))

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index, "source": self.source.describe()}

    def load_state_dict(self, state: dict) -> None:
        """Resume at a saved position; UserError when the data is not what the state was saved on."""
        saved, now = state.get("source", {}), self.source.describe()
        diff = [k for k in sorted(set(saved) | set(now)) if k != "path" and saved.get(k) != now.get(k)]
        if diff:
            parts = ", ".join(f"{k}: saved {saved.get(k)!r}, now {now.get(k)!r}" for k in diff)
            raise UserError(f"cannot resume the data position: the data changed since the checkpoint ({parts})")
        self.epoch, self.index = int(state["epoch"]), int(state["index"])


class BatchAhead:
    """A DataIterator read one micro-batch ahead: the trainer fetches the next micro-batch right after it
    has launched a backward pass, so the host's data work (the synthetic chain costs ~1 us a token on a CPU
    core: ~9 ms for 2 x 4096 tokens) runs while the GPU computes instead of leaving it idle at the start
    of the next step. ``state_dict()`` is the position of the first micro-batch not yet taken, so a
    checkpoint never skips the batch held ahead.
    """

    def __init__(self, data: DataIterator, micro_batch_size: int):
        self.data, self.micro_batch_size = data, micro_batch_size
        self._ahead = None
        self._state_before_ahead = None

    def fetch_ahead(self) -> None:
        """Read the next micro-batch now (no-op when one is already held)."""
        if self._ahead is None:
            self._state_before_ahead = self.data.state_dict()
            self._ahead = self.data.next_batch(self.micro_batch_size)

    def take(self):
        """(input_ids [B,S], labels [B,S]) CPU int64: the batch held ahead, else read now."""
        self.fetch_ahead()
        batch, self._ahead = self._ahead, None
        return batch

    def state_dict(self) -> dict:
        return self._state_before_ahead if self._ahead is not None else self.data.state_dict()


def build_data(cfg, vocab_size: Optional[int] = None, split: str = "train",
               dp_rank: int = 0, dp_size: int = 1) -> DataIterator:
    """The iterator for `split` as configured by cfg.data.* and cfg.train.{seq_length, seed}.

    vocab_size is the model's (default cfg.model.vocab_size): synthetic tokens are drawn
    below it and a token dataset is checked against it.
    """
    vocab_size = vocab_size or cfg.model.vocab_size
    d, t = cfg.data, cfg.train
    if d.source == "synthetic":
        source = SyntheticData(vocab_size, t.seq_length, seed=t.seed, split=split)
    elif d.source == "tokens":
        if not d.path:
            raise UserError("data.source = tokens needs data.path (a directory from `moetrain data prepare`)")
        source = TokenDataset(os.path.expanduser(d.path), t.seq_length, split=split, eval_fraction=d.eval_fraction,
                              seed=t.seed, shuffle=d.shuffle, vocab_size=vocab_size)
    else:
        raise UserError(f"data.source = {d.source!r}: valid: synthetic, tokens")
    return DataIterator(source, dp_rank=dp_rank, dp_size=dp_size)
