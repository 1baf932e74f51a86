"""Built-in data: a byte tokenizer, text corpora, and a resumable distributed token loader.

No downloads: the default corpus ("stdlib") is the source of the running Python's standard
library. Documents are assigned to train/validation by a hash of their key (a relative path,
or `path:line` for .jsonl), so the split is stable across machines and runs.

    tok = load_tokenizer(cfg.model.tokenizer_path)
    corpus = load_corpus(cfg.training.dataset, cfg.training.dataset_path, tok)
    loader = DistributedTokenLoader(corpus, seq_len, local_bs, dp_rank, dp_world, seed)
    inputs, labels = next(loader)   # LongTensor [local_bs, seq_len]; labels = inputs shifted by 1
"""

import hashlib
import json
import os
import sysconfig
from typing import Any, Callable, Iterator, NamedTuple

import torch

from simplesharded.models.context_parallel import head_tail_positions

VAL_FRACTION = 0.02
STDLIB_MAX_BYTES = 32 << 20  # the stdlib without tests is ~14 MB; the cap bounds memory/time
_STDLIB_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests",
                               "idle_test"})
_TEXT_SUFFIXES = (".txt", ".jsonl")
SPLITS = ("train", "validation")


# ---------------------------------------------------------------------------- tokenizers

class ByteTokenizer:
    """UTF-8 bytes are ids 0..255, then BOS=256, EOS=257, PAD=258."""

    bos_id = 256
    eos_id = 257
    pad_id = 258
    vocab_size = 259

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        return [self.bos_id] * bos + list(text.encode("utf-8")) + [self.eos_id] * eos

    def encode_tensor(self, text: str, bos: bool = False, eos: bool = False) -> torch.Tensor:
        """Like encode() but straight from the byte buffer: fast enough for a whole corpus."""
        raw = text.encode("utf-8")
        ids = torch.empty(len(raw) + bos + eos, dtype=torch.int32)
        if raw:
            ids[bos:bos + len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        if bos:
            ids[0] = self.bos_id
        if eos:
            ids[-1] = self.eos_id
        return ids

    def decode(self, ids) -> str:
        """Special ids are dropped; invalid UTF-8 (e.g. a cut multi-byte char) is replaced."""
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """Wrapper of a `tokenizers` tokenizer.json with the ByteTokenizer interface."""

    _BOS = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>")
    _EOS = ("<|end_of_text|>", "</s>", "<eos>", "<|endoftext|>")
    _PAD = ("<pad>", "<|pad|>", "[PAD]")

    def __init__(self, path: str):
        from tokenizers import Tokenizer

        self.path = path
        self._tok = Tokenizer.from_file(path)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.bos_id = self._first_id(self._BOS)
        self.eos_id = self._first_id(self._EOS)
        pad = self._first_id(self._PAD)
        self.pad_id = pad if pad is not None else self.eos_id

    def _first_id(self, names) -> int | None:
        ids = [self._tok.token_to_id(n) for n in names]
        return next((i for i in ids if i is not None), None)

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        head = [self.bos_id] if bos and self.bos_id is not None else []
        tail = [self.eos_id] if eos and self.eos_id is not None else []
        return head + ids + tail

    def encode_tensor(self, text: str, bos: bool = False, eos: bool = False) -> torch.Tensor:
        return torch.tensor(self.encode(text, bos, eos), dtype=torch.int32)

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)


def load_tokenizer(path: str = "") -> ByteTokenizer | HFTokenizer:
    """'' → ByteTokenizer; a tokenizer.json (or a directory holding one) → HFTokenizer."""
    if not path:
        return ByteTokenizer()
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(path):
        raise ValueError(f"model.tokenizer_path={path!r} does not exist")
    try:
        import tokenizers  # noqa: F401
    except ImportError:
        raise ValueError(f"model.tokenizer_path={path!r} needs the `tokenizers` package: "
                         "pip install tokenizers (or set model.tokenizer_path='' for the "
                         "built-in byte tokenizer)") from None
    try:
        return HFTokenizer(path)
    except Exception as e:  # tokenizers raises its own Exception type on a bad file
        raise ValueError(f"model.tokenizer_path={path!r} is not a tokenizer.json: {e}") from e


# ---------------------------------------------------------------------------- corpora

def _is_validation(key: str, val_fraction: float) -> bool:
    h = int.from_bytes(hashlib.sha1(key.encode("utf-8")).digest()[:8], "big")
    return h % 1_000_000 < val_fraction * 1_000_000


class TextCorpus:
    """Documents → one token array per split, built lazily once and kept on this object.

    Each document is encoded as BOS + text + EOS. If hashing leaves one split without
    documents (tiny user data), the concatenated stream's last `val_fraction` becomes the
    validation split instead (`split_by == "tail"`).
    """

    def __init__(self, name: str, documents: Callable[[], Iterator[tuple[str, str]]],
                 tokenizer: Any = None, val_fraction: float = VAL_FRACTION):
        self.name = name
        self.tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()
        self.val_fraction = val_fraction
        self._documents = documents
        self._tokens: dict[str, torch.Tensor] | None = None
        self._keys: dict[str, list[str]] = {}
        self._split_by = "document"

    @staticmethod
    def _split_name(split: str) -> str:
        split = "validation" if split == "val" else split
        if split not in SPLITS:
            raise ValueError(f"split={split!r} is not one of {sorted(SPLITS)}")
        return split

    def tokens(self, split: str = "train") -> torch.Tensor:
        """1-D int32 token array of `split`."""
        split = self._split_name(split)
        if self._tokens is None:
            self._build()
        return self._tokens[split]

    @property
    def split_by(self) -> str:
        """"document" (hash of each document's key) or "tail" (too few documents)."""
        self.tokens()
        return self._split_by

    def documents(self, split: str = "train") -> list[str]:
        """Keys of the documents assigned to `split` (by hash)."""
        split = self._split_name(split)
        if self._tokens is None:
            self._build()
        return list(self._keys[split])

    def _build(self) -> None:
        pieces: dict[str, list[torch.Tensor]] = {s: [] for s in SPLITS}
        keys: dict[str, list[str]] = {s: [] for s in SPLITS}
        for key, text in self._documents():
            split = "validation" if _is_validation(key, self.val_fraction) else "train"
            pieces[split].append(self.tokenizer.encode_tensor(text, bos=True, eos=True))
            keys[split].append(key)
        if not keys["train"] and not keys["validation"]:
            raise ValueError(f"corpus {self.name!r} has no documents")
        if keys["train"] and keys["validation"]:
            tokens = {s: torch.cat(pieces[s]) for s in SPLITS}
        else:
            stream = torch.cat(pieces["train"] + pieces["validation"])
            cut = len(stream) - max(1, int(len(stream) * self.val_fraction))
            tokens = {"train": stream[:cut], "validation": stream[cut:]}
            self._split_by = "tail"
        self._tokens, self._keys = tokens, keys


def _walk(root: str, suffixes: tuple[str, ...], skip_dirs: frozenset = frozenset()) -> list[str]:
    """Sorted relative paths of files under root ending in one of `suffixes`."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in skip_dirs and not d.startswith(".")]
        rel = os.path.relpath(dirpath, root)
        out += [os.path.normpath(os.path.join(rel, f)) for f in filenames if f.endswith(suffixes)]
    return sorted(out)


def stdlib_corpus(tokenizer: Any = None, max_bytes: int = STDLIB_MAX_BYTES,
                  root: str | None = None, val_fraction: float = VAL_FRACTION) -> TextCorpus:
    """The standard library's .py files (no tests, no site-packages), sorted, capped."""
    root = root or sysconfig.get_paths()["stdlib"]
    files, total = [], 0
    for rel in _walk(root, (".py",), _STDLIB_SKIP_DIRS):
        size = os.path.getsize(os.path.join(root, rel))
        if total + size > max_bytes:
            break
        files.append(rel)
        total += size

    def documents() -> Iterator[tuple[str, str]]:
        for rel in files:
            with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as fh:
                yield rel, fh.read()

    return TextCorpus("stdlib", documents, tokenizer, val_fraction)


def _read_text_file(path: str, rel: str) -> Iterator[tuple[str, str]]:
    """A .txt file is one document; each non-empty .jsonl line is one (its "text" field)."""
    where = f"training.dataset_path: {path}"
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            if not path.endswith(".jsonl"):
                yield rel, fh.read()
                return
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{where}:{lineno} is not valid JSON: {e}") from None
                text = obj.get("text") if isinstance(obj, dict) else None
                if not isinstance(text, str):
                    raise ValueError(f"{where}:{lineno} has no string field 'text'")
                yield f"{rel}:{lineno}", text
    except OSError as e:
        raise ValueError(f"{where} cannot be read: {e.strerror}") from None


def files_corpus(path: str, tokenizer: Any = None,
                 val_fraction: float = VAL_FRACTION) -> TextCorpus:
    """User data: a .txt/.jsonl file, or a directory searched recursively for them."""
    if not os.path.exists(path):
        raise ValueError(f"training.dataset_path={path!r} does not exist")
    if os.path.isdir(path):
        root, files = path, _walk(path, _TEXT_SUFFIXES)
        if not files:
            raise ValueError(f"training.dataset_path={path!r} contains no "
                             f"{'/'.join(_TEXT_SUFFIXES)} files")
    elif path.endswith(_TEXT_SUFFIXES):
        root, files = os.path.dirname(path) or ".", [os.path.basename(path)]
    else:
        raise ValueError(f"training.dataset_path={path!r} is not a "
                         f"{'/'.join(_TEXT_SUFFIXES)} file or a directory")
    for rel in files:  # fail now, not at the first batch
        if not os.access(os.path.join(root, rel), os.R_OK):
            raise ValueError(f"training.dataset_path={path!r}: cannot read {rel}")

    def documents() -> Iterator[tuple[str, str]]:
        for rel in files:
            yield from _read_text_file(os.path.join(root, rel), rel)

    return TextCorpus(path, documents, tokenizer, val_fraction)


DATASETS = ("stdlib",)


def load_corpus(dataset: str = "stdlib", dataset_path: str = "", tokenizer: Any = None,
                **kwargs) -> TextCorpus:
    """training.dataset / training.dataset_path → TextCorpus; a set dataset_path wins."""
    if dataset_path:
        return files_corpus(dataset_path, tokenizer, **kwargs)
    if dataset == "stdlib":
        return stdlib_corpus(tokenizer, **kwargs)
    raise ValueError(f"training.dataset={dataset!r} is not one of {sorted(DATASETS)} "
                     "(or set training.dataset_path)")


# ---------------------------------------------------------------------------- loader

def _mix_seed(seed: int, split: str, epoch: int) -> int:
    digest = hashlib.sha256(f"{seed}/{split}/{epoch}".encode()).digest()
    return int.from_bytes(digest[:8], "big") & ((1 << 63) - 1)


class DistributedTokenLoader:
    """Infinite, deterministic, resumable batches for one data-parallel rank.

    Sample i is the window tokens[i*seq_len : (i+1)*seq_len + 1]. A global sample position p
    maps to epoch p // N and, within it, sample perm_epoch[p % N] (a seeded permutation per
    epoch; identity if shuffle=False). Each call consumes one global batch of
    local_batch_size * dp_world positions starting at `consumed_samples`; rank r takes
    positions r, r + W, r + 2W, ... of it. So ranks are disjoint, and the only state is the
    global counter — which is why a checkpoint resumes at any dp world size without
    repeating or skipping samples.

    ``cp_rank`` of ``cp`` > 1 (context parallelism): the cp ranks of one dp rank read the same
    samples, and each keeps its head-tail chunks of every sequence (inputs and labels alike,
    models/context_parallel.py): [local_batch_size, seq_len // cp] each.
    """

    def __init__(self, tokens_source: Any, seq_len: int, local_batch_size: int,
                 dp_rank: int = 0, dp_world: int = 1, seed: int = 0, split: str = "train",
                 *, shuffle: bool = True, cp_rank: int = 0, cp: int = 1):
        split = TextCorpus._split_name(split)
        if hasattr(tokens_source, "tokens"):
            tokens = tokens_source.tokens(split)
        else:
            tokens = torch.as_tensor(tokens_source)
        if tokens.dim() != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
        if seq_len < 1 or local_batch_size < 1:
            raise ValueError(f"seq_len={seq_len} and local_batch_size={local_batch_size} "
                             "must be >= 1")
        if not 0 <= dp_rank < dp_world:
            raise ValueError(f"dp_rank={dp_rank} is not in [0, dp_world={dp_world})")
        self.num_samples = (len(tokens) - 1) // seq_len
        if self.num_samples < 1:
            raise ValueError(f"the {split} split has {len(tokens)} tokens; "
                             f"training.seq_len={seq_len} needs at least {seq_len + 1}")
        self.tokens = tokens
        self.seq_len, self.local_batch_size = seq_len, local_batch_size
        self.dp_rank, self.dp_world = dp_rank, dp_world
        self.seed, self.split, self.shuffle = seed, split, shuffle
        self.consumed_samples = 0  # global, over all ranks
        self._perm: tuple[int, torch.Tensor] | None = None  # (epoch, permutation) cache
        self._offsets = torch.arange(seq_len + 1)
        self._keep = None  # this cp rank's token positions (None: the whole sequence)
        if cp > 1:
            self._keep = head_tail_positions(seq_len, cp_rank, cp)

    @property
    def global_batch_size(self) -> int:
        return self.local_batch_size * self.dp_world

    def _epoch_perm(self, epoch: int) -> torch.Tensor:
        if self._perm is None or self._perm[0] != epoch:
            g = torch.Generator().manual_seed(_mix_seed(self.seed, self.split, epoch))
            self._perm = (epoch, torch.randperm(self.num_samples, generator=g))
        return self._perm[1]

    def sample_ids(self, positions: torch.Tensor) -> torch.Tensor:
        """Global sample positions → sample indices (window number in the token array)."""
        epoch, index = positions // self.num_samples, positions % self.num_samples
        if not self.shuffle:
            return index
        out = torch.empty_like(index)
        for e in epoch.unique().tolist():  # a batch spans at most a few epochs
            mask = epoch == e
            out[mask] = self._epoch_perm(e)[index[mask]]
        return out

    def __iter__(self) -> "DistributedTokenLoader":
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        positions = (self.consumed_samples + self.dp_rank
                     + self.dp_world * torch.arange(self.local_batch_size))
        self.consumed_samples += self.global_batch_size
        starts = self.sample_ids(positions) * self.seq_len
        windows = self.tokens[starts[:, None] + self._offsets].long()
        inputs, labels = windows[:, :-1], windows[:, 1:]
        if self._keep is not None:
            inputs, labels = inputs[:, self._keep], labels[:, self._keep]
        return inputs.contiguous(), labels.contiguous()

    def reset(self) -> None:
        """Back to the first batch (e.g. to evaluate on the same validation batches again)."""
        self.consumed_samples = 0

    # Fields that define the stream: resuming with any of them changed would not continue it.
    _STREAM_KEYS = ("seed", "seq_len", "num_tokens", "split", "shuffle")

    def state_dict(self) -> dict[str, Any]:
        c = self.consumed_samples
        return {"consumed_samples": c, "epoch": c // self.num_samples,
                "index": c % self.num_samples, "seed": self.seed, "seq_len": self.seq_len,
                "num_tokens": len(self.tokens), "split": self.split, "shuffle": self.shuffle}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mine = self.state_dict()
        for key in self._STREAM_KEYS:
            theirs = state[key]
            theirs = theirs.item() if isinstance(theirs, torch.Tensor) else theirs
            if theirs != mine[key]:
                raise ValueError(f"data loader state was saved with {key}={theirs!r} but this "
                                 f"loader has {key}={mine[key]!r}; the stream would not continue")
        consumed = state["consumed_samples"]
        self.consumed_samples = int(consumed.item() if isinstance(consumed, torch.Tensor)
                                    else consumed)


class Data(NamedTuple):
    tokenizer: Any
    corpus: TextCorpus
    train: DistributedTokenLoader
    validation: DistributedTokenLoader | None


def build_data(cfg: Any, dp_rank: int, dp_world: int, cp_rank: int = 0) -> Data:
    """Tokenizer, corpus and loaders from a Config (validation loader only if val_every > 0).

    A local_batch_size of -1 is derived as in config_checks.resolve(). ``cp_rank``: this rank's
    place in its cp group, whose ranks read the same samples (parallelism.
    context_parallel_degree > 1: each keeps its head-tail chunks of every sequence).
    """
    cp = {"cp_rank": cp_rank, "cp": cfg.parallelism.context_parallel_degree}
    t = cfg.training
    local = t.local_batch_size
    if local == -1:
        per_step = dp_world * t.gradient_accumulation_steps
        if t.global_batch_size % per_step:
            raise ValueError(f"training.global_batch_size={t.global_batch_size} is not "
                             f"divisible by dp * gradient_accumulation_steps = {per_step}")
        local = t.global_batch_size // per_step
    tokenizer = load_tokenizer(cfg.model.tokenizer_path)
    corpus = load_corpus(t.dataset, t.dataset_path, tokenizer)
    train = DistributedTokenLoader(corpus, t.seq_len, local, dp_rank, dp_world, cfg.job.seed,
                                   **cp)
    val = None
    if t.val_every > 0:
        val = DistributedTokenLoader(corpus, t.seq_len, local, dp_rank, dp_world, cfg.job.seed,
                                     "validation", shuffle=False, **cp)
    return Data(tokenizer, corpus, train, val)
