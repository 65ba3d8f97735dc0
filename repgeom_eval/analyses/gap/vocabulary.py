"""Vocabularies and token sets: which rows of the output embedding a token-set spec names (for the dispersion gap).

A token-set *spec* is one of

* a registered name (``digits``, ``python_keywords``, ``general`` ship with repgeom-eval; plugins add more through
  ``repgeom_register_token_sets``);
* ``words:a,b,c``: an explicit list of words;
* the path of a UTF-8 text file with one word per line (blank lines skipped).

Tokens are matched on their *stripped text*: the token decoded on its own, stripped of surrounding whitespace and of
the tokenizer's word-boundary markers (``Ġ`` of byte-level BPE, ``▁`` of SentencePiece, WordPiece's ``##``
continuation prefix, a BPE end-of-word suffix such as ``</w>``). A word maps to *every* entry whose stripped text is
exactly the word (``5`` and ``Ġ5`` both count as the word ``5``); a word with no such entry is reported as missing,
never silently dropped. Special tokens never match.

A registered token set is either a collection of strings (a fixed word list, resolved as above) or a callable::

    fn(vocab: Vocabulary, *, exclude: frozenset[int], seed: int, size: int)
        -> (ids: list[int], missing: list[str])      # or (ids, missing, extra_config: dict)

``vocab`` gives the stripped text of every id (``vocab.texts``), the ids of a word (``vocab.ids_for(word)``) and the
tokenizer (``vocab.tokenizer``); the callable must not return ids in ``exclude`` (for the reference set: the ids of
T). ``seed`` and ``size`` are for sampled sets (``general``) and may be ignored by fixed ones.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...spec.errors import RepgeomError, UnknownNameError

from repgeom_eval.spec.options.analyses import GapConfig

# The defaults under their earlier names (declared once, in GapConfig)
DEFAULT_DOMAIN, DEFAULT_REFERENCE, DEFAULT_SIZE, DEFAULT_SEED = (GapConfig().domain, GapConfig().reference,
                                                                 GapConfig().size, GapConfig().seed)
WORD_BOUNDARY_MARKERS = ("Ġ", "▁")  # byte-level BPE (GPT-2, Llama-3, SmolLM) and SentencePiece (Llama-2, T5)


def strip_token_text(text: str, prefixes: Sequence[str] = WORD_BOUNDARY_MARKERS, suffixes: Sequence[str] = ()) -> str:
    """``text`` without surrounding whitespace and word-boundary markers (``Ġ5`` → ``5``, ``▁for`` → ``for``)."""
    previous = None
    while text != previous:
        previous = text
        text = text.strip()
        for p in prefixes:
            if text.startswith(p):
                text = text[len(p):]
        for s in suffixes:
            if text.endswith(s):
                text = text[: -len(s)]
    return text


def _markers(tokenizer: Any) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(prefix markers, suffix markers) stripped from token text."""
    prefixes, suffixes = list(WORD_BOUNDARY_MARKERS), []
    backend = getattr(getattr(tokenizer, "backend_tokenizer", None), "model", None)
    cont = getattr(backend, "continuing_subword_prefix", None)
    if isinstance(cont, str) and cont:
        prefixes.append(cont)
    eow = getattr(backend, "end_of_word_suffix", None)
    if isinstance(eow, str) and eow:
        suffixes.append(eow)
    return tuple(prefixes), tuple(suffixes)


def _decode_each(tokenizer: Any, ids: list[int]) -> list[str]:
    """Each id decoded on its own (one batched call on fast tokenizers)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        try:
            return list(backend.decode_batch([[i] for i in ids], skip_special_tokens=False))
        except Exception:  # noqa: BLE001 - fall back to the Python path
            pass
    return list(tokenizer.batch_decode([[i] for i in ids], skip_special_tokens=False,
                                       clean_up_tokenization_spaces=False))


class Vocabulary:
    """Every token id of a tokenizer with its raw token and stripped text (what token sets match against).

    ``n_rows``: the number of rows of W; ids at or beyond it (tokens the checkpoint has no row for) never match.
    """

    def __init__(self, tokenizer: Any, n_rows: int | None = None):
        self.tokenizer = tokenizer
        vocab = tokenizer.get_vocab()
        self.size = len(vocab)
        self.n_rows = n_rows
        self.prefixes, self.suffixes = _markers(tokenizer)
        self.raw: dict[int, str] = {int(i): str(t) for t, i in vocab.items()}
        self.special = {int(i) for i in getattr(tokenizer, "all_special_ids", []) or [] if i is not None}
        ids = sorted(i for i in self.raw if n_rows is None or i < n_rows)
        self.n_beyond_rows = len(self.raw) - len(ids)
        decoded = _decode_each(tokenizer, ids)
        self.texts: dict[int, str] = {
            i: ("" if i in self.special else strip_token_text(d, self.prefixes, self.suffixes))
            for i, d in zip(ids, decoded)
        }
        self._by_text: dict[str, list[int]] | None = None

    def ids_for(self, word: str) -> list[int]:
        """Every id whose stripped text is exactly ``word`` (itself stripped), in id order."""
        if self._by_text is None:
            by: dict[str, list[int]] = {}
            for i, t in self.texts.items():
                if t:
                    by.setdefault(t, []).append(i)
            self._by_text = by
        return list(self._by_text.get(strip_token_text(word, self.prefixes, self.suffixes), []))

    def resolve_words(self, words: Iterable[str], exclude: Iterable[int] = ()) -> tuple[list[int], list[str]]:
        """(ids of every entry of every word, words with no entry) — the word-list rule above."""
        exclude = set(exclude)
        ids: list[int] = []
        missing: list[str] = []
        seen: set[str] = set()
        for w in words:
            if w in seen:
                continue
            seen.add(w)
            found = [i for i in self.ids_for(w) if i not in exclude]
            if found:
                ids.extend(found)
            else:
                missing.append(w)
        return sorted(set(ids)), missing


def vocabulary_difference(a: Any, b: Any) -> str | None:
    """Why two tokenizers' vocabularies differ (None if identical): sizes, or the first differing id."""
    va, vb = a.get_vocab(), b.get_vocab()
    if va == vb:
        return None
    if len(va) != len(vb):
        return f"{len(va)} vs {len(vb)} entries"
    ia = {i: t for t, i in va.items()}
    ib = {i: t for t, i in vb.items()}
    for i in sorted(set(ia) | set(ib)):
        if ia.get(i) != ib.get(i):
            return f"token id {i} is {ia.get(i)!r} vs {ib.get(i)!r}"
    return "the vocabularies differ"  # pragma: no cover - equal sizes and equal id maps imply equal dicts


@dataclass
class TokenSet:
    """A resolved token set: the ids (sorted), their raw tokens, the words not found, and how it was built."""

    name: str
    ids: list[int]
    tokens: list[str]
    missing: list[str]
    config: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.ids)

    def to_dict(self, with_tokens: bool = True) -> dict[str, Any]:
        d = {"name": self.name, "n": len(self.ids), "ids": list(self.ids), "missing": list(self.missing),
             "config": dict(self.config)}
        if with_tokens:
            d["tokens"] = list(self.tokens)
        return d


def _token_set(name: str, vocab: Vocabulary, ids: list[int], missing: list[str], config: dict[str, Any]) -> TokenSet:
    return TokenSet(name=name, ids=list(ids), tokens=[vocab.raw.get(i, "") for i in ids], missing=list(missing),
                    config=config)


def _read_word_file(path: Path) -> list[str]:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise RepgeomError(f"token set file {str(path)!r} is not valid UTF-8 (byte {exc.start}); save it as UTF-8"
                           ) from None
    except OSError as exc:
        raise RepgeomError(f"cannot read token set file {str(path)!r}: {exc.strerror or exc}") from None
    return [line.strip() for line in text.splitlines() if line.strip()]


def resolve_token_set(spec: str, tokenizer: Any, host: Any = None, exclude: Iterable[int] = (),
                      seed: int = DEFAULT_SEED, size: int = DEFAULT_SIZE) -> TokenSet:
    """Resolve a token-set spec (registered name, ``words:a,b,c`` or a file path) against a tokenizer.

    ``tokenizer`` may be a :class:`Vocabulary` (re-used, cheaper) or a tokenizer. ``exclude``: ids that must not be
    in the result (the domain set, when resolving the reference set).
    """
    vocab = tokenizer if isinstance(tokenizer, Vocabulary) else Vocabulary(tokenizer)
    exclude = frozenset(int(i) for i in exclude)
    if not isinstance(spec, str) or not spec.strip():
        raise RepgeomError("empty token set; pass a name (see `repgeom plugins`), words:a,b,c or a file path")
    spec = spec.strip()
    config: dict[str, Any] = {"spec": spec}
    if spec.startswith("words:"):
        words = [w.strip() for w in spec[len("words:"):].split(",") if w.strip()]
        if not words:
            raise RepgeomError(f"token set {spec!r} lists no words; give at least one, e.g. words:alpha,beta")
        ids, missing = vocab.resolve_words(words, exclude)
        config.update(kind="words", n_words=len(dict.fromkeys(words)))
        return _token_set(spec, vocab, ids, missing, config)

    if host is None:
        from repgeom_eval.plugin_system.host import get_host

        host = get_host()
    if spec in host.token_sets:
        entry = host.token_sets.entry(spec)
        obj = host.token_sets.get(spec)
        config.update(kind="registered", **host.provenance("token_set", [spec])[spec])  # plugin, distribution, version
        if callable(obj):
            out = obj(vocab, exclude=exclude, seed=seed, size=size)
            if not isinstance(out, tuple) or len(out) not in (2, 3):
                raise RepgeomError(f"token set {spec!r} of plugin {entry.plugin!r} returned {type(out).__name__}; "
                                   "expected (ids, missing) or (ids, missing, config)")
            ids, missing = sorted({int(i) for i in out[0]}), [str(m) for m in out[1]]
            bad = [i for i in ids if i in exclude or i not in vocab.texts]
            if bad:
                raise RepgeomError(f"token set {spec!r} of plugin {entry.plugin!r} returned ids that are excluded or "
                                   f"not in the vocabulary: {bad[:5]}")
            if len(out) == 3 and isinstance(out[2], dict):
                config.update(out[2])
            return _token_set(spec, vocab, ids, missing, config)
        words = [str(w) for w in obj]
        ids, missing = vocab.resolve_words(words, exclude)
        config.update(n_words=len(dict.fromkeys(words)))
        return _token_set(spec, vocab, ids, missing, config)

    path = Path(os.path.expanduser(spec))
    if path.is_file():
        words = _read_word_file(path)
        if not words:
            raise RepgeomError(f"token set file {spec!r} has no words; write one word per line")
        ids, missing = vocab.resolve_words(words, exclude)
        config.update(kind="file", path=str(path.resolve()), n_words=len(dict.fromkeys(words)))
        return _token_set(spec, vocab, ids, missing, config)
    if path.is_dir():
        raise RepgeomError(f"token set {spec!r} is a directory; pass a text file with one word per line")
    if os.sep in spec or spec.endswith((".txt", ".lst", ".list")):
        raise RepgeomError(f"token set file {spec!r} does not exist")
    raise UnknownNameError("token set", spec, host.token_sets.names(),
                           "Or pass words:a,b,c, or a file with one word per line")
